"""The ``subdivided`` bench (benchmarks/subdivided.py) at a tiny size: every schedule agrees
with naive micro-batch 1, the rows carry their plans and ratios, the planned row's plan is the
planner's under naive micro-batch 1's peak and fits it, and the written results."""

import json
import os
import sys
from dataclasses import replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `pytest` without `python -m`: the repo root holds benchmarks/
    sys.path.insert(0, ROOT)

from benchmarks import subdivided  # noqa: E402
from benchmarks.run import HEADLINE  # noqa: E402

TINY = replace(HEADLINE[0], name="A", group_size=4, prompt_length=24, response_length=6,
               wave_size=2, hidden=32, heads=2, num_loops=2)


def test_main_writes_rows_at_both_settings(tmp_path, monkeypatch):
    """One run of the bench's ``main`` (both settings): its written rows, then its tables."""
    monkeypatch.setattr(subdivided, "HEADLINE", (TINY,))
    assert subdivided.main(["--out", str(tmp_path), "--reps", "1"]) == 0
    data = json.loads((tmp_path / "subdivided.json").read_text())
    assert set(data["results"]["A"]) == set(subdivided.SETTINGS)
    for setting, r in data["results"]["A"].items():
        rows = r["rows"]
        names = list(subdivided.plans(TINY))
        assert list(rows) == (names if r["planned_refused"] is None else names[:-1])
        assert rows["naive_mb1"]["adjoint_bytes"] == 0
        assert rows["naive_mb1"]["peak_over_naive_mb1"] == 1.0
        assert r["budget_bytes"] == rows["naive_mb1"]["saved_bytes"]
        for name, row in rows.items():
            assert row["max_grad_error"] <= 1e-5, (setting, name, row)
            if name != "naive_mb1":
                assert row["adjoint_bytes"] > 0 and row["predicted_saved_bytes"] > 0
        assert rows["joint W1, 8 segments"]["plan"]["prompt_segments"] == 8
        # a state of layer inputs: half the adjoints of K/V (MHA), besides the boundary's
        inputs, kv = (rows[f"joint W1, 8 segments{k}"]["adjoint_bytes"] for k in (", inputs", ""))
        assert inputs < kv < 2 * inputs + 1, (inputs, kv)
        # four segments hold less than the whole prompt at the same wave size
        assert (rows["joint W2, 4 segments"]["saved_bytes"]
                < rows["joint W2"]["saved_bytes"]), rows
        if r["planned_refused"] is None:
            assert rows["planned"]["peak_bytes"] <= r["budget_bytes"], (setting, rows)
        else:
            assert "no joint-replay plan fits" in r["planned_refused"]
    table = (tmp_path / "subdivided.md").read_text()
    assert table.count("| A |") == len(subdivided.SETTINGS) * len(subdivided.plans(TINY))
    assert "| A | none | planned |" in table
