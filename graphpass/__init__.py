"""graphpass: a torch.compile backend that makes LLM RL loss code memory-efficient.

    loss = torch.compile(ppo_loss, backend="graphpass")            # defaults
    loss = torch.compile(ppo_loss, backend=graphpass.Backend(chunk_size=1024, report=True))
    step = graphpass.fuse_loss(logprob_helper, loss_from_logprobs)  # helper + its caller's loss
"""

from graphpass import integrations
from graphpass.backend import Backend
from graphpass.config import Config
from graphpass.fused_loss import fuse_loss
from graphpass.inspection import explain
from graphpass.records import GraphRecord, OutputRecord, Rejection, SiteRecord

__all__ = ["Backend", "Config", "explain", "fuse_loss", "GraphRecord", "SiteRecord", "OutputRecord", "Rejection"]
__version__ = "0.1.0"

# Library code Dynamo cannot trace as written (megatron-core's tensor-parallel linear layer) gets
# traceable stand-ins, for traced code only, once that library is imported.
integrations.register_available()
