"""The ``scale`` bench (benchmarks/scale.py) at a tiny size: the checkpoints' shapes are the
tests' own, a scaled workload keeps its structure, the full-size rows of a tiny checkpoint on
meta (fits / does not fit with its shortfall, the per-GPU total, naive / joint FLOPs), the
predicted peak of a real CPU step within 10% of the probe's, and the written results."""

import json
import os
import sys

import pytest
from helpers.h20 import HUGINN_0125, OURO_1_4B
from helpers.reference_nanbeige import NANBEIGE_42_3B
from helpers.reference_ouro import OURO_CONFIG

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # `pytest` without `python -m`: the repo root holds benchmarks/
    sys.path.insert(0, ROOT)

from benchmarks import scale  # noqa: E402

GIB = 2**30
TINY_OURO = scale.Family("tiny-ouro", "ouro_1.4b_h20.yaml",
                         {**OURO_CONFIG, "vocab_size": 512, "max_position_embeddings": 2048},
                         "ouro_tiny_cpu.yaml")
"""The Ouro H20 config with a tiny Ouro config.json (hidden 32, 2 layers x 4 loops; the
vocabulary and positions the config's task and responses need)."""
ONE = scale.ScaleWorkload("one", 16, 8, 4)
TREE = scale.ScaleWorkload("tree", 12, branches=(2, 2), node_lengths=(5, 4),
                           trained_lengths=(3, 4))


def test_the_shapes_are_the_checkpoints():
    assert scale.OURO_1_4B == OURO_1_4B
    assert scale.HUGINN_0125 == HUGINN_0125
    assert scale.NANBEIGE_42_3B == NANBEIGE_42_3B


def test_workloads_and_their_scaled_copies():
    m1, m2, m3, t = scale.WORKLOADS
    assert (m1.G, m1.S, m2.G, m3.S) == (16, 4096, 8, 2048)
    assert (t.G, t.S, t.prompt_length) == (16, 1280 + 1024, 8192)
    small = t.scaled(128)
    assert (small.G, small.branches, small.prompt_length) == (16, (4, 4), 64)
    assert small.node_lengths == (10, 8) and small.trained_lengths == (8, 8)
    assert m2.scaled(128).prompt_length / m2.scaled(128).S == m2.prompt_length / m2.S
    tree, has_loss, mask = scale.prefix_tree(TREE)
    assert tree.num_nodes == 7 and len(tree.leaf_of_row) == 4 and has_loss[0] is False
    # a row trains its turn-1 node's first 3 tokens and its leaf's 4
    assert mask.sum(1).tolist() == [7.0] * 4


def _entries(monkeypatch, gpu_gib: float) -> dict:
    monkeypatch.setattr(scale, "GPU_GIB", gpu_gib)
    entries = scale.full_size(TINY_OURO, (ONE, TREE), log=lambda *a: None)
    return {e["workload"]["name"]: e for e in entries}


def _check_totals(e: dict) -> None:
    for r in e["rows"]:
        cache = 0 if r["total_bytes"] == e["state_bytes"] + r["peak_bytes"] else e["rollout_cache"]
        assert r["total_bytes"] == e["state_bytes"] + max(r["peak_bytes"], cache), r
        assert r["fits"] == (r["plan"] != "none fits" and r["total_bytes"] <= e["gpu_bytes"]), r
        assert r["shortfall_bytes"] == max(r["total_bytes"] - e["gpu_bytes"], 0), r


def test_full_size_rows_fit_a_large_gpu(monkeypatch):
    """90 GiB: every row fits, joint replay takes one wave of G with the prompt retained, and
    naive / joint FLOPs is the two plans' counts' ratio (above 1: the prompt once)."""
    entries = _entries(monkeypatch, 90.0)
    for name, e in entries.items():
        _check_totals(e)
        assert all(r["fits"] for r in e["rows"]), name
        joint = e["rows"][2]
        assert e["joint_best"]["plan"] == joint["plan"]
        assert e["joint_best"]["schedule"] == "joint replay"
        assert e["naive_over_joint_flops"] == pytest.approx(e["naive_best"]["flops"]
                                                            / joint["flops"])
        assert e["naive_over_joint_flops"] > 1
    for i in (2, 3):  # joint replay without and with recompute: the planner's plans
        assert entries["one"]["rows"][i]["plan"] == "waves of 4, prompt retained"
        assert entries["tree"]["rows"][i]["plan"] == "waves of 2, 3/3 internal nodes retained"
    assert entries["one"]["plan_command"].endswith("fits")  # after any refusal of the flags
    assert all(e["samples_at_once"] is None for e in entries.values())  # every sample at once


def test_full_size_rows_that_do_not_fit_say_by_how_much(monkeypatch):
    """A GPU of the model state and half the smallest naive step: nothing fits, each row names
    its shortfall, and no FLOP ratio is given."""
    big = _entries(monkeypatch, 90.0)["one"]
    least = min(r["peak_bytes"] for r in big["rows"])
    gpu = (big["state_bytes"] + max(big["rollout_cache"], 0.5 * least)) / GIB
    for name, e in _entries(monkeypatch, gpu).items():
        _check_totals(e)
        assert not any(r["fits"] for r in e["rows"]), name
        assert all(r["shortfall_bytes"] > 0 for r in e["rows"]), name
        assert e["rows"][2]["plan"] == "none fits" and e["naive_over_joint_flops"] is None
    assert "needs" in e["plan_command"] or e["plan_command"].startswith("refuses")


def test_joint_replay_with_recompute_where_only_it_fits(monkeypatch):
    """A GPU between the recompute row's one-wave total and joint replay's smallest: joint
    replay with recompute is the best joint plan, the planner's under the budget (its peak
    within it), and naive / joint FLOPs is taken against it."""
    big = _entries(monkeypatch, 90.0)
    for name, e in big.items():
        plain, rc = e["rows"][2], e["rows"][3]
        assert rc["total_bytes"] < plain["total_bytes"], name
    gpu = {n: (e["rows"][3]["total_bytes"] + 1) / GIB for n, e in big.items()}
    for name in big:
        got = _entries(monkeypatch, gpu[name])[name]
        _check_totals(got)
        plain, rc = got["rows"][2], got["rows"][3]
        assert not plain["fits"] and rc["fits"] and rc["plan"] != "none fits", name
        assert rc["peak_bytes"] <= got["budget_bytes"], name
        assert got["joint_best"]["schedule"] == "joint replay, recompute", name
        assert got["naive_over_joint_flops"] == pytest.approx(got["naive_best"]["flops"]
                                                              / rc["flops"])


@pytest.mark.parametrize("wl", [ONE, TREE], ids=["one-level", "tree"])
def test_scaled_down_prediction_within_10_percent(mcore_single, wl):
    """A real CPU step of naive micro-batch 1 and of joint replay (the smallest plan: no
    full-size entry) against the planner's prediction."""
    out = scale.scaled_down(scale.FAMILIES[0], wl, None, factor=2)
    assert out["workload"]["G"] == wl.G
    for r in out["runs"]:
        assert r["measured"] > 0 and abs(r["error"]) <= scale.RTOL, r


def test_the_results_and_their_tables(monkeypatch, tmp_path):
    monkeypatch.setattr(scale, "GPU_GIB", 90.0)
    result = scale.run_scale((TINY_OURO,), (ONE,), factor=2, log=lambda *a: None)
    scale.write(str(tmp_path), result)
    doc = json.loads((tmp_path / "scale.json").read_text())
    assert [e["workload"]["name"] for e in doc["full_size"]] == ["one"]
    assert doc["targets"][-1]["met"] is True  # the scaled run's prediction
    md = (tmp_path / "scale.md").read_text()
    assert md.startswith(scale.MD_HEADING) and md.count("| tiny-ouro | one |") == 5



@pytest.mark.parametrize("retain", [False, True], ids=["recompute", "retain"])
def test_tree_flops_are_the_tree_benchs_count(mcore_single, retain):
    """The tree's joint FLOPs equal benchmarks/tree.py's analytic count of the same tree and
    model (itself held to PyTorch's FlopCounterMode in tests/test_tree_bench.py)."""
    from benchmarks import tree as tree_bench
    from scalerlt_mcore.app.plan import tree_flops
    from scalerlt_mcore.shared_prefix.planner import GroupPlan, ModelShape

    twl = tree_bench.TreeWorkload(prompt_length=6, branches=(2, 3), node_lengths=(4, 3),
                                  trained_lengths=(2, 3), wave_size=2, hidden=16, heads=2)
    model = tree_bench.build(twl)[0]
    wl = scale.ScaleWorkload("t", 6, branches=(2, 3), node_lengths=(4, 3),
                             trained_lengths=(2, 3))
    tree, has_loss, _ = scale.prefix_tree(wl)
    plan = GroupPlan(twl.wave_size, retain=retain)
    got = tree_flops(ModelShape.from_model(model), tree, plan, has_loss)
    want = tree_bench.analytic_flops(twl, tree_bench.config_shape(model.config))
    assert got == want["joint_retain" if retain else "joint"]
