"""The custom ops a rewritten graph calls, and their per-chunk kernels: the chunked row-wise op
(`chunked_op`), its kernels split from one joint trace (`joint`) and kept single-pass (`peephole`);
its variant that computes the gradients in forward (`gradients_in_forward`); the explicit
vocabulary-parallel log-prob / entropy op and its variant with the lm_head inside (`vocab_parallel`)."""

from graphpass.ops import gradients_in_forward  # noqa: F401 - registers its ops
from graphpass.ops.vocab_parallel import vocab_parallel_lm_head_logprob_entropy, vocab_parallel_logprob_entropy

__all__ = ["vocab_parallel_lm_head_logprob_entropy", "vocab_parallel_logprob_entropy"]
