"""Tensor-parallel (vocab-parallel) log-prob/entropy loss code at TP=2 on gloo ranks: memory, time, collectives.

    python -m bench.tp                 # megatron, slime x eager, inductor, graphpass x T 2048, 8192 x fp32, bf16
    python -m bench.tp --quick         # T=2048 only, fewer steps (a few minutes)
    python -m bench.tp --code slime --T 8192 --dtype bf16 --methods inductor graphpass
    python -m bench.tp --device cuda   # NCCL ranks, one GPU each (cuda:0, cuda:1)
    python -m bench.tp --code megatron_entropy --T 2048 --dtype fp32 --out bench/results/tp_megatron_entropy.json

The loss is `bench.workloads.tp_losses.ppo_loss` on the log-probs of one of the vocab-parallel codes:
`megatron` (megatron-core's `vocab_parallel_cross_entropy`, negated; no entropy), `slime` (a
slime-style `autograd.Function` with all-reduces; entropy with its gradient kept) and, not in the
default grid, `megatron_entropy` (verl's Megatron actor: the logits divided by a temperature of
0.7, megatron-core's loss on a clone of them, a verl-style entropy Function on them, PPO with an
entropy bonus over a per-token mask). Each rank holds
its `[T, V/2]` slice of the same random global logits (a leaf that requires grad), the global
targets, old log-probs and advantages (one seed on both ranks). Methods: `eager` (the plain
function), `inductor` (`torch.compile(fn, backend="inductor")`), `graphpass`
(`torch.compile(fn, backend=graphpass.Backend())`, which replaces the Function by one
`graphpass::vocab_parallel_logprob_entropy` call).

Per configuration (code, T, dtype) and method: per-rank peak bytes above the pre-step baseline
(inputs only) over the floor, the bytes of this rank's `logits.grad` (`T x V/2 x itemsize`),
max over ranks; the median step time (forward + backward; each step's time is the slowest
rank's); the collectives a rank issues per step; graphpass's vocab-parallel sites and their
collective bytes (from `backend.records`); and parity: the loss and `logits.grad` against eager's
on the same inputs (max abs difference relative to eager's largest magnitude, max over ranks).
The table goes to stdout, everything to `--out` (bench/results/tp.json). With `--device cuda`
the ranks are NCCL ranks on one GPU each: peaks from `max_memory_allocated`, the GPU synchronised
before every clock read, the collectives counted from the profiler's `nccl:` events.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

from bench.harness.machine_info import machine_description, provenance
from bench.harness.spec import DTYPE_BYTES

CODES = ("megatron", "slime", "megatron_entropy")
DEFAULT_CODES = ("megatron", "slime")
METHODS = ("eager", "inductor", "graphpass")
GRID_T = (2048, 8192)
QUICK_T = (2048,)
DTYPES = ("fp32", "bf16")
V = 65536
TP = 2
# Acceptance: graphpass's per-rank peak over the floor, and its time over inductor's on the same code.
MAX_PEAK_RATIO = 1.10
MAX_TIME_RATIO = 1.0
REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "bench" / "results" / "tp.json"


@dataclasses.dataclass(frozen=True)
class TpSpec:
    """One configuration: every method in `methods` runs on the same ranks, one after the other."""

    code: str
    T: int
    dtype: str
    V: int = V
    """Global vocabulary; each rank holds `V / world` columns."""
    methods: tuple[str, ...] = METHODS
    compiler: str = "inductor"
    """The `inductor` method's backend and graphpass's inner compiler (the smoke test uses aot_eager)."""
    steps: int = 5
    """Most timed steps; fewer when a step is slow (see `time_budget_s`)."""
    min_steps: int = 2
    time_budget_s: float = 20.0
    """Timed steps stop once the next would exceed this (at least `min_steps` run)."""
    memory_steps: int = 2
    """Steps per method measured for peak memory (a separate phase: see `run_config`)."""
    seed: int = 0
    device: str = "cpu"
    """"cpu" (gloo ranks) or "cuda" (NCCL ranks, one GPU each)."""

    def floor_bytes(self, world: int) -> int:
        """Bytes of one rank's `logits.grad`."""
        return self.T * (self.V // world) * DTYPE_BYTES[self.dtype]


# ---- the measured loss code ---------------------------------------------------------------------
# Module-level so that each method compiles the same function; nothing here is changed per method.
def megatron_loss(logits, target, old_log_prob, advantages):
    from bench.workloads.tp_losses import megatron_logprob, ppo_loss

    return ppo_loss(megatron_logprob(logits, target), old_log_prob, advantages)


def slime_loss(logits, target, old_log_prob, advantages):
    from bench.workloads.tp_losses import ppo_loss, slime_style_logprob_entropy

    log_prob, entropy = slime_style_logprob_entropy(logits, target, with_entropy=True, with_entropy_grad=True)
    return ppo_loss(log_prob, old_log_prob, advantages, entropy)


TEMPERATURE = 0.7  # megatron_entropy's sampling temperature


def megatron_entropy_loss(logits, target, old_log_prob, advantages, mask):
    """verl's Megatron actor: the logits divided by the temperature, megatron-core's loss on a clone
    of them, an entropy Function on them (`bench.workloads.tp_losses.VerlStyleEntropy`), PPO with an entropy
    bonus over the response tokens (`mask`)."""
    from bench.workloads.tp_losses import megatron_logprob_entropy, ppo_loss

    log_prob, entropy = megatron_logprob_entropy(logits, target, temperature=TEMPERATURE)
    return ppo_loss(log_prob, old_log_prob, advantages, entropy, mask=mask)


LOSSES = {"megatron": megatron_loss, "slime": slime_loss, "megatron_entropy": megatron_entropy_loss}
MEGATRON_CODES = ("megatron", "megatron_entropy")  # megatron-core's parallel state set up on the ranks
MASKED_CODES = ("megatron_entropy",)  # the loss also reads a per-token mask


# ---- inside a rank --------------------------------------------------------------------------------
def _inputs(spec: TpSpec, rank: int, world: int):
    """This rank's `[T, V/world]` slice of the global logits (a leaf), and the global side inputs.

    The global logits are drawn in row blocks (never `[T, V]` at once) from one seed, so every rank
    sees the same matrix. Old log-probs sit around a random logit's log-prob (about -log V - 1/2), so
    that the PPO ratio is near 1 and the clip is active for some tokens, not all.
    """
    import torch

    from bench.harness.spec import torch_dtype
    from bench.harness.ranks import device

    dtype = torch_dtype(spec.dtype)
    width = spec.V // world
    g = torch.Generator().manual_seed(spec.seed)
    logits = torch.empty(spec.T, width, dtype=dtype)
    block = 256
    for start in range(0, spec.T, block):
        rows = torch.randn(min(block, spec.T - start), spec.V, generator=g)
        logits[start:start + rows.shape[0]] = rows[:, rank * width:(rank + 1) * width]
        del rows
    target = torch.randint(0, spec.V, (spec.T,), generator=g)
    old_log_prob = -math.log(spec.V) - 0.5 + 0.5 * torch.randn(spec.T, generator=g)
    advantages = torch.randn(spec.T, generator=g)
    here = device()  # drawn on the CPU (the same matrix whatever the device), then moved
    inputs = [logits.to(here).requires_grad_(), target.to(here), old_log_prob.to(here), advantages.to(here)]
    if spec.code in MASKED_CODES:
        # About a quarter of the tokens are the prompt's or padding: no loss there.
        inputs.append((torch.rand(spec.T, generator=g) < 0.75).to(here))
    return inputs


def _build(method: str, spec: TpSpec):
    """(the step's loss function, the graphpass backend or None).

    The compiled methods compile the same function side by side: Dynamo keeps one cache entry per
    backend (its guards check the backend), so calls alternate between them without recompiling.
    """
    import torch

    fn = LOSSES[spec.code]
    if method == "eager":
        return fn, None
    if method == "inductor":
        return torch.compile(fn, backend=spec.compiler), None
    import graphpass

    backend = graphpass.Backend(inner=spec.compiler)
    return torch.compile(fn, backend=backend), backend


def max_rel_diff(a, b, block_rows: int = 512) -> float:
    """max |a - b| / max |b|, in float64, row block by row block (no full-size temporary)."""
    a, b = a.reshape(-1, a.shape[-1] if a.ndim else 1), b.reshape(-1, b.shape[-1] if b.ndim else 1)
    diff, scale = 0.0, 0.0
    for start in range(0, a.shape[0], block_rows):
        x, y = a[start:start + block_rows].double(), b[start:start + block_rows].double()
        diff = max(diff, (x - y).abs().max().item())
        scale = max(scale, y.abs().max().item())
    return diff / scale if scale > 0 else diff


def graphpass_summary(backend, world: int) -> dict:
    """What graphpass compiled: vocab-parallel sites, their collectives, fallbacks and rejections."""
    sites = [s for r in backend.records for s in r.sites]
    tp_sites = [s for s in sites if s.tp_size == world]
    return dict(
        graphs=len(backend.records),
        sites=len(sites),
        tp_sites=len(tp_sites),
        site_kinds=[s.kind for s in tp_sites],
        record_collectives=[(c.op, c.group_size, c.bytes) for s in tp_sites for c in s.collectives],
        collective_bytes=sum(c.bytes for s in tp_sites for c in s.collectives),
        fallbacks=[r.fallback_reason for r in backend.records if r.fallback_reason],
        rejected=[f"{c.source}: {c.reason}" for r in backend.records for c in r.rejected],
        warnings=[w for r in backend.records for w in r.warnings],
    )


def profiled(step) -> list[str]:
    """Run `step` once under the profiler; the collectives it issued at the process group, in order.

    `bench.harness.ranks.collectives()` sees calls through `torch.distributed`'s Python functions: eager
    code and graphpass's op, not the functional collectives that compiled code calls from its
    graph. The profiler's events named after the backend (`gloo:all_reduce`, `nccl:all_reduce`)
    are every path's collectives as the process group runs them, so this one count serves every
    method.
    """
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    # Kineto prints a line to stderr at each profiler start and stop (no setting turns it off):
    # stderr goes to /dev/null for this step only; an error still comes back as the exception.
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    prefix = f"{dist.get_backend()}:"
    events = sorted((e for e in prof.events() if e.name.startswith(prefix)), key=lambda e: e.time_range.start)
    return [e.name.removeprefix(prefix) for e in events]


def run_config(rank: int, world: int, spec: TpSpec) -> dict:
    """The rank's body (through `bench.harness.ranks.run_ranks`): every method of `spec` on the same inputs.

    One spawn per configuration (code, T, dtype) for all its methods: the inputs are built and each
    compile paid once per rank, and eager's loss and gradient are the parity reference in the same
    process. Steps run round-robin over the methods, so that load from outside the benchmark (the
    machine may be shared) lands on every method alike. Two phases, because one malloc setting
    cannot serve both measurements:

    * peak memory first, with glibc's mmap threshold pinned to 1 MiB from the rank's start
      (`mallopt`; `bench.harness.isolate` pins it with `MALLOC_MMAP_THRESHOLD_` for the single-device
      bench): every buffer of 1 MiB or more is mapped on allocation and unmapped on free, so RSS
      tracks live tensor bytes; VmHWM is reset (`CpuMeter.reset`: gc, malloc_trim, clear_refs)
      right before each step, every earlier step's outputs dropped. (It has to come first: once
      the heap holds large free chunks, malloc serves big requests from them whatever the
      threshold, and a temporary freed there stays resident for the rest of the step.)
    * then time, with the threshold where glibc's dynamic threshold settles once a step has freed
      its first temporaries (32 MiB, trim at 64 MiB): per-chunk temporaries are reused from the
      heap, as in any long-running process (and from the caching allocator on a GPU). Mapping and
      zeroing fresh pages for every temporary, as the memory phase does, penalises code that
      allocates per chunk (an unfused eager per-chunk loop measured 4x slower that way here,
      inductor's whole-tensor kernels not measurably): those steps' times stay in the JSON
      (`memory_phase_times`), not in the table.

    On CUDA ranks (NCCL, one GPU each) the peaks are the caching allocator's (`CudaMeter`) and
    the malloc settings concern host memory only; the phases stay as they are.
    """
    import warnings

    warnings.filterwarnings("ignore")  # megatron-core's and Dynamo's chatter, once per rank
    import torch

    torch._dynamo.reset()
    if spec.code in MEGATRON_CODES:
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    try:
        return _run_methods(rank, world, spec)
    finally:
        if spec.code in MEGATRON_CODES:
            parallel_state.destroy_model_parallel()
        torch._dynamo.reset()


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)


def set_malloc(mmap_threshold: int, trim_threshold: int) -> bool:
    """glibc: map new allocations of `mmap_threshold` bytes or more (when no free heap chunk fits),
    return heap tops above `trim_threshold`; fixed from now on (no dynamic threshold). False if not glibc."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, trim_threshold))
    except (OSError, AttributeError):
        return False


def _run_methods(rank: int, world: int, spec: TpSpec) -> dict:
    import torch
    import torch.distributed as dist

    from bench.harness.meters import CpuMeter, CudaMeter
    from bench.harness.ranks import collectives, device, synchronize

    # Before the first large allocation: see run_config.
    pinned = set_malloc(2**20, 128 * 2**10)
    load = [os.getloadavg()[0]]
    logits, target, old_log_prob, advantages, *extra = _inputs(spec, rank, world)
    # megatron-core's forward writes its softmax into its input, and `megatron_logprob` hands it
    # `logits.float()`, which for fp32 logits IS the leaf: eager (and inductor, which keeps the
    # input mutation) overwrite the bench's logits, and the backward's gradient is that same
    # storage (`logits.grad` aliases `logits`: eager's peak stays at the floor). That is
    # megatron's real behaviour on fp32 logits, so the measured code stays as written (no clone
    # inside it: that would charge megatron a copy it does not make); the logits are restored
    # from a pristine copy after each step, outside the measured region, and the result says
    # that the method overwrote them (`input_overwritten`). bf16 logits reach megatron as a
    # fresh fp32 copy: nothing to restore.
    pristine = logits.detach().clone() if spec.code == "megatron" and logits.dtype == torch.float32 else None
    built = {m: _build(m, spec) for m in spec.methods}
    meter = CudaMeter() if logits.is_cuda else CpuMeter()  # on a GPU, the caching allocator's peaks
    state = dict(loss=None)
    overwritten = {m: False for m in spec.methods}

    def step(method):
        state["loss"] = built[method][0](logits, target, old_log_prob, advantages, *extra)
        state["loss"].backward()

    def clear():
        # The baseline is inputs only: the previous step's loss graph and gradient go first.
        logits.grad, state["loss"] = None, None

    def restore(method):
        """Undo an overwrite of the logits by `method`'s step (outside the measured region)."""
        if pristine is not None and not torch.equal(logits.detach(), pristine):
            overwritten[method] = True
            with torch.no_grad():
                logits.copy_(pristine)

    def timed_step(method, before=None) -> tuple[float, float, list]:
        """(this rank's seconds, the slowest rank's, the logged collectives) of one step."""
        clear()
        if before is not None:
            before()
        dist.barrier()  # both ranks start together: no rank's time includes waiting for the other
        with collectives() as issued:
            synchronize()
            t0 = time.perf_counter()
            step(method)
            synchronize()
            elapsed = time.perf_counter() - t0
        # Every rank must run the same number of steps: stopping rules read the slowest rank's
        # time of each step, the same value on every rank.
        slowest = torch.tensor([elapsed], dtype=torch.float64, device=device())
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return elapsed, slowest.item(), [c[0] for c in issued]

    # Warm-up: a compiled method's first call compiles; eager's first call initialises lazily.
    first_call = {}
    for method in spec.methods:
        first_call[method] = timed_step(method)[1]
        clear()
        restore(method)

    # Phase 1: peak memory (mmap threshold pinned since the rank's start).
    out = dict(rank=rank, floor_bytes=spec.floor_bytes(world), load=load, mmap_threshold_pinned=pinned,
               malloc_env=os.environ.get("MALLOC_MMAP_THRESHOLD_"),
               methods={m: dict(status="ok", first_call_s=first_call[m], peaks=[], memory_phase_times=[])
                        for m in spec.methods})
    for _ in range(spec.memory_steps):
        for method in spec.methods:
            _, slowest, _ = timed_step(method, before=meter.reset)
            out["methods"][method]["peaks"].append(meter.peak())
            out["methods"][method]["memory_phase_times"].append(slowest)
            clear()
            restore(method)
    load.append(os.getloadavg()[0])

    # Phase 2: time (malloc reuses freed temporaries, see above).
    set_malloc(32 * 2**20, 64 * 2**20)
    times = {m: [] for m in spec.methods}
    rank_times = {m: [] for m in spec.methods}
    logged = {m: [] for m in spec.methods}
    rounds = []
    budget = spec.time_budget_s * len(spec.methods)
    while len(rounds) < spec.min_steps or (
            len(rounds) < spec.steps and sum(rounds) + statistics.median(rounds) <= budget):
        for method in spec.methods:
            mine, slowest, issued = timed_step(method)
            rank_times[method].append(mine)
            times[method].append(slowest)
            logged[method].append(issued)
            clear()
            restore(method)
        rounds.append(sum(times[m][-1] for m in spec.methods))
        load.append(os.getloadavg()[0])

    # One more step per method under the profiler: its collectives, and its loss and gradient
    # against eager's (eager runs first, so its step is the reference).
    reference = None
    for method in spec.methods:
        clear()
        issued = profiled(lambda: step(method))
        loss_value = state["loss"].detach().double().item()
        grad = logits.grad.detach()
        result = out["methods"][method]
        result.update(peak_bytes=max(result["peaks"]), time_s=statistics.median(times[method]), times=times[method],
                      rank_times=rank_times[method], loss=loss_value,
                      collectives=issued, collectives_per_step=len(issued), logged_collectives=logged[method][-1],
                      logged_constant=all(p == logged[method][-1] for p in logged[method]))
        if method == "eager":
            # A copy: megatron's fp32 gradient is the input's own storage, restored below.
            reference = (loss_value, grad.clone())
        if reference is not None:
            result["loss_diff"] = abs(loss_value - reference[0]) / max(abs(reference[0]), 1e-30)
            result["grad_diff"] = max_rel_diff(grad, reference[1])
            result["parity"] = max(result["loss_diff"], result["grad_diff"])
        del grad
        clear()
        restore(method)
        result["input_overwritten"] = overwritten[method]
        backend = built[method][1]
        if backend is not None:
            result["graphpass"] = graphpass_summary(backend, world)
    out["load"].append(os.getloadavg()[0])
    return out


# ---- the parent -----------------------------------------------------------------------------------
def spawn_timeout_s(spec: TpSpec) -> float:
    """Deadline of one configuration's spawn: start-up, a compile per compiled method, the steps."""
    compiled = sum(m != "eager" for m in spec.methods)
    per_step_s = 20 * spec.T / 2048  # a slow memory-phase step at this T, with room
    return 120 + 150 * compiled + len(spec.methods) * (spec.time_budget_s + (3 + spec.memory_steps) * per_step_s)


def _row_base(spec: TpSpec, world: int) -> dict:
    """The fields every row of `spec` starts with."""
    return dict(code=spec.code, T=spec.T, V=spec.V, tp=world, dtype=spec.dtype, device=spec.device,
                floor_bytes=spec.floor_bytes(world))


def run(spec: TpSpec, world: int = TP) -> list[dict]:
    """One row per method of `spec` (status "error" for all when the spawn failed)."""
    from bench.harness.ranks import RankFailed, backend_for, run_ranks

    base = _row_base(spec, world)
    started = time.monotonic()
    try:
        per_rank = run_ranks(run_config, world, args=(spec,), timeout_s=spawn_timeout_s(spec),
                             backend=backend_for(spec.device))
    except RankFailed as error:
        note = str(error).strip().splitlines()
        return [dict(base, method=m, status="error", note=" | ".join(note[:1] + note[-3:])[:800]) for m in spec.methods]
    return rows_from_ranks(spec, per_rank, time.monotonic() - started)


def rows_from_ranks(spec: TpSpec, per_rank: list[dict], wall_s: float | None = None) -> list[dict]:
    """One row per method from the ranks' `run_config` results: peaks maxed over ranks, and so on."""
    world = len(per_rank)
    base = _row_base(spec, world)
    rows = []
    for method in spec.methods:
        ranks = [r["methods"][method] for r in per_rank]
        first = ranks[0]
        row = dict(base, method=method, status="ok", spawn_wall_s=wall_s,
                   peak_bytes=max(r["peak_bytes"] for r in ranks),
                   peak_bytes_per_rank=[r["peak_bytes"] for r in ranks],
                   peaks=[max(p) for p in zip(*(r["peaks"] for r in ranks))],
                   time_s=first["time_s"],  # each step's time is already the slowest rank's
                   times=first["times"], rank_times=[r["rank_times"] for r in ranks],
                   first_call_s=max(r["first_call_s"] for r in ranks),
                   load_avg_max=max(max(r["load"]) for r in per_rank),
                   loss=first["loss"],
                   collectives_per_step=first["collectives_per_step"], collectives=first["collectives"],
                   logged_collectives=first["logged_collectives"],
                   collectives_same_on_all_ranks=all(r["collectives"] == first["collectives"]
                                                     and r["logged_collectives"] == first["logged_collectives"]
                                                     for r in ranks),
                   logged_constant=all(r["logged_constant"] for r in ranks),
                   input_overwritten=any(r["input_overwritten"] for r in ranks),
                   memory_phase_times=[max(t) for t in zip(*(r["memory_phase_times"] for r in ranks))],
                   mmap_threshold_pinned=all(r["mmap_threshold_pinned"] for r in per_rank),
                   malloc_env=per_rank[0]["malloc_env"])
        row["peak_ratio"] = row["peak_bytes"] / row["floor_bytes"]
        if "parity" in first:
            row.update(parity=max(r["parity"] for r in ranks), loss_diff=max(r["loss_diff"] for r in ranks),
                       grad_diff=max(r["grad_diff"] for r in ranks))
        if "graphpass" in first:
            row["graphpass"] = first["graphpass"]
        rows.append(row)
    return rows


def _time_vs_inductor(row: dict, rows: list[dict]) -> float | None:
    for other in rows:
        if (other["method"] == "inductor" and other.get("status") == "ok" and row.get("status") == "ok"
                and all(other[k] == row[k] for k in ("code", "T", "dtype", "V"))):
            return row["time_s"] / other["time_s"]
    return None


def _collectives_cell(row: dict) -> str:
    if row.get("status") != "ok":
        return ""
    names = sorted(set(row["collectives"]))
    text = f"{row['collectives_per_step']} ({', '.join(names)})" if names else "0"
    if not row["collectives_same_on_all_ranks"] or not row["logged_constant"]:
        text += " DIFFER across ranks or steps"
    return text


def _notes(row: dict) -> str:
    if row.get("status") != "ok":
        return f"{row.get('status')}: {row.get('note', '')}"[:160]
    notes = []
    gp = row.get("graphpass")
    if gp is not None:
        notes.append(f"{gp['tp_sites']} tp site(s), {gp['collective_bytes'] / 2**10:.0f} KiB/call")
        if gp["fallbacks"]:
            notes.append("FELL BACK: " + "; ".join(gp["fallbacks"]))
        if gp["rejected"]:
            notes.append("rejected: " + "; ".join(gp["rejected"]))
    if row.get("input_overwritten"):
        notes.append("overwrites its input logits")
    if row["method"] != "eager":
        notes.append(f"1st call {row['first_call_s']:.1f} s")
    return "; ".join(notes)


def table(rows: list[dict]) -> str:
    from tabulate import tabulate

    headers = ["code", "method", "T", "dtype", "peak/floor", "step s", "x inductor", "collectives/step", "parity",
               "notes"]
    body = []
    for r in rows:
        ok = r.get("status") == "ok"
        ratio = _time_vs_inductor(r, rows)
        body.append([r["code"], r["method"], r["T"], r["dtype"],
                     f"{r['peak_ratio']:.2f}" if ok else "",
                     f"{r['time_s']:.3f}" if ok else "",
                     "" if ratio is None else f"{ratio:.2f}",
                     _collectives_cell(r),
                     f"{r['parity']:.1e}" if ok and "parity" in r else "",
                     _notes(r)])
    return tabulate(body, headers=headers, disable_numparse=True)


def acceptance(rows: list[dict]) -> list[dict]:
    """Per configuration with a graphpass row: peak <= 1.10 x floor and time <= 1.0 x inductor's."""
    out = []
    for r in rows:
        if r["method"] != "graphpass":
            continue
        entry = dict(code=r["code"], T=r["T"], dtype=r["dtype"])
        if r.get("status") != "ok":
            entry.update(passed=False, line=f"FAIL {r['code']} T={r['T']} {r['dtype']}: graphpass {r.get('status')}")
            out.append(entry)
            continue
        ratio = _time_vs_inductor(r, rows)
        peak_ok = r["peak_ratio"] <= MAX_PEAK_RATIO
        time_ok = ratio is not None and ratio <= MAX_TIME_RATIO
        entry.update(peak_ratio=r["peak_ratio"], time_ratio=ratio, peak_ok=peak_ok, time_ok=time_ok,
                     passed=peak_ok and time_ok)
        time_text = "no inductor row" if ratio is None else f"{ratio:.2f} x inductor (<= {MAX_TIME_RATIO:.2f})"
        entry["line"] = (f"{'PASS' if entry['passed'] else 'FAIL'} {r['code']} T={r['T']} {r['dtype']}: "
                         f"peak {r['peak_ratio']:.2f} x floor (<= {MAX_PEAK_RATIO:.2f}) {'ok' if peak_ok else 'FAIL'}; "
                         f"time {time_text} {'ok' if time_ok else 'FAIL'}")
        out.append(entry)
    return out


def plan(args) -> list[TpSpec]:
    """The configurations to run, smallest first."""
    specs = []
    for T in args.T or (QUICK_T if args.quick else GRID_T):
        if args.quick:
            steps = dict(steps=2, min_steps=2, time_budget_s=5.0, memory_steps=1)
        else:
            # Peaks repeat to the page from step to step (they are the code's allocations, not
            # noise), and a memory-phase step at T=8192 costs up to ~25 s here: one there.
            steps = dict(steps=5, min_steps=2, time_budget_s=20.0, memory_steps=1 if T >= 8192 else 2)
        specs += [TpSpec(code, T, dtype, V=args.V, methods=tuple(args.methods), device=args.device, **steps)
                  for dtype in args.dtype for code in args.code]
    return specs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="T=2048 only, fewer steps")
    parser.add_argument("--T", type=int, nargs="+", help=f"token counts (default {GRID_T}, --quick {QUICK_T})")
    parser.add_argument("--V", type=int, default=V, help=f"the global vocabulary (default {V}; V/{TP} per rank)")
    parser.add_argument("--dtype", nargs="+", choices=DTYPES, default=list(DTYPES))
    parser.add_argument("--code", nargs="+", choices=CODES, default=list(DEFAULT_CODES))
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: gloo ranks; cuda: NCCL ranks, one GPU each")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results")
    args = parser.parse_args(argv)
    # Eager runs first in a configuration (it is the parity reference): keep the canonical order.
    args.methods = [m for m in METHODS if m in args.methods]

    specs = plan(args)
    before = provenance()
    print(f"bench.tp: {len(specs)} configuration(s), TP={TP}, V={args.V} ({args.V // TP} per rank); {machine_description()}",
          flush=True)
    rows = []
    started = time.monotonic()
    for spec in specs:
        t0 = time.monotonic()
        new = run(spec)
        rows += new
        status = ", ".join(f"{r['method']} {r['status']}" for r in new)
        print(f"  {spec.code} T={spec.T} {spec.dtype}: {status} ({time.monotonic() - t0:.0f} s)", flush=True)
    print()
    print(table(rows))
    loads = [r["load_avg_max"] for r in rows if "load_avg_max" in r]
    if loads:
        print(f"\n1-minute load average during the runs: up to {max(loads):.1f} on {os.cpu_count()} cores "
              f"(the benchmark's own ranks: {TP}); more means other processes shared the CPUs")
    if not all(r.get("mmap_threshold_pinned", True) for r in rows):
        print("warning: glibc's mmap threshold could not be pinned: peak memory may read low")
    print()
    accepted = acceptance(rows)
    for entry in accepted:
        print(entry["line"])
    if accepted:
        print(f"acceptance: {'PASS' if all(e['passed'] for e in accepted) else 'FAIL'} "
              f"({sum(e['passed'] for e in accepted)}/{len(accepted)} configurations)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # The working tree is imported afresh by every spawn of ranks: say if it changed during the run.
    after = provenance()
    if after != before:
        print(f"warning: the checkout changed during the run: {before} -> {after}")
    before["changed_during_run"] = after != before
    args.out.write_text(json.dumps(dict(machine=machine_description(), **before, tp=TP, V=args.V, quick=args.quick,
                                        wall_s=time.monotonic() - started, results=rows, acceptance=accepted),
                                   indent=1, default=str) + "\n")
    print(f"\nwrote {args.out} ({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
