"""``python -m scalerlt_mcore.plan`` (scalerlt_mcore/app/plan.py): does a run fit its GPUs?

- Each public checkpoint's 8 x H20 config, beside a directory with its real config.json (no
  weights), is planned at full size on ``meta``: the per-GPU breakdown, the four schedules and
  the run's own plan are printed, and the model state is the parameter count's bytes.
- At a small shape the predictions are held against a real CPU run: the command's predicted
  saved bytes of naive micro-batch 1 and of joint replay (the plan it picks under two GPU
  sizes) are within 10% of ``SavedTensorProbe``'s peak of the run's own schedule training a
  group of that P, S, G on CPU.
- A run that cannot fit ends with one line naming the numbers, status 1.
"""

import dataclasses
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from helpers.h20 import CONFIGS, REPO, checkpoint_dir
from helpers.sp import make_group

from scalerlt_mcore.app.config import model_config, objective_from, parse_args, schedule_from
from scalerlt_mcore.app.plan import (
    GIB,
    HEADROOM,
    format_report,
    main,
    make_report,
    meta_model,
    parse,
    shortfall,
    tree_segments,
)
from scalerlt_mcore.app.pretrained import run_vocab_size
from scalerlt_mcore.app.runtime import build_model
from scalerlt_mcore.rl.batch import RLGroup
from scalerlt_mcore.rl.objective import rl_forward_step
from scalerlt_mcore.shared_prefix import SavedTensorProbe
from scalerlt_mcore.shared_prefix.planner import GroupPlan, Planner
from scalerlt_mcore.testing import model_parallel_context

RTOL = 0.10
P, S, G = 24, 12, 8
RUN = ["--config", str(REPO / "configs" / "ouro_tiny_cpu.yaml"),
       "--rl-max-response-length", str(S), "--grpo-group-size", str(G)]
"""The tiny Ouro config (fp32, random weights) with groups of S, G."""
TINY = RUN + ["--world-size", "2", "--plan-prompt-length", str(P)]
"""The plan command's flags: the run's on 2 ranks, prompts of P."""


def test_help():
    out = subprocess.run([sys.executable, "-m", "scalerlt_mcore.plan", "--help"], cwd=REPO,
                         capture_output=True, text=True, timeout=500)
    assert out.returncode == 0, out.stderr
    for flag in ("--world-size", "--plan-prompt-length", "--plan-gpu-memory-gib"):
        assert flag in out.stdout


@pytest.mark.parametrize("name", CONFIGS)
def test_public_config_on_an_h20_node(name, tmp_path, capsys):
    shape, params = CONFIGS[name]
    source = checkpoint_dir(tmp_path, shape)
    code = main(["--config", str(REPO / "configs" / name), "--pretrained-checkpoint",
                 str(source), "--use-checkpoint-args", "--world-size", "8"])
    out = capsys.readouterr().out
    print(f"\n[plan] {name}\n{out}")
    assert code == 0, out
    numbers = dict(re.findall(r"^  (parameters|gradient buffers|fp32 main weights|Adam "
                              r"moments)\s+([\d.]+)$", out, re.M))
    # bf16 parameters, fp32 gradient buffers, fp32 main weights and moments over 8 ranks
    for part, width in (("parameters", 2), ("gradient buffers", 4), ("fp32 main weights", 4 / 8),
                        ("Adam moments", 8 / 8)):
        assert abs(float(numbers[part]) * GIB / (width * params) - 1) < 0.01, (part, out)
    for row in ("naive, micro-batch 1 ", "naive, micro-batch 1, recompute",
                "joint replay ", "joint replay, recompute", "rollout cache",
                "the run's schedule (joint_replay"):
        assert row in out, (row, out)
    assert "none fits" not in out


RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform",
             "--recompute-num-layers", "1"]
"""The plan command's "recompute" rows' setting (``app.plan.RECOMPUTE``) as flags."""


def _measured_peak(plan, recompute: bool = False) -> int:
    """``SavedTensorProbe``'s peak of the run's schedule training one group by ``plan`` on CPU
    (the tiny config's model with real weights; ``recompute``: with ``RECOMPUTE``)."""
    extra = (["--shared-prefix-schedule", "naive", "--micro-batch-size", str(plan.wave_size)]
             if plan.naive else
             ["--shared-prefix-wave-size", str(plan.wave_size),
              "--shared-prefix-prompt", "retain" if plan.retain else "recompute"])
    cfg = parse_args(RUN + extra + RECOMPUTE * recompute)
    model = build_model(cfg, model_config(cfg, "cpu"), run_vocab_size(cfg), "cpu")
    R = cfg.model.looped_num_loops
    group = make_group(G, P, S, R, seed=0, dtype=torch.float32, vocab=model.vocab_size)
    with SavedTensorProbe(model) as probe:
        schedule_from(cfg, model)(
            forward_step_func=rl_forward_step(objective_from(cfg)), data_iterator=iter([group]),
            model=model, num_microbatches=1, num_loops=R, seq_length=P + S, micro_batch_size=G)
    return probe.peak_bytes


def test_predictions_match_a_cpu_run():
    cfg, workload = parse(TINY)
    with model_parallel_context(seed=1):
        big = make_report(cfg, workload)
        naive, joint = big.rows[0], big.rows[2]
        # a GPU that holds 80% of the one-wave plan: the planner picks smaller waves
        small = dataclasses.replace(workload, gpu_bytes=big.state_bytes
                                    + 0.8 * joint.memory.peak_bytes)
        waves = make_report(cfg, small).rows[2]
        assert waves.plan is not None and waves.plan.wave_size < G < 1 + joint.plan.wave_size
        for row in (naive, joint, waves):
            got = _measured_peak(row.plan)
            err = abs(row.memory.saved_bytes / got - 1)
            print(f"\n[plan] {row.name} {row.plan}: predicted {row.memory.saved_bytes} B, "
                  f"measured {got} B ({err:.1%})")
            assert err <= RTOL, (row.plan, row.memory.saved_bytes, got)


def test_recompute_rows_are_planned_under_the_budget():
    """A GPU of the model state and 80% of joint replay's one-wave peak with recompute: the
    "joint replay, recompute" row is the planner's plan on the recompute twin (smaller waves),
    fits the budget, and its predicted saved bytes, as naive's with recompute, are within 10%
    of a CPU run with MCore's full recompute."""
    cfg, workload = parse(TINY)
    with model_parallel_context(seed=1):
        big = make_report(cfg, workload)
        one_wave = big.rows[3]
        assert one_wave.plan == GroupPlan(G, retain=True)
        small = dataclasses.replace(workload, gpu_bytes=big.state_bytes
                                    + 0.8 * one_wave.memory.peak_bytes)
        report = make_report(cfg, small)
        naive, joint = report.rows[1], report.rows[3]
        assert joint.name == "joint replay, recompute" and joint.plan is not None
        assert joint.plan.wave_size < G and joint.memory.peak_bytes <= report.budget
        twin = meta_model(cfg, recompute=True)
        planner = Planner("auto", "auto", memory_budget=report.budget,
                          loss_per_position=objective_from(cfg).saved_per_position)
        group = SimpleNamespace(prompt_length=P, response_length=S, group_size=G, group_id=0,
                                tree=None)
        assert joint.plan == planner(group, twin, cfg.model.looped_num_loops)
        for row in (naive, joint):
            got = _measured_peak(row.plan, recompute=True)
            err = abs(row.memory.saved_bytes / got - 1)
            print(f"\n[plan] {row.name} {row.plan}: predicted {row.memory.saved_bytes} B, "
                  f"measured {got} B ({err:.1%})")
            assert err <= RTOL, (row.plan, row.memory.saved_bytes, got)


TREE = ["--config", str(REPO / "configs" / "multiturn_tree.yaml"), "--world-size", "1",
        "--plan-prompt-length", "6", "--plan-reply-length", "4"]
"""The tiny multi-turn tree run (branches 4,4, answers of 5): prompts of 6, replies of 4."""


def _tree_peak(cfg, plan) -> int:
    """``SavedTensorProbe``'s peak of the run's schedule training the command's tree (random
    advantages and behaviour log-probs) by ``plan`` on CPU."""
    model = build_model(cfg, model_config(cfg, "cpu"), run_vocab_size(cfg), "cpu")
    R = cfg.model.looped_num_loops
    segments = tree_segments(6, (4, 4), cfg.rl.rl_max_response_length, 4)
    G, T = RLGroup.from_tree(segments, 0).tokens.shape
    gen = torch.Generator().manual_seed(0)
    group = RLGroup.from_tree(segments, 0, advantages=torch.randn(G, generator=gen),
                              old_logprobs=-3 + 0.1 * torch.randn(R, G, T, generator=gen))
    schedule = schedule_from(cfg, model, max_response_length=T - 6)  # a path's positions
    schedule.chooser = lambda group, model: plan
    with SavedTensorProbe(model) as probe:
        schedule(forward_step_func=rl_forward_step(objective_from(cfg)),
                 data_iterator=iter([group]), model=model, num_microbatches=1, num_loops=R,
                 seq_length=T, micro_batch_size=G)
    return probe.peak_bytes


def test_a_tree_run_is_planned_and_matches_a_cpu_run():
    """``rl_rollout tree``: the command plans the largest tree the run decodes (its branches,
    answers of S, replies of ``--plan-reply-length``): the table names the tree, the rollout
    cache holds each node's tokens once, and where the run's default budget is 90% of the
    joint row's peak the run's own plan (per node retained or recomputed) fits that budget and
    its predicted saved bytes are within 10% of the run's schedule training that tree on CPU
    by that plan."""
    cfg, workload = parse(TREE)
    with model_parallel_context(seed=1):
        big = make_report(cfg, workload)
        text = format_report(big)
        assert "a tree: P 6, branches 4,4, answers of 5, replies of 4, G 16 leaves" in text
        unique = 6 + 4 * (5 + 4) + 16 * 5  # the prompt, 4 answers + replies, 16 answers
        prompts = cfg.training.global_batch_size // cfg.rl.grpo_group_size  # one GPU
        # per token: depths (2 layers x 2 loops), K and V, hidden 64, fp32
        assert big.rollout_cache == unique * prompts * 2 * 2 * 2 * 64 * 4
        joint = big.rows[2]
        small = dataclasses.replace(workload, gpu_bytes=big.state_bytes
                                    + 0.9 * joint.memory.peak_bytes / HEADROOM)
        report = make_report(cfg, small)
        plan = report.run_plan
        assert plan is not None, report.run_error
        assert plan.retain_nodes is not None and not all(plan.retain_nodes), plan
        assert report.run_memory.peak_bytes <= HEADROOM * report.budget
        got = _tree_peak(cfg, plan)
        err = abs(report.run_memory.saved_bytes / got - 1)
        print(f"\n[plan] tree {plan}: predicted {report.run_memory.saved_bytes} B, measured "
              f"{got} B ({err:.1%})")
        assert err <= RTOL, (plan, report.run_memory.saved_bytes, got)


def _mib(text: str) -> float:
    return float(text) * 2**20


def test_shortfall_names_the_numbers(capsys):
    """A GPU that holds the model state and the rollout cache (not beside a training step),
    but not the smallest step of any row beside the state (joint replay's in as many prompt
    segments as prompt tokens): a long prompt, short responses (a small cache)."""
    flags = TINY + ["--plan-prompt-length", "56", "--rl-max-response-length", "4"]
    cfg, workload = parse(flags)
    with model_parallel_context(seed=1):
        report = make_report(cfg, workload)
        assert shortfall(report) == ""
        # each row's smallest step: on a GPU that holds only the state and the cache
        starved = make_report(cfg, dataclasses.replace(
            workload, gpu_bytes=report.state_bytes + report.rollout_cache))
        least = min(row.memory.peak_bytes for row in starved.rows)
        assert report.rollout_cache < least
        gpu = report.state_bytes + max(report.rollout_cache, 0.5 * least)
        short = make_report(cfg, dataclasses.replace(workload, gpu_bytes=gpu))
    # the smallest step of any row: naive micro-batch 1 or joint replay, with recompute or not
    least = min(row.memory.peak_bytes for row in short.rows)
    line = shortfall(short)
    got = re.fullmatch(r"needs ([\d.]+) MiB per GPU at the least \(([^)]+)\), the GPU has "
                       r"([\d.]+) MiB: lower --plan-prompt-length or --rl-max-response-length, "
                       r"or raise --world-size", line)
    assert got, line
    assert abs(_mib(got[1]) - (short.state_bytes + least)) <= 0.005 * 2**20
    assert abs(_mib(got[3]) - gpu) <= 0.005 * 2**20
    code = main(flags + ["--plan-gpu-memory-gib", repr(gpu / GIB)])
    out, err = capsys.readouterr()
    assert code == 1 and "none fits" in out
    # recompute is among the rows already: the change named is the longest prompt that fits
    got = re.fullmatch(re.escape(f"error: {line}; the smallest change that fits: "
                                 f"--plan-prompt-length ") + r"(\d+) \(the longest prompt that "
                       r"fits\)\n", err)
    assert got, err
    longest = int(got[1])
    with model_parallel_context(seed=1):
        for P_, fits in ((longest, True), (longest + 1, False)):
            at = make_report(cfg, dataclasses.replace(workload, gpu_bytes=gpu, prompt_length=P_))
            room = gpu - at.resident_bytes
            planned = (at.state_bytes + at.rollout_cache <= gpu and at.run_plan is not None
                       and any(r.plan is not None and r.memory.peak_bytes <= room
                               for r in at.rows))
            assert planned == fits, (P_, shortfall(at))


def test_shortfall_names_recompute_where_it_fits(capsys):
    """A run whose own budget (--shared-prefix-memory-budget) is below joint replay's smallest
    plan but above the recompute row's one-wave peak: the command names the recompute flags as
    the change, and the run with them fits (status 0)."""
    cfg, workload = parse(TINY)
    with model_parallel_context(seed=1):
        report = make_report(cfg, workload)
    plain, rc = report.rows[2].memory.peak_bytes, report.rows[3].memory.peak_bytes
    with model_parallel_context(seed=1):
        tight = make_report(cfg, dataclasses.replace(workload, gpu_bytes=report.state_bytes
                                                     + 0.5 * rc))
    least = tight.rows[2].memory.peak_bytes  # joint replay's smallest plan (none fits there)
    rc = tight.rows[3].memory.peak_bytes  # the recompute row's plan there
    assert tight.rows[2].plan is None and tight.rows[3].plan is not None
    assert rc < least <= plain, (rc, least, plain)
    budget = ["--shared-prefix-wave-size", "auto", "--shared-prefix-memory-budget",
              repr((rc + least) / 2 / 2**20)]
    code = main(TINY + budget)
    err = capsys.readouterr().err
    assert code == 1, err
    assert re.fullmatch(r"error: the run's schedule finds no plan: .+; the smallest change that "
                        r"fits: add --recompute-granularity full --recompute-method uniform "
                        r"--recompute-num-layers 1 \(waves of \d+, prompt [\w ]+, [\d.]+ MiB "
                        r"per GPU\)\n", err), err
    assert main(TINY + budget + RECOMPUTE) == 0, capsys.readouterr()


def _least_recompute_peak(flags: list) -> float:
    """The smallest joint-replay plan's peak with recompute (on a GPU too small for any)."""
    cfg, workload = parse(flags)
    with model_parallel_context(seed=1):
        report = make_report(cfg, workload)
        tight = make_report(cfg, dataclasses.replace(
            workload, gpu_bytes=report.state_bytes + 1))
    assert tight.rows[3].plan is None
    return tight.rows[3].memory.peak_bytes


def test_shortfall_names_fewer_loops_where_they_fit(capsys):
    """A run with recompute whose budget is below joint replay's smallest plan at its 3 loops
    but above it at 2: the command names ``--looped-num-loops 2`` (the most loops that fit),
    and the run with it fits (status 0)."""
    flags = TINY + RECOMPUTE
    least = {R: _least_recompute_peak(flags + ["--looped-num-loops", str(R)]) for R in (2, 3)}
    assert least[2] < least[3], least
    budget = ["--shared-prefix-wave-size", "auto", "--shared-prefix-memory-budget",
              repr((least[2] + least[3]) / 2 / 2**20)]
    code = main(flags + budget)
    err = capsys.readouterr().err
    assert code == 1, err
    assert re.fullmatch(r"error: the run's schedule finds no plan: .+; the smallest change that "
                        r"fits: add --looped-num-loops 2 \(waves of \d+, prompt [\w ]+, "
                        r"[\d.]+ MiB per GPU\)\n", err), err
    assert main(flags + budget + ["--looped-num-loops", "2"]) == 0, capsys.readouterr()


def test_model_state_over_the_gpu_is_refused_by_name(capsys):
    code = main(TINY + ["--plan-gpu-memory-gib", "1e-6"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert re.fullmatch(r"error: the model state and rollout cache need [\d.]+ MiB per GPU, the "
                        r"GPU has 0.00 MiB: lower --inference-max-requests \(the samples "
                        r"decoded at once\), --plan-prompt-length, --grpo-group-size or "
                        r"the prompts per GPU \(--global-batch-size\), or raise --world-size; "
                        r"neither fewer samples decoded at once, activation recompute, fewer "
                        r"loops nor a shorter prompt fits \(tensor parallelism is not "
                        r"evaluated: the command plans TP 1\)\n", err), err


def test_a_rollout_cache_over_the_gpu_names_the_samples_decoded_at_once(capsys):
    """Many long responses beside a short prompt (2 prompts x G 64 on each rank: the rollout
    cache the larger part), on a GPU that holds the state and the cache of 40 samples at a
    time beside the run's step, not of 41 nor of all 128: the command names
    ``--inference-max-requests 40``, and the run with it fits (status 0), with 41 it does
    not."""
    flags = RUN[:-4] + ["--rl-max-response-length", "48", "--grpo-group-size", "64",
                        "--global-batch-size", "256", "--micro-batch-size", "64",
                        "--shared-prefix-wave-size", "1", "--world-size", "2",
                        "--plan-prompt-length", "8"]
    cfg, workload = parse(flags)
    assert cfg.rl.rl_rollout == "prompt_once"
    with model_parallel_context(seed=1):
        report = make_report(cfg, workload)
    per_token = report.rollout_cache // (2 * (8 + 64 * 48))  # 2 prompts' whole groups
    assert report.rollout_cache == per_token * 2 * (8 + 64 * 48)
    forty = per_token * (8 + 40 * 48)  # one prompt at a time, 40 of its samples
    assert forty > report.run_memory.peak_bytes  # the cache, not the step, sets the GPU
    gpu = report.state_bytes + forty + per_token * 24  # 41 samples: 48 tokens more
    code = main(flags + ["--plan-gpu-memory-gib", repr(gpu / GIB)])
    err = capsys.readouterr().err
    assert code == 1, err
    assert re.search(r"; the smallest change that fits: add --inference-max-requests 40 "
                     r"\(waves of 1, prompt retained, [\d.]+ MiB per GPU\)\n$", err), err
    for rows, code in ((40, 0), (41, 1)):
        got = main(flags + ["--plan-gpu-memory-gib", repr(gpu / GIB),
                            "--inference-max-requests", str(rows)])
        assert got == code, (rows, capsys.readouterr())


@pytest.mark.parametrize("flags, message", [
    (["--plan-prompt-length", "60"], "error: --plan-prompt-length 60 + rl_max_response_length "
                                     "12 = 72 positions: max_position_embeddings is 64\n"),
    (["--world-size", "0"], "error: --world-size must be > 0, got 0\n"),
])
def test_bad_plan_flags_are_refused_by_name(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(TINY + flags)
    assert e.value.code == 2 and capsys.readouterr().err == message
