"""The prefix-tree workload (benchmarks/tree.py): the tree and its token counts, the analytic
FLOPs against a hand count and against PyTorch's counter, the packed tree mask's per-token
log-probs against the naive rows' (fp64), and the structure of its cpu.json entry."""

import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `pytest` without `python -m`: the repo root holds benchmarks/
    sys.path.insert(0, ROOT)

from benchmarks import tree  # noqa: E402
from benchmarks.measure import count_flops  # noqa: E402

TINY = tree.TreeWorkload(prompt_length=6, branches=(2, 3), node_lengths=(4, 3),
                         trained_lengths=(2, 3), wave_size=2, hidden=16, heads=2,
                         repetitions=1)


def test_the_bench_tree_and_its_limit():
    """P = 512, 4 turn-1 nodes of 96 (64 trained), 4 leaves of 64 under each."""
    nodes = tree.tree_nodes(tree.TREE)
    assert len(nodes) == 21 and len(tree.leaves(nodes)) == 16
    assert nodes[1] == tree.Node(0, 512, 96, 64) and nodes[2] == tree.Node(1, 608, 64, 64)
    assert nodes[6] == tree.Node(0, 512, 96, 64)  # depth first: node 1's 4 leaves, then 6
    assert tree.token_counts(tree.TREE) == {"naive": 16 * 672, "unique": 512 + 4 * 96 + 16 * 64,
                                            "rows": 16, "row_length": 672}
    flops, saved = tree.tree_targets("tree", 5.6, "joint", 5.0, 0.5)
    assert flops["target"] == pytest.approx(5.04) and not flops["ok"] and saved["ok"]


def test_analytic_flops_hand_count():
    """Prompt 3, two children of 2 tokens; hidden 4, FFN 16, 2 heads of 2, 1 layer, 2 loops,
    vocabulary 8."""
    wl = tree.TreeWorkload(prompt_length=3, branches=(2,), node_lengths=(2,),
                           trained_lengths=(2,), num_loops=2, core_layers=1, vocab=8)
    shape = tree.layer_shape(4, 16, 2, 2, 2, False, 1)
    # qkv 4 x 12, proj 4 x 4, fc1 4 x 16, fc2 16 x 4 = 192 multiply-adds per token
    assert shape["matmul_per_token"] == 2 * 192 and shape["attention_per_pair"] == 16
    readout = 2 * 4 * 8  # per position per loop
    # naive: 2 rows of 5 tokens, 15 causal pairs each, every position read out; x3 (fwd + bwd)
    naive = 3 * 2 * (384 * 10 + 16 * 30 + readout * 10)
    # unique tokens 3 + 2 + 2; pairs: root 6, each child 2 x 3 ancestors + 3 causal
    tree_mask = 3 * 2 * (384 * 7 + 16 * (6 + 2 * 9) + readout * 7)
    # joint: the root once without grad (no readout) and once in its replay; both leaves in one
    # wave without their last token (1 token, 3 + 1 pairs each), read out there and once at
    # the root's boundary (the leaves' first label)
    no_grad = 2 * (384 * 3 + 16 * 6)
    joint = no_grad + 3 * 2 * (384 * 3 + 16 * 6) + 3 * 2 * (2 * (384 + 16 * 4) + readout * 3)
    flops = tree.analytic_flops(wl, shape)
    assert flops == {"naive": naive, "tree_mask": tree_mask, "joint": joint,
                     "joint_retain": joint - no_grad}


def test_analytic_flops_match_pytorchs_count(mcore_single):
    """The analytic naive and joint steps are PyTorch's FlopCounterMode counts of them (causal
    SDPA; joint: every internal node without grad and in its replay, or retained; leaf waves
    without the leaf's last token); the tree mask's dense kernel computes every (query, key)
    pair of the packed square."""
    model, rows, packed, group = tree.build(TINY)
    steps = tree.step_functions(model, rows, packed, group, TINY.wave_size)
    shape = tree.config_shape(model.config)
    analytic = tree.analytic_flops(TINY, shape)
    for way in ("naive", "joint", "joint_retain"):
        assert count_flops(steps[way])["causal"] == analytic[way], way
    U = tree.token_counts(TINY)["unique"]
    dense = tree.pass_flops(shape, TINY.vocab, TINY.num_loops, U, U * U, U, 3)
    assert count_flops(steps["tree_mask"])["dense"] == dense


def test_the_naive_rows_are_the_trees_rows(mcore_single):
    """The benchmark's naive rows are ``RLGroup.from_tree``'s rows of the same segments."""
    _, rows, _, group = tree.build(TINY)
    for field in ("tokens", "labels", "loss_mask", "advantages", "old_logprobs"):
        assert torch.equal(getattr(group, field), getattr(rows, field)), field
    assert group.tree is not None and group.tree.depth == 2


def test_tree_mask_hides_siblings():
    nodes = tree.tree_nodes(TINY)
    packed = tree.packed_tree(TINY, tree.make_segments(TINY))
    visible = ~packed["mask"][0, 0]
    first_leaf, second_leaf = 2, 3  # both under node 1; node 5 is node 1's sibling
    start = {n: sum(x.length for x in nodes[:n]) for n in range(len(nodes))}
    q = start[second_leaf]
    assert visible[q, : start[1] + nodes[1].length].all()  # root and node 1: every token
    assert not visible[q, start[first_leaf] : start[second_leaf]].any()  # a sibling leaf
    assert not visible[start[1], start[5]]  # node 1 does not see node 5
    assert packed["positions"][0, q].item() == nodes[second_leaf].start


def test_tree_mask_logprobs_equal_the_naive_rows_fp64(mcore_single):
    """Per-token log-probs of every row position from one packed forward under the tree mask
    equal an independent forward of each root-to-leaf row (fp64, every loop)."""
    model, rows, packed, _ = tree.build(TINY)
    model = model.double()
    naive = model(rows.tokens, labels=rows.labels).logprobs  # [R, G, T]
    packed_lp = tree.tree_mask_logprobs(model, packed, rows.labels)
    assert packed_lp.dtype == torch.float64 and packed_lp.shape == naive.shape
    err = float((packed_lp - naive).abs().max() / naive.abs().max())
    assert err <= 1e-12, err


def test_the_tree_entry_and_its_report(tmp_path, monkeypatch):
    from benchmarks import report, run

    monkeypatch.setattr(tree, "TREE", TINY)
    monkeypatch.setattr(report, "plot", lambda *a, **k: None)  # the plot: test_benchmarks.py
    assert run.main(["--only", "tree", "--no-prompt-sweep", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "cpu.json").read_text())
    r = doc["tree"]
    assert set(r["ways"]) == set(tree.WAYS)
    assert r["flops_limit_ratio"] == pytest.approx(tree.token_counts(TINY)["naive"]
                                                   / tree.token_counts(TINY)["unique"])
    for s in r["ways"].values():
        assert s["flops_causal"] > 0 and s["saved_bytes"] > 0 and s["wall_s"] > 0
        assert s["wall_s"] == min(s["wall_all_s"]) and len(s["wall_all_s"]) == TINY.repetitions
    assert set(r["naive_over"]) == set(tree.WAYS) - {"naive"}
    assert all(x["flops_causal"] > 1 for x in r["naive_over"].values())
    assert r["joint_variant"] == "joint_retain"  # the fewest FLOPs
    for err in r["agreement_max_rel_err"].values():
        assert err["loss"] <= 1e-5 and err["grad"] <= 1e-5
    rows = [t for t in doc["meta"]["targets"] if t["workload"] == "tree"]
    assert [t["figure"] for t in rows] == ["naive_over.joint.flops_causal (joint_retain) >=",
                                           "joint_over_tree_mask_saved_bytes (joint_retain) <"]
    assert rows[0]["measured"] == r["naive_over"]["joint_retain"]["flops_causal"]
    assert rows[1]["measured"] == (r["ways"]["joint_retain"]["saved_bytes"]
                                   / r["ways"]["tree_mask"]["saved_bytes"])
    md = (tmp_path / "cpu.md").read_text()
    assert md.count(tree.MD_HEADING) == 1 and "| tree_mask |" in md
    tree.merge_into(str(tmp_path), r)  # run alone again: the section is replaced
    assert (tmp_path / "cpu.md").read_text().count(tree.MD_HEADING) == 1
