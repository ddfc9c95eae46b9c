"""Render benchmark results: a tabulate table, a JSON file, PNG plots."""

from __future__ import annotations

import json
from pathlib import Path

from tabulate import tabulate

MiB = 2**20


def _mib(n) -> str:
    return "" if n is None else f"{n / MiB:,.0f}"


def _sci(x) -> str:
    return "" if x is None else f"{x:.1e}"


def _time_vs_inductor(r: dict, results: list[dict]) -> str:
    """This method's median time over inductor's on the same configuration."""
    if r.get("status") != "ok":
        return ""
    for other in results:
        if (other["method"] == "inductor" and other.get("status") == "ok"
                and all(other[k] == r[k] for k in ("workload", "T", "V", "dtype", "device"))):
            return f"{r['time_s'] / other['time_s']:.2f}"
    return ""


def _first_call(r: dict) -> str:
    """First-call seconds; "(cached)" when the compile caches answered and nothing compiled; after
    `--cold-compile`, the cold first call and a new process's from the cache it filled."""
    if r.get("warm_first_call_s") is not None:
        return f"{r['first_call_s']:.1f} cold, {r['warm_first_call_s']:.1f} warm"
    notes = r.get("notes") or {}
    cached = notes.get("compile_cache_hits", 0) > 0 and notes.get("compile_cache_misses", 0) == 0
    return f"{r['first_call_s']:.1f}" + (" (cached)" if cached else "")


def _status(r: dict) -> str:
    """"ok", or the status with its reason (predicted OOM says from what)."""
    status = r.get("status", "?")
    if status == "oom_predicted":
        return f"OOM (predicted: {r['note']})"
    if status == "ok":
        return "ok" + (f" [{r['warning']}]" if r.get("warning") else "")
    return f"{status}: {r.get('note', '').splitlines()[0] if r.get('note') else ''}"


def table(results: list[dict]) -> str:
    """One row per (workload, shape, dtype, method)."""
    headers = ["workload", "T", "V", "dtype", "method", "peak MiB", "x floor", "time ms",
               "/ inductor", "x SoL", "1st call s", "|dloss|", "|dgrad|", "status"]
    rows = []
    for r in results:
        ok = r.get("status") == "ok"
        peak = r.get("peak_bytes") if ok else r.get("predicted_peak_bytes")
        rows.append([
            r["workload"], r["T"], r["V"], r["dtype"], r["method"],
            _mib(peak) + ("" if ok or peak is None else " *"),
            "" if peak is None else f"{peak / r['floor_bytes']:.2f}",
            f"{r['time_s'] * 1e3:,.0f}" if ok else "",
            _time_vs_inductor(r, results),
            f"{r['x_sol']:.2f}" if ok and r.get("x_sol") else "",
            _first_call(r) if ok else "",
            _sci(r.get("loss_diff")), _sci(r.get("grad_diff")),
            _status(r),
        ])
    return tabulate(rows, headers=headers, disable_numparse=True, colalign=("left",) * 5 + ("right",) * 8 + ("left",))


def write_json(path: Path, machine: str, results: list[dict], **meta) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(machine=machine, **meta, results=results), indent=1) + "\n")


def plots(results: list[dict], workload: str, out_dir: Path, methods: list[str], prefix: str = "") -> list[Path] | str:
    """memory.png and time.png versus T: one panel per (V, dtype); a string says why none were made."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib): plots skipped"
    rows = [r for r in results if r["workload"] == workload]
    Vs = sorted({r["V"] for r in rows})
    dtypes = [d for d in ("fp32", "bf16") if any(r["dtype"] == d for r in rows)]
    if not rows:
        return f"no results for {workload}: plots skipped"
    colors = {m: f"C{i}" for i, m in enumerate(methods)}
    written = []
    for what, ylabel in (("memory", "peak above baseline (GiB)"), ("time", "fwd+bwd median time (s)")):
        fig, axes = plt.subplots(len(Vs), len(dtypes), figsize=(5.5 * len(dtypes), 4 * len(Vs)), squeeze=False)
        for (i, V), (j, dtype) in ((a, b) for a in enumerate(Vs) for b in enumerate(dtypes)):
            ax = axes[i][j]
            panel = [r for r in rows if r["V"] == V and r["dtype"] == dtype]
            for m in methods:
                pts = sorted((r for r in panel if r["method"] == m), key=lambda r: r["T"])
                ok = [r for r in pts if r.get("status") == "ok"]
                y = (lambda r: r["peak_bytes"] / 2**30) if what == "memory" else (lambda r: r["time_s"])
                ax.plot([r["T"] for r in ok], [y(r) for r in ok], "o-", color=colors[m], label=m)
                if what == "memory":
                    oom = [r for r in pts if r.get("status") == "oom_predicted"]
                    ax.plot([r["T"] for r in oom], [r["predicted_peak_bytes"] / 2**30 for r in oom],
                            "x", color=colors[m], markersize=9)
            if what == "memory":
                Ts = sorted({r["T"] for r in panel})
                floors = [T * V * (4 if dtype == "fp32" else 2) / 2**30 for T in Ts]
                ax.plot(Ts, floors, "k--", marker="_", markersize=12, linewidth=1, label="floor (logits.grad)")
            ax.set(xscale="log", yscale="log", xlabel="T (tokens)", ylabel=ylabel, title=f"V={V}, {dtype} logits")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        title = f"{workload}: {'peak memory' if what == 'memory' else 'time'} vs T"
        if what == "memory":
            title += "   (x = OOM predicted, not run)"
        fig.suptitle(title)
        fig.tight_layout()
        path = out_dir / f"{prefix}{what}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written
