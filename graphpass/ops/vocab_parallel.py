"""Log-probabilities and entropy of vocabulary-parallel logits, chunked and recomputing.

`vocab_parallel_logprob_entropy(logits, target, group)` is the tensor-parallel counterpart of
`log_softmax(logits / temperature).gather(target)` (and the softmax entropy) when each rank of
`group` holds one slice of the vocabulary: rank r holds columns `r * Vl .. (r + 1) * Vl - 1` of
the global `[*, V]` logits, `V = tp * Vl` (Megatron's `VocabUtility` convention). It is a drop-in
for slime's `calculate_log_probs_and_entropy` (`_VocabParallelLogProbEntropy`), with these
differences: one collective per call instead of three to six per chunk, O(rows) saved for
backward instead of the whole fp32 softmax, and an `ignore_index`.

Forward: every chunk of rows computes this rank's row statistics (max, sum of exp, the shifted
first moment for the entropy, the target's logit if this rank owns the target, the target id);
one all-gather of the `[rows, C]` statistics of all chunks then combines them on every rank (M = max_r m_r, S = sum_r S_r exp(m_r - M), lse = M + log S). Backward recomputes
each chunk's softmax from the saved log-sum-exp and issues no collective.

With `with_slice_mean` the op also returns each row's mean over this rank's slice of its
log-probs, local to the rank (megatron-core's label smoothing reads it): the chunk loop sums
`x - m` about the slice's own max, `_slice_mean` subtracts `lse - m` (no cancellation); nothing
is added to the collective; its gradient `(1/Vl - p) * g` is this rank's alone, as for the log-prob.

The collectives a call issues depend only on shapes and configuration (dtype, keep_mask given
or not, with_entropy), never on values, requires_grad or grad mode, so ranks cannot disagree
(slime #2123 hung on exactly that). A group of size one issues none.

The op with the lm_head inside is in `vocab_parallel_lm_head.py`; the differentiable all-reduce
the vocab-parallel code needs in `collectives.py`.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.distributed

from graphpass import _torch_api
from graphpass.ops import chunk_sizes, devices
from graphpass.ops.groups import all_gather, group_name, rank_and_size

# Columns of the per-row statistics each rank contributes to the one collective.
_M, _S = 0, 1  # the log-prob distribution (masked by keep_mask): max m, sum exp(x - m)
_TARGET, _OWNER = 2, 3  # the target's logit where this rank owns it (else 0), and 1.0 where it does
_TOKEN = 4  # the target id itself: ranks given different targets are caught, not silently mixed
_A = 5  # entropy: sum exp(x - m) (x - m) over the unmasked logits
_FULL_M, _FULL_S = 6, 7  # entropy under a keep_mask: max and sum exp of the unmasked logits


def _stat_columns(with_entropy: bool, masked: bool) -> int:
    if not with_entropy:
        return 5
    return 8 if masked else 6


def collective_bytes(rows: int, dtype: torch.dtype, with_entropy: bool, masked: bool) -> int:
    """Bytes one rank contributes to the call's all-gather, for `rows` rows of `dtype` logits."""
    return rows * _stat_columns(with_entropy, masked) * compute_dtype(dtype).itemsize


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 logits are computed (and returned) in float64; every other float dtype in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---- layout --------------------------------------------------------------------------------------
def _row_blocks(logits: torch.Tensor):
    """(row offset, 2-D `[rows, Vl]` view) blocks covering the rows of `logits` in order, without a copy.

    One block when `logits` views as `[R, Vl]`; a strided view such as `logits[:, :-1]` of a
    `[B, S, Vl]` tensor walks its leading dims instead (every 2-D slice of a strided tensor is a view).
    """
    if logits.ndim == 2:
        return [(0, logits)]
    try:
        return [(0, logits.view(math.prod(logits.shape[:-1]), logits.shape[-1]))]
    except RuntimeError:
        pass
    inner = logits.shape[-2]
    return [(n * inner, logits[index]) for n, index in enumerate(itertools.product(*map(range, logits.shape[:-2])))]


def _row_chunks(logits, chunk_size: int):
    """`_chunks` of a logits tensor, or the chunks a `HeadLogits` or `RoundedQuotient` computes."""
    if isinstance(logits, (HeadLogits, RoundedQuotient)):
        return logits.chunks(chunk_size)
    return _chunks(logits, chunk_size)


def _chunks(logits, chunk_size: int):
    """Yield (row slice, `[r, Vl]` view) covering all rows, at most `chunk_size` rows each."""
    for offset, block in _row_blocks(logits):
        for start in range(0, block.shape[0], chunk_size):
            stop = min(block.shape[0], start + chunk_size)
            yield slice(offset + start, offset + stop), block[start:stop]


def _rows_per_chunk(chunk_size: int, rows: int, vocab: int, itemsize: int, device: torch.device,
                    budget_bytes: int) -> int:
    """Rows per chunk: `chunk_size` (> 0), else one fp32 `[chunk, V]` temporary within
    `chunk_sizes.vocab_parallel_logits_bytes` of the logits' bytes (on a CPU at most `budget_bytes`)."""
    if chunk_size > 0:
        return max(1, min(chunk_size, rows))
    budget = chunk_sizes.vocab_parallel_logits_bytes(rows * vocab * itemsize, budget_bytes,
                                                      host=devices.host_reads_are_free(device))
    return chunk_sizes.fitting(budget, vocab * 4, rows)


def _flat(t: torch.Tensor | None, rows: int, width: int | None = None):
    if t is None:
        return None
    return t.reshape(rows) if width is None else t.reshape(rows, width)


# ---- per-chunk math ------------------------------------------------------------------------------
def _scaled(chunk, temperature: float, dtype):
    """The chunk's logits divided by the temperature, upcast to `dtype` (one chunk, never the shard)."""
    x = chunk.to(dtype)
    if temperature != 1.0:
        x = x / temperature
    return x


def _apply_keep_mask(x, keep, local_target, owned):
    """`x` with entries not kept set to -inf, except each owned target's own logit (slime keeps the
    sampled token in the support: the support is the kept set plus the target)."""
    target_x = x.gather(1, local_target[:, None])
    masked = x.masked_fill(~keep, float("-inf"))
    masked.scatter_(1, local_target[:, None], torch.where(owned[:, None], target_x, masked.gather(1, local_target[:, None])))
    return masked


def _max_and_sum_exp(x):
    """Row max m and sum exp(x - m); an all -inf row gives (-inf, 0), never NaN."""
    m = x.amax(dim=1)
    m_safe = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    z = x - m_safe[:, None]
    e = z.exp()
    return m, e.sum(dim=1), z, e


def _shifted_moment(z, e):
    """sum exp(z) * z over each row; a -inf logit (probability 0) contributes 0, not NaN."""
    z = z.clamp_min(torch.finfo(z.dtype).min)
    return (e * z).sum(dim=1)


# ---- per-chunk kernels of the unmasked op (compiled by inductor under the graphpass backend) ---------
def _chunk_stats(piece, temperature: float, with_entropy: bool, with_slice_sum: bool = False):
    """`[2 to 4, r]`: each row's max, sum of exp about it, (entropy) shifted first moment and
    (`with_slice_sum`, last) the sum of the shifted logits `x - m` over this slice; the owned
    targets' logits are read by the caller (a gather, not worth a kernel)."""
    x = _scaled(piece, temperature, compute_dtype(piece.dtype))
    m, s, z, e = _max_and_sum_exp(x)
    rows = [m, s]
    if with_entropy:
        rows.append(_shifted_moment(z, e))
    if with_slice_sum:
        rows.append(z.sum(dim=1))
    return torch.stack(rows)


def _chunk_grad(piece, lse, g_lp, g_target, local_target, entropy, g_ent, temperature: float, g_mean=None):
    """One chunk of the logits' gradient, in their dtype (see `_backward`); `[r, 1]` row operands
    (`g_mean`: the gradient of the slice's mean log-prob, or None)."""
    x = _scaled(piece, temperature, compute_dtype(piece.dtype))
    z = x - lse
    p = z.exp()
    out = torch.zeros_like(x)
    if g_lp is not None:
        target_column = torch.arange(x.shape[1], device=x.device)[None, :] == local_target
        out = out - p * g_lp + target_column * g_target
    if g_ent is not None:
        # d entropy / dx = p (E[x] - x) = p (-H - (x - lse)); a -inf logit has p = 0 and contributes 0.
        out = out + p * (-entropy - z.clamp_min(torch.finfo(z.dtype).min)) * g_ent
    if g_mean is not None:
        # d mean_v(x_v - lse) / dx over this slice of W columns: 1/W - p (lse's dependence on the
        # other ranks' logits is theirs to propagate, as for the log-prob).
        out = out + (1.0 / x.shape[1] - p) * g_mean
    if temperature != 1.0:
        out = out / temperature
    return out.to(piece.dtype)


def chunk_grad_(piece, lse, g_lp, g_target, local_target, entropy, g_ent, temperature: float, g_mean=None):
    """`_chunk_grad` written over `piece` (its logits are read, then replaced by their gradient):
    one pass, no chunk-sized output. `local_target` may be shifted by a tile's first column."""
    piece.copy_(_chunk_grad(piece, lse, g_lp, g_target, local_target, entropy, g_ent, temperature, g_mean))


_KERNELS: dict = {}


def compiled_kernel(fn, kernels: str):
    """`fn` as run eagerly ("eager") or compiled by inductor ("inductor"), dynamic in the rows."""
    if kernels != "inductor":
        return fn
    if fn not in _KERNELS:
        _KERNELS[fn] = _torch_api.compile_kernel(fn, "inductor")
    return _KERNELS[fn]


# ---- combine -------------------------------------------------------------------------------------
def _combine(m, s):
    """Per-rank row statistics `[tp, R]` (max m_r, sum exp S_r about m_r) into (M, S, w): the global
    max (0 where every rank's row is all -inf), the global sum exp about M, and w_r = exp(m_r - M)."""
    big_m = m.amax(dim=0)
    big_m = torch.where(torch.isneginf(big_m), torch.zeros_like(big_m), big_m)
    # A rank whose row is all -inf (m_r = -inf) weighs exp(-inf) = 0.
    w = (m - big_m).exp()
    return big_m, (s * w).sum(dim=0), w


def _entropy(m, s, moment):
    """(log-sum-exp, entropy) per row from per-rank (max, sum exp, shifted moment) `[tp, R]`.

    Rank r's moment A_r = sum exp(x - m_r) (x - m_r) is about its own max, so
    E[x] - M = sum_r w_r (A_r + (m_r - M) S_r) / S, and entropy = lse - E[x] = log S - (E[x] - M):
    no difference of two large numbers.
    """
    big_m, total, w = _combine(m, s)
    offset = torch.where(torch.isneginf(m), torch.zeros_like(m), m - big_m)
    centred = ((moment + offset * s) * w).sum(dim=0) / total
    return big_m + total.log(), total.log() - centred


def _finish(stats, with_entropy: bool, masked: bool, ignored, target_flat, vocab_global: int, size: int):
    """From the gathered `[tp, R, C]` statistics: (logprob, entropy or None, lse_lp, lse_full or None)."""
    # Every rank gathered the same statistics, so every rank raises here, together.
    tokens = stats[..., _TOKEN]
    differ = (tokens != tokens[:1]).any(dim=0)

    def different_targets():
        row = int(differ.nonzero()[0, 0])
        return ValueError(f"graphpass: the ranks of the tensor-parallel group were given different targets (row {row}: "
                          f"{[int(t) for t in tokens[:, row].tolist()]}); pass the same targets on every rank")

    devices.check(~differ.any(), different_targets, "graphpass: the ranks of the tensor-parallel group were given "
                                                    "different targets; pass the same targets on every rank")
    bad = (stats[..., _OWNER].sum(dim=0) != 1) & ~ignored

    def outside_vocabulary():
        row = int(bad.nonzero()[0, 0])
        return ValueError(f"graphpass: token id {int(target_flat[row])} at row {row} is outside the vocabulary "
                          f"[0, {vocab_global}) ({size} ranks x {vocab_global // size} columns) and is not "
                          "ignore_index; check the targets, or set ignore_index to the padding id")

    devices.check(~bad.any(), outside_vocabulary, f"graphpass: a token id is outside the vocabulary [0, {vocab_global}) "
                                                  "and is not ignore_index; check the targets, or set ignore_index "
                                                  "to the padding id")
    big_m, total, _ = _combine(stats[..., _M], stats[..., _S])
    lse_lp = big_m + total.log()
    logprob = torch.where(ignored, torch.zeros_like(lse_lp), stats[..., _TARGET].sum(dim=0) - lse_lp)
    if not with_entropy:
        return logprob, None, lse_lp, None
    if masked:
        lse_full, entropy = _entropy(stats[..., _FULL_M], stats[..., _FULL_S], stats[..., _A])
        return logprob, entropy, lse_lp, lse_full
    _, entropy = _entropy(stats[..., _M], stats[..., _S], stats[..., _A])
    return logprob, entropy, lse_lp, None


# ---- forward -------------------------------------------------------------------------------------
def _local_targets(target_flat, rank: int, vocab: int, ignore_index: int | None):
    """(this rank's column of each target clamped into the slice, owned here, ignored)."""
    ignored = torch.zeros_like(target_flat, dtype=torch.bool) if ignore_index is None else target_flat == ignore_index
    local = target_flat.long() - rank * vocab
    owned = (local >= 0) & (local < vocab) & ~ignored
    return local.clamp(0, max(0, vocab - 1)), owned, ignored


def forward_statistics(logits, target, keep_mask, group_name: str, temperature: float, with_entropy: bool,
                       ignore_index: int | None, chunk_size: int, kernels: str,
                       chunk_budget_bytes: int = chunk_sizes.DEFAULT_BUDGET_BYTES, with_slice_mean: bool = False):
    """The op's forward over `logits`, a `[*, Vl]` tensor or a `HeadLogits` (computed chunk by chunk):
    (logprob, entropy or [0], lse_lp, lse_full or [0]), and with `with_slice_mean` a fifth, the
    slice mean of the log-probs (`_slice_mean`; not with a keep mask)."""
    if with_slice_mean and keep_mask is not None:
        raise ValueError("graphpass: the slice mean of the log-probs is not computed under a keep_mask")
    group, rank, size = rank_and_size(group_name)
    vocab = logits.shape[-1]
    lead = logits.shape[:-1]
    rows = math.prod(lead)
    dtype = compute_dtype(logits.dtype)
    masked = keep_mask is not None
    columns = _stat_columns(with_entropy, masked)
    target_flat = target.reshape(rows)
    local_target, owned, ignored = _local_targets(target_flat, rank, vocab, ignore_index)
    keep_rows = None if keep_mask is None or keep_mask.ndim == 1 else _flat(keep_mask, rows, vocab)
    stats = torch.zeros(rows, columns, dtype=dtype, device=logits.device)
    # This rank's own: sum over its slice of x - m (its row max m), never gathered.
    slice_sum = torch.zeros(rows, dtype=dtype, device=logits.device) if with_slice_mean else None
    chunk = _rows_per_chunk(chunk_size, rows, vocab, logits.dtype.itemsize, logits.device, chunk_budget_bytes)
    with torch.no_grad():
        for sl, piece in _row_chunks(logits, chunk):
            lt, own = local_target[sl], owned[sl]
            # The target's logit, scaled alone: the same value as read from the scaled chunk.
            stats[sl, _TARGET] = torch.where(own, _scaled(piece.gather(1, lt[:, None])[:, 0], temperature, dtype), 0)
            stats[sl, _OWNER] = own.to(dtype)
            # Exact below 2^24 in fp32; two ids that round alike pass unnoticed, never a false alarm.
            stats[sl, _TOKEN] = target_flat[sl].to(dtype)
            if masked:
                x = _scaled(piece, temperature, dtype)
                keep = keep_mask[None, :] if keep_rows is None else keep_rows[sl]
                m, s, _, _ = _max_and_sum_exp(_apply_keep_mask(x, keep, lt, own))
                stats[sl, _M], stats[sl, _S] = m, s
                if with_entropy:
                    m, s, z, e = _max_and_sum_exp(x)
                    stats[sl, _FULL_M], stats[sl, _FULL_S], stats[sl, _A] = m, s, _shifted_moment(z, e)
                del x
            else:
                row_stats = compiled_kernel(_chunk_stats, kernels)(piece, temperature, with_entropy, with_slice_mean)
                stats[sl, _M], stats[sl, _S] = row_stats[0], row_stats[1]
                if with_entropy:
                    stats[sl, _A] = row_stats[2]
                if with_slice_mean:
                    slice_sum[sl] = row_stats[-1]
    local_max = stats[:, _M].clone() if with_slice_mean else None
    if size > 1:
        # The one collective of the call: its shape is [size * rows, columns] on every rank, whatever
        # the values, grad mode or requires_grad (gloo wants the flat [world * n, ...] output).
        gathered = torch.empty(size * rows, columns, dtype=dtype, device=logits.device)
        all_gather(gathered, stats, group)
        stats = gathered.view(size, rows, columns)
    else:
        stats = stats[None]
    logprob, entropy, lse_lp, lse_full = _finish(stats, with_entropy, masked, ignored, target_flat, vocab * size, size)
    # Distinct empty tensors: a custom op's outputs may not alias one another.
    outputs = (logprob.reshape(lead),
               logits.new_empty((0,), dtype=dtype) if entropy is None else entropy.reshape(lead), lse_lp,
               logits.new_empty((0,), dtype=dtype) if lse_full is None else lse_full)
    if not with_slice_mean:
        return outputs
    return (*outputs, _slice_mean(stats, slice_sum, local_max, vocab).reshape(lead))


def _slice_mean(stats, slice_sum, local_max, vocab: int):
    """Each row's mean over this rank's slice of `vocab` columns of the log-probs `x - lse`
    (megatron-core's label smoothing reads it), from the slice's sum of `x - m` about its own max
    `m`: `sum/vocab - (lse - m)`, with `lse - m = (M - m) + log S`. The two terms are <= 0 and
    >= 0: no cancellation (`sum(x)/vocab - lse` would lose the digits of large logits). Local to
    the rank: each rank's differs."""
    big_m, total, _ = _combine(stats[..., _M], stats[..., _S])
    m = torch.where(torch.isneginf(local_max), torch.zeros_like(local_max), local_max)
    return slice_sum / vocab - ((big_m - m) + total.log())


# ---- backward ------------------------------------------------------------------------------------
def _backward(logits, target, keep_mask, lse_lp, lse_full, entropy, grad_logprob, grad_entropy, group_name: str,
              temperature: float, ignore_index: int | None, chunk_size: int, kernels: str,
              rounded_division: bool, chunk_budget_bytes: int, grad_slice_mean=None):
    """d(logprob . grad_logprob + entropy . grad_entropy + slice mean . grad_slice_mean) / d logits,
    chunk by chunk, no collective.

    `rounded_division`: the op's logits are `logits / temperature` computed in the logits' dtype
    (`RoundedQuotient`); the gradient is then eager autograd's of that division: the gradient
    with respect to the quotient, in the logits' dtype, divided by the temperature in that dtype."""
    grad = torch.empty(math.prod(logits.shape[:-1]), logits.shape[-1], dtype=logits.dtype, device=logits.device)

    def write(sl, chunk_grad):
        grad[sl] = chunk_grad

    if rounded_division:
        quotient_temperature = temperature
        logits, temperature = RoundedQuotient(logits, temperature), 1.0

        def write(sl, chunk_grad):  # noqa: F811 -- the division's backward, the same aten op as eager's
            torch.div(chunk_grad, quotient_temperature, out=grad[sl])

    backward_rows(logits, target, keep_mask, lse_lp, lse_full, entropy, grad_logprob, grad_entropy, group_name,
                  temperature, ignore_index, chunk_size, kernels, write, chunk_budget_bytes, grad_slice_mean)
    return grad.view(logits.shape)


class GradRows:
    """The row operands of the unmasked gradient kernel (`_chunk_grad`) for all rows, computed once:
    `[rows, 1]` columns, None where the log-prob's (or the entropy's) gradient is absent or known
    zero (`known_zero`: no entropy recompute for an entropy returned only for logging)."""

    def __init__(self, target, lse_lp, entropy, grad_logprob, grad_entropy, rank: int, vocab: int,
                 ignore_index: int | None, dtype):
        rows = target.numel()
        local_target, owned, ignored = _local_targets(target.reshape(rows), rank, vocab, ignore_index)
        self.lse, self.local_target = lse_lp.reshape(rows, 1), local_target[:, None]
        self.g_lp = self.g_target = self.entropy = self.g_ent = None
        if grad_logprob is not None:
            g_lp = torch.where(ignored, 0, _flat(grad_logprob, rows).to(dtype))
            self.g_lp, self.g_target = g_lp[:, None], torch.where(owned, g_lp, 0)[:, None]
        if not devices.known_zero(grad_entropy):
            self.entropy, self.g_ent = entropy.reshape(rows, 1), _flat(grad_entropy, rows).to(dtype)[:, None]

    @staticmethod
    def _rows(t, sl):
        return None if t is None else t[sl]

    def args(self, sl, column: int = 0):
        """The kernel's row operands for rows `sl` of a piece whose first column is `column`."""
        target = self.local_target[sl] if column == 0 else self.local_target[sl] - column
        return (self.lse[sl], self._rows(self.g_lp, sl), self._rows(self.g_target, sl), target,
                self._rows(self.entropy, sl), self._rows(self.g_ent, sl))


def backward_rows(logits, target, keep_mask, lse_lp, lse_full, entropy, grad_logprob, grad_entropy, group_name: str,
                  temperature: float, ignore_index: int | None, chunk_size: int, kernels: str, sink,
                  chunk_budget_bytes: int = chunk_sizes.DEFAULT_BUDGET_BYTES, grad_slice_mean=None) -> None:
    """`sink(row slice, the chunk's dlogits in the logits' dtype)` for each chunk of rows in order;
    `logits`: a `[*, Vl]` tensor or a `HeadLogits`. No collective. `grad_slice_mean`: the gradient
    of the slice mean of the log-probs (`_slice_mean`), or None; not with a keep mask."""
    _, rank, _ = rank_and_size(group_name)
    vocab = logits.shape[-1]
    rows = math.prod(logits.shape[:-1])
    dtype = compute_dtype(logits.dtype)
    masked = keep_mask is not None
    local_target, owned, ignored = _local_targets(target.reshape(rows), rank, vocab, ignore_index)
    keep_rows = None if keep_mask is None or keep_mask.ndim == 1 else _flat(keep_mask, rows, vocab)
    g_lp = None
    if grad_logprob is not None:
        # An ignored row contributes nothing; its (masked) log-sum-exp may be -inf, so its softmax
        # is taken against +inf (probabilities 0) rather than multiplied by a zero weight (NaN).
        g_lp = torch.where(ignored, 0, _flat(grad_logprob, rows).to(dtype))
        lse_lp = torch.where(ignored, float("inf"), lse_lp) if masked else lse_lp
        g_target = torch.where(owned, g_lp, 0)
    # An entropy returned only for logging gets a zero gradient: skip its recompute.
    g_ent = None if devices.known_zero(grad_entropy) else _flat(grad_entropy, rows).to(dtype)
    g_mean = None if devices.known_zero(grad_slice_mean) else _flat(grad_slice_mean, rows).to(dtype)
    if g_mean is not None and masked:
        raise ValueError("graphpass: the slice mean of the log-probs is not computed under a keep_mask")
    lse_ent = lse_full if masked else lse_lp
    chunk = _rows_per_chunk(chunk_size, rows, vocab, logits.dtype.itemsize, logits.device, chunk_budget_bytes)
    if not masked:
        entropy_rows = entropy.reshape(-1)
        # A chunk a `HeadLogits` or `RoundedQuotient` computed is a temporary: its gradient takes its place.
        in_place = isinstance(logits, (HeadLogits, RoundedQuotient))
        kernel = compiled_kernel(chunk_grad_ if in_place else _chunk_grad, kernels)
        for sl, piece in _row_chunks(logits, chunk):
            grad = kernel(piece, lse_lp[sl, None],
                          None if g_lp is None else g_lp[sl, None], None if g_lp is None else g_target[sl, None],
                          local_target[sl, None], None if g_ent is None else entropy_rows[sl, None],
                          None if g_ent is None else g_ent[sl, None], temperature,
                          None if g_mean is None else g_mean[sl, None])
            sink(sl, piece if in_place else grad)
        return
    # Under a keep mask the log-prob's softmax is over the kept logits, the entropy's over all.
    for sl, piece in _row_chunks(logits, chunk):
        x = _scaled(piece, temperature, dtype)
        lt = local_target[sl]
        out = torch.zeros_like(x)
        if g_lp is not None:
            xm = _apply_keep_mask(x, keep_mask[None, :] if keep_rows is None else keep_rows[sl], lt, owned[sl])
            out.addcmul_((xm - lse_lp[sl, None]).exp(), g_lp[sl, None], value=-1)
            out.scatter_add_(1, lt[:, None], g_target[sl, None])
            del xm
        if g_ent is not None:
            z = x - lse_ent[sl, None]
            p = z.exp()
            # d entropy / dx = p (E[x] - x) = p (-H - (x - lse)); a -inf logit has p = 0 and contributes 0.
            z = z.clamp_min(torch.finfo(dtype).min)
            out.addcmul_(p, (-entropy.reshape(rows)[sl, None] - z) * g_ent[sl, None])
            del z, p
        if temperature != 1.0:
            out.div_(temperature)
        sink(sl, out.to(logits.dtype))
        del x, out


# ---- logits divided in their own dtype -----------------------------------------------------------
class RoundedQuotient:
    """`logits / temperature` as eager computes it for bf16/fp16 `logits` (the quotient rounded to
    their dtype; the op would otherwise divide the fp32 upcast), one chunk at a time: what the op
    reads when the temperature's division it took in is one of the logits' own dtype. The division
    is the same aten op as eager's, elementwise, so each chunk holds exactly eager's quotient."""

    def __init__(self, logits, temperature: float):
        self.logits, self.temperature = logits, temperature
        self.shape, self.dtype, self.device = logits.shape, logits.dtype, logits.device

    def new_empty(self, *args, **kwargs):
        return self.logits.new_empty(*args, **kwargs)

    def chunks(self, chunk_size: int):
        for sl, piece in _row_chunks(self.logits, chunk_size):
            yield sl, torch.div(piece, self.temperature)


# ---- logits computed from the hidden states (the lm_head op's, `vocab_parallel_lm_head.py`) ------
class HeadLogits:
    """This rank's `[*, Vl]` logits as `hidden @ W_r.T (+ b_r)`, never stored: `chunks` computes
    each chunk's rows from the hidden states' (what `_forward` and `backward_rows` read instead of
    a logits tensor)."""

    def __init__(self, hidden, weight, bias):
        lead = hidden.shape[:-1]
        self.hidden = hidden.reshape(math.prod(lead), hidden.shape[-1])  # a view where hidden allows one
        self.weight, self.bias = weight, bias
        self.shape = torch.Size((*lead, weight.shape[0]))
        self.dtype, self.device = hidden.dtype, hidden.device

    def new_empty(self, *args, **kwargs):
        return self.hidden.new_empty(*args, **kwargs)

    def logits(self, sl, out=None):
        """The logits of rows `sl`, `[r, Vl]`, as autograd of `F.linear(hidden, W, b)` computes them
        (into `out` when given)."""
        h = self.hidden[sl]
        if self.bias is None:
            return torch.mm(h, self.weight.t(), out=out)
        return torch.addmm(self.bias, h, self.weight.t(), out=out)

    def chunks(self, chunk_size: int):
        rows = self.hidden.shape[0]
        for start in range(0, rows, chunk_size):
            sl = slice(start, min(rows, start + chunk_size))
            yield sl, self.logits(sl)


def fake_outputs(like, lead, with_entropy: bool, masked: bool):
    dtype = compute_dtype(like.dtype)
    rows = math.prod(lead)
    entropy = like.new_empty(lead if with_entropy else (0,), dtype=dtype)
    lse_full = like.new_empty((rows,) if with_entropy and masked else (0,), dtype=dtype)
    return like.new_empty(lead, dtype=dtype), entropy, like.new_empty((rows,), dtype=dtype), lse_full


# ---- custom ops ----------------------------------------------------------------------------------
@torch.library.custom_op("graphpass::vocab_parallel_logprob_entropy", mutates_args=(),
                        tags=devices.NOT_CUDAGRAPH_CAPTURABLE)
def _vocab_parallel_op(logits: torch.Tensor, target: torch.Tensor, keep_mask: torch.Tensor | None, group_name: str,
                       temperature: float, with_entropy: bool, entropy_grad: bool, ignore_index: int | None,
                       chunk_size: int, kernels: str, rounded_division: bool = False,
                       chunk_budget_bytes: int = chunk_sizes.DEFAULT_BUDGET_BYTES, with_slice_mean: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprob, entropy or [0], log-sum-exp of the log-prob distribution [R], of the unmasked one or
    [0], the mean of the log-probs over this rank's vocabulary slice or [0]).

    `rounded_division`: the logits are divided by the temperature in their own dtype, as eager
    divides bf16/fp16 logits (`RoundedQuotient`), not upcast first and divided in fp32.
    `chunk_budget_bytes`: `Config.chunk_budget_bytes`, for `chunk_size` 0 (`chunk_sizes`).
    `with_slice_mean`: the fifth output is each row's mean over this rank's slice of its log-probs,
    local to the rank (not all-reduced; megatron-core's label smoothing reads it), differentiable
    with respect to this rank's logits alone; no keep mask. It adds nothing to the collective."""
    if rounded_division and temperature != 1.0:
        logits, temperature = RoundedQuotient(logits, temperature), 1.0
    out = forward_statistics(logits, target, keep_mask, group_name, temperature, with_entropy, ignore_index,
                             chunk_size, kernels, chunk_budget_bytes, with_slice_mean)
    return out if with_slice_mean else (*out, logits.new_empty((0,), dtype=compute_dtype(logits.dtype)))


@_vocab_parallel_op.register_fake
def _(logits, target, keep_mask, group_name, temperature, with_entropy, entropy_grad, ignore_index, chunk_size,
      kernels, rounded_division=False, chunk_budget_bytes=chunk_sizes.DEFAULT_BUDGET_BYTES, with_slice_mean=False):
    dtype = compute_dtype(logits.dtype)
    mean = logits.new_empty(logits.shape[:-1] if with_slice_mean else (0,), dtype=dtype)
    return (*fake_outputs(logits, logits.shape[:-1], with_entropy, keep_mask is not None), mean)


@torch.library.custom_op("graphpass::vocab_parallel_logprob_entropy_backward", mutates_args=(),
                        tags=devices.NOT_CUDAGRAPH_CAPTURABLE)
def _vocab_parallel_backward_op(logits: torch.Tensor, target: torch.Tensor, keep_mask: torch.Tensor | None,
                                lse_lp: torch.Tensor, lse_full: torch.Tensor, entropy: torch.Tensor,
                                grad_logprob: torch.Tensor | None, grad_entropy: torch.Tensor | None, group_name: str,
                                temperature: float, ignore_index: int | None, chunk_size: int,
                                kernels: str, rounded_division: bool = False,
                                chunk_budget_bytes: int = chunk_sizes.DEFAULT_BUDGET_BYTES,
                                grad_slice_mean: torch.Tensor | None = None) -> torch.Tensor:
    """The logits' gradient (in their dtype) of `vocab_parallel_logprob_entropy`; issues no collective."""
    return _backward(logits, target, keep_mask, lse_lp, lse_full, entropy, grad_logprob, grad_entropy, group_name,
                     temperature, ignore_index, chunk_size, kernels, rounded_division and temperature != 1.0,
                     chunk_budget_bytes, grad_slice_mean)


@_vocab_parallel_backward_op.register_fake
def _(logits, target, keep_mask, lse_lp, lse_full, entropy, grad_logprob, grad_entropy, group_name, temperature,
      ignore_index, chunk_size, kernels, rounded_division=False, chunk_budget_bytes=chunk_sizes.DEFAULT_BUDGET_BYTES,
      grad_slice_mean=None):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    (logits, target, keep_mask, group_name, temperature, with_entropy, entropy_grad, ignore_index, chunk_size,
     kernels, rounded_division, chunk_budget_bytes, with_slice_mean) = inputs
    ctx.rounded_division, ctx.chunk_budget_bytes = bool(rounded_division), chunk_budget_bytes
    logprob, entropy, lse_lp, lse_full, slice_mean = output
    if not with_slice_mean:
        ctx.mark_non_differentiable(slice_mean)
    ctx.group_name, ctx.temperature, ctx.ignore_index, ctx.chunk_size = group_name, temperature, ignore_index, chunk_size
    ctx.kernels = kernels
    ctx.entropy_grad = with_entropy and entropy_grad
    # O(rows) beyond the inputs: the log-sum-exps and the entropy (the backward's E[x] = lse - H).
    ctx.save_for_backward(logits, target, keep_mask, lse_lp, lse_full, entropy)
    ctx.mark_non_differentiable(lse_lp, lse_full)
    if not ctx.entropy_grad:
        ctx.mark_non_differentiable(entropy)


def _autograd_backward(ctx, grad_logprob, grad_entropy, _grad_lse_lp, _grad_lse_full, grad_slice_mean):
    if not ctx.needs_input_grad[0]:
        return (None,) * 13
    logits, target, keep_mask, lse_lp, lse_full, entropy = ctx.saved_tensors
    if not ctx.entropy_grad:
        grad_entropy = None
    if grad_slice_mean is not None and grad_slice_mean.numel() == 0:  # not asked for: an empty output
        grad_slice_mean = None
    if grad_logprob is None and grad_entropy is None and grad_slice_mean is None:
        return (None,) * 13
    grad = _vocab_parallel_backward_op(logits, target, keep_mask, lse_lp, lse_full, entropy, grad_logprob,
                                       grad_entropy, ctx.group_name, ctx.temperature, ctx.ignore_index,
                                       ctx.chunk_size, ctx.kernels, ctx.rounded_division, ctx.chunk_budget_bytes,
                                       grad_slice_mean)
    return (grad,) + (None,) * 12


_vocab_parallel_op.register_autograd(_autograd_backward, setup_context=_setup_context)


# ---- public entry --------------------------------------------------------------------------------
def vocab_parallel_logprob_entropy(logits: torch.Tensor, target: torch.Tensor, group=None, *, temperature: float = 1.0,
                                   with_entropy: bool = False, entropy_grad: bool = True, ignore_index: int | None = -100,
                                   keep_mask: torch.Tensor | None = None, chunk_size: int | None = None):
    """Log-probabilities of `target` (and the entropy) under `softmax(logits / temperature)` over a
    vocabulary split across the ranks of `group`.

    Args:
        logits: this rank's `[*, Vl]` slice of the global `[*, V]` logits (rank r of the group holds
            columns `r * Vl .. (r + 1) * Vl - 1`, `V = group size * Vl`); any float dtype, read chunk
            by chunk (bf16 is upcast one chunk at a time, never copied whole).
        target: global token ids `[*]` (the logits' leading shape), the same on every rank.
        group: the tensor-parallel `ProcessGroup`; None is the default group (or a single process
            when torch.distributed is not initialized).
        temperature: the logits are divided by it (exactly, per chunk) before the softmax.
        with_entropy: also return the entropy of `softmax(logits / temperature)` per row.
        entropy_grad: False makes the entropy non-differentiable (a logged metric).
        ignore_index: rows whose target equals it get logprob 0 and no log-prob gradient; their
            entropy (which does not read the target) is still computed and differentiable. None:
            no id is ignored (every target must be in the vocabulary).
        keep_mask: optional bool `[*, Vl]` or `[Vl]`: logits not kept count as -inf for the
            log-prob (top-p replay); each row's own target is always kept, as in slime. The entropy
            is that of the unmasked logits.
        chunk_size: rows per chunk; None: one fp32 `[chunk, Vl]` temporary of 1/160 of the logits'
            bytes, on a CPU at most 16 MiB (`graphpass.ops.chunk_sizes`).

    Returns:
        `(logprob, entropy)`, each of the logits' leading shape, float64 for float64 logits and fp32
        otherwise; `entropy` is None unless `with_entropy`.

    One all-gather (`all_gather_single`) of a `[group size * rows, 5..8]` statistics tensor per call (none
    for a group of one), the same on every rank whatever the values, requires_grad or grad mode;
    the backward issues none. Saves the inputs and O(rows) statistics for the backward.

    Raises ValueError, on every rank together, for a non-ignored token id outside `[0, V)` or
    targets that differ across the ranks of the group (checked on the gathered statistics).
    """
    if not isinstance(logits, torch.Tensor) or logits.ndim < 2:
        raise ValueError("graphpass: logits must be this rank's [*, V/tp] slice of the vocabulary "
                         f"(at least 2-D), got shape {tuple(getattr(logits, 'shape', ()))}")
    if not logits.is_floating_point():
        raise ValueError(f"graphpass: logits must be a float tensor, got {logits.dtype}")
    if logits.shape[-1] == 0:
        raise ValueError("graphpass: this rank's vocabulary slice is empty (logits.shape[-1] == 0); "
                         "pad the vocabulary to a multiple of the tensor-parallel size")
    if not isinstance(target, torch.Tensor) or target.dtype.is_floating_point or target.dtype.is_complex \
            or target.dtype == torch.bool:
        raise ValueError("graphpass: target must be an integer tensor of token ids (e.g. torch.long), got "
                         f"{getattr(target, 'dtype', type(target).__name__)}")
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"graphpass: target shape {tuple(target.shape)} must equal logits.shape[:-1] = "
                         f"{tuple(logits.shape[:-1])} (one token id per row of logits)")
    if keep_mask is not None:
        if not isinstance(keep_mask, torch.Tensor) or keep_mask.dtype != torch.bool:
            raise ValueError("graphpass: keep_mask must be a bool tensor (True = kept), got "
                             f"{getattr(keep_mask, 'dtype', type(keep_mask).__name__)}")
        if tuple(keep_mask.shape) not in (tuple(logits.shape), (logits.shape[-1],)):
            raise ValueError(f"graphpass: keep_mask shape {tuple(keep_mask.shape)} must be the logits' shape "
                             f"{tuple(logits.shape)} or ({logits.shape[-1]},) (this rank's vocabulary slice)")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0:
        raise ValueError(f"graphpass: temperature must be a positive Python number, got {temperature!r}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"graphpass: chunk_size must be a positive int or None, got {chunk_size!r}")
    logprob, entropy, *_ = _vocab_parallel_op(logits, target, keep_mask, group_name(group), float(temperature),
                                                bool(with_entropy), bool(entropy_grad),
                                                None if ignore_index is None else int(ignore_index),
                                                chunk_size or 0, "eager")
    return logprob, (entropy if with_entropy else None)
