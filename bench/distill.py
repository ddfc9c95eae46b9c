"""On-policy distillation: a student's and a teacher's lm_heads in one compiled loss.

    python -m bench.distill                        # T=2048 H=512 V=32768, fp32 and bf16
    python -m bench.distill --quick --out /tmp/x   # one tiny configuration (tests)

The loss computes both models' logits from their hidden states, `hidden @ W.T`, the teacher's
under no_grad, and compares the full next-token distributions at temperature 2: `fkl`, the
token-mean forward KL(teacher || student); `jsd`, TRL GKD's generalised Jensen-Shannon divergence
(beta 0.5, its mixture a logsumexp over the stacked pair). The floor is the bytes of the
gradients backward must produce, the student's `hidden.grad + W.grad`. Each (loss, dtype,
method) runs in its own forked process (`bench.harness.isolate.run_isolated`): peak bytes above the
pre-step baseline, median step time, and the loss and both student gradients against float64 on
the same (rounded) inputs (`|rel|`: max abs difference over the reference's max abs value).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
from pathlib import Path

from bench.harness.isolate import run_isolated
from bench.harness.machine_info import default_device, machine_description
from bench.harness.meters import timed_steps
from bench.harness.spec import torch_dtype

RESULTS = Path(__file__).parent / "results"
LOSSES = ("fkl", "jsd")
METHODS = ("eager", "inductor", "graphpass")
TEMPERATURE, BETA = 2.0, 0.5
ACCEPTANCE_RATIO = 1.5
DTYPE_BYTES = {"fp32": 4, "bf16": 2}


@dataclasses.dataclass(frozen=True)
class DistillSpec:
    """One worker's configuration."""

    loss: str
    method: str
    T: int
    H: int
    V: int
    dtype: str
    device: str = "cpu"
    steps: int = 3
    seed: int = 0

    @property
    def floor_bytes(self) -> int:
        return (self.T + self.V) * self.H * DTYPE_BYTES[self.dtype]


def _logits(hidden, weight):
    import torch.nn.functional as F

    return F.linear(hidden, weight).float() / TEMPERATURE


def fkl(hidden, weight, teacher_hidden, teacher_weight, mask):
    import torch

    student = torch.log_softmax(_logits(hidden, weight), -1)
    with torch.no_grad():
        teacher = torch.log_softmax(_logits(teacher_hidden, teacher_weight), -1)
    kl = (teacher.exp() * (teacher - student)).sum(-1)
    return (kl * mask).sum() / mask.sum() * TEMPERATURE ** 2


def jsd(hidden, weight, teacher_hidden, teacher_weight, mask):
    import torch
    import torch.nn.functional as F

    student = torch.log_softmax(_logits(hidden, weight), -1)
    with torch.no_grad():
        teacher = torch.log_softmax(_logits(teacher_hidden, teacher_weight), -1)
    log_half = torch.log(torch.tensor(BETA, device=student.device))
    mixture = torch.logsumexp(torch.stack([student + log_half, teacher + log_half]), dim=0)
    divergence = BETA * F.kl_div(mixture, teacher, reduction="none", log_target=True) + \
        (1 - BETA) * F.kl_div(mixture, student, reduction="none", log_target=True)
    return (divergence.sum(-1) * mask).sum() / mask.sum()


LOSS_FNS = {"fkl": fkl, "jsd": jsd}


def make_inputs(spec: DistillSpec) -> list:
    import torch

    dtype, device = torch_dtype(spec.dtype), spec.device
    gen = torch.Generator(device=device).manual_seed(spec.seed)

    def normal(*shape, std=1.0):
        return torch.empty(*shape, dtype=dtype, device=device).normal_(std=std, generator=gen)

    hidden, weight = normal(spec.T, spec.H).requires_grad_(), normal(spec.V, spec.H, std=spec.H ** -0.5).requires_grad_()
    teacher_hidden, teacher_weight = normal(spec.T, spec.H), normal(spec.V, spec.H, std=1.5 * spec.H ** -0.5)
    mask = (torch.rand(spec.T, generator=gen, device=device) < 0.9).float()
    return [hidden, weight, teacher_hidden, teacher_weight, mask]


def _relative(ours, ref) -> float:
    return float((ours.double() - ref).abs().max()) / (float(ref.abs().max()) or 1.0)


def measure(spec: DistillSpec) -> dict:
    """The worker: peak, time and float64 parity of one method."""
    import torch

    fn = LOSS_FNS[spec.loss]
    notes = dict
    if spec.method == "inductor":
        fn = torch.compile(fn)
    elif spec.method == "graphpass":
        import graphpass

        backend = graphpass.Backend()
        fn = torch.compile(fn, backend=backend)

        def notes():
            sites = [s for r in backend.records for s in r.sites]
            return dict(sites=len(sites), lm_head_sites=sum(s.lm_head for s in sites),
                        wide_inputs=[s.wide_inputs for s in sites],
                        rejected=[c.reason for r in backend.records for c in r.rejected][:4],
                        fallback=[r.fallback_reason for r in backend.records if r.fallback_reason])
    inputs = make_inputs(spec)
    hidden, weight = inputs[:2]
    loss = None

    def clear():
        nonlocal loss
        hidden.grad = weight.grad = loss = None

    def step():
        nonlocal loss
        clear()
        loss = fn(*inputs)
        loss.backward()

    first_s, times, peaks = timed_steps(step, clear, spec.device, spec.steps)
    exact = [t.detach().double().requires_grad_(t.requires_grad) for t in inputs]
    ref = LOSS_FNS[spec.loss](*exact)
    ref.backward()
    parity = dict(loss_rel=abs(float(loss) - float(ref)) / abs(float(ref)),
                  hidden_grad_rel=_relative(hidden.grad, exact[0].grad),
                  weight_grad_rel=_relative(weight.grad, exact[1].grad))
    return dict(status="ok", peak_bytes=max(peaks), ratio=max(peaks) / spec.floor_bytes,
                time_s=statistics.median(times), first_call_s=first_s, parity=max(parity.values()), **parity,
                load_avg_1m=os.getloadavg()[0], notes=notes())


def run(args) -> list[dict]:
    results = []
    for dtype in args.dtypes:
        for loss in args.losses:
            for method in args.methods:
                spec = DistillSpec(loss, method, args.T, args.H, args.V, dtype, args.device, args.steps)
                result = run_isolated(spec, args.timeout_s, measure_fn=measure)
                results.append(result)
                print(_row(result), flush=True)
    return results


def _row(r: dict) -> str:
    head = f"{r['loss']:<4} {r['dtype']:<5} {r['method']:<10}"
    if r.get("status") != "ok":
        return f"{head} {r.get('status')}: {r.get('note', '')}"
    return (f"{head} x floor {r['ratio']:6.2f}  step {r['time_s'] * 1e3:8.1f} ms  |rel| {r['parity']:.1e}  "
            f"load {r['load_avg_1m']:.1f}  {r['notes'] or ''}")


def acceptance(results: list[dict]) -> list[str]:
    """One line per (loss, dtype): graphpass's ratio against 1.5 x floor, and its time and peak
    against inductor's of the same run."""
    lines = []
    for r in results:
        if r["method"] != "graphpass" or r.get("status") != "ok":
            continue
        ind = next((o for o in results if o["method"] == "inductor" and o["loss"] == r["loss"]
                    and o["dtype"] == r["dtype"] and o.get("status") == "ok"), None)
        vs = f", {r['time_s'] / ind['time_s']:.2f} x inductor's time, inductor {ind['ratio']:.2f} x floor" if ind else ""
        verdict = "PASS" if r["ratio"] <= ACCEPTANCE_RATIO else "FAIL"
        lines.append(f"{verdict} {r['loss']} {r['dtype']}: graphpass {r['ratio']:.2f} x floor "
                     f"(<= {ACCEPTANCE_RATIO}){vs}, |rel| {r['parity']:.1e}")
    return lines


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.distill", description=__doc__.split("\n\n")[0])
    p.add_argument("--T", type=int, default=2048)
    p.add_argument("--H", type=int, default=512)
    p.add_argument("--V", type=int, default=32768)
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=sorted(DTYPE_BYTES))
    p.add_argument("--losses", nargs="+", default=list(LOSSES), choices=LOSSES)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--device", default=default_device())
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--timeout-s", type=float, default=900)
    p.add_argument("--quick", action="store_true", help="T=64 H=16 V=256, fp32, one step")
    p.add_argument("--out", type=Path, default=RESULTS, help="directory for distill.json")
    args = p.parse_args(argv)
    if args.quick:
        args.T, args.H, args.V, args.dtypes, args.steps = 64, 16, 256, ["fp32"], 1
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    print(f"# {machine_description()}", flush=True)
    results = run(args)
    lines = acceptance(results)
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "distill.json").write_text(json.dumps(dict(results=results, acceptance=lines), indent=1, default=str))
    return 0 if all(r.get("status") == "ok" for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
