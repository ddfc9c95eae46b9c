"""`python -m tests.corpus [--dtype fp32] [--case NAME ...] [-v]`: the corpus table.

One row per case and dtype: parity with eager (the worst relative error of a gradient), the sites
expected (the ideal answer) and found, and the totals.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import tabulate

from . import BY_NAME, CASES
from ._harness import run_case, sites_rewritten


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.corpus", description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", action="append", choices=("fp32", "bf16"),
                        help="only these dtypes (default: every dtype a case supports)")
    parser.add_argument("--case", action="append", help="only these cases (by name)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every problem of every case")
    args = parser.parse_args(argv)
    logging.getLogger("graphpass").setLevel(logging.ERROR)

    cases = [BY_NAME[n] for n in args.case] if args.case else CASES
    rows, failures = [], []
    n_parity = n_full = found_sites = ideal_sites = total = 0
    start = time.perf_counter()
    for case in cases:
        for dtype in case.dtypes:
            if args.dtype and dtype not in args.dtype:
                continue
            r = run_case(case.name, dtype)
            total += 1
            n_parity += r.parity_ok
            n_full += r.coverage_ok
            ideal = case.ideal(dtype)
            ideal_sites += len(ideal)
            found_sites += sites_rewritten(case, r)
            if r.error:
                parity = "ERROR"
            else:
                parity = ("ok" if r.parity_ok else "FAIL") + (f" ({r.max_grad_err:.1e})" if r.n_grads else " (no grad)")
            rows.append([case.name, case.library, dtype, parity, _kinds(ideal), _kinds(r.found),
                         "ok" if r.coverage_ok else "FAIL", f"{r.seconds:.1f}"])
            problems = ([r.error] if r.error else []) + r.parity_problems + r.coverage_problems
            if problems:
                failures.append((f"{case.name} [{dtype}]", problems))
            print(f"  {case.name} [{dtype}] {r.seconds:.1f}s", file=sys.stderr)
    print(tabulate.tabulate(rows, headers=["case", "library", "dtype", "parity (max grad err)",
                                            "sites expected", "sites found", "coverage", "s"]))
    print()
    print(f"{n_parity}/{total} parity, {n_full}/{total} fully rewritten, "
          f"sites rewritten {found_sites}/{ideal_sites}  ({time.perf_counter() - start:.0f} s)")
    if failures:
        print("\nfailing:")
        for what, problems in failures:
            shown = problems if args.verbose else problems[:2]
            print(f"  {what}: " + "; ".join(p.splitlines()[0] for p in shown)
                  + (f" (+{len(problems) - 2} more)" if len(problems) > len(shown) else ""))
    return 0


def _kinds(kinds) -> str:
    if not kinds:
        return "-"
    out, i = [], 0
    while i < len(kinds):  # run-length: "logprob x4"
        j = i
        while j < len(kinds) and kinds[j] == kinds[i]:
            j += 1
        out.append(kinds[i] + (f" x{j - i}" if j - i > 1 else ""))
        i = j
    return ", ".join(out)


if __name__ == "__main__":
    sys.exit(main())
