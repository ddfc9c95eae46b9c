"""TRL's fused lm_head (`ChunkedLogProbFunction`) as Dynamo can fuse it.

TRL's trainers (`GRPOTrainer` always) install a fused head with `add_fused_lm_head`: a
`model(..., fused_lm_head=True)` call runs the backbone, then `ChunkedLogProbFunction.apply`,
an `autograd.Function` that computes each token's log-prob (and entropy) of
`hidden @ weight.T` tile by tile with an online log-sum-exp over vocabulary blocks and a
hand-written backward. Traced as written, Dynamo keeps it as one autograd-Function op whose
in-place tile loop graphpass does not recognise: nothing is fused.

`register()` makes Dynamo trace, in place of `ChunkedLogProbFunction.apply`, the plain math
the Function computes (`_chunked_logprob`): the logits `hidden @ weight.T (+ bias)` in the
compute dtype then fp32, TRL's logit scale, softcap and temperature, `log_softmax`, the targets'
log-probs and the entropy, differentiated by autograd (the same values and gradients). graphpass's
lm_head fusion then takes the matmul in. Eager calls run TRL's own Function, untouched: the
mechanism is `torch.compiler.substitute_in_graph`'s for a Function's `apply`
(`_torch_api.substitute_in_graph_apply`; see `graphpass.integrations.megatron` for why).

What the stand-in does not compute falls back to TRL's Function, with a graph break that says
why: the non-differentiable extra outputs (`log_sum_sq_probs`, `mean_logits`, `is_top1`), and
DeepSpeed ZeRO-3, whose partitioned weight must be gathered again in backward (TRL's backward
does it; autograd's saved weight would be empty). One difference remains: a target id outside the
vocabulary raises (as `gather` does) where TRL's kernel returns `-logsumexp`; TRL's callers pass
valid ids (its fused forward clamps the ignored label -100 to 0 and masks those rows afterwards).
"""

from __future__ import annotations

import torch

from graphpass import _torch_api
from graphpass.integrations import register_now, substitute_apply

#: The module whose Function the stand-in replaces in traced code.
MODULE = "trl.kernels.chunked_logprob"

#: TRL's per-token outputs the stand-in computes; any other one requested keeps TRL's Function.
MODELLED_OUTPUTS = ("entropy",)

_registered: list = []  # the module registered for, once registered


def _chunked_logprob(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
                     logit_scale=1.0, outputs=None):
    """`ChunkedLogProbFunction.apply`'s five outputs, as plain math: the targets' log-probs of
    `z = softcap(logit_scale * (hidden @ weight.T + bias)) / temperature` (fp32 `[N]`), the entropy
    when requested, None for the others (`chunk_size` only tiles TRL's kernel)."""
    outputs = _registered[0].OPTIONAL_OUTPUTS if outputs is None else outputs
    why = _unsupported(outputs)
    if why is not None:
        _torch_api.graph_break(f"graphpass has no traceable stand-in for TRL's ChunkedLogProbFunction with {why}")
    device = hidden.device.type
    # TRL multiplies its tiles in the autocast dtype when autocast is on, else in the hidden states'.
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    logits = hidden.to(dtype) @ weight.to(dtype).t()
    if bias is not None:
        logits = logits + bias.to(dtype)
    z = logits.float()
    if logit_scale != 1.0:
        z = z * logit_scale
    if final_logit_softcapping is not None:
        z = final_logit_softcapping * torch.tanh(z / final_logit_softcapping)
    logp_all = torch.log_softmax(z / temperature, dim=-1)
    logprobs = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1) if "entropy" in outputs else None
    return logprobs, entropy, None, None, None


def _unsupported(outputs) -> str | None:
    """Why the stand-in cannot compute what TRL's Function does, or None."""
    extra = [name for name in _registered[0].OPTIONAL_OUTPUTS if name in outputs and name not in MODELLED_OUTPUTS]
    if extra:
        return f"outputs {', '.join(extra)} (only the log-probs and the entropy are modelled)"
    if _zero3_enabled():
        return "DeepSpeed ZeRO-3 (the partitioned lm_head weight is gathered again in TRL's backward)"
    return None


def _zero3_enabled() -> bool:
    """Whether transformers runs under DeepSpeed ZeRO-3 (TRL's own test, `maybe_gather_lm_head_ctx`)."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    return is_deepspeed_zero3_enabled()


def register() -> bool:
    """Register the stand-in with Dynamo (idempotent); False when TRL is not importable.

    Imports TRL's `kernels.chunked_logprob` if it is not imported yet."""
    return register_now(MODULE, register_for)


def register_for(chunked_logprob) -> bool:
    """`register()` given TRL's imported `kernels.chunked_logprob` module."""
    return substitute_apply(chunked_logprob.ChunkedLogProbFunction, _chunked_logprob, _registered,
                            chunked_logprob, "TRL's ChunkedLogProbFunction")
