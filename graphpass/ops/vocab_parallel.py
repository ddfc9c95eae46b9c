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

The code is shaped as `ops.chunked_op`'s: one loop over row chunks (`row_chunks`) over whatever
gives a chunk of logits (`ShardLogits`, `RoundedQuotient`, the lm_head op's `HeadLogits`), and the
math of a chunk in `RowStatistics` (forward) and `RowGradients` (backward); a call's configuration
travels as one `VocabParallelArgs`.

The op with the lm_head inside is in `vocab_parallel_lm_head.py`, the one computing its gradients
in forward in `vocab_parallel_gradients.py`; the differentiable all-reduce the vocab-parallel code
needs in `collectives.py`.
"""

from __future__ import annotations

import dataclasses
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


# ---- the call --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class VocabParallelArgs:
    """Everything a vocab-parallel op call computes with besides its tensors, built once from the
    custom op's flat arguments and handed whole to the forward and backward code.

    `masked`: a keep_mask is given. `entropy_grad` counts only `with_entropy`. `rounded_division`:
    the logits are divided by the temperature in their own dtype, as eager divides bf16/fp16
    logits (`RoundedQuotient`), not upcast first and divided in fp32. `chunk_budget_bytes`:
    `Config.chunk_budget_bytes`, for `chunk_size` 0 (`chunk_sizes`). `with_slice_mean`: the op
    also returns each row's mean over this rank's slice of its log-probs (no keep mask)."""

    group_name: str
    temperature: float
    ignore_index: int | None
    chunk_size: int
    kernels: str
    with_entropy: bool = False
    entropy_grad: bool = True
    masked: bool = False
    with_slice_mean: bool = False
    rounded_division: bool = False
    chunk_budget_bytes: int = chunk_sizes.DEFAULT_BUDGET_BYTES

    @property
    def entropy_differentiable(self) -> bool:
        return self.with_entropy and self.entropy_grad

    def group(self):
        """(the process group, this rank in it, its size): `groups.rank_and_size`."""
        return rank_and_size(self.group_name)


# ---- the logits, chunk by chunk ------------------------------------------------------------------
class ShardLogits:
    """This rank's `[*, Vl]` logits tensor as the ops read it: row blocks (`blocks`) that `row_chunks`
    cuts into chunks (`piece`), each a view without a copy."""

    computed = False  # a chunk is a view of the caller's logits: its gradient goes elsewhere

    def __init__(self, logits: torch.Tensor):
        self.logits = logits
        self.shape, self.dtype, self.device = logits.shape, logits.dtype, logits.device

    def new_empty(self, *args, **kwargs):
        return self.logits.new_empty(*args, **kwargs)

    def blocks(self):
        """(row offset, 2-D `[rows, Vl]` view) blocks covering the rows in order, without a copy.

        One block when the logits view as `[R, Vl]`; a strided view such as `logits[:, :-1]` of a
        `[B, S, Vl]` tensor walks its leading dims instead (every 2-D slice of a strided tensor is a view).
        """
        logits = self.logits
        if logits.ndim == 2:
            return [(0, logits)]
        try:
            return [(0, logits.view(math.prod(logits.shape[:-1]), logits.shape[-1]))]
        except RuntimeError:
            pass
        inner = logits.shape[-2]
        return [(n * inner, logits[index]) for n, index in enumerate(itertools.product(*map(range, logits.shape[:-2])))]

    def piece(self, block, start: int, stop: int):
        """Rows `start:stop` of one of `blocks`."""
        return block[start:stop]

    def rows_per_chunk(self, args: VocabParallelArgs) -> int:
        """`args.chunk_size` (> 0), else one fp32 `[chunk, V]` temporary within
        `chunk_sizes.vocab_parallel_logits_bytes` of the logits' bytes (on a CPU at most
        `args.chunk_budget_bytes`)."""
        rows, vocab = math.prod(self.shape[:-1]), self.shape[-1]
        if args.chunk_size > 0:
            return max(1, min(args.chunk_size, rows))
        budget = chunk_sizes.vocab_parallel_logits_bytes(rows * vocab * self.dtype.itemsize, args.chunk_budget_bytes,
                                                          host=devices.host_reads_are_free(self.device))
        return chunk_sizes.fitting(budget, vocab * 4, rows)

    def write_gradient(self, grad, sl, chunk_grad) -> None:
        """Rows `sl` of the logits' gradient `grad` from the gradient of the chunk `piece` read."""
        grad[sl] = chunk_grad


class RoundedQuotient(ShardLogits):
    """`logits / temperature` as eager computes it for bf16/fp16 `logits` (the quotient rounded to
    their dtype; the op would otherwise divide the fp32 upcast), one chunk at a time: what the op
    reads when the temperature's division it took in is one of the logits' own dtype. The division
    is the same aten op as eager's, elementwise, so each chunk holds exactly eager's quotient."""

    computed = True

    def __init__(self, logits: torch.Tensor, temperature: float):
        super().__init__(logits)
        self.temperature = temperature

    def piece(self, block, start: int, stop: int):
        return torch.div(block[start:stop], self.temperature)

    def write_gradient(self, grad, sl, chunk_grad) -> None:
        # The division's backward, the same aten op as eager's.
        torch.div(chunk_grad, self.temperature, out=grad[sl])


def read_logits(logits: torch.Tensor, args: VocabParallelArgs):
    """(what the logits op reads, the args it reads it with): with `args.rounded_division` and a
    temperature other than 1, the `RoundedQuotient` at temperature 1, else the logits themselves."""
    if args.rounded_division and args.temperature != 1.0:
        return RoundedQuotient(logits, args.temperature), dataclasses.replace(args, temperature=1.0)
    return ShardLogits(logits), args


def row_chunks(logits, chunk: int):
    """(row slice, `[r, Vl]` chunk) covering all rows of `logits` in order, at most `chunk` rows each:
    the one loop over rows of the vocab-parallel ops. `logits`: a `ShardLogits`, `RoundedQuotient`
    or `vocab_parallel_lm_head.HeadLogits` (whose chunks are computed, not read)."""
    for offset, block in logits.blocks():
        for start in range(0, block.shape[0], chunk):
            stop = min(block.shape[0], start + chunk)
            yield slice(offset + start, offset + stop), logits.piece(block, start, stop)


def _flat(t: torch.Tensor | None, rows: int, width: int | None = None):
    if t is None:
        return None
    return t.reshape(rows) if width is None else t.reshape(rows, width)


def _keep_rows(keep_mask, rows: int, vocab: int):
    """`keep(sl)`: the keep mask of rows `sl` (`[r, Vl]`, or the `[1, Vl]` row of a `[Vl]` mask);
    None without a keep mask."""
    if keep_mask is None:
        return None
    if keep_mask.ndim == 1:
        row = keep_mask[None, :]
        return lambda sl: row
    flat = _flat(keep_mask, rows, vocab)
    return lambda sl: flat[sl]


def _local_targets(target_flat, rank: int, vocab: int, ignore_index: int | None):
    """(this rank's column of each target clamped into the slice, owned here, ignored)."""
    ignored = torch.zeros_like(target_flat, dtype=torch.bool) if ignore_index is None else target_flat == ignore_index
    local = target_flat.long() - rank * vocab
    owned = (local >= 0) & (local < vocab) & ~ignored
    return local.clamp(0, max(0, vocab - 1)), owned, ignored


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


# ---- forward -------------------------------------------------------------------------------------
class RowStatistics:
    """This rank's statistics of each row, the one all-gather's operand (columns `_M`, `_S`, ...),
    filled chunk by chunk (`add`), and the op's outputs from every rank's (`finish`).
    `logits`: what the rows are read from (its shape, dtype and device)."""

    def __init__(self, logits, target, keep_mask, args: VocabParallelArgs):
        if args.with_slice_mean and keep_mask is not None:
            raise ValueError("graphpass: the slice mean of the log-probs is not computed under a keep_mask")
        self.args = args
        self.group, rank, self.size = args.group()
        self.lead, self.vocab = logits.shape[:-1], logits.shape[-1]
        rows = math.prod(self.lead)
        self.dtype = dtype = compute_dtype(logits.dtype)
        self.new_empty = logits.new_empty
        self.target_flat = target.reshape(rows)
        self.local_target, self.owned, self.ignored = _local_targets(self.target_flat, rank, self.vocab,
                                                                     args.ignore_index)
        self.keep = _keep_rows(keep_mask, rows, self.vocab)
        self.stats = torch.zeros(rows, _stat_columns(args.with_entropy, args.masked), dtype=dtype, device=logits.device)
        # This rank's own: sum over its slice of x - m (its row max m), never gathered.
        self.slice_sum = torch.zeros(rows, dtype=dtype, device=logits.device) if args.with_slice_mean else None

    def add(self, sl, piece) -> None:
        """The statistics of rows `sl` from their `[r, Vl]` logits `piece`."""
        args, stats, dtype = self.args, self.stats, self.dtype
        lt, own = self.local_target[sl], self.owned[sl]
        # The target's logit, scaled alone: the same value as read from the scaled chunk.
        stats[sl, _TARGET] = torch.where(own, _scaled(piece.gather(1, lt[:, None])[:, 0], args.temperature, dtype), 0)
        stats[sl, _OWNER] = own.to(dtype)
        # Exact below 2^24 in fp32; two ids that round alike pass unnoticed, never a false alarm.
        stats[sl, _TOKEN] = self.target_flat[sl].to(dtype)
        if args.masked:
            x = _scaled(piece, args.temperature, dtype)
            m, s, _, _ = _max_and_sum_exp(_apply_keep_mask(x, self.keep(sl), lt, own))
            stats[sl, _M], stats[sl, _S] = m, s
            if args.with_entropy:
                m, s, z, e = _max_and_sum_exp(x)
                stats[sl, _FULL_M], stats[sl, _FULL_S], stats[sl, _A] = m, s, _shifted_moment(z, e)
            del x
        else:
            row_stats = compiled_kernel(_chunk_stats, args.kernels)(piece, args.temperature, args.with_entropy,
                                                                    args.with_slice_mean)
            stats[sl, _M], stats[sl, _S] = row_stats[0], row_stats[1]
            if args.with_entropy:
                stats[sl, _A] = row_stats[2]
            if args.with_slice_mean:
                self.slice_sum[sl] = row_stats[-1]

    def finish(self):
        """(logprob, entropy or [0], lse_lp, lse_full or [0]), and `with_slice_mean` a fifth, the slice
        mean of the log-probs (`_slice_mean`): the one all-gather, then the combination on every rank."""
        args, stats, dtype = self.args, self.stats, self.dtype
        rows, columns = stats.shape
        local_max = stats[:, _M].clone() if args.with_slice_mean else None
        if self.size > 1:
            # The one collective of the call: its shape is [size * rows, columns] on every rank, whatever
            # the values, grad mode or requires_grad (gloo wants the flat [world * n, ...] output).
            gathered = torch.empty(self.size * rows, columns, dtype=dtype, device=stats.device)
            all_gather(gathered, stats, self.group)
            stats = gathered.view(self.size, rows, columns)
        else:
            stats = stats[None]
        logprob, entropy, lse_lp, lse_full = self._combined(stats)
        # Distinct empty tensors: a custom op's outputs may not alias one another.
        outputs = (logprob.reshape(self.lead),
                   self.new_empty((0,), dtype=dtype) if entropy is None else entropy.reshape(self.lead), lse_lp,
                   self.new_empty((0,), dtype=dtype) if lse_full is None else lse_full)
        if not args.with_slice_mean:
            return outputs
        return (*outputs, _slice_mean(stats, self.slice_sum, local_max, self.vocab).reshape(self.lead))

    def _combined(self, stats):
        """From the gathered `[tp, R, C]` statistics: (logprob, entropy or None, lse_lp, lse_full or None)."""
        ignored, target_flat, size = self.ignored, self.target_flat, self.size
        vocab_global = self.vocab * size
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
        if not self.args.with_entropy:
            return logprob, None, lse_lp, None
        if self.args.masked:
            lse_full, entropy = _entropy(stats[..., _FULL_M], stats[..., _FULL_S], stats[..., _A])
            return logprob, entropy, lse_lp, lse_full
        _, entropy = _entropy(stats[..., _M], stats[..., _S], stats[..., _A])
        return logprob, entropy, lse_lp, None


def forward_statistics(logits, target, keep_mask, args: VocabParallelArgs):
    """The op's forward over `logits` (a `ShardLogits`, `RoundedQuotient` or `HeadLogits`, read chunk
    by chunk): `RowStatistics.finish`'s outputs."""
    statistics = RowStatistics(logits, target, keep_mask, args)
    with torch.no_grad():
        for sl, piece in row_chunks(logits, logits.rows_per_chunk(args)):
            statistics.add(sl, piece)
    return statistics.finish()


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
class RowGradients:
    """The row operands of the logits' gradient, for all rows, computed once (None where the
    log-prob's, the entropy's or the slice mean's gradient is absent or known zero: no entropy
    recompute for an entropy returned only for logging), and each chunk's gradient from them
    (`of_chunk`). `logits`: what the op reads (its shape and dtype); `lse_full`: read under a keep
    mask only; `grad_slice_mean`: the gradient of the slice mean of the log-probs (`_slice_mean`),
    or None; not with a keep mask."""

    def __init__(self, logits, target, keep_mask, lse_lp, lse_full, entropy, grad_logprob, grad_entropy,
                 args: VocabParallelArgs, grad_slice_mean=None):
        _, rank, _ = args.group()
        vocab = logits.shape[-1]
        rows = math.prod(logits.shape[:-1])
        self.args, self.dtype = args, compute_dtype(logits.dtype)
        local_target, self.owned, ignored = _local_targets(target.reshape(rows), rank, vocab, args.ignore_index)
        self.local_target = local_target[:, None]
        self.keep = _keep_rows(keep_mask, rows, vocab)
        self.g_lp = self.g_target = self.entropy = self.g_ent = self.g_mean = None
        if grad_logprob is not None:
            g_lp = torch.where(ignored, 0, _flat(grad_logprob, rows).to(self.dtype))
            self.g_lp, self.g_target = g_lp[:, None], torch.where(self.owned, g_lp, 0)[:, None]
            if args.masked:
                # An ignored row contributes nothing; its (masked) log-sum-exp may be -inf, so its softmax
                # is taken against +inf (probabilities 0) rather than multiplied by a zero weight (NaN).
                lse_lp = torch.where(ignored, float("inf"), lse_lp)
        self.lse_lp = lse_lp.reshape(rows, 1)
        if not devices.known_zero(grad_entropy):
            self.entropy, self.g_ent = entropy.reshape(rows, 1), _flat(grad_entropy, rows).to(self.dtype)[:, None]
            # Under a keep mask the log-prob's softmax is over the kept logits, the entropy's over all.
            self.lse_ent = lse_full.reshape(rows, 1) if args.masked else self.lse_lp
        if not devices.known_zero(grad_slice_mean):
            if args.masked:
                raise ValueError("graphpass: the slice mean of the log-probs is not computed under a keep_mask")
            self.g_mean = _flat(grad_slice_mean, rows).to(self.dtype)[:, None]

    @staticmethod
    def _rows(t, sl):
        return None if t is None else t[sl]

    def of_chunk(self, sl, piece, in_place: bool, column: int = 0):
        """The gradient of the logits `piece` of rows `sl` (a tile of columns from `column` on: no
        keep mask), in their dtype; `in_place`: written over `piece` (its logits are then gone)."""
        if self.args.masked:
            return self._masked(sl, piece)
        target = self.local_target[sl] if column == 0 else self.local_target[sl] - column
        kernel = compiled_kernel(chunk_grad_ if in_place else _chunk_grad, self.args.kernels)
        grad = kernel(piece, self.lse_lp[sl], self._rows(self.g_lp, sl), self._rows(self.g_target, sl), target,
                      self._rows(self.entropy, sl), self._rows(self.g_ent, sl), self.args.temperature,
                      self._rows(self.g_mean, sl))
        return piece if in_place else grad

    def _masked(self, sl, piece):
        dtype, temperature = self.dtype, self.args.temperature
        x = _scaled(piece, temperature, dtype)
        lt = self.local_target[sl, 0]
        out = torch.zeros_like(x)
        if self.g_lp is not None:
            xm = _apply_keep_mask(x, self.keep(sl), lt, self.owned[sl])
            out.addcmul_((xm - self.lse_lp[sl]).exp(), self.g_lp[sl], value=-1)
            out.scatter_add_(1, lt[:, None], self.g_target[sl])
            del xm
        if self.g_ent is not None:
            z = x - self.lse_ent[sl]
            p = z.exp()
            # d entropy / dx = p (E[x] - x) = p (-H - (x - lse)); a -inf logit has p = 0 and contributes 0.
            z = z.clamp_min(torch.finfo(dtype).min)
            out.addcmul_(p, (-self.entropy[sl] - z) * self.g_ent[sl])
            del z, p
        if temperature != 1.0:
            out.div_(temperature)
        return out.to(piece.dtype)


def backward_rows(logits, gradients: RowGradients, sink) -> None:
    """`sink(row slice, the chunk's dlogits in the logits' dtype)` for each chunk of rows of `logits`
    (as `forward_statistics` reads them) in order. No collective."""
    for sl, piece in row_chunks(logits, logits.rows_per_chunk(gradients.args)):
        # A computed chunk is a temporary: its gradient takes its place.
        sink(sl, gradients.of_chunk(sl, piece, in_place=logits.computed))


def _backward(logits, target, keep_mask, lse_lp, lse_full, entropy, grad_logprob, grad_entropy, grad_slice_mean,
              args: VocabParallelArgs):
    """d(logprob . grad_logprob + entropy . grad_entropy + slice mean . grad_slice_mean) / d logits,
    chunk by chunk, no collective. With `args.rounded_division` (`read_logits`) it is eager
    autograd's of the division: the gradient with respect to the quotient, in the logits' dtype,
    divided by the temperature in that dtype."""
    grad = torch.empty(math.prod(logits.shape[:-1]), logits.shape[-1], dtype=logits.dtype, device=logits.device)
    source, read_args = read_logits(logits, args)
    gradients = RowGradients(source, target, keep_mask, lse_lp, lse_full, entropy, grad_logprob, grad_entropy,
                             read_args, grad_slice_mean)
    backward_rows(source, gradients, lambda sl, chunk_grad: source.write_gradient(grad, sl, chunk_grad))
    return grad.view(logits.shape)


def fake_outputs(like, lead, with_entropy: bool, masked: bool):
    dtype = compute_dtype(like.dtype)
    rows = math.prod(lead)
    entropy = like.new_empty(lead if with_entropy else (0,), dtype=dtype)
    lse_full = like.new_empty((rows,) if with_entropy and masked else (0,), dtype=dtype)
    return like.new_empty(lead, dtype=dtype), entropy, like.new_empty((rows,), dtype=dtype), lse_full


# ---- custom ops ----------------------------------------------------------------------------------
def _op_args(keep_mask, group_name, temperature, with_entropy, entropy_grad, ignore_index, chunk_size, kernels,
             rounded_division=False, chunk_budget_bytes=chunk_sizes.DEFAULT_BUDGET_BYTES, with_slice_mean=False):
    """The `VocabParallelArgs` of a `graphpass::vocab_parallel_logprob_entropy` call, from its arguments after `target`."""
    return VocabParallelArgs(group_name, temperature, ignore_index, chunk_size, kernels, with_entropy=with_entropy,
                             entropy_grad=entropy_grad, masked=keep_mask is not None, with_slice_mean=with_slice_mean,
                             rounded_division=bool(rounded_division), chunk_budget_bytes=chunk_budget_bytes)


@torch.library.custom_op("graphpass::vocab_parallel_logprob_entropy", mutates_args=(),
                        tags=devices.NOT_CUDAGRAPH_CAPTURABLE)
def _vocab_parallel_op(logits: torch.Tensor, target: torch.Tensor, keep_mask: torch.Tensor | None, group_name: str,
                       temperature: float, with_entropy: bool, entropy_grad: bool, ignore_index: int | None,
                       chunk_size: int, kernels: str, rounded_division: bool = False,
                       chunk_budget_bytes: int = chunk_sizes.DEFAULT_BUDGET_BYTES, with_slice_mean: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprob, entropy or [0], log-sum-exp of the log-prob distribution [R], of the unmasked one or
    [0], the mean of the log-probs over this rank's vocabulary slice or [0]).

    `rounded_division`, `chunk_budget_bytes`, `with_slice_mean`: as in `VocabParallelArgs`; the slice
    mean is local to the rank (not all-reduced; megatron-core's label smoothing reads it),
    differentiable with respect to this rank's logits alone, and adds nothing to the collective."""
    args = _op_args(keep_mask, group_name, temperature, with_entropy, entropy_grad, ignore_index, chunk_size, kernels,
                    rounded_division, chunk_budget_bytes, with_slice_mean)
    source, read_args = read_logits(logits, args)
    out = forward_statistics(source, target, keep_mask, read_args)
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
    args = VocabParallelArgs(group_name, temperature, ignore_index, chunk_size, kernels, masked=keep_mask is not None,
                             rounded_division=bool(rounded_division), chunk_budget_bytes=chunk_budget_bytes)
    return _backward(logits, target, keep_mask, lse_lp, lse_full, entropy, grad_logprob, grad_entropy,
                     grad_slice_mean, args)


@_vocab_parallel_backward_op.register_fake
def _(logits, target, keep_mask, lse_lp, lse_full, entropy, grad_logprob, grad_entropy, group_name, temperature,
      ignore_index, chunk_size, kernels, rounded_division=False, chunk_budget_bytes=chunk_sizes.DEFAULT_BUDGET_BYTES,
      grad_slice_mean=None):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    logits, target, keep_mask = inputs[:3]
    ctx.args = _op_args(*inputs[2:])
    logprob, entropy, lse_lp, lse_full, slice_mean = output
    if not ctx.args.with_slice_mean:
        ctx.mark_non_differentiable(slice_mean)
    # O(rows) beyond the inputs: the log-sum-exps and the entropy (the backward's E[x] = lse - H).
    ctx.save_for_backward(logits, target, keep_mask, lse_lp, lse_full, entropy)
    ctx.mark_non_differentiable(lse_lp, lse_full)
    if not ctx.args.entropy_differentiable:
        ctx.mark_non_differentiable(entropy)


def _autograd_backward(ctx, grad_logprob, grad_entropy, _grad_lse_lp, _grad_lse_full, grad_slice_mean):
    if not ctx.needs_input_grad[0]:
        return (None,) * 13
    logits, target, keep_mask, lse_lp, lse_full, entropy = ctx.saved_tensors
    args = ctx.args
    if not args.entropy_differentiable:
        grad_entropy = None
    if grad_slice_mean is not None and grad_slice_mean.numel() == 0:  # not asked for: an empty output
        grad_slice_mean = None
    if grad_logprob is None and grad_entropy is None and grad_slice_mean is None:
        return (None,) * 13
    grad = _vocab_parallel_backward_op(logits, target, keep_mask, lse_lp, lse_full, entropy, grad_logprob,
                                       grad_entropy, args.group_name, args.temperature, args.ignore_index,
                                       args.chunk_size, args.kernels, args.rounded_division, args.chunk_budget_bytes,
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

