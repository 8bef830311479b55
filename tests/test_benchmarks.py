"""The benchmark harness (benchmarks/): schedules agree with naive training on a tiny
workload, a wrong schedule aborts, the FLOP formula for the CPU SDPA kernel, the JSON /
markdown / PNG writers, and that the GPU script imports and answers --help on CPU."""

import copy
import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # `pytest` without `python -m`: the repo root holds benchmarks/
    sys.path.insert(0, ROOT)

from benchmarks import gpu  # noqa: E402
from benchmarks.harness import run_workload  # noqa: E402
from benchmarks.measure import AgreementError, check_agreement, count_flops  # noqa: E402
from benchmarks.report import (  # noqa: E402
    best_joint,
    check_targets,
    plot,
    write_json,
    write_markdown,
)
from benchmarks.schedules import SCHEDULES, step_functions  # noqa: E402
from benchmarks.workloads import (  # noqa: E402
    Workload,
    attach_old_logprobs,
    build_model,
    make_group,
    objective,
)

TINY = Workload("A", group_size=5, prompt_length=12, response_length=6, wave_size=2,
                num_loops=2, hidden=32, heads=4, repetitions=1, full_length=False)


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _steps(wl=TINY):
    torch.manual_seed(0)
    model = build_model(wl)
    group = attach_old_logprobs(model, make_group(wl, seed=1), seed=1)
    return model, step_functions(model, group, objective(), wl.wave_size)


def test_schedules_agree_with_naive(mcore_single):
    model, steps = _steps()
    assert tuple(steps) == SCHEDULES
    errors = check_agreement(steps, model)
    assert set(errors) == set(SCHEDULES) - {"naive"}
    for name, err in errors.items():
        assert err["loss"] <= 1e-5 and err["grad"] <= 1e-5, (name, err)


def test_disagreeing_schedule_aborts(mcore_single):
    model, steps = _steps()
    joint = steps["joint"]

    def skewed():  # a schedule whose gradients are 1% off
        loss = joint()
        for p in model.parameters():
            p.grad.mul_(1.01)
        return loss

    steps["joint"] = skewed
    with pytest.raises(AgreementError, match="joint disagrees with naive"):
        check_agreement(steps, model)


def test_a_disagreement_writes_the_json_with_the_errors_and_exits_2(monkeypatch, tmp_path):
    from benchmarks import harness, run

    def disagreeing(wl, seed):
        raise AgreementError("joint disagrees with naive: grad 1.0e-02", {"joint": {"grad": 1e-2}})

    monkeypatch.setattr(harness, "run_workload", disagreeing)
    assert run.main(["--only", "A", "--no-prompt-sweep", "--no-rl-step",
                     "--out", str(tmp_path)]) == 2
    doc = json.loads((tmp_path / "cpu.json").read_text())
    assert doc["meta"]["status"] == "failed"
    assert doc["meta"]["error"] == ("A: schedules disagree with naive training: joint disagrees "
                                    "with naive: grad 1.0e-02")
    assert doc["A"]["agreement"] == {"joint": {"grad": 1e-2}}
    assert not (tmp_path / "cpu.md").exists() and not (tmp_path / "cpu.png").exists()


def test_the_headline_tick_labels_do_not_overlap(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    figures, savefig = [], Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (figures.append(fig),
                                                                  savefig(fig, *a, **k)))
    with open(os.path.join(ROOT, "benchmarks", "results", "cpu.json")) as f:
        doc = json.load(f)
    results = {n: r for n, r in doc.items() if isinstance(r, dict) and "schedules" in r}
    plot(str(tmp_path / "cpu.png"), results, "CPU")
    (fig,) = figures
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(fig).get_renderer()
    boxes = [t.get_window_extent(renderer) for t in fig.axes[0].get_xticklabels()]
    assert len(boxes) == 9
    overlaps = [(a, b) for a, b in zip(boxes, boxes[1:]) if a.x1 > b.x0]
    assert not overlaps, overlaps


def test_cpu_sdpa_flops_dense_and_causal():
    q, k, v = (torch.randn(1, 1, 4, 2, requires_grad=True) for _ in range(3))

    def step():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    flops = count_flops(step)
    per_pair = 2 * 2 * 2  # QK^T and PV, head dim 2
    assert flops["dense"] == 3 * per_pair * 16  # forward + backward (2x), full 4x4 square
    assert flops["causal"] == 3 * per_pair * 10  # the causal triangle: 1 + 2 + 3 + 4 pairs


@pytest.mark.parametrize("kernel, dtype", [("flash", torch.bfloat16),
                                           ("efficient", torch.float32)])
def test_cuda_sdpa_flops_count_the_causal_triangle_on_meta(kernel, dtype):
    """The cascade on the CUDA ops (meta): the prefix part is dense, the own part causal; the
    dense total is PyTorch's own count, the causal one skips the own part's upper triangle."""
    from scalerlt_mcore.model import kernels

    S, B, H, G, P, D = 5, 3, 4, 2, 6, 64
    shapes = [(S, B, H, D), (S, B, G, D), (S, B, G, D), (P, 1, G, D), (P, 1, G, D)]
    inputs = [torch.empty(s, dtype=dtype, device="meta", requires_grad=True) for s in shapes]

    def step():
        kernels.cascade_prefix_attention(*inputs, 0.125, kernel=kernel).sum().backward()

    with torch.utils.flop_counter.FlopCounterMode(display=False) as pytorch:
        step()
    flops = count_flops(step)
    per_pair = 2 * B * H * D  # one product's multiply-adds per (query, key) pair
    skipped = S * S - S * (S + 1) // 2  # the own part's keys after each query
    assert flops["dense"] == pytorch.get_total_flops()
    assert flops["dense"] - flops["causal"] == (2 + 5) * per_pair * skipped  # fwd 2, bwd 5


_TINY_RESULT = []


def _tiny_result() -> dict:
    """``run_workload(TINY)``, run once for the tests that read it (a copy each)."""
    if not _TINY_RESULT:
        _TINY_RESULT.append(run_workload(TINY, log=lambda *a, **k: None))
    return copy.deepcopy(_TINY_RESULT[0])


def test_writers_produce_required_keys(mcore_single, tmp_path):
    sweep = dataclasses.replace(TINY, name="sweep_G4_r2", group_size=4, prompt_length=12,
                                full_length=True)
    results = {"A": _tiny_result(),
               sweep.name: run_workload(sweep, log=lambda *a, **k: None)}
    targets = check_targets(results)
    doc = write_json(str(tmp_path / "cpu.json"), results, {"targets": targets})
    loaded = json.loads((tmp_path / "cpu.json").read_text())
    assert loaded.keys() == doc.keys() == {"meta", "A", "sweep_G4_r2"}
    for name in ("A", "sweep_G4_r2"):
        r = loaded[name]
        for key in ("naive_over_joint", "naive_mb1_over_joint", "tree_over_joint"):
            for fig in ("flops", "flops_causal", "saved_bytes", "wall"):
                assert isinstance(r[key][fig], float) and r[key][fig] > 0, (name, key, fig)
        assert set(r["schedules"]) == set(SCHEDULES)
        for s in r["schedules"].values():
            assert s["flops"] > 0 and s["saved_bytes"] > 0 and s["wall_s"] > 0
        assert set(r["cascade_vs_concat"]["concat_over_cascade"]) >= {"saved_bytes", "wall"}
        assert r["theory"]["naive_over_joint_work"] > 1
    assert {t["workload"] for t in targets} == {"A"}
    md = write_markdown(str(tmp_path / "cpu.md"), results, targets, "# test")
    assert "sweep_G4_r2" in md and "| A |" in md
    plot(str(tmp_path / "cpu.png"), results, "test")
    assert (tmp_path / "cpu.png").read_bytes()[:4] == b"\x89PNG"


def test_gpu_script_imports_helps_and_dry_runs_on_cpu(capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        gpu.parse_args(["--help"])
    assert exit_.value.code == 0 and "--dry-run" in capsys.readouterr().out
    assert gpu.parse_args([]).hidden == 1024
    if torch.cuda.is_available():
        return
    assert gpu.main([]) == 1  # refuses to run without a GPU unless --dry-run
    out = tmp_path / "gpu.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--dry-run", "--only", "A",
                          "--reps", "1", "--warmup", "0", "--out", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(out.read_text())["A"]
    assert set(result["schedules"]) == set(SCHEDULES)
    assert result["naive_over_joint"]["flops"] > 1


def test_retain_and_auto_rows(mcore_single):
    """The best joint variant names the naive/joint figures; recompute vs retain and auto are
    reported; auto's plan is recorded."""
    from benchmarks.report import retain_table

    result = _tiny_result()
    assert result["joint_variant"] in ("joint", "joint_retain", "joint_ckpt", "joint_concat")
    best = result["schedules"][result["joint_variant"]]
    assert result["naive_over_joint"]["wall"] == result["schedules"]["naive"]["wall_s"] / (
        best["wall_s"])
    assert set(result["recompute_over_retain"]) >= {"flops", "saved_bytes", "wall"}
    assert result["recompute_over_retain"]["flops"] > 1  # the retained prompt runs once
    assert result["auto_over_fastest_wall"] > 0 and set(result["auto_plan"]) == {
        "wave_size", "retain", "naive", "retain_nodes", "prompt_segments", "state_kind"}
    assert "| A |" in retain_table({"A": result})


def test_prompt_sweep_point(mcore_single):
    from benchmarks.prompt_sweep import BUDGETS_MIB, run_point
    from benchmarks.report import prompt_sweep_table

    wl = dataclasses.replace(TINY, name="prompt_P12", full_length=True)
    row = run_point(wl)
    assert set(row["wall_s"]) == set(row["saved_bytes"]) == {"recompute", "retain"}
    for mode in ("recompute", "retain"):
        pred, got = row["predicted_saved_bytes"][mode], row["saved_bytes"][mode]
        assert abs(pred / got - 1) <= 0.10, (mode, pred, got)
    assert [p["budget_mib"] for p in row["plans"]] == list(BUDGETS_MIB)
    assert row["plans"][-1]["plan"]["wave_size"] == wl.group_size  # a roomy budget: one wave
    assert "| 12 |" in prompt_sweep_table([row])


def test_naive_one_response_per_microbatch_baseline(mcore_single, monkeypatch):
    """naive_mb1 is MCore's usual gradient accumulation: G microbatches of one full sequence,
    the loss and gradients of naive training, about one sequence's activations held."""
    import megatron.core.pipeline_parallel.schedules as mcore_schedules

    from benchmarks.measure import peak_saved_bytes, theory

    model, steps = _steps()
    stock, calls = mcore_schedules.forward_backward_no_pipelining, []

    def counting(**kwargs):
        calls.append(kwargs["num_microbatches"])
        return stock(**kwargs)

    monkeypatch.setattr(mcore_schedules, "forward_backward_no_pipelining", counting)
    errors = check_agreement({"naive": steps["naive"], "naive_mb1": steps["naive_mb1"]}, model)
    assert calls == [1, TINY.group_size]
    assert errors["naive_mb1"]["loss"] <= 1e-5 and errors["naive_mb1"]["grad"] <= 1e-5
    assert theory(TINY)["held_tokens"]["naive_mb1"] == TINY.prompt_length + TINY.response_length
    ratio = peak_saved_bytes(steps["naive"], model) / peak_saved_bytes(steps["naive_mb1"], model)
    assert ratio > TINY.group_size / 2, ratio  # one sequence's activations, not G


def test_targets_are_checked_against_the_causal_flop_count():
    """A FLOPs target is met or missed by the causal count; the all-scores count (PyTorch's
    convention for SDPA kernels) is reported beside it but judges nothing."""
    def fake(dense, causal):
        ratio = {"flops": dense, "flops_causal": causal, "saved_bytes": 10.0, "wall": 10.0}
        return {"naive_over_joint": ratio, "joint_over_tree_flops": 0.5,
                "joint_over_tree_flops_causal": 2.0}

    rows = check_targets({"A": fake(dense=3.1, causal=2.8), "B": fake(dense=5.5, causal=5.0)})
    flops_rows = [r for r in rows if "flops" in r["figure"]]
    assert flops_rows and all("flops_causal" in r["figure"] for r in flops_rows), flops_rows
    assert [(r["workload"], r["measured"], r["ok"]) for r in flops_rows] == [
        ("A", 2.8, False), ("B", 5.0, False), ("A", 2.0, False), ("B", 2.0, False)]


def test_best_joint_variant_is_chosen_by_flops_then_saved_bytes_not_wall_time():
    """The naive/joint figures take the variant with the fewest FLOPs, then the fewest saved
    bytes, whatever the host's noise did to the wall times of this run; the median wall time
    decides only where no FLOPs were counted."""
    def sched(flops, saved, wall):
        return {"flops_causal": flops, "saved_bytes": saved, "wall_s": wall}

    schedules = {"joint": sched(110, 50, 0.90),  # the fastest in this run
                 "joint_retain": sched(100, 50, 1.00),  # the fewest FLOPs
                 "joint_ckpt": sched(130, 20, 1.30), "joint_concat": sched(110, 60, 0.95)}
    assert best_joint(schedules) == "joint_retain"
    schedules["joint_concat"] = sched(100, 40, 1.20)  # as few FLOPs, fewer bytes
    assert best_joint(schedules) == "joint_concat"
    uncounted = {n: dict(s, flops_causal=None) for n, s in schedules.items()}
    assert best_joint(uncounted) == "joint"


def test_loss_agreement_is_relative_to_the_size_of_its_terms(mcore_single):
    """A loss whose terms cancel to near 0 is compared at the terms' size (loss_scale): fp32
    rounding of a sum of 16 terms of ~0.06 (seen: 2.8e-8 on a loss of 6.4e-4) passes, an
    error of 1e-4 of the terms' size does not."""
    from benchmarks.measure import relative_error

    loss, rounded = torch.tensor(6.359e-4, dtype=torch.float64), 6.359e-4 + 2.8e-8
    assert relative_error(torch.tensor(rounded), loss) > 1e-5  # against the mean: ill-posed
    assert relative_error(torch.tensor(rounded), loss, scale=0.985) < 1e-7
    model, steps = _steps()
    naive = steps["naive"]
    scale = 0.5

    def off():
        return naive() + 1e-4 * scale

    with pytest.raises(AgreementError, match="off disagrees with naive: loss rel err 0.0001"):
        check_agreement({"naive": naive, "off": off}, model, loss_scale=scale)


# ---- the whole RL step (benchmarks/rl_step.py) ---------------------------------------------

TINY_RL = {  # the long-prompt config made tiny
    "num_layers": 1, "hidden_size": 32, "num_attention_heads": 4, "looped_num_loops": 2,
    "max_position_embeddings": 32,
    "rl_task_options": "{num_pairs: 4, key_len: 2, value_len: 1}", "grpo_group_size": 4,
    "global_batch_size": 8, "micro_batch_size": 4, "rl_max_response_length": 4,
    "shared_prefix_wave_size": 2, "eval_interval": 0,
}


def test_rl_step_benchmark_reports_the_split(mcore_single, tmp_path):
    from benchmarks.rl_step import kv_cache_bytes, merge_into, run_rl_step
    from benchmarks.run import _write

    result = run_rl_step(steps=1, warmup=0, overrides=TINY_RL, log=lambda *a, **k: None)
    for key in ("naive_over_joint", "naive_over_joint_rollout_logprobs"):
        assert set(result[key]) == {"wall", "rollout", "score", "train"}
        assert all(isinstance(result[key][p], float) and result[key][p] > 0
                   for p in ("wall", "rollout", "train")), result[key]
    assert result["naive_over_joint"]["score"] > 0
    assert result["naive_over_joint_rollout_logprobs"]["score"] is None  # no scoring pass
    variants = result["variants"]
    assert set(variants) == {"naive", "joint", "joint_rollout_logprobs"}
    assert variants["joint_rollout_logprobs"]["score_s"] < variants["joint"]["score_s"]
    for v in variants.values():
        assert v["rollout_logprob_max_diff"] <= 1e-5
        assert v["step_s"] >= v["rollout_s"] + v["score_s"] + v["train_s"]
    ro = result["rollouts"]
    assert ro["same_samples"] and ro["max_logprob_diff"] <= 1e-5
    # 2 prompts of 1 + 4 * 5 + 3 = 24 tokens, G = 4, 4 new tokens; K/V of 2 loops, 4 heads of 8
    per_token = 2 * 2 * 4 * 8 * 4
    assert ro["per_row"]["kv_cache_bytes"] == per_token * 8 * (24 + 4)
    assert ro["prompt_once"]["kv_cache_bytes"] == per_token * (2 * 24 + 8 * 4)
    config = type("C", (), {"num_query_groups": None, "num_attention_heads": 4,
                            "looped_num_depths": 2, "kv_channels": 8})
    assert kv_cache_bytes(config, 2, 4, 24, 4, 4)["per_row"] == per_token * 8 * 28
    assert ro["per_row"]["peak_tensor_bytes"] > ro["prompt_once"]["peak_tensor_bytes"] > 0
    assert _write(str(tmp_path), {}, 1.0, {"rl_step": result}) == 0
    doc = json.loads((tmp_path / "cpu.json").read_text())
    assert doc["rl_step"]["naive_over_joint"] == result["naive_over_joint"]
    assert [t["workload"] for t in doc["meta"]["targets"]] == ["rl_step"]
    assert "## Whole RL step (rl_step)" in (tmp_path / "cpu.md").read_text()
    assert "score none (no scoring pass)" in (tmp_path / "cpu.md").read_text()
    # run alone, it joins the results already there (twice: its section is replaced)
    (tmp_path / "cpu.json").write_text(json.dumps({"meta": {"targets": [{"workload": "A"}]},
                                                   "A": {"x": 1}}))
    (tmp_path / "cpu.md").write_text("# bench\n\nA table\n")
    merge_into(str(tmp_path), result)
    merge_into(str(tmp_path), result)
    doc = json.loads((tmp_path / "cpu.json").read_text())
    assert doc["A"] == {"x": 1} and doc["rl_step"]["rollouts"] == result["rollouts"]
    assert [t["workload"] for t in doc["meta"]["targets"]] == ["A", "rl_step"]
    md = (tmp_path / "cpu.md").read_text()
    assert md.startswith("# bench\n\nA table\n") and md.count("## Whole RL step") == 1


def test_sweep_workloads_leave_out_the_variant_rows(mcore_single):
    """The G x P:S sweep runs without joint_retain and auto (bench time); the headline and demo
    workloads keep them. A workload without them still reports every other figure."""
    from benchmarks.report import retain_table
    from benchmarks.run import DEMO, HEADLINE, sweep_workloads
    from benchmarks.schedules import VARIANTS

    assert all(not w.variants for w in sweep_workloads())
    assert all(w.variants for w in (*HEADLINE, DEMO))
    result = run_workload(dataclasses.replace(TINY, variants=False), log=lambda *a, **k: None)
    assert set(result["schedules"]) == set(SCHEDULES) - set(VARIANTS)
    assert result["joint_variant"] in ("joint", "joint_ckpt", "joint_concat")
    assert "auto_plan" not in result and "recompute_over_retain" not in result
    assert retain_table({"x": result}).count("\n") == 1  # the header only
    assert not [t for t in check_targets({"x": result}) if "auto" in t["figure"]]


def test_graphed_decode_reports_the_capture_apart():
    """The GPU decode bench times replays through one kept ``DecodeGraphs`` and reports the
    capture's seconds apart from their tokens/s."""
    def wall(graphs):  # a warm-up that captured once, then three replayed rollouts
        graphs.captures, graphs.capture_s = 1, 0.5
        return [0.1, 0.2, 0.3]

    row = gpu.graphed_decode(wall, tokens=40)
    assert row == {"graphed_wall_s": 0.2, "graphed_tokens_per_s": 200.0, "graph_captures": 1,
                   "graph_capture_s": 0.5}
    modes = {"wall_s": 1.0, "tokens_per_s": 40.0, "decode_step_s": 0.01,
             "decode_tokens_per_s": 100.0, **row}
    table = gpu.decode_table({"prompts": 2, "group_size": 2, "prompt_length": 8,
                              "new_tokens": 10, "dtype": "bfloat16", "hidden": 32, "heads": 4,
                              "num_loops": 2, "modes": ["per_row"], "per_row": modes})
    assert "| per_row | 1000.0 | 40 | 10.00 | 100.00 | 200.00 | 1 | 500.00 |" in table
