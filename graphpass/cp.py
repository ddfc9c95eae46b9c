"""Context-parallel sequence layouts: which rows of the packed token stream each rank holds.

    from graphpass import cp
    layout = cp.Layout.zigzag(group, seq_lens)        # Megatron's / slime's load-balanced thd layout
    local = layout.shard(x)                           # [T, ...] -> this rank's rows [T_local, ...]
    tgt = layout.shifted_targets(tokens)              # [T_local]: the next token of each local row
    full = layout.unshard(y)                          # [T_local, ...] -> [T, ...] on every rank

The loss is written once, for one device, over the packed sequences (`T = sum(seq_lens)` rows):
per-token math on the model's local rows, `unshard`, then the single-device loss. Compiled with
graphpass, a loss that reduces what `unshard` returns to sums (a token mean, per-sequence sums) is
rewritten to reduce the local rows and all-reduce only the sums (`passes/localize_cp_reductions`).

Tensors of `T` rows that the loss reads besides (tokens, old log-probs, advantages, masks) are the
same on every rank, as in slime, where every rank holds the whole rollout batch.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.distributed

from graphpass.ops.cp_shards import cp_shard, cp_shifted_targets, cp_unshard
from graphpass.ops.groups import all_gather, group_name, rank_and_size

__all__ = ["Layout", "rows_per_rank"]

KINDS = ("zigzag", "contiguous", "allgather")


class Layout:
    """Which rows of the packed stream of sequences `seq_lens` each rank of a CP group holds.

    Build one with `Layout.zigzag`, `Layout.contiguous`, `Layout.allgather` or
    `Layout.from_megatron`, outside the compiled loss (once per batch: it checks with one tiny
    all-gather that every rank was given the same `seq_lens`; `check=False` skips that). Its tables
    depend only on the sequence lengths and the group's size, so they are the same on every rank;
    a new batch gets a new layout and reuses the compiled code. `tp_group`: the tensor-parallel
    group the loss also uses, checked to be another axis of the device mesh. `device`: where the
    tables live (default: the current GPU for an NCCL group, else the CPU).
    """

    def __init__(self, kind: str, group, seq_lens, *, pad_multiple: int = 1, tp_group=None, device=None,
                 check: bool = True):
        if kind not in KINDS:
            raise ValueError(f"graphpass.cp: unknown layout {kind!r}; use one of {', '.join(KINDS)}")
        self.kind = kind
        self.seq_lens = _check_seq_lens(seq_lens)
        self.group, self.group_name, self.rank, self.size = _group(group)
        if isinstance(pad_multiple, bool) or not isinstance(pad_multiple, int) or pad_multiple < 1:
            raise ValueError(f"graphpass.cp: pad_multiple must be a positive int, got {pad_multiple!r}")
        if tp_group is not None:
            _check_disjoint(self.group, tp_group)
        rows = _rows(kind, self.seq_lens, self.size, pad_multiple)
        device = _default_device(self.group) if device is None else torch.device(device)
        if check and self.size > 1:
            self._check_same_on_every_rank(pad_multiple, device)
        self.all_rows = rows.to(device)
        """`[cp, T_local]`: the global row each rank's local row holds, -1 for padding."""
        self.local_rows = rows[self.rank].contiguous().to(device)
        self.next_rows = _next_rows(rows[self.rank], self.seq_lens).to(device)
        self.order = _order(rows).to(device)

    def _check_same_on_every_rank(self, pad_multiple: int, device) -> None:
        """One all-gather of a fingerprint of the layout: ranks given different sequence lengths
        would otherwise disagree on every shape that follows, and hang or mix rows."""
        digest = hashlib.blake2b(repr((self.kind, self.seq_lens, pad_multiple)).encode(), digest_size=7).digest()
        mine = torch.tensor([int.from_bytes(digest, "little")], dtype=torch.long, device=device)
        every = torch.empty(self.size, dtype=torch.long, device=device)
        all_gather(every, mine, self.group)
        if bool((every != mine).any()):
            differ = [r for r in range(self.size) if int(every[r]) != int(mine)]
            raise ValueError(f"graphpass.cp: ranks {differ} of the context-parallel group were given another layout than "
                             f"rank {self.rank} ({self.kind}, {len(self.seq_lens)} sequences, T={sum(self.seq_lens)}); "
                             "pass the same seq_lens on every rank")

    # ---- constructors --------------------------------------------------------------------------
    @classmethod
    def zigzag(cls, group, seq_lens, *, pad_multiple: int = 1, **kw) -> "Layout":
        """Each sequence padded to a multiple of 2·cp and cut into 2·cp chunks; rank r holds chunks r
        and 2·cp−1−r of every sequence (Megatron's and slime's load-balanced context parallelism),
        its rows padded at their end to a multiple of pad_multiple (slime: tp · 128)."""
        return cls("zigzag", group, seq_lens, pad_multiple=pad_multiple, **kw)

    @classmethod
    def contiguous(cls, group, seq_lens, *, pad_multiple: int = 1, **kw) -> "Layout":
        """The packed stream padded at its end to a multiple of cp · pad_multiple and split into cp
        contiguous pieces; rank r holds piece r."""
        return cls("contiguous", group, seq_lens, pad_multiple=pad_multiple, **kw)

    @classmethod
    def allgather(cls, group, seq_lens, packing: str = "thd", *, pad_multiple: int = 1, **kw) -> "Layout":
        """slime's `allgather_cp`: the globally concatenated thd stream, padded to a multiple of
        cp · pad_multiple (slime: tp · 128), split contiguously. Needs thd packing and cp > 1."""
        if packing != "thd":
            raise ValueError(f"graphpass.cp: the allgather layout needs packing='thd' (sequences concatenated), "
                             f"got packing={packing!r}")
        layout = cls("allgather", group, seq_lens, pad_multiple=pad_multiple, **kw)
        if layout.size < 2:
            raise ValueError("graphpass.cp: the allgather layout needs a context-parallel group of at least 2 ranks; "
                             "use Layout.contiguous for one rank")
        return layout

    @classmethod
    def from_megatron(cls, kind: str, seq_lens, **kw) -> "Layout":
        """The layout `kind` over megatron-core's context-parallel group, checked against its
        tensor-parallel group (`parallel_state` must be initialised)."""
        try:
            from megatron.core import parallel_state
        except ImportError:
            raise ImportError("graphpass.cp: Layout.from_megatron needs megatron-core: pip install 'graphpass[megatron]'") \
                from None
        if not parallel_state.model_parallel_is_initialized():
            raise ValueError("graphpass.cp: megatron-core's parallel_state is not initialised; call "
                             "parallel_state.initialize_model_parallel(...) first, or pass a group to Layout.zigzag")
        kw.setdefault("tp_group", parallel_state.get_tensor_model_parallel_group())
        group = parallel_state.get_context_parallel_group()
        if kind == "allgather":
            return cls.allgather(group, seq_lens, **kw)
        if kind not in KINDS:
            raise ValueError(f"graphpass.cp: unknown layout {kind!r}; use one of {', '.join(KINDS)}")
        return cls(kind, group, seq_lens, **kw)

    # ---- sizes -----------------------------------------------------------------------------------
    @property
    def total_rows(self) -> int:
        """T: the tokens of all sequences."""
        return int(self.order.shape[0])

    @property
    def local_row_count(self) -> int:
        """T_local: the rows each rank holds, padding included (the same on every rank)."""
        return int(self.local_rows.shape[0])

    def __repr__(self):
        return (f"cp.Layout.{self.kind}(cp={self.size}, rank={self.rank}, sequences={len(self.seq_lens)}, "
                f"T={self.total_rows}, T_local={self.local_row_count})")

    # ---- the ops -----------------------------------------------------------------------------------
    def shard(self, x: torch.Tensor) -> torch.Tensor:
        """`[T, ...]` -> this rank's rows `[T_local, ...]`, padding rows zero; no communication."""
        self._check_rows(x, self.order, "the global", "shard")
        return cp_shard(x, self.local_rows)

    def shifted_targets(self, tokens: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """`[T]` token ids -> `[T_local]`: the next token of each local row within its sequence,
        `ignore_index` at a sequence's last token and on padding rows; no communication."""
        self._check_rows(tokens, self.order, "the global", "shifted_targets")
        if tokens.ndim != 1 or tokens.dtype.is_floating_point or tokens.dtype == torch.bool:
            raise ValueError(f"graphpass.cp: shifted_targets takes the [T] integer token ids, got "
                             f"{tuple(tokens.shape)} {tokens.dtype}")
        return cp_shifted_targets(tokens, self.next_rows, int(ignore_index))

    def unshard(self, y: torch.Tensor) -> torch.Tensor:
        """`[T_local, ...]` -> `[T, ...]` on every rank, in global order, padding dropped: one exact
        all-gather of the local rows. Backward: each rank takes the gradient rows it holds."""
        self._check_rows(y, self.local_rows, "this rank's", "unshard")
        return cp_unshard(y, self.local_rows, self.order, self.group_name)

    def _check_rows(self, x, rows: torch.Tensor, which: str, op: str) -> None:
        # Compared with the tables' shapes, not Python ints, so that a compiled loss treats the
        # sizes as symbols: a new batch's layout does not recompile it.
        if not isinstance(x, torch.Tensor) or x.ndim == 0:
            raise ValueError(f"graphpass.cp: {op} takes a tensor with rows, got {type(x).__name__}")
        if x.shape[0] != rows.shape[0]:
            raise ValueError(f"graphpass.cp: {op} got {x.shape[0]} rows, but {which} rows of {self!r} are "
                             f"{rows.shape[0]}; check seq_lens against the tensor")


def rows_per_rank(kind: str, seq_lens, cp: int, pad_multiple: int = 1) -> int:
    """T_local: the rows (padding included) each of `cp` ranks holds in layout `kind`; no group needed."""
    if kind not in KINDS:
        raise ValueError(f"graphpass.cp: unknown layout {kind!r}; use one of {', '.join(KINDS)}")
    return int(_rows(kind, _check_seq_lens(seq_lens), cp, pad_multiple).shape[1])


# ---- tables ------------------------------------------------------------------------------------------
def _check_seq_lens(seq_lens) -> tuple[int, ...]:
    if isinstance(seq_lens, torch.Tensor):
        seq_lens = seq_lens.tolist()
    try:
        lens = tuple(seq_lens)
    except TypeError:
        raise ValueError(f"graphpass.cp: seq_lens must be a list of positive ints, got {seq_lens!r}") from None
    if not lens or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in lens):
        raise ValueError(f"graphpass.cp: seq_lens must be a non-empty list of positive ints (one per packed "
                         f"sequence), got {list(lens)[:8]}{'...' if len(lens) > 8 else ''}")
    return lens


def _group(group):
    """(group, name, this rank in it, its size); a single process without torch.distributed is a
    group of one named ""."""
    name = group_name(group)
    resolved, rank, size = rank_and_size(name)
    return resolved, name, rank, size


def _default_device(group) -> torch.device:
    """Where the tables live when the caller does not say: the current GPU for an NCCL group."""
    if group is not None and "nccl" in str(torch.distributed.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _check_disjoint(cp_group, tp_group) -> None:
    """The CP and TP groups share this rank only: each is one axis of the device mesh."""
    if not isinstance(tp_group, torch.distributed.ProcessGroup):
        raise ValueError(f"graphpass.cp: tp_group must be a ProcessGroup, got {type(tp_group).__name__}")
    cp_ranks = set(torch.distributed.get_process_group_ranks(cp_group)) if cp_group is not None else set()
    tp_ranks = set(torch.distributed.get_process_group_ranks(tp_group))
    shared = cp_ranks & tp_ranks
    if len(shared) > 1:
        raise ValueError(f"graphpass.cp: the context-parallel group {sorted(cp_ranks)} and the tensor-parallel group "
                         f"{sorted(tp_ranks)} share ranks {sorted(shared)}; they must be different axes of the "
                         "device mesh (e.g. megatron-core's parallel_state groups)")


def _rows(kind: str, seq_lens, size: int, pad_multiple: int) -> torch.Tensor:
    """`[size, T_local]` global rows (-1 padding) of layout `kind`."""
    if kind == "zigzag":
        rows = _zigzag_rows(seq_lens, size)
        extra = -rows.shape[1] % pad_multiple
        return torch.cat([rows, rows.new_full((size, extra), -1)], dim=1) if extra else rows
    return _contiguous_rows(sum(seq_lens), size, pad_multiple)


def _zigzag_rows(seq_lens, size: int) -> torch.Tensor:
    """`[size, T_local]` global rows (-1 padding) of the zigzag layout."""
    per_rank: list[list[torch.Tensor]] = [[] for _ in range(size)]
    start = 0
    for n in seq_lens:
        chunk = math.ceil(n / (2 * size))
        for rank in range(size):
            for piece in (rank, 2 * size - 1 - rank):
                pos = torch.arange(piece * chunk, (piece + 1) * chunk)
                per_rank[rank].append(torch.where(pos < n, start + pos, -1))
        start += n
    return torch.stack([torch.cat(pieces) for pieces in per_rank])


def _contiguous_rows(total: int, size: int, pad_multiple: int) -> torch.Tensor:
    """`[size, T_local]` global rows (-1 padding) of the stream padded and split into `size` pieces."""
    padded = math.ceil(total / (size * pad_multiple)) * size * pad_multiple
    rows = torch.arange(padded)
    return torch.where(rows < total, rows, -1).view(size, padded // size)


def _next_rows(local_rows: torch.Tensor, seq_lens) -> torch.Tensor:
    """The global row of each local row's target; -1 at a sequence's last token and on padding."""
    total = sum(seq_lens)
    is_last = torch.zeros(total, dtype=torch.bool)
    is_last[torch.tensor(seq_lens).cumsum(0) - 1] = True
    following = torch.where(is_last, -1, torch.arange(total) + 1)
    return torch.where(local_rows >= 0, following[local_rows.clamp_min(0)], -1)


def _order(all_rows: torch.Tensor) -> torch.Tensor:
    """`[T]`: where each global row sits in the concatenation of every rank's local rows."""
    flat = all_rows.reshape(-1)
    valid = flat >= 0
    order = torch.empty(int(valid.sum()), dtype=torch.long)
    order[flat[valid]] = torch.arange(flat.numel())[valid]
    return order
