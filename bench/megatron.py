"""megatron-core's output layer and a vocab-parallel loss at TP=2 on gloo ranks: per-rank peak and time.

    python -m bench.megatron                      # S=1024 B=1 H=256 V=32768 fp32, both losses (a few minutes)
    python -m bench.megatron --quick --out /tmp/x # fewer steps
    python -m bench.megatron --code slime --S 2048 --methods inductor graphpass

The measured function is unmodified model code: `logits, _ = output_layer(hidden)` through
megatron-core's own `ColumnParallelLinear` (`gradient_accumulation_fusion=False`,
`use_cpu_initialization=True`, no bias, as GPT's output layer), then `bench.workloads.tp_losses.ppo_loss`
of the log-probs of megatron-core's `vocab_parallel_cross_entropy` on a clone of the logits
(`megatron`, as its callers write it: it overwrites its input) or of the slime-style Function
(`slime`, entropy with its gradient kept). Each rank holds the same hidden states `[S, B, H]` (a
leaf that requires grad) and its `[V/2, H]` weight shard. Floor = bytes of this rank's
`hidden.grad + W_shard.grad`.

Methods, run round-robin in one spawn of ranks per loss (`bench.tp`'s helpers: malloc pinned for
the memory phase, profiler `gloo:` events, parity against eager): `eager`; `inductor`
(`torch.compile`, unmodified megatron-core as inductor users get it: Dynamo breaks the graph in
the layer's backward, the loss graph reads the logits); `graphpass`, whose stand-in for the
layer's linear Function (`graphpass.integrations.megatron`) is registered only after inductor's
compile, when the rank first imports graphpass: the layer traces whole and the vocab-parallel op
takes in its matmul. The inductor row records how many graphs inductor compiled, so that a
recompile after the registration (which would trace the stand-in) shows.

Acceptance per loss: an lm_head site recorded, graphpass's per-rank peak <= 1.5 x the floor,
time <= inductor's. Table on stdout, everything to `--out` (bench/results/megatron.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

from bench.harness.machine_info import machine_description, provenance
from bench.tp import TpSpec

CODES = ("megatron", "slime")
METHODS = ("eager", "inductor", "graphpass")
TP = 2
MAX_PEAK_RATIO = 1.5
MAX_TIME_RATIO = 1.0
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "megatron.json"


@dataclasses.dataclass(frozen=True)
class MegatronSpec(TpSpec):
    """`bench.tp`'s configuration (methods, steps, seed) over megatron-core's output layer: hidden
    states `[S, B, H]` (`T = S * B` tokens), a vocabulary of `V`, fp32."""

    V: int = 32768
    S: int = 1024
    B: int = 1
    H: int = 256

    def floor_bytes(self, world: int) -> int:
        """Bytes of one rank's `hidden.grad + W_shard.grad` (fp32)."""
        return 4 * (self.S * self.B * self.H + self.V // world * self.H)


# ---- inside a rank --------------------------------------------------------------------------------
def _output_layer(spec: MegatronSpec, world: int):
    import torch
    from megatron.core import tensor_parallel
    from megatron.core.model_parallel_config import ModelParallelConfig

    config = ModelParallelConfig(tensor_model_parallel_size=world, use_cpu_initialization=True,
                                 gradient_accumulation_fusion=False, params_dtype=torch.float32)
    torch.manual_seed(spec.seed)  # the same master weight on every rank, each keeps its shard
    return tensor_parallel.ColumnParallelLinear(spec.H, spec.V, config=config, bias=False, gather_output=False,
                                                init_method=lambda w: torch.nn.init.normal_(w, std=spec.H ** -0.5))


def _loss_fn(spec: MegatronSpec, layer):
    """The measured function: unmodified model code, output layer then loss."""
    from bench.workloads.tp_losses import ppo_loss, slime_style_logprob_entropy

    def megatron(hidden, target, old_log_prob, advantages):
        from megatron.core import tensor_parallel

        logits, _ = layer(hidden)
        log_prob = -tensor_parallel.vocab_parallel_cross_entropy(logits.clone(), target)
        return ppo_loss(log_prob.reshape(-1), old_log_prob, advantages)

    def slime(hidden, target, old_log_prob, advantages):
        logits, _ = layer(hidden)
        log_prob, entropy = slime_style_logprob_entropy(logits.view(-1, logits.shape[-1]), target.view(-1),
                                                        with_entropy=True, with_entropy_grad=True)
        return ppo_loss(log_prob, old_log_prob, advantages, entropy)

    return {"megatron": megatron, "slime": slime}[spec.code]


def _inputs(spec: MegatronSpec):
    """The hidden states (a leaf), targets, old log-probs near a random token's, advantages: one seed on every rank."""
    import math

    import torch

    g = torch.Generator().manual_seed(spec.seed + 1)
    hidden = torch.randn(spec.S, spec.B, spec.H, generator=g).requires_grad_()
    target = torch.randint(0, spec.V, (spec.S, spec.B), generator=g)
    old_log_prob = -math.log(spec.V) - 0.5 + 0.5 * torch.randn(spec.S * spec.B, generator=g)
    advantages = torch.randn(spec.S * spec.B, generator=g)
    return hidden, target, old_log_prob, advantages


def run_config(rank: int, world: int, spec: MegatronSpec) -> dict:
    """The rank's body (through `bench.harness.ranks.run_ranks`): every method of `spec` on the same inputs."""
    import warnings

    warnings.filterwarnings("ignore")  # megatron-core's and Dynamo's chatter, once per rank
    # megatron-core's linear function warns (and marks itself warned) unless this is set: Dynamo
    # would guard on that mark and recompile inductor's graphs after the first call.
    os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    import torch
    from megatron.core import parallel_state

    torch._dynamo.reset()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    try:
        return _run_methods(rank, world, spec)
    finally:
        parallel_state.destroy_model_parallel()
        torch._dynamo.reset()


def _run_methods(rank: int, world: int, spec: MegatronSpec) -> dict:
    import torch
    import torch.distributed as dist

    from bench.harness.meters import CpuMeter
    from bench.tp import graphpass_summary, max_rel_diff, profiled, set_malloc

    pinned = set_malloc(2**20, 128 * 2**10)  # before the first large allocation: see bench.tp.run_config
    load = [os.getloadavg()[0]]
    layer = _output_layer(spec, world)
    hidden, target, old_log_prob, advantages = _inputs(spec)
    fn = _loss_fn(spec, layer)
    inductor_graphs = []
    state = dict(loss=None)

    def clear():
        hidden.grad = layer.weight.grad = state["loss"] = None

    def step(method):
        state["loss"] = built[method](hidden, target, old_log_prob, advantages)
        state["loss"].backward()

    def timed_step(method, before=None) -> tuple[float, float]:
        """(this rank's seconds, the slowest rank's) of one step."""
        clear()
        if before is not None:
            before()
        dist.barrier()
        t0 = time.perf_counter()
        step(method)
        elapsed = time.perf_counter() - t0
        slowest = torch.tensor([elapsed], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return elapsed, slowest.item()

    def counted(gm, example_inputs, compiler=torch._dynamo.lookup_backend(spec.compiler)):
        inductor_graphs.append(len(gm.graph.nodes))
        return compiler(gm, example_inputs)

    # Eager and inductor first, then graphpass: its import registers the stand-in (see the module doc).
    built, backend, first_call = {}, None, {}
    for method in spec.methods:
        if method == "eager":
            built[method] = fn
        elif method == "inductor":
            built[method] = torch.compile(fn, backend=counted)
        else:
            import graphpass

            backend = graphpass.Backend(inner=spec.compiler)
            built[method] = torch.compile(fn, backend=backend)
        first_call[method] = timed_step(method)[1]
        clear()

    out = dict(rank=rank, floor_bytes=spec.floor_bytes(world), load=load, mmap_threshold_pinned=pinned,
               methods={m: dict(status="ok", first_call_s=first_call[m], peaks=[], memory_phase_times=[])
                        for m in spec.methods})
    meter = CpuMeter()
    for _ in range(spec.memory_steps):
        for method in spec.methods:
            _, slowest = timed_step(method, before=meter.reset)
            out["methods"][method]["peaks"].append(meter.peak())
            out["methods"][method]["memory_phase_times"].append(slowest)
            clear()
    load.append(os.getloadavg()[0])

    set_malloc(32 * 2**20, 64 * 2**20)  # time: malloc reuses freed temporaries (bench.tp.run_config)

    def another_round(rounds) -> bool:
        """`bench.tp`'s rule: `min_steps` rounds at least, `steps` at most, while the next fits the budget."""
        fits = sum(rounds) + statistics.median(rounds) <= spec.time_budget_s * len(spec.methods) if rounds else True
        return len(rounds) < spec.min_steps or (len(rounds) < spec.steps and fits)

    timed = {m: [] for m in spec.methods}  # per step: (this rank's seconds, the slowest rank's)
    rounds = []
    while another_round(rounds):
        for method in spec.methods:
            timed[method].append(timed_step(method))
        rounds.append(sum(timed[m][-1][1] for m in spec.methods))
        load.append(os.getloadavg()[0])
    times = {m: [slowest for _, slowest in timed[m]] for m in spec.methods}

    # One more step per method under the profiler: its collectives, and its loss and gradients
    # against eager's (eager runs first: its step is the reference).
    reference = None
    for method in spec.methods:
        clear()
        issued = profiled(lambda: step(method))
        result = out["methods"][method]
        values = [state["loss"].detach().double().reshape(1, 1), hidden.grad.detach(), layer.weight.grad.detach()]
        result.update(peak_bytes=max(result["peaks"]), time_s=statistics.median(times[method]), times=times[method],
                      rank_times=[mine for mine, _ in timed[method]], loss=values[0].item(), collectives=issued,
                      collectives_per_step=len(issued))
        if method == "eager":
            reference = [v.clone() for v in values]
        if reference is not None:
            diffs = [max_rel_diff(mine, theirs) for mine, theirs in zip(values, reference)]
            result.update(loss_diff=diffs[0], grad_diff=max(diffs[1:]), parity=max(diffs))
        if method == "inductor":
            result["inductor_graphs"] = len(inductor_graphs)
        if method == "graphpass":
            sites = [s for r in backend.records for s in r.sites]
            result["graphpass"] = dict(graphpass_summary(backend, world), lm_head_sites=sum(s.lm_head for s in sites),
                                       gradients_in_forward_sites=sum(s.gradients_in_forward for s in sites),
                                       lm_head_reasons=[s.lm_head_reason for s in sites if s.lm_head_reason],
                                       recompute_reasons=[s.recompute_reason for s in sites if s.recompute_reason])
        del values
        clear()
    load.append(os.getloadavg()[0])
    return out


# ---- the parent -----------------------------------------------------------------------------------
def run(spec: MegatronSpec, world: int = TP) -> list[dict]:
    """One row per method of `spec` (status "error" for all when the spawn failed)."""
    from bench.harness.ranks import RankFailed, run_ranks

    from bench.tp import spawn_timeout_s

    base = dict(code=spec.code, S=spec.S, B=spec.B, H=spec.H, V=spec.V, tp=world, floor_bytes=spec.floor_bytes(world))
    try:
        per_rank = run_ranks(run_config, world, args=(spec,), timeout_s=spawn_timeout_s(spec))
    except RankFailed as error:
        note = str(error).strip().splitlines()
        return [dict(base, method=m, status="error", note=" | ".join(note[:1] + note[-3:])[:800]) for m in spec.methods]
    rows = []
    for method in spec.methods:
        ranks = [r["methods"][method] for r in per_rank]
        first = ranks[0]
        row = dict(base, method=method, status="ok", peak_bytes=max(r["peak_bytes"] for r in ranks),
                   peak_bytes_per_rank=[r["peak_bytes"] for r in ranks], time_s=first["time_s"], times=first["times"],
                   rank_time_s=[statistics.median(r["rank_times"]) for r in ranks],
                   first_call_s=max(r["first_call_s"] for r in ranks), loss=first["loss"],
                   collectives=first["collectives"], collectives_per_step=first["collectives_per_step"],
                   collectives_same_on_all_ranks=all(r["collectives"] == first["collectives"] for r in ranks),
                   memory_phase_times=[max(t) for t in zip(*(r["memory_phase_times"] for r in ranks))],
                   load_avg_max=max(max(r["load"]) for r in per_rank),
                   mmap_threshold_pinned=all(r["mmap_threshold_pinned"] for r in per_rank))
        row["peak_ratio"] = row["peak_bytes"] / row["floor_bytes"]
        for key in ("parity", "loss_diff", "grad_diff"):
            if key in first:
                row[key] = max(r[key] for r in ranks)
        for key in ("inductor_graphs", "graphpass"):
            if key in first:
                row[key] = first[key]
        rows.append(row)
    return rows


def _time_vs_inductor(row: dict, rows: list[dict]) -> float | None:
    for other in rows:
        if other["method"] == "inductor" and other["code"] == row["code"] and other.get("status") == "ok" \
                and row.get("status") == "ok":
            return row["time_s"] / other["time_s"]
    return None


def table(rows: list[dict]) -> str:
    from tabulate import tabulate

    body = []
    for r in rows:
        ok = r.get("status") == "ok"
        ratio = _time_vs_inductor(r, rows)
        notes = [] if ok else [f"{r['status']}: {r.get('note', '')}"[:160]]
        gp = r.get("graphpass")
        if gp is not None:
            notes.append(f"{gp['lm_head_sites']} lm_head site(s) of {gp['tp_sites']} tp, "
                         f"{gp['gradients_in_forward_sites']} with gradients in forward")
            notes += [f"FELL BACK: {why}" for why in gp["fallbacks"]] + gp["lm_head_reasons"] + gp["recompute_reasons"]
        if "inductor_graphs" in r:
            notes.append(f"{r['inductor_graphs']} graphs")
        if ok and not r["collectives_same_on_all_ranks"]:
            notes.append("collectives DIFFER across ranks")
        body.append([r["code"], r["method"], f"{r['peak_ratio']:.2f}" if ok else "",
                     " / ".join(f"{p / 2**20:.1f}" for p in r["peak_bytes_per_rank"]) if ok else "",
                     " / ".join(f"{t:.3f}" for t in r["rank_time_s"]) if ok else "",
                     "" if ratio is None else f"{ratio:.2f}",
                     _runs(r["collectives"]) if ok else "", f"{r['parity']:.1e}" if "parity" in r else "",
                     "; ".join(notes)])
    return tabulate(body, headers=["code", "method", "peak/floor", "peak MiB per rank", "step s per rank",
                                   "x inductor", "collectives/step", "parity", "notes"], disable_numparse=True)


def _runs(names: list[str]) -> str:
    """`a, a, a, b` as `a x3, b`."""
    runs = [(name, len(list(group))) for name, group in itertools.groupby(names)]
    return ", ".join(name if n == 1 else f"{name} x{n}" for name, n in runs)


def acceptance(rows: list[dict]) -> list[dict]:
    """Per loss: an lm_head site, graphpass's peak <= 1.5 x floor, its time <= inductor's."""
    out = []
    for r in rows:
        if r["method"] != "graphpass":
            continue
        if r.get("status") != "ok":
            out.append(dict(code=r["code"], passed=False, line=f"FAIL {r['code']}: graphpass {r.get('status')}"))
            continue
        ratio = _time_vs_inductor(r, rows)
        checks = dict(lm_head=r["graphpass"]["lm_head_sites"] >= 1, peak=r["peak_ratio"] <= MAX_PEAK_RATIO,
                      time=ratio is not None and ratio <= MAX_TIME_RATIO)
        passed = all(checks.values())
        time_text = "no inductor row" if ratio is None else f"{ratio:.2f} x inductor's (<= {MAX_TIME_RATIO:.2f})"
        line = (f"{'PASS' if passed else 'FAIL'} {r['code']}: {r['graphpass']['lm_head_sites']} lm_head site(s) "
                f"{'ok' if checks['lm_head'] else 'FAIL'}; peak {r['peak_ratio']:.2f} x floor (<= {MAX_PEAK_RATIO:.2f}) "
                f"{'ok' if checks['peak'] else 'FAIL'}; time {time_text} {'ok' if checks['time'] else 'FAIL'}")
        out.append(dict(code=r["code"], peak_ratio=r["peak_ratio"], time_ratio=ratio, **checks, passed=passed,
                        line=line))
    return out


def _run_and_say(spec: MegatronSpec) -> list[dict]:
    """`run(spec)`, saying how each method went."""
    t0 = time.monotonic()
    rows = run(spec)
    print(f"  {spec.code}: " + ", ".join(f"{r['method']} {r['status']}" for r in rows) +
          f" ({time.monotonic() - t0:.0f} s)", flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer steps")
    parser.add_argument("--code", nargs="+", choices=CODES, default=list(CODES))
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    for size in "SBHV":
        parser.add_argument(f"--{size}", type=int, default=getattr(MegatronSpec, size))
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results")
    args = parser.parse_args(argv)
    methods = tuple(m for m in METHODS if m in args.methods)  # eager first: the parity reference
    steps = dict(steps=2, min_steps=2, time_budget_s=5.0, memory_steps=1) if args.quick else {}
    specs = [MegatronSpec(code, args.S * args.B, "fp32", V=args.V, S=args.S, B=args.B, H=args.H, methods=methods, **steps)
             for code in args.code]
    before = provenance()
    print(f"bench.megatron: TP={TP}, S={args.S} B={args.B} H={args.H} V={args.V} fp32; {machine_description()}",
          flush=True)
    started = time.monotonic()
    rows = [row for spec in specs for row in _run_and_say(spec)]
    accepted = acceptance(rows)
    loads = [r["load_avg_max"] for r in rows if "load_avg_max" in r]
    print("\n".join(["", table(rows), "",
                     *([f"1-minute load average during the runs: up to {max(loads):.1f} on {os.cpu_count()} cores "
                        f"(the benchmark's own ranks: {TP})", ""] if loads else []),
                     *(e["line"] for e in accepted),
                     f"acceptance: {'PASS' if accepted and all(e['passed'] for e in accepted) else 'FAIL'}"]))
    # Each spawn of ranks imports the working tree afresh: the record says if it changed meanwhile.
    record = dict(machine=machine_description(), **before, changed_during_run=provenance() != before,
                  command=sys.argv, tp=TP, wall_s=time.monotonic() - started, results=rows, acceptance=accepted)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1, default=str) + "\n")
    print(f"\nwrote {args.out} ({record['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
