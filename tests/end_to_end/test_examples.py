"""The README's demo runs: it compiles the example PPO loss, matches eager and reports the rewrite."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_demo_runs_and_reports_the_rewrite():
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "demo.py"), "--T", "256", "--V", "4096"],
                          capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "rewrote logprob+entropy" in done.stdout and "entropy grad dropped" in done.stdout
