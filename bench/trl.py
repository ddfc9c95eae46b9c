"""TRL 1.16's default GRPO log-prob path: TRL's own fused head against graphpass, peak and gradients.

    python -m bench.trl                 # 8 x 256 completion tokens, H=256, V=32768, fp32 (a few minutes)
    python -m bench.trl --quick --out /tmp/x

The measured step is `GRPOTrainer._get_per_token_logps_and_entropies(model, input_ids, ...)` as TRL
runs it in training (`compute_entropy=True`, the model's forward through TRL's fused head,
`ChunkedLogProbFunction`), then a GRPO-style token-mean loss with an entropy bonus and its
backward. The model is a random one-layer Qwen2 (hidden size H, vocabulary V, untied lm_head);
each of the B sequences is a P-token prompt and C completion tokens; fp32 (`bf16=False`:
GRPOConfig's default bf16 autocasts on the CPU too). Methods, each in its own
process: `eager` (TRL as it ships) and `graphpass` (the method compiled with
`backend="graphpass"`, nothing else changed: graphpass's stand-in for TRL's Function lets the
lm_head fusion take the matmul in). Peak = bytes above the step's start (`CpuMeter`); floor =
`hidden.grad + W.grad` of the lm_head, `(B * (P + C - 1) + V) * H * 4`, the rows TRL scores.

Acceptance: an lm_head site, every parameter's gradient within 1e-4 (relative to its largest
entry) of eager TRL's, graphpass's peak <= 0.25 x eager's. JSON to `--out` (bench/results/trl.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

from bench.harness.isolate import run_isolated
from bench.harness.machine_info import GiB, machine_description, provenance
from bench.harness.meters import CpuMeter, timed

METHODS = ("eager", "graphpass")
MAX_PEAK_RATIO = 0.25
MAX_GRAD_REL = 1e-4
TEMPERATURE, ENTROPY_COEF = 0.7, 0.01
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "trl.json"


@dataclasses.dataclass(frozen=True)
class TrlSpec:
    """One method at one shape: B sequences of P prompt and C completion tokens, fp32."""

    method: str
    B: int = 8
    P: int = 16
    C: int = 256
    H: int = 256
    V: int = 32768
    steps: int = 2
    seed: int = 0

    @property
    def floor_bytes(self) -> int:
        return (self.B * (self.P + self.C - 1) + self.V) * self.H * 4


# ---- a GRPO trainer on CPU from nothing but a config (also tests/integrations/test_trl.py) ----------
def char_tokenizer():
    """A character-level tokenizer built in memory (no hub download): <pad>, <eos>, a-z and space."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate("abcdefghijklmnopqrstuvwxyz ")}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>")


def count_a_reward(completions, **kwargs):
    """A Python reward: the completion's letters a, less a tenth of its length."""
    return [completion.count("a") - 0.1 * len(completion) for completion in completions]


def tiny_qwen2(vocab_size: int, hidden_size: int = 32, layers: int = 1):
    """A random Qwen2 causal LM built from a config (untied lm_head)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        pad_token_id=0, eos_token_id=1, bos_token_id=1, tie_word_embeddings=False))


def grpo_trainer(model, tokenizer, output_dir: str, **config):
    """TRL's GRPOTrainer on CPU over an in-memory dataset of equal-length prompts, `count_a_reward`."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    dataset = Dataset.from_dict({"prompt": ["abcd", "hell", "zz a", "cat "] * 4})
    args = GRPOConfig(output_dir=output_dir, use_cpu=True, report_to="none", save_strategy="no",
                      disable_tqdm=True, dataloader_num_workers=0, **config)
    return GRPOTrainer(model=model, reward_funcs=count_a_reward, args=args, train_dataset=dataset,
                       processing_class=tokenizer)


# ---- the worker -----------------------------------------------------------------------------------
def _setup(spec: TrlSpec):
    """The trainer's log-prob method (compiled for graphpass) and one batch, from `spec.seed`."""
    import tempfile

    import torch

    torch.manual_seed(spec.seed)
    model = tiny_qwen2(spec.V, spec.H)
    trainer = grpo_trainer(model, char_tokenizer(), tempfile.mkdtemp(prefix="bench_trl_"),
                           per_device_train_batch_size=spec.B, num_generations=spec.B, temperature=TEMPERATURE,
                           max_completion_length=spec.C, gradient_checkpointing=False, bf16=False)
    g = torch.Generator().manual_seed(spec.seed)
    batch = dict(input_ids=torch.randint(2, spec.V, (spec.B, spec.P + spec.C), generator=g),
                 attention_mask=torch.ones(spec.B, spec.P + spec.C, dtype=torch.long),
                 advantages=torch.randn(spec.B, 1, generator=g))
    return model, trainer, batch


def _step(logps_fn, model, batch, C: int):
    """GRPO's token-mean policy term with an entropy bonus, and its backward; the loss."""
    logps, entropies, _ = logps_fn(model, batch["input_ids"], batch["attention_mask"], C, compute_entropy=True)
    loss = -(batch["advantages"] * (logps - logps.detach()).exp()).mean() - ENTROPY_COEF * entropies.mean()
    loss.backward()
    return loss.detach()


def measure(spec: TrlSpec) -> dict:
    import torch

    import graphpass

    model, trainer, batch = _setup(spec)
    eager_fn = trainer._get_per_token_logps_and_entropies
    backend = graphpass.Backend()  # what backend="graphpass" runs, with its records kept
    fn = eager_fn if spec.method == "eager" else torch.compile(eager_fn, backend=backend)
    meter = CpuMeter()
    loss = None

    def step():
        nonlocal loss
        model.zero_grad(set_to_none=True)
        loss = _step(fn, model, batch, spec.C)

    first_call_s = timed(step, "cpu") if spec.method != "eager" else None
    times, peaks = [], []
    for _ in range(spec.steps):
        model.zero_grad(set_to_none=True)
        loss = None
        meter.reset()
        times.append(timed(step, "cpu"))
        peaks.append(meter.peak())
    result = dict(status="ok", peak_bytes=max(peaks), peaks=peaks, floor_ratio=max(peaks) / spec.floor_bytes,
                  time_s=statistics.median(times), first_call_s=first_call_s or times[0],
                  load_avg_1m=os.getloadavg()[0])
    if spec.method == "eager":
        return result
    result["sites"] = [dict(kind=s.kind, lm_head=s.lm_head, shape=list(s.shape), source=s.source)
                       for r in backend.records for s in r.sites]
    # Against TRL's own head on the same model and batch, in this process (after the peaks).
    grads = {name: p.grad for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    eager_loss = _step(eager_fn, model, batch, spec.C)
    rel = {name: float((grads[name] - p.grad).abs().max() / p.grad.abs().max().clamp(min=1e-30))
           for name, p in model.named_parameters()}
    worst = max(rel, key=rel.get)
    result.update(loss_rel=float(abs(loss - eager_loss) / abs(eager_loss).clamp(min=1e-30)),
                  grad_rel=rel[worst], grad_rel_worst=worst,
                  lm_head_grad_rel=rel["lm_head.weight"])
    return result


# ---- the parent -----------------------------------------------------------------------------------
def acceptance(results: dict[str, dict]) -> list[dict]:
    """The three checks of the module's docstring, each {name, ok, line}."""
    eager, ours = results.get("eager", {}), results.get("graphpass", {})
    if eager.get("status") != "ok" or ours.get("status") != "ok":
        return [dict(name="ran", ok=False, line=f"FAIL ran: eager {eager.get('status')}, graphpass {ours.get('status')}")]
    site = any(s["lm_head"] for s in ours["sites"])
    ratio = ours["peak_bytes"] / eager["peak_bytes"]
    checks = [("lm_head site", site, f"{len(ours['sites'])} site(s): {ours['sites']}"),
              ("gradients", ours["grad_rel"] <= MAX_GRAD_REL,
               f"worst parameter gradient {ours['grad_rel']:.2e} relative ({ours['grad_rel_worst']}), "
               f"lm_head {ours['lm_head_grad_rel']:.2e}, loss {ours['loss_rel']:.2e} (<= {MAX_GRAD_REL:g})"),
              ("peak", ratio <= MAX_PEAK_RATIO,
               f"peak {ours['peak_bytes'] / 2**20:.0f} MiB = {ratio:.3f} x TRL's own head's "
               f"{eager['peak_bytes'] / 2**20:.0f} MiB (<= {MAX_PEAK_RATIO})")]
    return [dict(name=n, ok=bool(ok), line=f"{'ok  ' if ok else 'FAIL'} {n}: {line}") for n, ok, line in checks]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="B=2 P=8 C=32 H=64 V=1024")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the JSON file")
    for name in ("B", "P", "C", "H", "V", "steps"):
        p.add_argument(f"--{name}", type=int, default=getattr(TrlSpec, name))
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per worker before it is killed")
    args = p.parse_args(argv)
    if args.quick:
        args.B, args.P, args.C, args.H, args.V = 2, 8, 32, 64, 1024
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    machine = machine_description()
    print(f"machine: {machine}; load average {os.getloadavg()[0]:.1f}", flush=True)
    t0 = time.time()
    results = {}
    for method in METHODS:
        spec = TrlSpec(method, B=args.B, P=args.P, C=args.C, H=args.H, V=args.V, steps=args.steps)
        results[method] = run_isolated(spec, timeout_s=args.timeout, measure_fn=measure)
        r = results[method]
        print(f"{method:10s} {r['status']:8s} peak {r.get('peak_bytes', 0) / GiB:.3f} GiB "
              f"({r.get('floor_ratio', 0):.1f} x floor) step {r.get('time_s', 0):.2f} s {r.get('note', '')}",
              flush=True)
    checks = acceptance(results)
    for c in checks:
        print(c["line"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(
        machine=machine, provenance=provenance(),
        command=" ".join(["python -m bench.trl", *(argv if argv is not None else sys.argv[1:])]),
        elapsed_s=round(time.time() - t0), acceptance=checks, results=results), indent=1) + "\n")
    print(f"JSON: {args.out}")
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
