"""The examples run as documented."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_joint_replay_step_example_runs():
    out = subprocess.run([sys.executable, "examples/joint_replay_step.py"], cwd=ROOT,
                         capture_output=True, text=True, timeout=500)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[-1].startswith("optimizer step ok=True"), out.stdout
    assert sum("in 3 waves" in line for line in lines) == 2
