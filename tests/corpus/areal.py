"""inclusionAI/AReaL: chunked gather_logprobs / gather_logprobs_entropy on packed `[T, V]`
logits, the GRPO actor loss (entropy detached), and GSPO on packed sequences.

Restated from areal/utils/functional/vocab_parallel.py (_gather_logprobs,
_gather_logprobs_entropy: `log_softmax(logits.float() / temperature)`; _chunked_apply: a Python
loop over row chunks, results concatenated; gather_logprobs(_entropy) without a TP group),
areal/engine/fsdp_engine.py (_compute_logprobs(_entropy): `torch.roll` labels),
areal/trainer/ppo/actor.py (grpo_loss_fn: `entropy = entropy.detach()`) and
areal/utils/functional/functional.py (ppo_actor_loss_fn: proximal log-probs, decoupled clip,
dual clip `c_clip`, `where(loss_mask)`; _compute_sequence_level_ratio_and_advantages for packed 1-D
inputs: zeros buffers `scatter_add_` per sequence).
"""

from __future__ import annotations

import torch

from . import MERGED, Case, choices, gen, logits_leaf, n_chunks, near_logp, one_or_each, randn, seq_offset

TEMP = 0.9
CHUNK = 8  # chunk_size of gather_logprobs(_entropy) (1024 in the library)


def _gather_logprobs(logits, labels, temperature=1.0):
    log_probs = torch.nn.functional.log_softmax(logits.float() / temperature, dim=-1)
    return log_probs.gather(dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)


def _gather_logprobs_entropy(logits, labels, temperature=1.0):
    log_probs = torch.nn.functional.log_softmax(logits.float() / temperature, dim=-1)
    entropy = -torch.sum(log_probs.exp() * log_probs, dim=-1)
    return log_probs.gather(dim=-1, index=labels.unsqueeze(-1)).squeeze(-1), entropy


def _chunked_apply(fn, logits, labels, temperature, chunk_size=CHUNK):
    total = logits.shape[0]
    results = []
    for i in range(0, total, chunk_size):
        end = min(i + chunk_size, total)
        results.append(fn(logits[i:end], labels[i:end], temperature))
    if isinstance(results[0], tuple):
        return tuple(torch.cat([r[k] for r in results]) for k in range(len(results[0])))
    return torch.cat(results)


def ppo_actor_loss(logprobs, proximal_logprobs, advantages, loss_mask, eps_clip=0.2, eps_clip_higher=0.28,
                   c_clip=3.0, ratio=None):
    count = loss_mask.sum().clamp(min=1)
    if ratio is None:
        ratio = torch.where(loss_mask, torch.exp(logprobs - proximal_logprobs), 0)
    clipped_ratio = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_clip_higher)
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * clipped_ratio
    clip_mask = pg_loss1.detach() < pg_loss2.detach()
    pg_loss = torch.max(pg_loss1, pg_loss2)
    if c_clip is not None:
        pg_loss3 = torch.sign(advantages) * c_clip * advantages
        pg_loss = torch.min(pg_loss, pg_loss3)
    pg_loss = torch.where(loss_mask, pg_loss, 0).sum() / count
    clip_frac = (clip_mask & loss_mask).float().sum() / count
    return pg_loss, clip_frac


T, V = 29, 67


def grpo_logprobs_entropy(logits, input_ids, proximal_logprobs, advantages, loss_mask, temperature=TEMP):
    # FSDPEngine._compute_logprobs_entropy + grpo_loss_fn (token-level, c_clip).
    labels = torch.roll(input_ids, shifts=-1, dims=-1)
    logprobs, entropy = _chunked_apply(_gather_logprobs_entropy, logits, labels, temperature)
    entropy = entropy.detach()
    loss, clip_frac = ppo_actor_loss(logprobs, proximal_logprobs, advantages, loss_mask)
    mean_entropy = torch.where(loss_mask, entropy, 0).sum() / loss_mask.sum()
    return loss, mean_entropy, clip_frac


def packed_inputs(seed, gspo=False):
    def make(dtype):
        g = gen(seed)
        logits = logits_leaf((T, V), dtype, g)
        ids = torch.randint(0, V, (T,), generator=g)
        mask = torch.ones(T, dtype=torch.bool)
        mask[[0, 1, 12, 13, 28]] = False  # prompts and each sequence's last position
        return {"logits": logits, "input_ids": ids,
                "proximal_logprobs": (seq_offset(near_logp(logits, torch.roll(ids, -1), g, TEMP, 0.0), g, SEQ_LENS)
                                      if gspo else near_logp(logits, torch.roll(ids, -1), g, TEMP)),
                "advantages": randn((T,), g), "loss_mask": mask}
    return make


SEQ_LENS = (12, 9, 8)  # packed sequences of T tokens


def gspo_packed(logits, input_ids, proximal_logprobs, advantages, loss_mask, sequence_idx, temperature=TEMP):
    # FSDPEngine._compute_logprobs + ppo_actor_loss_fn(importance_sampling_level="sequence") with
    # cu_seqlens; the token -> sequence index (repeat_interleave of the lengths) is an input here.
    labels = torch.roll(input_ids, shifts=-1, dims=-1)
    logprobs = _chunked_apply(_gather_logprobs, logits, labels, temperature)
    nseq = len(SEQ_LENS)
    log_ratio = torch.where(loss_mask, logprobs - proximal_logprobs, 0.0)
    ratio_sum = torch.zeros(nseq, dtype=log_ratio.dtype).scatter_add_(0, sequence_idx, log_ratio)
    adv_sum = torch.zeros(nseq, dtype=advantages.dtype).scatter_add_(
        0, sequence_idx, torch.where(loss_mask, advantages, 0.0))
    count = torch.zeros(nseq, dtype=torch.int32).scatter_add_(0, sequence_idx, loss_mask.int()).clamp(min=1)
    ratio = torch.exp(ratio_sum / count.to(log_ratio.dtype))[sequence_idx]
    ratio = torch.where(loss_mask, ratio, 0.0)
    seq_adv = (adv_sum / count.to(advantages.dtype))[sequence_idx]
    return ppo_actor_loss(logprobs, proximal_logprobs, seq_adv, loss_mask, eps_clip=3e-4,
                          eps_clip_higher=4e-4, c_clip=None, ratio=ratio)


def gspo_inputs(dtype):
    out = packed_inputs(92, gspo=True)(dtype)
    out["sequence_idx"] = torch.repeat_interleave(torch.arange(len(SEQ_LENS)), torch.tensor(SEQ_LENS))
    return out


K = n_chunks(T, CHUNK)

CASES = [
    Case("areal_chunked_logprobs_entropy_detached", "AReaL",
         "areal/utils/functional/vocab_parallel.py:gather_logprobs_entropy (_chunked_apply of "
         "_gather_logprobs_entropy); areal/trainer/ppo/actor.py:grpo_loss_fn (entropy.detach()); "
         "areal/utils/functional/functional.py:ppo_actor_loss_fn (c_clip)",
         grpo_logprobs_entropy, packed_inputs(91),
         choices(one_or_each("logprob", K), one_or_each("entropy", K), merged=[MERGED, MERGED * K]),
         no_grad_kinds=("entropy",), temperature="/ 0.9"),
    Case("areal_gspo_packed_sequences", "AReaL",
         "areal/utils/functional/vocab_parallel.py:gather_logprobs (chunked); "
         "areal/utils/functional/functional.py:_compute_sequence_level_ratio_and_advantages (packed, "
         "scatter_add_ buffers), ppo_actor_loss_fn(importance_sampling_level='sequence')",
         gspo_packed, gspo_inputs, choices(one_or_each("logprob", K)), temperature="/ 0.9"),
]
