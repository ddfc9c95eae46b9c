"""Below the floor of logits.grad: RL losses that start from hidden states, the lm_head inside.

    python -m bench.lm_head                       # the grid this machine allows; table, JSON, plot
    python -m bench.lm_head --quick --out /tmp/x  # one tiny configuration per method (tests)

The loss is computed from `hidden [T, H]` and the output layer's `W [V, H]`: `ppo` is the suite's
PPO loss (temperature 0.7, entropy computed, coefficient 0) over `F.linear(hidden, W)`;
`ppo_outside` is the same loss computed after a compiled log-prob helper returns
(`logp, entropy = compiled(hidden, W, targets)`, as TRL, verl and OpenRLHF call one: the backward
recomputes the logits, four GEMMs where inductor's keeps them and runs three); `ce` is
`F.cross_entropy(F.linear(hidden, W).float(), targets)`, the one loss `F.linear_cross_entropy`
also computes. The floor is the bytes of the gradients backward must
produce, `hidden.grad + W.grad`.

Methods: `eager`; `inductor` (`torch.compile`); `autochunk` (inductor's auto-chunker, which targets
this matmul-amplified case); `linear_ce` (`F.linear_cross_entropy` with its chunked options; `ce`
only); `chunked` (a hand-written loop over token chunks, each chunk's head and loss under
`torch.utils.checkpoint`: what a user writes by hand); `graphpass`
(`torch.compile(backend=graphpass.Backend())`); `graphpass_fused` (`ppo_outside` only: the helper
and the caller's loss compiled as one graph by `graphpass.fuse_loss`, the one-call opt-in that
gives the site its gradients in forward); and, where the packages import (not in the
default list: `bench.gpu` runs them), `liger` (Liger-Kernel's `LigerFusedLinearCrossEntropyLoss`
for `ce`, its chunked `LigerFusedLinearGRPOLoss` for `ppo`) and `cce` (Apple's cut-cross-entropy
`linear_cross_entropy`; `ce` only). Each (workload, T, H, V, dtype, method) runs in
its own forked process (`bench.harness.isolate`): peak bytes above the pre-step baseline (`VmHWM` after
`clear_refs` on CPU, glibc's mmap threshold pinned to 1 MiB; `max_memory_allocated` on CUDA),
median step time, and the loss and both gradients against float64 on the same (rounded) inputs,
in row blocks (`|rel|` = max abs difference over the reference's max abs value, the worst of
loss, hidden.grad and W.grad). Timings on a shared CPU are noisy: compare a method with inductor
in the same run (`x inductor`); each result records the 1-minute load average.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness.isolate import run_isolated
from bench.harness.machine_info import GiB, fill_device_and_memory_limit, machine_description
from bench.harness.meters import CpuMeter, CudaMeter, timed

RESULTS = Path(__file__).parent / "results"
WORKLOADS = ("ppo", "ppo_outside", "ce")
METHODS = ("eager", "inductor", "autochunk", "linear_ce", "chunked", "graphpass", "graphpass_fused")
GRAPHPASS_METHODS = ("graphpass", "graphpass_fused")
LIBRARY_METHODS = ("liger", "cce")
# Methods whose first call compiles (Dynamo, or the libraries' Triton kernels): it is the warm-up.
FIRST_CALL_COMPILES = ("inductor", "autochunk", *GRAPHPASS_METHODS, *LIBRARY_METHODS)
GRID_T, GRID_H, GRID_V = (2048, 8192), (1024, 4096), (32768, 151936)
DTYPES = ("fp32", "bf16")
# The issues' checks: (configuration, most peak / floor or None). Every one: an lm_head site, time
# <= 1.0 x inductor's (the alternating A/B's ratio when there is one), fp32 |rel| <= 1e-4, bf16
# gradients as close to float64 as inductor's. The loss outside the helper is checked on the
# opt-in (`graphpass_fused`); the helper compiled alone is printed beside it (its backward
# recomputes the logits).
ACCEPTANCE = [
    (dict(workload="ppo", T=2048, H=1024, V=32768, dtype="fp32", method="graphpass"), 1.25),
    (dict(workload="ppo", T=2048, H=1024, V=32768, dtype="bf16", method="graphpass"), 1.5),  # issue 24
    (dict(workload="ppo_outside", T=4096, H=256, V=65536, dtype="fp32", method="graphpass_fused"), None),  # B=8 x S=512
    (dict(workload="ppo_outside", T=4096, H=1024, V=65536, dtype="fp32", method="graphpass_fused"), None),
]
TEMPERATURE, ENT_COEF, HAND_CHUNK = 0.7, 0.0, 1024
DTYPE_BYTES = {"fp32": 4, "bf16": 2}
# A step runs 3-4 GEMMs of 2*T*H*V flops; a configuration whose step would take longer than
# `--max-step-s` at this rate is skipped on CPU ("where this machine allows").
CPU_FLOPS = 100e9


@dataclasses.dataclass(frozen=True)
class HeadSpec:
    """One configuration."""

    workload: str
    method: str
    T: int
    H: int
    V: int
    dtype: str
    device: str = "cpu"
    steps: int = 3
    min_steps: int = 2
    time_budget_s: float = 30.0
    seed: int = 0
    inner: str = "inductor"
    """graphpass's inner compiler and the `inductor` method's backend (`aot_eager`: a quick smoke)."""
    chunk_size: int | None = None
    reference_cache: str | None = None
    warmup: bool = False
    """Time every method's first call apart, not only those that compile (`bench.gpu`)."""

    @property
    def floor_bytes(self) -> int:
        return (self.T + self.V) * self.H * DTYPE_BYTES[self.dtype]

    @property
    def key(self) -> str:
        return f"{self.workload}_T{self.T}_H{self.H}_V{self.V}_{self.dtype}_{self.device}_seed{self.seed}"


# ---- the user's code ----------------------------------------------------------------------------
def ppo_loss(hidden, weight, targets, mask, advantages, old_logp):
    """The suite's PPO loss (`bench.workloads.losses.ppo_loss`) over the lm_head's logits."""
    from bench.workloads import losses

    logits = torch_functional().linear(hidden, weight)
    return losses.ppo_loss(logits, targets, mask, advantages, old_logp, None, TEMPERATURE, ENT_COEF,
                           losses.logprob_entropy)


def logprob_helper(hidden, weight, targets, temperature):
    """A log-prob helper as TRL, verl and OpenRLHF call one: per-token log-probs of the sampled
    tokens and entropies from hidden states; the loss is computed by the caller."""
    from bench.workloads import losses

    return losses.logprob_entropy(torch_functional().linear(hidden, weight), targets, temperature)


def ppo_from_logprobs(logp, entropy, mask, advantages, old_logp):
    """The loss a caller computes from a helper's per-token log-probs and entropies."""
    from bench.workloads import losses

    pg = losses.clipped_surrogate(logp, old_logp, advantages)
    return losses.masked_mean(pg, mask) - ENT_COEF * losses.masked_mean(entropy, mask)


def ppo_outside(helper=logprob_helper):
    """The PPO loss of `ppo` computed after `helper(hidden, W, targets, temperature)` returns: only
    the helper is compiled, so its backward receives the log-probs' gradients."""
    from bench.workloads import losses

    def fn(hidden, weight, targets, mask, advantages, old_logp):
        def lp_ent(h, t, temperature):
            return helper(h, weight, t, temperature)

        return losses.ppo_loss(hidden, targets, mask, advantages, old_logp, None, TEMPERATURE, ENT_COEF, lp_ent)

    return fn


def ce_loss(hidden, weight, targets, mask, advantages, old_logp):
    F = torch_functional()
    return F.cross_entropy(F.linear(hidden, weight).float(), targets)


def linear_ce_loss(hidden, weight, targets, mask, advantages, old_logp):
    import torch

    return torch_functional().linear_cross_entropy(hidden, weight, targets,
                                                   options=torch.nn.LinearCrossEntropyOptions())


def chunked(loss_kind: str, chunk: int = HAND_CHUNK):
    """The loss by hand: a loop over token chunks, each chunk's logits recomputed in backward
    (`torch.utils.checkpoint`), autograd summing each chunk's weight gradient."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from bench.workloads import losses

    F = torch_functional()

    def piece(h, w, t):
        logits = F.linear(h, w)
        if loss_kind == "ce":
            return F.cross_entropy(logits.float(), t, reduction="sum"), None
        return losses.logprob_entropy(logits, t, TEMPERATURE)

    def fn(hidden, weight, targets, mask, advantages, old_logp):
        parts = [checkpoint(piece, h, weight, t, use_reentrant=False)
                 for h, t in zip(hidden.split(chunk), targets.split(chunk))]
        if loss_kind == "ce":
            return sum(p[0] for p in parts) / targets.numel()
        logp = torch.cat([p[0] for p in parts])
        entropy = torch.cat([p[1] for p in parts])
        pg = losses.clipped_surrogate(logp, old_logp, advantages)
        return losses.masked_mean(pg, mask) - ENT_COEF * losses.masked_mean(entropy, mask)

    return fn


def torch_functional():
    import torch.nn.functional as F

    return F


# Liger's GRPO loss takes per-sequence advantages `[B]`: the per-token ones of `ppo` make each
# token a sequence of one (`[T, 1]`), and a chunk of that many sequences is about the tokens of the
# one sequence per chunk TRL's trainer gives it.
LIGER_SEQUENCES_PER_CHUNK = 1024


def library_loss(method: str, loss_kind: str, tokens: int):
    """Liger-Kernel's fused linear loss for `loss_kind` (`method` "liger") or Apple's
    cut-cross-entropy (`"cce"`: its Triton kernel on a GPU, its torch.compile path elsewhere), in
    this module's signature; ImportError where the package does not import."""
    if method == "cce":
        from cut_cross_entropy import linear_cross_entropy

        def fn(hidden, weight, targets, mask, advantages, old_logp):
            return linear_cross_entropy(hidden, weight, targets, impl="cce" if hidden.is_cuda else "torch_compile")

        return fn
    if loss_kind == "ce":
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        ce = LigerFusedLinearCrossEntropyLoss()

        def fn(hidden, weight, targets, mask, advantages, old_logp):
            return ce(weight, hidden, targets)

        return fn
    from bench.workloads.losses import CLIP
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    # beta 0 and no reference model: the clipped surrogate alone; "bnpo" is the masked token mean.
    grpo = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, loss_type="bnpo", epsilon_low=CLIP,
                                    epsilon_high=CLIP, temperature=TEMPERATURE,
                                    chunk_size=min(tokens, LIGER_SEQUENCES_PER_CHUNK))

    def fn(hidden, weight, targets, mask, advantages, old_logp):
        out = grpo(hidden[:, None], weight, targets[:, None], mask[:, None], advantages,
                   old_per_token_logps=old_logp[:, None])
        return out[0] if isinstance(out, tuple) else out  # (loss, metrics) in recent versions

    return fn


LOSSES = {"ppo": ppo_loss, "ppo_outside": ppo_outside(), "ce": ce_loss}


def _compiled(spec: HeadSpec, compile_fn):
    """The workload with `compile_fn` applied to what the user compiles: the whole loss, or for
    `ppo_outside` the log-prob helper only."""
    if spec.workload == "ppo_outside":
        return ppo_outside(compile_fn(logprob_helper))
    return compile_fn(LOSSES[spec.workload])


def build(spec: HeadSpec):
    """(step function, notes callback, or a string saying why the method does not apply)."""
    import torch

    if spec.method == "linear_ce":
        if spec.workload != "ce":
            return "F.linear_cross_entropy computes cross-entropy only"
        if not hasattr(torch_functional(), "linear_cross_entropy"):
            return f"F.linear_cross_entropy is not in torch {torch.__version__}"
        return linear_ce_loss, dict
    if spec.method == "chunked":
        return chunked(spec.workload), dict
    if spec.method in LIBRARY_METHODS:
        if spec.method == "cce" and spec.workload != "ce":
            return "cut-cross-entropy computes cross-entropy only"
        if spec.workload == "ppo_outside":
            return f"{spec.method} computes the loss inside its kernel"
        try:
            return library_loss(spec.method, spec.workload, spec.T), dict
        except ImportError as exc:
            return f"not importable here: {type(exc).__name__}: {exc}"
    if spec.method == "eager":
        return LOSSES[spec.workload], dict
    if spec.method in ("inductor", "autochunk"):
        if spec.method == "autochunk":
            import torch._inductor.config as config

            config.auto_chunker.enable = True
        backend = spec.inner if spec.method == "inductor" else "inductor"
        compiled = _compiled(spec, lambda f: torch.compile(f, backend=backend))

        def notes():
            if spec.method != "autochunk":
                return {}
            from torch._inductor import metrics

            return {"auto_chunked_graphs": metrics.num_auto_chunking}

        return compiled, notes
    if spec.method in GRAPHPASS_METHODS:
        import functools

        import graphpass

        backend = graphpass.Backend(inner=spec.inner, chunk_size=spec.chunk_size)

        def notes():
            sites = [s for r in backend.records for s in r.sites]
            return {"graphs": len(backend.records), "sites": len(sites),
                    "lm_head_sites": sum(s.lm_head for s in sites),
                    "gradients_in_forward_sites": sum(getattr(s, "gradients_in_forward", False) for s in sites),
                    "fallbacks": [r.fallback_reason for r in backend.records if r.fallback_reason],
                    "chunk_rows": [s.chunk_rows for s in sites],
                    "rejected": [c.reason for r in backend.records for c in r.rejected][:5]}

        if spec.method == "graphpass":
            return _compiled(spec, lambda f: torch.compile(f, backend=backend)), notes
        if spec.workload != "ppo_outside":
            return "the loss is compiled with the head already (graphpass)"
        step = graphpass.fuse_loss(functools.partial(logprob_helper, temperature=TEMPERATURE), ppo_from_logprobs,
                                   backend=backend)

        def fused(hidden, weight, targets, mask, advantages, old_logp):
            return step((hidden, weight, targets), mask, advantages, old_logp)

        return fused, notes
    raise ValueError(f"unknown method {spec.method}")


# ---- inputs and the float64 reference ---------------------------------------------------------
def make_inputs(spec: HeadSpec) -> dict:
    """Hidden states and an output layer scaled like a trained model's (logits of unit scale),
    drawn on the spec's device by its own generator (fast on a GPU; other values than the CPU's)."""
    import torch

    from bench.harness.spec import torch_dtype

    dtype, device = torch_dtype(spec.dtype), spec.device
    gen = torch.Generator(device=device).manual_seed(spec.seed)
    hidden = torch.empty(spec.T, spec.H, dtype=dtype, device=device)
    hidden.normal_(generator=gen)
    weight = torch.empty(spec.V, spec.H, dtype=dtype, device=device)
    weight.normal_(std=spec.H ** -0.5, generator=gen)
    targets = torch.randint(0, spec.V, (spec.T,), generator=gen, device=device)

    def draw(fn):
        return fn(spec.T, generator=gen, device=device)

    batch = dict(hidden=hidden, weight=weight, targets=targets,
                 mask=(draw(torch.rand) < 0.9).float(),
                 advantages=draw(torch.randn),
                 old_logp=-draw(torch.rand) * 2 - (torch.tensor(float(spec.V)).log() - 1))
    batch["hidden"].requires_grad_()
    batch["weight"].requires_grad_()
    return batch


FIELDS = ("hidden", "weight", "targets", "mask", "advantages", "old_logp")


def reference(spec: HeadSpec, batch: dict, budget_bytes: int | None = None) -> dict:
    """float64 loss and gradients of the same (rounded) inputs, in row blocks: both losses are
    sums of per-token terms over a whole-batch denominator, so blocks add up exactly. Blocks of
    `budget_bytes` (None: 512 MiB on a CPU; 8 GiB on a GPU, where a few large float64 GEMMs run
    far faster than hundreds of skinny ones)."""
    import torch

    if budget_bytes is None:
        budget_bytes = GiB // 2 if spec.device == "cpu" else 8 * GiB
    fn = _float64_loss(spec.workload)
    weight = batch["weight"].detach().double().requires_grad_()
    rows = max(1, min(spec.T, budget_bytes // (spec.V * 8 * 6)))
    ce = spec.workload == "ce"
    denominator = (torch.tensor(float(spec.T)) if ce else batch["mask"].sum().clamp(min=1)).double()
    loss, hidden_grads = 0.0, []
    for start in range(0, spec.T, rows):
        sl = slice(start, start + rows)
        h = batch["hidden"][sl].detach().double().requires_grad_()
        part = [batch[k][sl] for k in FIELDS[2:]]
        n = torch.tensor(float(h.shape[0])).double() if ce else part[1].sum().clamp(min=1).double()
        block = fn(h, weight, *[p.double() if p.is_floating_point() else p for p in part]) * (n / denominator)
        block.backward()
        loss += float(block.detach())
        hidden_grads.append(h.grad)
    return dict(loss=loss, hidden=torch.cat(hidden_grads), weight=weight.grad)


def _float64_loss(workload: str):
    """The workload's math without its `.float()` casts, so float64 stays float64."""
    from bench.workloads import losses

    F = torch_functional()

    def ppo(hidden, weight, targets, mask, advantages, old_logp):
        return losses.ppo_loss(F.linear(hidden, weight), targets, mask, advantages, old_logp, None, TEMPERATURE,
                               ENT_COEF, losses.logprob_entropy_exact)

    def ce(hidden, weight, targets, mask, advantages, old_logp):
        return F.cross_entropy(F.linear(hidden, weight), targets)

    return {"ppo": ppo, "ppo_outside": ppo, "ce": ce}[workload]


def _relative(ours, ref) -> float:
    scale = float(ref.abs().max()) or 1.0
    return float((ours.double() - ref).abs().max()) / scale


# ---- the worker -----------------------------------------------------------------------------------
def measure(spec: HeadSpec) -> dict:
    import torch

    torch.manual_seed(spec.seed)
    built = build(spec)
    if isinstance(built, str):
        return dict(status="unavailable", note=built)
    fn, notes = built
    batch = make_inputs(spec)
    args = [batch[k] for k in FIELDS]
    hidden, weight = batch["hidden"], batch["weight"]
    meter = CudaMeter() if spec.device.startswith("cuda") else CpuMeter()
    loss = None

    def step():
        nonlocal loss
        hidden.grad = weight.grad = None
        loss = fn(*args)
        loss.backward()
        meter.sync()

    compiled = spec.warmup or spec.method in FIRST_CALL_COMPILES
    first_call_s = timed(step, spec.device) if compiled else None
    times, peaks = [], []
    while len(times) < spec.min_steps or (
            len(times) < spec.steps and sum(times) + statistics.median(times) <= spec.time_budget_s):
        hidden.grad = weight.grad = None
        loss = None
        meter.reset()
        times.append(timed(step, spec.device))
        peaks.append(meter.peak())
    result = dict(status="ok", peak_bytes=max(peaks), peaks=peaks, ratio=max(peaks) / spec.floor_bytes,
                  time_s=statistics.median(times), times=times, first_call_s=first_call_s or times[0],
                  loss=float(loss.detach()), load_avg_1m=os.getloadavg()[0], notes=notes())
    ours = dict(loss=float(loss.detach()), hidden=hidden.grad.detach(), weight=weight.grad.detach())
    loss = None
    cache = os.path.join(spec.reference_cache, spec.key + ".pt") if spec.reference_cache else None
    if cache and os.path.exists(cache):
        ref = torch.load(cache)
    else:
        ref = reference(spec, batch)
        if cache:
            torch.save(ref, cache)
    result.update(loss_rel=abs(ours["loss"] - ref["loss"]) / max(abs(ref["loss"]), 1e-30),
                  hidden_grad_rel=_relative(ours["hidden"], ref["hidden"]),
                  weight_grad_rel=_relative(ours["weight"], ref["weight"]))
    result["parity"] = max(result["loss_rel"], result["hidden_grad_rel"], result["weight_grad_rel"])
    return result


def ab_methods(workload: str) -> tuple[str, ...]:
    """The methods `measure_ab` alternates: inductor and graphpass, and the opt-in where it applies."""
    return ("inductor", "graphpass") + (("graphpass_fused",) if workload == "ppo_outside" else ())


def measure_ab(spec: HeadSpec) -> dict:
    """Time graphpass (and `ab_methods`' others) against inductor in one worker, their steps
    alternating, so all see the same background load (the fair ratio on a shared machine): medians
    and per-pair ratios (`pair_ratios`, each method's; `ratio` is graphpass's median, `ratios`
    each method's)."""
    batch = make_inputs(spec)
    args = [batch[k] for k in FIELDS]
    hidden, weight = batch["hidden"], batch["weight"]
    built = {m: build(dataclasses.replace(spec, method=m)) for m in ab_methods(spec.workload)}
    fns = {m: b[0] for m, b in built.items()}

    def step(fn):
        hidden.grad = weight.grad = None
        fn(*args).backward()

    for fn in fns.values():  # compile and warm up
        step(fn)
    times = {m: [] for m in fns}
    for _ in range(spec.steps):
        for m, fn in fns.items():
            times[m].append(timed(lambda: step(fn), spec.device))
    pairs = {m: [t / i for t, i in zip(times[m], times["inductor"])] for m in fns if m != "inductor"}
    return dict(status="ok", times=times, inductor_s=statistics.median(times["inductor"]),
                graphpass_s=statistics.median(times["graphpass"]), ratio=statistics.median(pairs["graphpass"]),
                pair_ratios=pairs, ratios={m: statistics.median(p) for m, p in pairs.items()},
                load_avg_1m=os.getloadavg()[0], notes=built["graphpass"][1](),
                notes_by_method={m: b[1]() for m, b in built.items() if m != "inductor"})


def run_ab(args) -> list[dict]:
    out, configs = [], set()
    for spec in plan(args):
        config = dataclasses.replace(spec, method="ab", steps=args.ab_steps)
        if spec.method not in GRAPHPASS_METHODS or config in configs or _too_big(spec, args) is not None:
            continue
        configs.add(config)
        r = run_isolated(config, timeout_s=args.timeout, measure_fn=measure_ab)
        r.pop("reference_cache", None)
        out.append(r)
        if r["status"] == "ok":
            label = _label(spec).rsplit(" ", 1)[0]
            for m, ratio in r["ratios"].items():
                n = r["notes_by_method"][m]
                print(f"A/B {label}: {m} {statistics.median(r['times'][m]) * 1e3:.0f} ms (lm_head sites: "
                      f"{n.get('lm_head_sites')}, gradients in forward: {n.get('gradients_in_forward_sites')}), "
                      f"inductor {r['inductor_s'] * 1e3:.0f} ms, {ratio:.2f} x (pairs "
                      f"{', '.join(f'{p:.2f}' for p in r['pair_ratios'][m])}; "
                      f"load {r['load_avg_1m']:.1f})", flush=True)
        else:
            print(f"A/B {_label(spec)}: {r['status']}: {r.get('note', '')[:300]}", flush=True)
    return out


# ---- the grid -------------------------------------------------------------------------------------
def plan(args) -> list[HeadSpec]:
    common = dict(device=args.device, steps=args.steps, time_budget_s=args.step_budget)
    if args.quick:
        return [HeadSpec(w, m, 256, 64, 1024, "fp32", steps=2, time_budget_s=5, inner=args.inner,
                         device=args.device) for w in args.workloads for m in args.methods]
    return [HeadSpec(w, m, T, H, V, d, inner=args.inner, **common)
            for w in args.workloads for T in args.T for H in args.H for V in args.V for d in args.dtypes
            for m in args.methods]


def _too_big(spec: HeadSpec, args) -> str | None:
    """Why this machine cannot run `spec` (memory, or CPU time), or None."""
    itemsize = DTYPE_BYTES[spec.dtype]
    # eager keeps about five fp32 [T, V] values (inputs, logits, softmax, gradient) plus W and its grads
    need = spec.T * spec.V * 4 * (6 if spec.method in ("eager", "chunked") else 3) + 3 * spec.V * spec.H * 4
    if spec.method in ("graphpass", "linear_ce"):
        need = 4 * spec.floor_bytes + spec.V * spec.H * 4
    need += spec.T * spec.H * itemsize + 2 * GiB  # the float64 reference's blocks and the process
    if need > args.mem_limit_gib * GiB:
        return f"needs about {need / GiB:.0f} GiB > {args.mem_limit_gib:.0f} GiB"
    if spec.device == "cpu":
        step = 4 * 2 * spec.T * spec.H * spec.V / CPU_FLOPS
        if step > args.max_step_s:
            return f"one step is about {step:.0f} s of GEMMs on this CPU (> --max-step-s {args.max_step_s:g})"
    return None


def run(args) -> list[dict]:
    done = []
    with tempfile.TemporaryDirectory(prefix="bench_lm_head_ref_") as ref_dir:
        for spec in plan(args):
            base = dict(dataclasses.asdict(spec), floor_bytes=spec.floor_bytes)
            base.pop("reference_cache")
            if (why := _too_big(spec, args)) is not None:
                done.append(dict(base, status="skipped", note=why))
                print(f"{_label(spec)}: skipped ({why})", flush=True)
                continue
            t0 = time.time()
            r = run_isolated(dataclasses.replace(spec, reference_cache=ref_dir), timeout_s=args.timeout,
                             measure_fn=measure)
            r.pop("reference_cache", None)
            done.append(r)
            if r["status"] == "ok":
                print(f"{_label(spec)}: {r['ratio']:.2f} x floor, {r['time_s'] * 1e3:.0f} ms, |rel| {r['parity']:.1e}"
                      f" [{time.time() - t0:.0f} s, load {r['load_avg_1m']:.1f}]", flush=True)
            else:
                print(f"{_label(spec)}: {r['status']}: {r.get('note', '')[:300]}", flush=True)
    return done


def _label(s) -> str:
    get = (lambda k: s[k]) if isinstance(s, dict) else (lambda k: getattr(s, k))
    return f"{get('workload')} T={get('T')} H={get('H')} V={get('V')} {get('dtype')} {get('method')}"


def _same_config(a: dict, b: dict) -> bool:
    return all(a[k] == b[k] for k in ("workload", "T", "H", "V", "dtype", "device"))


def _find(results, r, method):
    return next((o for o in results if o["method"] == method and o.get("status") == "ok" and _same_config(o, r)), None)


def table(results: list[dict]) -> str:
    from tabulate import tabulate

    rows = []
    for r in results:
        ok = r.get("status") == "ok"
        ind = _find(results, r, "inductor") if ok else None
        status = r.get("status", "?") if ok else f"{r.get('status')}: {str(r.get('note', ''))[:60]}"
        if ok and r["method"] in GRAPHPASS_METHODS:
            status += (f" (lm_head sites: {r['notes'].get('lm_head_sites')}, gradients in forward: "
                       f"{r['notes'].get('gradients_in_forward_sites', 0)})")
        if ok and r["method"] == "autochunk":
            status += f" (auto-chunked graphs: {r['notes'].get('auto_chunked_graphs')})"
        rows.append([r["workload"], r["T"], r["H"], r["V"], r["dtype"], r["method"],
                     f"{r['peak_bytes'] / 2**20:,.0f}" if ok else "", f"{r['ratio']:.2f}" if ok else "",
                     f"{r['time_s'] * 1e3:,.0f}" if ok else "",
                     f"{r['time_s'] / ind['time_s']:.2f}" if ind else "",
                     f"{r['parity']:.1e}" if ok else "", f"{r['load_avg_1m']:.1f}" if ok else "", status])
    return tabulate(rows, headers=["loss", "T", "H", "V", "dtype", "method", "peak MiB", "x floor", "step ms",
                                   "x inductor", "|rel| vs fp64", "load", "status"], disable_numparse=True)


def acceptance(results: list[dict], ab: list[dict] = ()) -> list[dict]:
    """The checks of `ACCEPTANCE` for each graphpass result at its configurations; for
    cross-entropy, peak <= linear_ce's. Beside the loss-outside check, an `INFO` line: the helper
    compiled alone (its backward recomputes the logits: four GEMMs against inductor's three)."""
    out = []
    for r in results:
        if r["method"] not in GRAPHPASS_METHODS or r.get("status") != "ok":
            continue
        ind = _find(results, r, "inductor")
        ratio = r["time_s"] / ind["time_s"] if ind else None
        paired = next((a for a in ab if a.get("status") == "ok" and _same_config(a, r)
                       and a["notes_by_method"].get(r["method"], {}).get("lm_head_sites")), None)
        if paired is not None:
            ratio = paired["ratios"][r["method"]]
        if r["workload"] == "ppo_outside" and r["method"] == "graphpass" and any(
                all(r[k] == v for k, v in c.items() if k != "method") for c, _ in ACCEPTANCE):
            out.append(dict(check="ppo_outside_recompute", passed=None, time_ratio=ratio,
                            line=f"INFO {_label(r)} (the helper compiled alone, its backward recomputing "
                                 f"the logits: 4 GEMMs against inductor's 3): {r['ratio']:.2f} x floor, "
                                 + (f"{ratio:.2f} x inductor" if ratio is not None else "no inductor row")))
        for config, most_floor in ACCEPTANCE:
            if any(r[k] != v for k, v in config.items()):
                continue
            if r["dtype"] == "fp32":
                parity, parity_text = r["parity"] <= 1e-4, f"|rel| {r['parity']:.1e} (<= 1e-4)"
            else:  # each gradient, against inductor's in the same run
                keys = ("hidden_grad_rel", "weight_grad_rel")
                parity = ind is not None and all(r[k] <= ind[k] for k in keys)
                parity_text = ", ".join(f"{k.split('_')[0]}.grad |rel| {r[k]:.1e}"
                                        + (f" (<= inductor's {ind[k]:.1e})" if ind else "") for k in keys)
            checks = dict(lm_head=r["notes"].get("lm_head_sites", 0) >= 1, parity=parity,
                          time=ratio is not None and ratio <= 1.0)
            if most_floor is not None:
                checks["peak"] = r["ratio"] <= most_floor
            passed = all(checks.values())
            out.append(dict(check=r["workload"], passed=passed, checks=checks, time_ratio=ratio,
                            line=f"{'PASS' if passed else 'FAIL'} {_label(r)}: "
                                 f"lm_head sites {r['notes'].get('lm_head_sites')}, {parity_text}, "
                                 f"{r['ratio']:.2f} x floor" + (f" (<= {most_floor})" if most_floor else "") + ", "
                                 + (f"{ratio:.2f} x inductor (<= 1.0{', alternating A/B' if paired else ''})"
                                    if ratio is not None else "no inductor row")))
        if r["workload"] == "ce":
            lce = _find(results, r, "linear_ce")
            if lce is None:
                continue
            passed = r["peak_bytes"] <= lce["peak_bytes"]
            out.append(dict(check="ce", passed=passed,
                            line=f"{'PASS' if passed else 'FAIL'} ce T={r['T']} H={r['H']} V={r['V']} {r['dtype']}: "
                                 f"graphpass {r['peak_bytes'] / 2**20:,.0f} MiB vs F.linear_cross_entropy "
                                 f"{lce['peak_bytes'] / 2**20:,.0f} MiB ({r['ratio']:.2f} vs {lce['ratio']:.2f} x floor)"))
    return out


def plot(results: list[dict], path: Path) -> str:
    """Peak / floor and time / inductor per configuration, one bar per method."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: plot skipped"
    ok = [r for r in results if r.get("status") == "ok"]
    configs = []
    for r in ok:
        c = (r["workload"], r["T"], r["H"], r["V"], r["dtype"])
        if c not in configs:
            configs.append(c)
    if not configs:
        return "no results: plot skipped"
    methods = [m for m in METHODS + LIBRARY_METHODS if any(r["method"] == m for r in ok)]
    fig, axes = plt.subplots(2, 1, figsize=(max(6, 1.6 * len(configs) * len(methods) / 3), 8))
    width = 0.8 / len(methods)
    for j, m in enumerate(methods):
        xs, peaks, times, txs = [], [], [], []
        for i, c in enumerate(configs):
            r = next((o for o in ok if o["method"] == m and (o["workload"], o["T"], o["H"], o["V"], o["dtype"]) == c), None)
            if r is None:
                continue
            xs.append(i + j * width)
            peaks.append(r["ratio"])
            ind = _find(ok, r, "inductor")
            if ind:
                txs.append(i + j * width)
                times.append(r["time_s"] / ind["time_s"])
        axes[0].bar(xs, peaks, width, label=m, color=f"C{j}")
        axes[1].bar(txs, times, width, label=m, color=f"C{j}")
    labels = [f"{w} T={T}\nH={H} V={V}\n{d}" for w, T, H, V, d in configs]
    for ax, ylabel in ((axes[0], "peak / floor (hidden.grad + W.grad)"), (axes[1], "step time / inductor's")):
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(configs))], labels, fontsize=8)
        ax.set_ylabel(ylabel)
        ax.axhline(1.0, color="k", linestyle="--", linewidth=1)
        ax.set_yscale("log")
        ax.grid(True, axis="y", which="both", alpha=0.3)
    axes[0].legend(fontsize=8, ncol=len(methods))
    fig.suptitle("lm_head + RL loss: peak memory and time per method")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"plot: {path}"


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="T=256 H=64 V=1024 fp32, two steps per method")
    p.add_argument("--out", type=Path, default=RESULTS, help="directory for NAME.json and NAME.png")
    p.add_argument("--name", default=None, help="file name of the JSON and plot (default lm_head, lm_head_quick)")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS + LIBRARY_METHODS)
    p.add_argument("--T", nargs="+", type=int, default=list(GRID_T))
    p.add_argument("--H", nargs="+", type=int, default=list(GRID_H))
    p.add_argument("--V", nargs="+", type=int, default=list(GRID_V))
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--inner", default="inductor", help="graphpass's inner compiler")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--step-budget", type=float, default=30.0, help="seconds of timed steps per configuration")
    p.add_argument("--max-step-s", type=float, default=30.0,
                   help="CPU: skip configurations whose step would take longer (GEMM estimate)")
    p.add_argument("--mem-limit-gib", type=float, default=None, help="default: 80%% of RAM / GPU memory")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per worker before it is killed")
    p.add_argument("--ab", action="store_true",
                   help="also time graphpass against inductor in one worker, steps alternating (fair on a shared CPU)")
    p.add_argument("--ab-steps", type=int, default=5, help="alternating steps per method with --ab")
    args = p.parse_args(argv)
    fill_device_and_memory_limit(args)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    machine = machine_description()
    print(f"machine: {machine}; load average {os.getloadavg()[0]:.1f}", flush=True)
    t0 = time.time()
    results = run(args)
    ab = run_ab(args) if args.ab else []
    print()
    print(table(results))
    checks = acceptance(results, ab)
    for c in checks:
        print(c["line"])
    args.out.mkdir(parents=True, exist_ok=True)
    name = args.name or ("lm_head_quick" if args.quick else "lm_head")
    (args.out / f"{name}.json").write_text(json.dumps(dict(
        machine=machine, commit=_commit(), command=" ".join(["python -m bench.lm_head", *(argv if argv is not None else sys.argv[1:])]),
        elapsed_s=round(time.time() - t0), load_avg_end=list(os.getloadavg()),
        timing_note="CPU shared with other processes: compare times within a run (x inductor); load_avg_1m per result",
        acceptance=checks, ab=ab, results=results), indent=1) + "\n")
    print(f"\nJSON: {args.out / f'{name}.json'}")
    print(plot(results, args.out / f"{name}.png"))
    return 1 if any(r["status"] in ("error", "timeout") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
