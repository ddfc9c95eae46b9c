"""Context parallelism: bytes each rank sends and step time, slime's redistribution vs graphpass's.

    python -m bench.cp                 # 48 sequences, cp = 2, 4 on gloo ranks; cp = 8 counted
    python -m bench.cp --quick         # 8 short sequences, the aot_eager compiler (CI, a minute)
    python -m bench.cp --device cuda   # NCCL ranks, one GPU each (cp = 4 needs four)

Every loss of `bench.workloads.cp_losses` (token-mean PPO, per-sample GRPO, GSPO, OPSM, and PPO that also
returns every token's log-prob) starts from this rank's per-token log-probs `[T_local]` (a leaf that
requires grad, fp32) in a CP layout of a packed batch of sequences (prompt + response, lengths
drawn once from a seed), and the rollout's per-token tensors, the same on every rank. Methods:

- `slime`: slime's redistribution: every rank scatters its response rows into a zero-padded
  `[R]` buffer of all responses (R = the batch's response tokens), one differentiable all-reduce
  (`torch.distributed.nn.functional.all_reduce`, whose backward all-reduces again), then the loss
  on the responses, eager (torch.compile cannot capture that all-reduce);
- `unshard`: `layout.unshard` (one all-gather of the local rows), then the loss, eager;
- `graphpass`: the same code as `unshard`, compiled with `graphpass.Backend()`: where the loss
  reduces to sums, it all-reduces the sums only (`passes/localize_cp_reductions`).

Per (loss, layout, cp, method): the bytes one rank contributes to collectives in one step,
forward + backward, read from the collectives it issued (`bench.harness.ranks`); the median step time
(forward + backward, each step the slowest rank's); parity of the loss and of this rank's gradient
with `unshard`'s (slime's gradient divided by cp: its all-reduce's backward sums the gradient over
ranks that all compute the whole loss, so it comes out cp x the loss's). cp = 8 is counted, not run: slime's bytes are 2 x 4 x R whatever cp; graphpass's
reduced sums do not depend on cp (their sizes come from the cp = 2 run); an exact `unshard`
contributes T_local x 4 bytes (`graphpass.cp.rows_per_rank`). The table goes to stdout, everything
to `--out` (bench/results/cp.json). With `--device cuda` the ranks are NCCL ranks on one GPU each
(the rollout moved there, the GPU synchronised before every clock read); a cp the machine has too
few GPUs for is skipped.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from bench.workloads import cp_losses
from bench.harness.machine_info import machine_description, provenance

METHODS = ("slime", "unshard", "graphpass")
LOSSES = cp_losses.LOSSES + (cp_losses.LOGGED,)
LAYOUTS = ("zigzag", "contiguous", "allgather")
RUN_CP = (2, 4)
COUNTED_CP = (8,)
ARGS = ("old_logp", "adv", "mask", "seq_ids", "seq_zeros")
# Acceptance: graphpass's bytes per rank over slime's, where the loss reduces to sums / keeps the unshard.
MAX_BYTES_RATIO_REDUCED = 1 / 8
MAX_BYTES_RATIO_UNSHARD = 1 / 2
REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "bench" / "results" / "cp.json"


@dataclasses.dataclass(frozen=True)
class CpSpec:
    """One batch of sequences; every loss, layout and method runs on it."""

    sequences: int = 48
    prompt: tuple[int, int] = (64, 512)
    """Prompt lengths are drawn uniformly from this range (inclusive)."""
    response: tuple[int, int] = (256, 2048)
    steps: int = 7
    warmup: int = 2
    compiler: str = "inductor"
    seed: int = 0
    device: str = "cpu"
    """"cpu" (gloo ranks) or "cuda" (NCCL ranks, one GPU each)."""

    def lengths(self) -> tuple[list[int], list[int]]:
        """(sequence lengths, prompt lengths): prompt + response tokens per sequence."""
        g = torch.Generator().manual_seed(self.seed)
        prompts = torch.randint(self.prompt[0], self.prompt[1] + 1, (self.sequences,), generator=g).tolist()
        responses = torch.randint(self.response[0], self.response[1] + 1, (self.sequences,), generator=g).tolist()
        return [p + r for p, r in zip(prompts, responses)], prompts

    def rollout(self) -> dict:
        lens, prompts = self.lengths()
        return cp_losses.rollout(lens, None, prompt_lens=prompts, seed=self.seed)


QUICK = CpSpec(sequences=8, prompt=(3, 9), response=(4, 20), steps=2, warmup=1, compiler="aot_eager")


# ---- the measured code --------------------------------------------------------------------------
def slime_style(loss, layout, response_index, local_logp, old_logp, adv, mask, seq_ids, seq_zeros):
    """slime's scheme: the responses zero-padded to `[R]`, one differentiable all-reduce, the loss on them.

    `response_index [T]`: each row's position among the batch's response rows, -1 for a prompt row."""
    import torch.distributed.nn.functional as dist_nn

    local_index = layout.shard(response_index + 1) - 1  # padding rows read 0 -> -1
    keep = local_index >= 0
    total = int((response_index >= 0).sum())
    full = torch.zeros(total, dtype=local_logp.dtype, device=local_logp.device).index_put(
        (local_index[keep],), local_logp[keep])
    with warnings.catch_warnings():  # deprecated in 2.13, and what slime calls
        warnings.simplefilter("ignore", FutureWarning)
        full = dist_nn.all_reduce(full, group=layout.group)
    rows = response_index >= 0
    return loss(full, old_logp[rows], adv[rows], mask[rows], seq_ids[rows], seq_zeros)


def unsharded(loss, layout, local_logp, *args):
    return loss(layout.unshard(local_logp), *args)


def _contributed(entry) -> int:
    """Bytes a rank put into one logged collective: an all-gather's input, an all-reduce's tensor."""
    name, tensors = entry[0], entry[1]
    shape, dtype = tensors[-1] if name.startswith("all_gather") else tensors[0]
    return int(torch.Size(shape).numel()) * torch.empty((), dtype=getattr(torch, dtype)).element_size()


def _rank(rank: int, world: int, spec: CpSpec, kind: str) -> dict:
    import torch.distributed as dist

    import graphpass
    from bench.harness.ranks import collectives, device, synchronize
    from graphpass import cp

    lens, _ = spec.lengths()
    here = device()
    data = {k: (v.to(here, torch.float32 if v.is_floating_point() else v.dtype) if isinstance(v, torch.Tensor) else v)
            for k, v in spec.rollout().items()}
    layout = getattr(cp.Layout, kind)(dist.group.WORLD, lens)
    response_index = torch.where(data["response"], data["response"].long().cumsum(0) - 1, -1)
    local_logp = layout.shard(data["logp"])
    out = {}
    for name in LOSSES:
        loss = cp_losses.loss_by_name(name)
        results = {}
        for method in METHODS:
            torch._dynamo.reset()
            backend = graphpass.Backend(inner=spec.compiler)
            if method == "slime":
                fn = functools.partial(slime_style, loss, layout, response_index)
            else:
                fn = functools.partial(unsharded, loss, layout)
                if method == "graphpass":
                    fn = torch.compile(fn, backend=backend)
            times, log = [], None
            for step in range(spec.warmup + spec.steps):
                x = local_logp.clone().requires_grad_()
                dist.barrier()
                synchronize()
                t0 = time.perf_counter()
                with collectives() as issued:
                    value = fn(x, *(data[k] for k in ARGS))
                    (value[0] if isinstance(value, tuple) else value).backward()
                synchronize()
                elapsed = time.perf_counter() - t0
                if step >= spec.warmup:
                    times.append(elapsed)
                log = issued
            value = value[0] if isinstance(value, tuple) else value
            results[method] = dict(
                times=times, bytes=sum(_contributed(e) for e in log), collectives=[e[0] for e in log],
                loss=float(value.detach()), grad=x.grad.clone(),
                cp=[dict(rewritten=c.rewritten, reason=c.reason, reductions=c.reductions,
                         collectives=[dataclasses.asdict(k) for k in c.collectives])
                    for r in backend.records for c in r.cp])
        # slime's all-reduce backward sums the gradient over the ranks, which all compute the same
        # loss: its local gradient is cp x the loss's (slime scales it elsewhere); compared / cp.
        results["slime"]["grad"] /= world
        reference = results["unshard"]
        for r in results.values():
            r["loss_diff"] = abs(r["loss"] - reference["loss"]) / max(1e-30, abs(reference["loss"]))
            r["grad_diff"] = float((r["grad"] - reference["grad"]).abs().max()) / max(
                1e-30, float(reference["grad"].abs().max()))
        for r in results.values():
            del r["grad"]
        out[name] = results
    return dict(rank=rank, T=sum(lens), T_local=layout.local_row_count, results=out, load=os.getloadavg()[0])


# ---- the grid -------------------------------------------------------------------------------------
def run(spec: CpSpec, kinds=LAYOUTS, cps=RUN_CP) -> list[dict]:
    from bench.harness.ranks import backend_for, run_ranks
    from graphpass import cp

    lens, _ = spec.lengths()
    total_responses = int(spec.rollout()["response"].sum())  # R: the rows that predict a response token
    rows = []
    for kind in kinds:
        reduced_bytes = {}
        for world in cps:
            per_rank = run_ranks(_rank, world, args=(spec, kind), timeout_s=1500, backend=backend_for(spec.device))
            for name in LOSSES:
                for method in METHODS:
                    rs = [r["results"][name][method] for r in per_rank]
                    step_times = [max(t) for t in zip(*(r["times"] for r in rs))]
                    row = dict(loss=name, layout=kind, cp=world, method=method, measured=True,
                               bytes_per_rank=max(r["bytes"] for r in rs), collectives=rs[0]["collectives"],
                               same_on_every_rank=all(r["collectives"] == rs[0]["collectives"] for r in rs),
                               step_ms=1e3 * statistics.median(step_times), loss_diff=max(r["loss_diff"] for r in rs),
                               grad_diff=max(r["grad_diff"] for r in rs), cp_records=rs[0]["cp"],
                               T=per_rank[0]["T"], T_local=per_rank[0]["T_local"], R=total_responses,
                               load_avg_max=max(r["load"] for r in per_rank))
                    rows.append(row)
                    if method == "graphpass":
                        reduced_bytes[name] = row
        for world in COUNTED_CP:
            t_local = cp.rows_per_rank(kind, lens, world)
            for name in LOSSES:
                measured = reduced_bytes[name]
                rewritten = bool(measured["cp_records"]) and measured["cp_records"][0]["rewritten"]
                counted = dict(slime=2 * 4 * total_responses, unshard=4 * t_local,
                               graphpass=measured["bytes_per_rank"] if rewritten else 4 * t_local)
                for method in METHODS:
                    rows.append(dict(loss=name, layout=kind, cp=world, method=method, measured=False,
                                     bytes_per_rank=counted[method], T=measured["T"], T_local=t_local,
                                     R=total_responses, cp_records=measured["cp_records"] if method == "graphpass" else []))
    return rows


def _row(rows, **key):
    return next(r for r in rows if all(r[k] == v for k, v in key.items()))


def table(rows: list[dict]) -> str:
    from tabulate import tabulate

    lines = []
    for r in rows:
        if r["method"] != "graphpass":
            continue
        key = dict(loss=r["loss"], layout=r["layout"], cp=r["cp"])
        slime, unshard = _row(rows, method="slime", **key), _row(rows, method="unshard", **key)
        record = r["cp_records"][0] if r["cp_records"] else None
        what = ("reduced (" + ", ".join(record["reductions"]) + ")") if record and record["rewritten"] else "unshard kept"
        times = [f"{x['step_ms']:.1f}" if x.get("measured") else "counted" for x in (slime, unshard, r)]
        lines.append([r["loss"], r["layout"], r["cp"], f"{slime['bytes_per_rank']:,}", f"{unshard['bytes_per_rank']:,}",
                      f"{r['bytes_per_rank']:,}", f"{r['bytes_per_rank'] / slime['bytes_per_rank']:.2g}", what, *times,
                      f"{r['grad_diff']:.1e}" if r.get("measured") else "-"])
    return tabulate(lines, headers=["loss", "layout", "cp", "slime B/rank", "unshard B/rank", "graphpass B/rank",
                                    "graphpass / slime", "graphpass did", "slime ms", "unshard ms", "graphpass ms",
                                    "grad diff"], tablefmt="simple")


def acceptance(rows: list[dict]) -> list[dict]:
    """graphpass's bytes per rank against slime's: <= 1/8 where the loss reduces to sums, <= 1/2
    where the unshard stays; the same collectives on every rank where measured."""
    out = []
    for r in rows:
        if r["method"] != "graphpass":
            continue
        slime = _row(rows, method="slime", loss=r["loss"], layout=r["layout"], cp=r["cp"])
        rewritten = bool(r["cp_records"]) and r["cp_records"][0]["rewritten"]
        limit = MAX_BYTES_RATIO_REDUCED if rewritten else MAX_BYTES_RATIO_UNSHARD
        ratio = r["bytes_per_rank"] / slime["bytes_per_rank"]
        passed = ratio <= limit and r.get("same_on_every_rank", True) and r.get("grad_diff", 0.0) <= 1e-5
        out.append(dict(loss=r["loss"], layout=r["layout"], cp=r["cp"], ratio=ratio, limit=limit, passed=passed,
                        line=f"{'PASS' if passed else 'FAIL'} {r['loss']} {r['layout']} cp={r['cp']}"
                             f"{'' if r.get('measured') else ' (counted)'}: graphpass {ratio:.2g} x slime's bytes "
                             f"per rank (limit {limit:.3f}, {'reduced' if rewritten else 'unshard kept'})"))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="8 short sequences, aot_eager, cp = 2 only")
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: gloo ranks; cuda: NCCL ranks, one GPU each")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results")
    args = parser.parse_args(argv)
    spec = dataclasses.replace(QUICK if args.quick else CpSpec(), device=args.device)
    cps = (2,) if args.quick else RUN_CP
    if args.device == "cuda":
        skipped = [c for c in cps if c > torch.cuda.device_count()]
        cps = tuple(c for c in cps if c not in skipped)
        if skipped:
            print(f"bench.cp: cp = {', '.join(map(str, skipped))} skipped: {torch.cuda.device_count()} GPU(s) here")
        if not cps:
            return 2
    lens, prompts = spec.lengths()
    print(f"bench.cp: {len(lens)} sequences, T={sum(lens)} tokens, {sum(lens) - sum(prompts)} response tokens; "
          f"layouts {', '.join(args.layouts)}; cp {', '.join(map(str, cps))} run, "
          f"{', '.join(map(str, COUNTED_CP))} counted; {machine_description()}", flush=True)
    before = provenance()
    started = time.monotonic()
    rows = run(spec, args.layouts, cps)
    print()
    print(table(rows))
    loads = [r["load_avg_max"] for r in rows if "load_avg_max" in r]
    print(f"\n1-minute load average during the runs: up to {max(loads):.1f} on {os.cpu_count()} cores")
    accepted = acceptance(rows)
    print()
    for entry in accepted:
        print(entry["line"])
    print(f"acceptance: {'PASS' if all(e['passed'] for e in accepted) else 'FAIL'} "
          f"({sum(e['passed'] for e in accepted)}/{len(accepted)})")
    after = provenance()
    before["changed_during_run"] = after != before
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(machine=machine_description(), **before, spec=dataclasses.asdict(spec),
                                        quick=args.quick, wall_s=time.monotonic() - started, results=rows,
                                        acceptance=accepted), indent=1, default=str) + "\n")
    print(f"\nwrote {args.out} ({time.monotonic() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
