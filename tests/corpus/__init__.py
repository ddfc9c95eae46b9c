"""A corpus of the loss code of real LLM RL libraries, restated small, with what graphpass must find.

Each library module (`verl`, `openrlhf`, ...) restates, in its own words and on one device, the
log-prob / entropy code and the policy loss around it of one library, keeping what matters to a
graph compiler: chunk loops and preallocated buffers, in-place ops, `torch.no_grad()` blocks,
`detach`, `autograd.Function`s, `torch.utils.checkpoint`, temperature handling, `.float()` upcasts,
masks, shifted `[B, S, V]` layouts. Tensor-parallel collectives are replaced by their
single-device equivalent (a sum over one rank is the identity). Every case names the library
file and function it restates.

A `Case` is a loss function `fn(**inputs) -> tuple[Tensor, ...]` (the first element is the
scalar loss backward runs on; the rest are logged statistics), an input builder, and the sites a
correct graphpass must rewrite in it. `tests/end_to_end/test_corpus.py` checks every case (parity with eager
and coverage separately); `python -m tests.corpus` prints the table.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Callable, Mapping

import torch

ANY = "<any>"
"""`Case.temperature` value that skips the temperature check."""

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class Case:
    """One library's loss code and what graphpass must make of it."""

    name: str
    library: str
    source: str
    """The library file(s) and function(s) this case restates."""
    fn: Callable
    make_inputs: Callable[[torch.dtype], dict]
    """Builds the keyword inputs for one dtype of the model's logits (deterministic)."""
    sites: tuple[tuple[str, ...], ...] | Mapping[str, tuple[tuple[str, ...], ...]]
    """Every acceptable sorted list of site kinds, the ideal one first; or one such tuple per dtype
    name when the library's code differs by dtype (e.g. a per-row loop only for bf16)."""
    dtypes: tuple[str, ...] = ("fp32", "bf16")
    """Logits dtypes the library supports for this path."""
    no_grad_kinds: tuple[str, ...] = ()
    """Output labels whose every rewritten output must report keeps_grad False."""
    grad_kinds: tuple[str, ...] = ("logprob",)
    """Output labels whose every rewritten output must report keeps_grad True."""
    temperature: str | None = ANY
    """The temperature every labelled (logprob/entropy) output must report; ANY skips the check."""

    def __repr__(self):
        return self.name

    def acceptable(self, dtype: str) -> tuple[tuple[str, ...], ...]:
        sites = self.sites[dtype] if isinstance(self.sites, Mapping) else self.sites
        return tuple(tuple(sorted(s)) for s in sites)

    def ideal(self, dtype: str) -> tuple[str, ...]:
        return self.acceptable(dtype)[0]


# ---- expectations --------------------------------------------------------------------------------


def choices(*groups, merged=()) -> tuple[tuple[str, ...], ...]:
    """Acceptable site lists: any one of `merged` (listed first: the ideal answers), or one
    alternative from every group (independent computations, each rewritten on its own)."""
    out: dict[tuple[str, ...], None] = {}
    for m in merged:
        out[tuple(sorted(m))] = None
    for combo in itertools.product(*groups):
        out[tuple(sorted(itertools.chain.from_iterable(combo)))] = None
    return tuple(out)


def one_or_each(kind: str, n: int) -> list[tuple[str, ...]]:
    """A loop of `n` chunks computing `kind`: one merged site, or one site per chunk."""
    return [(kind,)] if n == 1 else [(kind,), (kind,) * n]


def n_chunks(rows: int, chunk: int) -> int:
    return -(-rows // chunk)


def lp_and_entropy(logprob, entropy) -> tuple[tuple[str, ...], ...]:
    """A log-prob and an entropy of the same logits: one merged site (ideal), or one of `logprob`'s
    and one of `entropy`'s alternatives."""
    return choices(list(logprob), entropy, merged=[("entropy+logprob",)])


MERGED = ("entropy+logprob",)


# ---- input builders ------------------------------------------------------------------------------


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def leaf(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype).requires_grad_()


def logits_leaf(shape, dtype, g, scale=2.0) -> torch.Tensor:
    """Model logits as a leaf (code that never mutates its logits)."""
    return leaf(torch.randn(shape, generator=g) * scale, dtype)


def lm_head(lead, hidden: int, vocab: int, dtype, g) -> dict:
    """`hidden [*lead, H]` and `weight [V, H]`: the policy's last layer, for code that mutates the
    model's logits in place (`logits.div_(T)`), which a leaf would not allow."""
    h = torch.randn(*lead, hidden, generator=g)
    w = torch.randn(vocab, hidden, generator=g) * (2.0 / math.sqrt(hidden))
    return {"hidden": leaf(h, dtype), "weight": leaf(w, dtype)}


def head_logits(inputs: dict) -> torch.Tensor:
    return inputs["hidden"].detach().float() @ inputs["weight"].detach().float().T


def tokens(shape, vocab, g) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=g)


def near_logp(logits: torch.Tensor, labels: torch.Tensor, g, temperature=1.0, noise=None, clip=0.2):
    """Log-probs of an older (or reference) policy: the current ones plus per-token offsets.

    `noise=None`: offsets for a PPO ratio with clip range `clip`, well inside it or well outside it
    (never within 0.4 x clip of its edges), so that bf16 rounding cannot flip a clip decision;
    otherwise Gaussian offsets of that scale (a KL reference)."""
    lp = torch.log_softmax(logits.detach().double() / temperature, -1)
    lp = lp.gather(-1, labels.unsqueeze(-1)).squeeze(-1).float()
    if noise is not None:
        return lp + noise * torch.randn(lp.shape, generator=g)
    u = torch.rand(lp.shape, generator=g)
    inside = torch.rand(lp.shape, generator=g) < 0.6
    magnitude = torch.where(inside, 0.4 * clip * u, clip * (2.0 + u))
    sign = torch.where(torch.rand(lp.shape, generator=g) < 0.5, -1.0, 1.0)
    return lp + sign * magnitude


def seq_offset(lp: torch.Tensor, g, lengths=None) -> torch.Tensor:
    """Old log-probs for a sequence-level ratio (GSPO, clip ranges ~1e-4): every sequence (a row,
    or a run of `lengths` tokens of a packed 1-D tensor) shifted by one offset in +-[0.05, 0.1], far
    outside the clip range whatever the rounding."""
    n = lp.shape[0] if lengths is None else len(lengths)
    off = (0.05 + 0.05 * torch.rand(n, generator=g)) * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    if lengths is None:
        return lp + off.view(-1, *([1] * (lp.dim() - 1)))
    return lp + torch.repeat_interleave(off, torch.tensor(lengths))


def response_mask(batch, length, g, min_len=2) -> torch.Tensor:
    """[B, L] float mask: each row a prefix of random length >= min_len (right padding)."""
    lens = torch.randint(min_len, length + 1, (batch,), generator=g)
    lens[0] = length
    return (torch.arange(length)[None, :] < lens[:, None]).float()


def randn(shape, g, scale=1.0) -> torch.Tensor:
    return torch.randn(shape, generator=g) * scale


# ---- the registry --------------------------------------------------------------------------------

from . import (  # noqa: E402  (the modules import Case and the helpers above)
    areal,
    nemo_rl,
    open_instruct,
    openrlhf,
    prime_rl,
    roll,
    skyrl,
    slime,
    torchtune,
    trl,
    verl,
)

MODULES = (verl, openrlhf, trl, skyrl, open_instruct, torchtune, slime, nemo_rl, areal, roll, prime_rl)
CASES: list[Case] = [c for m in MODULES for c in m.CASES]
BY_NAME = {c.name: c for c in CASES}
assert len(BY_NAME) == len(CASES), "duplicate case names"
