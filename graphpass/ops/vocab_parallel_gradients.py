"""The vocab-parallel op with the lm_head inside that computes its gradients in its forward pass.

Where the loss is affine in sums over the rows of per-token math of the log-probs and entropies
(token-mean PPO, cross-entropy, an entropy bonus; `graphpass.analysis.vocab_parallel.match_loss`),
`graphpass::vocab_parallel_lm_head_with_gradients` runs, per block of rows:

1. the block's logits `h_b @ W_r.T (+ b_r)` (one GEMM),
2. this rank's row statistics and their all-gather over the group (the recomputing op's one
   collective, per block: the block's log-probs and entropies are known while its logits are at
   hand),
3. the loss math's gradient for the block's rows (`LossGradient`, traced once per loss),
4. the block's dlogits, written over its logits by one compiled kernel call (no second buffer),
5. `dh_b = dl_b @ W_r` (this rank's partial) and `dW_r += dl_b.T @ h_b` (two GEMMs).

Three GEMMs instead of the recomputing op's four, and one `[block, V/tp]` buffer. The op returns
the log-probs and entropies without gradient (the graph's loss math still computes the loss
value from them), a -0.0 the graph adds to the loss (the "carrier"), the gradients for a loss
gradient of 1, and a count of the backward passes that used them; its backward scales them by the
carrier's gradient in place (`graphpass::scale_gradients_`, as the single-device op does).

Collectives: one all-gather per block, ceil(rows / block) per call, the block size a function of
shapes and configuration alone (`block_rows`): the same on every rank whatever the values or
requires_grad. Blocks are as large as half the floor allows (peak about 1.5 x the floor): each
all-gather synchronises the ranks, which on a shared CPU costs milliseconds.
"""

from __future__ import annotations

import hashlib
import math

import torch

from graphpass import _torch_api
from graphpass.ops.gradients_in_forward import scale_gradients_
from graphpass.ops.vocab_parallel import RowGradients, RowStatistics, VocabParallelArgs, compute_dtype, row_chunks
from graphpass.ops.vocab_parallel_lm_head import HeadGradients, HeadLogits, block_rows


class LossGradient:
    """`(g_logprob, g_entropy)` of `sum_k seeds[k] * summands[k].sum()` for a block's rows, where
    `loss(logprob, entropy, *sides) -> summands` is per-token math (every value one per row, or a
    scalar): traced once, with a symbolic row count, into ATen ops that run on any block."""

    def __init__(self, loss: torch.fx.GraphModule, dtype: torch.dtype, sides: list, seeds: list, reductions: list,
                 with_entropy: bool):
        """`sides`: (dtype, per_row) of the loss's other inputs; `seeds`: the dtypes of the totals'
        coefficients; `reductions`: per total, "sum" or "mean"; `with_entropy`: whether the
        entropy gets a gradient (else only the log-prob)."""
        self.reductions, self.with_entropy = list(reductions), with_entropy

        def total(logprob, entropy, side_values, seed_values):
            summands = loss(logprob, entropy, *side_values)
            return sum(seed * s.sum() for seed, s in zip(seed_values, summands))

        def joint(logprob, entropy, *rest):
            side_values, seed_values = rest[:len(sides)], rest[len(sides):]
            argnums = (0, 1) if with_entropy else 0
            grads = torch.func.grad(total, argnums=argnums)(logprob, entropy, side_values, seed_values)
            return grads if with_entropy else (grads,)

        fake_mode, rows = _torch_api.symbolic_rows_mode()
        with torch.inference_mode(False), torch.enable_grad(), fake_mode:
            args = [torch.empty(rows, dtype=dtype), torch.empty(rows if with_entropy else 0, dtype=dtype)]
            args += [torch.empty(rows if per_row else (), dtype=side_dtype) for side_dtype, per_row in sides]
            args += [torch.empty((), dtype=seed_dtype) for seed_dtype in seeds]
            self.traced = _torch_api.trace_decomposed(joint, args)
        _torch_api.check_no_guards_on(fake_mode, rows)

    def __call__(self, logprob, entropy, sides, seeds):
        grads = self.traced(logprob, entropy, *sides, *seeds)
        return grads[0], (grads[1] if self.with_entropy else None)


_LOSSES: dict[str, LossGradient] = {}


def register_loss(loss: torch.fx.GraphModule, dtype, sides: list, seeds: list, reductions: list,
                  with_entropy: bool) -> str:
    """The key of `LossGradient(...)` for the op: a content hash, so that a graph compiled (and
    cached) with one key always means the same loss."""
    identity = repr((loss.code, dtype, sides, seeds, reductions, with_entropy))
    key = "vploss-" + hashlib.sha256(identity.encode()).hexdigest()[:20]
    if key not in _LOSSES:
        _LOSSES[key] = LossGradient(loss, dtype, sides, seeds, reductions, with_entropy)
    return key


@torch.library.custom_op("graphpass::vocab_parallel_lm_head_with_gradients", mutates_args=())
def vocab_parallel_lm_head_with_gradients(
        hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, target: torch.Tensor,
        sides: list[torch.Tensor], seeds: list[torch.Tensor], loss_key: str, group_name: str, temperature: float,
        with_entropy: bool, entropy_grad: bool, ignore_index: int | None, chunk_size: int, kernels: str,
        need_hidden: bool, need_weight: bool, need_bias: bool) -> list[torch.Tensor]:
    """[logprob, entropy or [0], carrier, dhidden, dweight, dbias (each [0] where not needed), backward
    calls]: `vocab_parallel_lm_head_logprob_entropy`'s outputs and the gradients of the loss
    `sum_k seeds[k] * total_k` its registered loss math `loss_key` computes from them (module doc).
    `sides`: the loss math's other inputs, flattened to `[rows]` or 0-d."""
    args = VocabParallelArgs(group_name, temperature, ignore_index, chunk_size, kernels, with_entropy=with_entropy,
                             entropy_grad=entropy_grad)
    loss = _LOSSES[loss_key]
    head = HeadLogits(hidden, weight, bias, one_buffer=True)
    grads = HeadGradients(head, hidden.shape, need_hidden, need_weight, need_bias)
    rows = head.hidden.shape[0]
    dtype = compute_dtype(hidden.dtype)
    target_flat = target.reshape(rows)
    # A mean's coefficient applies to each row's summand divided by the rows.
    seeds = [seed / rows if reduction == "mean" else seed for seed, reduction in zip(seeds, loss.reductions)]
    logprob = hidden.new_empty(rows, dtype=dtype)
    entropy = hidden.new_empty(rows if with_entropy else 0, dtype=dtype)
    empty = hidden.new_empty(0, dtype=dtype)
    wanted = need_hidden or need_weight or need_bias
    for sl, logits in row_chunks(head, head.rows_per_chunk(args)):
        # The block's statistics, gathered: its log-probs and entropies are known while its logits are at hand.
        statistics = RowStatistics(logits, target_flat[sl], None, args)
        with torch.no_grad():
            statistics.add(slice(None), logits)
        lp, ent, lse, _ = statistics.finish()
        logprob[sl] = lp
        if with_entropy:
            entropy[sl] = ent
        if not wanted:  # this rank computes no gradient (the same blocks and collectives)
            continue
        g_lp, g_ent = loss(lp, ent if loss.with_entropy else empty, [s[sl] if s.ndim else s for s in sides], seeds)
        gradients = RowGradients(logits, target_flat[sl], None, lse, None, ent, g_lp,
                                 g_ent if loss.with_entropy else None, args)
        # One kernel call per block: the block's logits become their gradient where they are.
        gradients.of_chunk(slice(None), logits, in_place=True)
        grads(sl, logits)
    dh, dw, db = grads.results()
    carrier = torch.full((), -0.0, dtype=seeds[0].dtype, device=hidden.device)
    return [logprob.view(hidden.shape[:-1]), entropy.view(hidden.shape[:-1]) if with_entropy else entropy, carrier,
            dh, dw, db, torch.zeros((), dtype=torch.int64)]


@vocab_parallel_lm_head_with_gradients.register_fake
def _(hidden, weight, bias, target, sides, seeds, loss_key, group_name, temperature, with_entropy, entropy_grad,
      ignore_index, chunk_size, kernels, need_hidden, need_weight, need_bias):
    dtype, lead = compute_dtype(hidden.dtype), hidden.shape[:-1]
    empty = hidden.new_empty((0,))
    return [hidden.new_empty(lead, dtype=dtype), hidden.new_empty(lead if with_entropy else (0,), dtype=dtype),
            hidden.new_empty((), dtype=seeds[0].dtype),
            torch.empty_like(hidden, memory_format=torch.contiguous_format) if need_hidden else empty,
            torch.empty_like(weight, memory_format=torch.contiguous_format) if need_weight else empty,
            torch.empty_like(bias, memory_format=torch.contiguous_format) if need_bias and bias is not None else empty,
            torch.empty((), dtype=torch.int64)]


def _setup_context(ctx, inputs, output):
    need_hidden, need_weight, need_bias = inputs[-3:]
    ctx.needs = [need_hidden, need_weight, need_bias and inputs[2] is not None]
    ctx.n_sides, ctx.n_seeds = len(inputs[4]), len(inputs[5])
    ctx.save_for_backward(*output[3:])
    ctx.mark_non_differentiable(*[o for j, o in enumerate(output) if j != 2])
    ctx.set_materialize_grads(False)  # no zeros for the outputs without a gradient


def _backward(ctx, grad_outputs):
    *grads, calls = ctx.saved_tensors
    g = grad_outputs[2]
    results = [None, None, None]
    if g is not None:
        wanted = [t for t, need in zip(grads, ctx.needs) if need]
        scale_gradients_(wanted, calls, g)
        results = [t if need else None for t, need in zip(grads, ctx.needs)]
    return (*results, None, [None] * ctx.n_sides, [None] * ctx.n_seeds, *([None] * 11))


vocab_parallel_lm_head_with_gradients.register_autograd(_backward, setup_context=_setup_context)


def block_collective_count(rows: int, vocab: int, hidden_size: int, itemsize: int, chunk_size: int) -> int:
    """All-gathers one call issues at `rows` rows (one per block)."""
    return math.ceil(rows / block_rows(chunk_size, rows, vocab, hidden_size, itemsize)) if rows else 0
