"""The loss code of real LLM RL libraries (tests/corpus/) under graphpass.

For every case and logits dtype the library supports, one compile (graphpass, aot_eager inner,
chunks of 5 rows) shared by two tests:
- `test_parity`: every output and the gradient of every input that requires grad match eager
  (fp32: tight; bf16: the error against a float64 run at most twice eager's plus a small atol);
  a missing gradient fails. bf16 runs beyond DEFAULT_BF16 are marked slow.
- `test_coverage`: no graph ran unchanged, the sites rewritten are one of the acceptable answers,
  outputs that cannot reach the loss dropped their gradient (those that reach it kept it), and the
  temperature is read as written.
- `test_explain_decides_as_the_backend`: `graphpass.explain` / `graphpass inspect` (on fakes) make
  the backend's decision for every graph (`pipeline.decide`: rewrite, memory veto, lint).
`python -m tests.corpus` prints the same results as a table. Inductor parity for a few cases is slow.
"""

from __future__ import annotations

import pytest

from tests.corpus import BY_NAME, CASES, DTYPES
from tests.corpus._harness import CHUNK_SIZE, INNER, run_case
from graphpass.config import Config
from tests.helpers import decisions, explained_records

pytestmark = pytest.mark.heavy  # a minute or more: xdist starts it early (tests/conftest.py)

LIBRARIES = {"verl", "OpenRLHF", "trl", "SkyRL", "open-instruct", "torchtune", "slime", "NeMo-RL", "AReaL",
             "ROLL", "prime-rl"}

# Every case at fp32 by default; bf16 (about as long again) for the cases whose bf16 path differs
# (per-row loops, buffers in the logits' dtype, upcasts); the rest of bf16 with --runslow.
DEFAULT_BF16 = {"verl_padded_actor_ppo", "skyrl_gspo_entropy_grad_kl", "openrlhf_actor_ppo_kl"}

PARAMS = [pytest.param(c.name, d, id=f"{c.name}-{d}",
                       marks=[] if d == "fp32" or c.name in DEFAULT_BF16 else [pytest.mark.slow])
          for c in CASES for d in c.dtypes]


def _problems(r, problems) -> str:
    return "\n".join(([r.error] if r.error else []) + problems)


@pytest.mark.parametrize("name,dtype", PARAMS)
def test_parity(name, dtype):
    r = run_case(name, dtype)
    assert r.parity_ok, _problems(r, r.parity_problems)


@pytest.mark.parametrize("name,dtype", PARAMS)
def test_coverage(name, dtype):
    """The library cases are the recipes of docs/frameworks/slime.md and docs/frameworks/openrlhf.md (compile the
    library's loss function with graphpass): each case's sites are one of the acceptable answers."""
    r = run_case(name, dtype)
    assert r.coverage_ok, _problems(r, r.coverage_problems)


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_explain_decides_as_the_backend(name):
    case, dtype = BY_NAME[name], BY_NAME[name].dtypes[0]
    r = run_case(name, dtype)  # test_parity's run where it ran in this process
    assert r.error is None, r.error
    explained = explained_records(case.fn, (), case.make_inputs(DTYPES[dtype]), Config(chunk_size=CHUNK_SIZE, inner=INNER))
    assert decisions(explained) == decisions(r.records)


INDUCTOR = ["verl_padded_actor_ppo", "torchtune_grpo_batched_logprobs", "nemo_rl_top_k_function_and_unfiltered_kl",
            "slime_fused_function_chunked"]


@pytest.mark.slow
@pytest.mark.parametrize("name", INDUCTOR)
def test_parity_inductor(name):
    """The same parity with inductor as the inner compiler (chunk loops, buffers, a Function)."""
    r = run_case(name, "fp32", inner="inductor")
    assert r.parity_ok, _problems(r, r.parity_problems)


def test_corpus_is_complete():
    assert len(CASES) >= 25
    by_library: dict[str, int] = {}
    for c in CASES:
        by_library[c.library] = by_library.get(c.library, 0) + 1
        assert c.source and "/" in c.source, f"{c.name}: name the library file it restates"
        assert c.dtypes and set(c.dtypes) <= {"fp32", "bf16"}
        for d in c.dtypes:
            assert c.acceptable(d), f"{c.name}: no acceptable answer for {d}"
    assert set(by_library) == LIBRARIES
    assert all(n >= 2 for n in by_library.values()), by_library
    assert sum("bf16" in c.dtypes for c in CASES) >= 15
