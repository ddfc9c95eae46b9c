"""The custom ops a rewritten graph calls, and their per-chunk kernels: the chunked row-wise op
(`chunked_op`), its kernels split from one joint trace (`joint`) and kept single-pass (`peephole`);
its variant that computes the gradients in forward (`gradients_in_forward`); the explicit
vocabulary-parallel log-prob / entropy op (`vocab_parallel`), its variant with the lm_head inside
(`vocab_parallel_lm_head`) and that variant computing its gradients in forward
(`vocab_parallel_gradients`), the differentiable all-reduce (`collectives`)."""

from graphpass.ops import collectives, gradients_in_forward, vocab_parallel_gradients  # noqa: F401 - register ops
from graphpass.ops.vocab_parallel import vocab_parallel_logprob_entropy
from graphpass.ops.vocab_parallel_lm_head import vocab_parallel_lm_head_logprob_entropy

__all__ = ["vocab_parallel_lm_head_logprob_entropy", "vocab_parallel_logprob_entropy"]
