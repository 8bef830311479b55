"""The host-sync and decode benchmark (benchmarks/decode.py) on a tiny setting: the counts
are in its result (0 per decoded token, a training step's count the same at 2 and 8 waves),
the project's greedy tokens equal transformers' on the same weights, and it merges into
cpu.json under ``host_syncs``."""

import json

import pytest

pytest.importorskip("transformers")

from benchmarks import decode  # noqa: E402


def test_decode_bench_reports_counts_and_peer(mcore_single, monkeypatch, tmp_path):
    monkeypatch.setattr(decode, "RESPONSE", 4)
    monkeypatch.setattr(decode, "REPEATS", 1)
    monkeypatch.setattr(decode, "PROMPT", 8)
    monkeypatch.setattr(decode, "SHAPES", {
        "small": dict(n_prompts=2, group=2, prompt=8, response=4),
        "rl": dict(n_prompts=1, group=3, prompt=12, response=3)})
    result = decode.run_decode_bench()
    assert result["decode_per_token"] == {"per_row": 0.0, "prompt_once": 0.0,
                                          "prompt_once_shared": 0.0}
    assert result["train_step"]["2"] == result["train_step"]["8"]
    assert result["greedy_equals_transformers"] is True
    assert set(result["tokens_per_s"]) == {"small", "rl"}
    for shape in ("small", "rl"):
        for mode in ("per_row", "prompt_once", "prompt_once_shared"):
            speeds = result["tokens_per_s"][shape][mode]
            assert set(speeds) == {"project_static", "project_sliced", "transformers"}
            assert all(v > 0 for v in speeds.values())
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"A": {"x": 1}}))
    decode.merge_into(str(path), result)
    assert set(json.loads(path.read_text())) == {"A", "host_syncs"}


def test_cpu_times_across_processes_summarized_by_median():
    runs = [{"small": {"transformers": t, "per_row": r, "prompt_once": o}}
            for t, r, o in ((60.0, 50.0, 90.0), (80.0, 100.0, 70.0), (70.0, 70.0, 140.0))]
    out = decode.summarize_cpu_times(runs)
    assert out["small"]["transformers"] == {"median": 70.0, "min": 60.0, "max": 80.0}
    assert out["small"]["per_row"] == {"median": 70.0, "min": 50.0, "max": 100.0}
    assert out["small"]["prompt_once"]["median"] == 90.0
    assert out["speed_vs_transformers"] == {"small": {"per_row": 1.0, "prompt_once": 0.778}}
