"""graphpass's graph passes, one module per rewrite, each `<effect>_pass(gm, example_inputs, *, ...)`."""

from passes.chunk_rowwise_regions import chunk_rowwise_regions_pass
from passes.tag_grad_flow import tag_grad_flow_pass

__all__ = ["chunk_rowwise_regions_pass", "tag_grad_flow_pass"]
