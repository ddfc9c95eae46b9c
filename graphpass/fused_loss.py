"""One call that compiles a log-prob helper together with the loss its caller computes after it.

TRL, verl and OpenRLHF call a log-prob helper (`logp, entropy = helper(hidden, W, ids)`) and
compute the loss after it returns. Compiled alone, the helper cannot know its outputs' gradients
before backward, so its backward recomputes the lm_head's logits: four GEMMs a step where a
logits-keeping compiler runs three. `fuse_loss` compiles the two as one graph; when the loss is a
sum of per-token terms the lm_head site computes every gradient in forward (three GEMMs, no
`[T, V]` value kept) and its backward only scales them.
"""

from __future__ import annotations

import logging

import torch

from graphpass.backend import Backend

log = logging.getLogger("graphpass")


def fuse_loss(helper, loss, *, backend: Backend | None = None, **compile_options):
    """`loss(*helper(*helper_args), *loss_args, **loss_kwargs)`, compiled as one graph.

        step = graphpass.fuse_loss(logprobs_and_entropy, ppo_loss_from_logprobs)
        value = step((hidden, W, ids), mask, advantages, old_logp)
        value.backward()

    `helper`'s outputs (a tensor or a tuple) are `loss`'s first arguments; bind a helper's keyword
    arguments with `functools.partial`. `backend` defaults to `graphpass.Backend()` and is
    `step.backend` (its `records`); `compile_options` go to `torch.compile`. After the first call a
    warning names each lm_head site whose gradients are not computed in forward, and why (the
    step is then as exact as ever, with the recompute's cost).
    """
    backend = Backend() if backend is None else backend

    def helper_then_loss(helper_args, *loss_args, **loss_kwargs):
        outputs = helper(*helper_args)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        return loss(*outputs, *loss_args, **loss_kwargs)

    compiled = torch.compile(helper_then_loss, backend=backend, **compile_options)
    graphs_seen = 0

    def step(helper_args, *loss_args, **loss_kwargs):
        nonlocal graphs_seen
        if not isinstance(helper_args, (tuple, list)):
            raise TypeError("graphpass.fuse_loss: pass the helper's arguments as a tuple, "
                            "step((hidden, W, ids), *loss_args)")
        value = compiled(tuple(helper_args), *loss_args, **loss_kwargs)
        for record in backend.records[graphs_seen:]:
            for site in record.sites:
                if site.lm_head and not site.gradients_in_forward and site.recompute_reason:
                    log.warning("graphpass.fuse_loss: the lm_head site at %s recomputes its logits "
                                "in backward: %s", site.source, site.recompute_reason)
        graphs_seen = len(backend.records)
        return value

    step.backend = backend
    return step
