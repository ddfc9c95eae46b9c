"""verl's fused lm_head (`FusedLinearForPPOFunction`) as Dynamo can fuse it.

With `actor.use_fused_kernels`, verl's patched model forward ends in `FusedLinearForPPO()(hidden,
lm_head.weight, labels, temperature)`: `FusedLinearForPPOFunction.apply`, an `autograd.Function`
that computes each token's log-prob and entropy of `(hidden @ W.T) / temperature` a chunk of rows
at a time, with a hand-written backward that recomputes each chunk's logits. Traced as written,
Dynamo keeps it as one opaque op (its forward fills preallocated outputs in place): nothing is
fused, and at verl's default 512-row chunks its `[512, V]` fp32 temporaries are the step's peak.

`register()` makes Dynamo trace, in place of `FusedLinearForPPOFunction.apply`, the plain math the
Function computes (`_fused_linear_for_ppo`): the logits in the hidden states' dtype divided by the
temperature there, then fp32, the targets' fp32 log-probs and the entropy cast back to the hidden
states' dtype, differentiated by autograd. verl's backward is that math's gradient (the one-hot
minus the softmax, the entropy's `-p (log p + H)`, cast to the logits' dtype, divided by the
temperature), so the values and gradients are verl's, up to rounding (graphpass accumulates the
weight's gradient in fp32 where verl adds chunks in the weight's dtype). graphpass's lm_head
fusion then takes the matmul in. Eager calls run verl's own Function; the mechanism is
`graphpass.integrations.trl`'s. verl's Liger backend (`impl_backend="liger"`) is another Function
and stays as it is.
"""

from __future__ import annotations

import torch

from graphpass import _torch_api
from graphpass.integrations import register_now, substitute_apply

#: The module whose Function the stand-in replaces in traced code.
MODULE = "verl.utils.experimental.torch_functional"

_registered: list = []  # the module registered for, once registered


def _fused_linear_for_ppo(hidden_states, vocab_weights, input_ids, temperature=1.0, chunk_size=512):
    """`FusedLinearForPPOFunction.apply`'s (log-probs fp32, entropy in the hidden states' dtype) of
    `[T, H]` or `[B, S, H]` hidden states, as plain math (`chunk_size` only tiles verl's loop)."""
    if hidden_states.ndim not in (2, 3):
        _torch_api.graph_break("graphpass has no stand-in for verl's FusedLinearForPPOFunction on "
                               f"{hidden_states.ndim}-D hidden states (verl takes 2-D or 3-D)")
    logits = ((hidden_states @ vocab_weights.t()) / temperature).to(torch.float32)
    logp_all = torch.log_softmax(logits, dim=-1)
    log_probs = logp_all.gather(-1, input_ids.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return log_probs, entropy.to(hidden_states.dtype)


def register() -> bool:
    """Register the stand-in with Dynamo (idempotent); False when verl is not importable.

    Imports verl's `utils.experimental.torch_functional` if it is not imported yet."""
    return register_now(MODULE, register_for)


def register_for(torch_functional) -> bool:
    """`register()` given verl's imported `utils.experimental.torch_functional` module."""
    return substitute_apply(torch_functional.FusedLinearForPPOFunction, _fused_linear_for_ppo, _registered,
                            torch_functional, "verl's FusedLinearForPPOFunction")
