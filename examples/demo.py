"""Demo: compile a PPO loss with graphpass, check it against eager, print the savings table.

    python examples/demo.py [--T 2048] [--V 32768] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ppo_loss import example_inputs, ppo_loss  # noqa: E402

import graphpass  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--T", type=int, default=2048)
    parser.add_argument("--V", type=int, default=32768)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)

    backend = graphpass.Backend(report=True)
    compiled = torch.compile(ppo_loss, backend=backend)
    logits, *rest = example_inputs(args.T, args.V, dtype)
    start = time.perf_counter()
    loss = compiled(logits, *rest)  # compiling prints the table
    loss.backward()
    print(f"first call (compile + step): {time.perf_counter() - start:.1f} s")

    reference = logits.detach().clone().requires_grad_()
    expected = ppo_loss(reference, *rest)
    expected.backward()
    grad_diff = (logits.grad.float() - reference.grad.float()).abs().max().item()
    print(f"loss {loss.item():.6f} (eager {expected.item():.6f}); max |grad - eager grad| = {grad_diff:.2e}")
    site = backend.records[0].sites[0]
    grads = ", ".join(f"{o.kind} grad {'kept' if o.keeps_grad else 'dropped'}" for o in site.outputs)
    print(f"rewrote {site.kind} at {site.source}: {grads}")


if __name__ == "__main__":
    main()
