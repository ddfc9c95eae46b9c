"""A catalog of PPO-style loss idioms, each with the sites graphpass must find in it.

Every idiom is a plain function `fn(logits, tokens, **extra) -> tuple[Tensor, ...]`: the first
element is the scalar loss that backward runs on, the rest are logged (detached) statistics.
`logits` is `[N, V]` or `[B, S, V]`; `tokens`, `adv` and `old_logp` have the logits' shape minus V.

`expected_kinds` lists one entry per rewritten site: the labels of its outputs, sorted and joined
by "+" (e.g. "entropy+logprob" for a shared log_softmax). An empty tuple means nothing must be
rewritten. `alternatives` lists other acceptable answers for the must-not-match idioms.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.nn.functional as F

CLIP = 0.2
TEMP = 0.7


@dataclasses.dataclass(frozen=True)
class Idiom:
    """One loss idiom and what graphpass must make of it."""

    name: str
    fn: Callable
    expected_kinds: tuple[str, ...]
    """Per site, its output labels sorted and joined by "+"; () when nothing may be rewritten."""
    layouts: tuple[str, ...] = ("2d", "3d")
    """Logits layouts the idiom is written for: "2d" is [N, V], "3d" is [B, S, V]."""
    alternatives: tuple[tuple[str, ...], ...] = ()
    """Other acceptable `expected_kinds` (e.g. a region left out instead of labelled rowwise)."""
    per_chunk: int | None = None
    """For a hand-chunked loss: rows per Python chunk; one site per chunk, or one merged site."""
    forbidden_kinds: tuple[str, ...] = ()
    """Output labels that must never appear (e.g. "entropy" for -p(y) log p(y))."""
    temperature: str | None = None
    """The temperature every labelled output must report."""

    def __repr__(self):
        return self.name

    def acceptable_sites(self, rows: int) -> list[tuple[str, ...]]:
        """Every acceptable sorted list of site kinds for logits with `rows` rows."""
        answers = [self.expected_kinds, *self.alternatives]
        if self.per_chunk:
            chunks = -(-rows // self.per_chunk)
            answers = [self.expected_kinds * chunks, self.expected_kinds]
        return [tuple(sorted(a)) for a in answers]


def make_extra(logits: torch.Tensor, tokens: torch.Tensor, seed: int = 0) -> dict:
    """Advantages, old log-probs and a top-p style mask matching `tokens` (deterministic)."""
    g = torch.Generator().manual_seed(seed)
    shape = tokens.shape
    adv = torch.randn(shape, generator=g)
    old_logp = -torch.rand(shape, generator=g) * 3.0
    # Mask ~30% of the vocabulary in every other row, never the sampled token: rows with -inf entries.
    mask = torch.rand(logits.shape, generator=g) < 0.3
    mask.view(-1, logits.shape[-1])[::2] = False
    mask.scatter_(-1, tokens.unsqueeze(-1), False)
    return {"adv": adv, "old_logp": old_logp, "top_p_mask": mask}


def ppo_loss(logp, old_logp, adv, ent=None, ent_coef=0.01):
    """Clipped PPO surrogate on per-token log-probs, minus an entropy bonus."""
    ratio = torch.exp(logp.float() - old_logp)
    surrogate = torch.min(ratio * adv, ratio.clamp(1 - CLIP, 1 + CLIP) * adv)
    loss = -surrogate.mean()
    if ent is not None:
        loss = loss - ent_coef * ent.float().mean()
    return loss


def _stats(*xs):
    return tuple(x.detach().float().mean() for x in xs)


# ---- log-prob spellings ------------------------------------------------------------------------


def log_softmax_gather(logits, tokens, adv, old_logp, **_):
    logp = F.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return (ppo_loss(logp, old_logp, adv), *_stats(logp))


def log_softmax_gather_dim1(logits, tokens, adv, old_logp, **_):
    logp = F.log_softmax(logits, dim=1).gather(1, tokens.unsqueeze(1)).squeeze(1)  # [N, V]
    return (ppo_loss(logp, old_logp, adv), *_stats(logp))


def log_softmax_gather_dim2(logits, tokens, adv, old_logp, **_):
    logp = F.log_softmax(logits, dim=2).gather(2, tokens.unsqueeze(2)).squeeze(2)  # [B, S, V]
    return (ppo_loss(logp, old_logp, adv), *_stats(logp))


def take_along_dim(logits, tokens, adv, old_logp, **_):
    logp = torch.take_along_dim(F.log_softmax(logits, -1), tokens.unsqueeze(-1), dim=-1).squeeze(-1)
    return (ppo_loss(logp, old_logp, adv), *_stats(logp))


def neg_cross_entropy(logits, tokens, adv, old_logp, **_):
    V = logits.shape[-1]
    logp = -F.cross_entropy(logits.reshape(-1, V), tokens.reshape(-1), reduction="none").view_as(tokens)
    return (ppo_loss(logp, old_logp, adv), *_stats(logp))


def neg_cross_entropy_transposed(logits, tokens, adv, old_logp, **_):
    logp = -F.cross_entropy(logits.transpose(1, 2), tokens, reduction="none")  # [B, V, S] input
    return (ppo_loss(logp, old_logp, adv), *_stats(logp))


def neg_nll_loss_transposed(logits, tokens, adv, old_logp, **_):
    logp = -F.nll_loss(F.log_softmax(logits, -1).transpose(1, 2), tokens, reduction="none")
    return (ppo_loss(logp, old_logp, adv), *_stats(logp))


def neg_nll_loss(logits, tokens, adv, old_logp, **_):
    V = logits.shape[-1]
    lp = F.log_softmax(logits.reshape(-1, V), -1)
    logp = -F.nll_loss(lp, tokens.reshape(-1), reduction="none").view_as(tokens)
    return (ppo_loss(logp, old_logp, adv), *_stats(logp))


def gather_minus_logsumexp(logits, tokens, adv, old_logp, **_):
    logp = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    return (ppo_loss(logp, old_logp, adv), *_stats(logp))


def per_vocab_bias(logits, tokens, adv, old_logp, **_):
    # A [V] logit bias broadcasts along the vocabulary, also when there are exactly V rows.
    bias = torch.linspace(-1.0, 1.0, logits.shape[-1], dtype=logits.dtype, device=logits.device)
    logp = F.log_softmax(logits - bias, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return (ppo_loss(logp, old_logp, adv), *_stats(logp))


# ---- entropy spellings (each next to a log-prob, as in a real PPO loss) ---------------------------


def _logp(logits, tokens):
    return F.log_softmax(logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def entropy_logsumexp_minus_expected_logit(logits, tokens, adv, old_logp, ent_coef=0.01, **_):
    logp = _logp(logits, tokens)
    ent = torch.logsumexp(logits, -1) - (F.softmax(logits, -1) * logits).sum(-1)
    return (ppo_loss(logp, old_logp, adv, ent, ent_coef), *_stats(logp, ent))


def entropy_neg_sum_p_log_p(logits, tokens, adv, old_logp, ent_coef=0.01, **_):
    logp = _logp(logits, tokens)
    p = F.softmax(logits, -1)
    ent = -(p * torch.log(p)).sum(-1)
    return (ppo_loss(logp, old_logp, adv, ent, ent_coef), *_stats(logp, ent))


def entropy_shared_log_softmax(logits, tokens, adv, old_logp, ent_coef=0.01, **_):
    lp = F.log_softmax(logits, -1)
    logp = lp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    ent = -(torch.exp(lp) * lp).sum(-1)
    return (ppo_loss(logp, old_logp, adv, ent, ent_coef), *_stats(logp, ent))


def entropy_categorical(logits, tokens, adv, old_logp, ent_coef=0.01, **_):
    dist = torch.distributions.Categorical(logits=logits)
    logp, ent = dist.log_prob(tokens), dist.entropy()
    return (ppo_loss(logp, old_logp, adv, ent, ent_coef), *_stats(logp, ent))


def entropy_special_entr(logits, tokens, adv, old_logp, ent_coef=0.01, **_):
    logp = _logp(logits, tokens)
    ent = torch.special.entr(F.softmax(logits, -1)).sum(-1)
    return (ppo_loss(logp, old_logp, adv, ent, ent_coef), *_stats(logp, ent))


def entropy_detached(logits, tokens, adv, old_logp, **_):
    lp = F.log_softmax(logits, -1)
    logp = lp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    ent = -(lp.exp() * lp).sum(-1).detach()  # logged only
    return (ppo_loss(logp, old_logp, adv), *_stats(logp, ent))


def entropy_no_grad_block(logits, tokens, adv, old_logp, **_):
    lp = F.log_softmax(logits, -1)
    with torch.no_grad():
        ent = -(lp.exp() * lp).sum(-1)
    logp = lp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return (ppo_loss(logp, old_logp, adv), *_stats(logp, ent))


def entropy_no_grad_block_last(logits, tokens, adv, old_logp, **_):
    # The region ends inside the no_grad block: the op must run where grad is on.
    lp = F.log_softmax(logits, -1)
    logp = lp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    loss = ppo_loss(logp, old_logp, adv)
    with torch.no_grad():
        ent = -(lp.exp() * lp).sum(-1)
    return (loss, *_stats(logp, ent))


def no_grad_probs_weight_log_probs(logits, tokens, adv, old_logp, **_):
    # -(p * logp).sum(-1) with p a constant: the entropy's value, but not its gradient.
    lp = F.log_softmax(logits, -1)
    with torch.no_grad():
        p = lp.exp()
    cross = -(p * lp).sum(-1)
    logp = lp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return (ppo_loss(logp, old_logp, adv) - 0.01 * cross.mean(), *_stats(logp, cross))


def no_grad_weight_from_logprob(logits, tokens, adv, old_logp, ent_coef=0.01, **_):
    # A no_grad reader of logp before the region's end: moving it after the op would give it grad.
    lp = F.log_softmax(logits, -1)
    logp = lp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        w = logp.exp()
    ent = -(lp.exp() * lp).sum(-1)
    loss = ppo_loss(logp, old_logp, adv, ent, ent_coef) + (w * logp).mean()
    return (loss, *_stats(logp, ent))


# ---- dtype, temperature, masking, chunking -------------------------------------------------------


def float_upcast(logits, tokens, adv, old_logp, ent_coef=0.01, **_):
    lp = F.log_softmax(logits.float(), -1)  # bf16 logits upcast before the softmax
    logp = lp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    ent = -(lp.exp() * lp).sum(-1)
    return (ppo_loss(logp, old_logp, adv, ent, ent_coef), *_stats(logp, ent))


def temperature_div(logits, tokens, adv, old_logp, temp=TEMP, ent_coef=0.01, **_):
    lp = F.log_softmax(logits / temp, -1)
    logp = lp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    ent = -(lp.exp() * lp).sum(-1)
    return (ppo_loss(logp, old_logp, adv, ent, ent_coef), *_stats(logp, ent))


def temperature_mul_reciprocal(logits, tokens, adv, old_logp, temp=TEMP, **_):
    logp = F.log_softmax(logits * (1.0 / temp), -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return (ppo_loss(logp, old_logp, adv), *_stats(logp))


def temperature_inplace_div(logits, tokens, adv, old_logp, temp=TEMP, **_):
    scaled = logits.clone()
    scaled.div_(temp)
    logp = F.log_softmax(scaled, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return (ppo_loss(logp, old_logp, adv), *_stats(logp))


def top_p_masked_fill(logits, tokens, adv, old_logp, top_p_mask, temp=TEMP, ent_coef=0.01, **_):
    # The sampler's top-p mask, applied to the scaled logits: some rows have -inf entries.
    masked = (logits / temp).masked_fill(top_p_mask, float("-inf"))
    dist = torch.distributions.Categorical(logits=masked)  # clamps, so 0 * -inf stays 0
    logp = F.log_softmax(masked, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    ent = dist.entropy()
    return (ppo_loss(logp, old_logp, adv, ent, ent_coef), *_stats(logp, ent))


CHUNK = 5


def python_chunk_loop(logits, tokens, adv, old_logp, ent_coef=0.01, **_):
    # A hand-chunked loss (slime/verl style) that Dynamo unrolls: the chunk count is static.
    V = logits.shape[-1]
    x, y = logits.reshape(-1, V), tokens.reshape(-1)
    logps, ents = [], []
    for i in range(0, x.shape[0], CHUNK):
        lp = F.log_softmax(x[i : i + CHUNK].float(), -1)
        logps.append(lp.gather(-1, y[i : i + CHUNK, None]).squeeze(-1))
        ents.append(-(lp.exp() * lp).sum(-1))
    logp, ent = torch.cat(logps).view_as(tokens), torch.cat(ents).view_as(tokens)
    return (ppo_loss(logp, old_logp, adv, ent, ent_coef), *_stats(logp, ent))


# ---- must not match ------------------------------------------------------------------------------


def transposed_logits_used_elsewhere(logits, tokens, adv, old_logp, **_):
    # The transposed logits are also read outside the loss, where a chunk cannot stand in for them.
    xt = logits.transpose(1, 2)
    logp = -F.cross_entropy(xt, tokens, reduction="none")
    return (ppo_loss(logp, old_logp, adv) + 1e-3 * xt.float().pow(2).mean(), *_stats(logp))


def sampled_token_p_log_p(logits, tokens, adv, old_logp, **_):
    # -p(y) log p(y) of the sampled token only: a "bonus" that is NOT the entropy.
    logp = _logp(logits, tokens)
    bonus = -logp.exp() * logp
    return (ppo_loss(logp, old_logp, adv, bonus, 0.01), *_stats(logp, bonus))


def no_softmax(logits, tokens, adv, old_logp, **_):
    # A value-head style regression on the gathered logit: nothing to normalise over V.
    chosen = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).float()
    loss = F.mse_loss(chosen, adv) + 0.001 * logits.float().pow(2).mean()
    return loss, chosen.detach().mean()


# Log-prob and entropy spelled with separate normalizers of the same logits: one merged site is
# best, two sites (each reading the logits, neither copying them) are acceptable.
SEPARATE = ("entropy", "logprob")

IDIOMS: list[Idiom] = [
    Idiom("log_softmax_gather", log_softmax_gather, ("logprob",)),
    Idiom("log_softmax_gather_dim1", log_softmax_gather_dim1, ("logprob",), layouts=("2d",)),
    Idiom("log_softmax_gather_dim2", log_softmax_gather_dim2, ("logprob",), layouts=("3d",)),
    Idiom("take_along_dim", take_along_dim, ("logprob",)),
    Idiom("neg_cross_entropy", neg_cross_entropy, ("logprob",)),
    Idiom("neg_cross_entropy_transposed", neg_cross_entropy_transposed, ("logprob",), layouts=("3d",)),
    Idiom("neg_nll_loss", neg_nll_loss, ("logprob",)),
    Idiom("neg_nll_loss_transposed", neg_nll_loss_transposed, ("logprob",), layouts=("3d",)),
    Idiom("gather_minus_logsumexp", gather_minus_logsumexp, ("logprob",)),
    Idiom("per_vocab_bias", per_vocab_bias, ("logprob",)),
    Idiom("entropy_logsumexp_minus_expected_logit", entropy_logsumexp_minus_expected_logit, ("entropy+logprob",), alternatives=(SEPARATE,)),
    Idiom("entropy_neg_sum_p_log_p", entropy_neg_sum_p_log_p, ("entropy+logprob",), alternatives=(SEPARATE,)),
    Idiom("entropy_shared_log_softmax", entropy_shared_log_softmax, ("entropy+logprob",)),
    Idiom("entropy_categorical", entropy_categorical, ("entropy+logprob",), alternatives=(SEPARATE,)),
    Idiom("entropy_special_entr", entropy_special_entr, ("entropy+logprob",), alternatives=(SEPARATE,)),
    Idiom("entropy_detached", entropy_detached, ("entropy+logprob",)),
    Idiom("entropy_no_grad_block", entropy_no_grad_block, ("logprob", "entropy"),
          alternatives=(("entropy+logprob",),)),
    # The op goes after the log-prob's last op, where grad is on; the entropy is forward-only.
    Idiom("entropy_no_grad_block_last", entropy_no_grad_block_last, ("entropy+logprob",),
          alternatives=(SEPARATE,)),
    # p is a constant in the op (detached): its value is the entropy's, its gradient is not.
    Idiom("no_grad_probs_weight_log_probs", no_grad_probs_weight_log_probs, ("logprob+rowwise",),
          forbidden_kinds=("entropy",)),
    Idiom("no_grad_weight_from_logprob", no_grad_weight_from_logprob, (), alternatives=(("entropy+logprob",),)),
    Idiom("float_upcast", float_upcast, ("entropy+logprob",)),
    Idiom("temperature_div", temperature_div, ("entropy+logprob",), temperature="/ 0.7"),
    Idiom("temperature_mul_reciprocal", temperature_mul_reciprocal, ("logprob",), temperature="* 1.43"),
    Idiom("temperature_inplace_div", temperature_inplace_div, ("logprob",), temperature="/ 0.7"),
    Idiom("top_p_masked_fill", top_p_masked_fill, ("entropy+logprob",), temperature="/ 0.7"),
    Idiom("python_chunk_loop", python_chunk_loop, ("entropy+logprob",), per_chunk=CHUNK),
    Idiom("sampled_token_p_log_p", sampled_token_p_log_p, ("logprob+rowwise",),
          alternatives=(("logprob",),), forbidden_kinds=("entropy",)),
    Idiom("no_softmax", no_softmax, ()),
    Idiom("transposed_logits_used_elsewhere", transposed_logits_used_elsewhere, (), layouts=("3d",),
          alternatives=(("logprob",),)),
]

BY_NAME = {i.name: i for i in IDIOMS}
