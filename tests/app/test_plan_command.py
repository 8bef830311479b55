"""``python -m scalerlt_mcore.plan`` (scalerlt_mcore/app/plan.py): does a run fit its GPUs?

- Each public checkpoint's 8 x H20 config, beside a directory with its real config.json (no
  weights), is planned at full size on ``meta``: the per-GPU breakdown, the four schedules and
  the run's own plan are printed, and the model state is the parameter count's bytes.
- At a small shape the predictions are held against a real CPU run: the command's predicted
  saved bytes of naive micro-batch 1 and of joint replay (the plan it picks under two GPU
  sizes) are within 10% of ``SavedTensorProbe``'s peak of the run's own schedule training a
  group of that P, S, G on CPU.
- A run that cannot fit ends with one line naming the numbers, status 1.
- Tensor parallelism: at TP 2 the model is rank 0's shards (a real 2-rank TP run's saved bytes
  within 10%, about half the parameters); a run that fits only at TP 2 is told so; a family
  that refuses TP is not offered it.
"""

import dataclasses
import re
import subprocess
import sys
from types import SimpleNamespace
from typing import Optional

import pytest
import torch
import torch.distributed as dist
from helpers.h20 import CONFIGS, REPO, checkpoint_dir
from helpers.sp import make_group

from scalerlt_mcore.app.config import model_config, objective_from, parse_args, schedule_from
from scalerlt_mcore.app.plan import (
    GIB,
    HEADROOM,
    at_degree,
    format_report,
    main,
    make_report,
    meta_model,
    parse,
    plan_text,
    shortfall,
    tp_context,
    tree_segments,
    wider_tp,
)
from scalerlt_mcore.app.pretrained import run_vocab_size
from scalerlt_mcore.app.runtime import build_model
from scalerlt_mcore.rl.batch import RLGroup
from scalerlt_mcore.rl.objective import rl_forward_step
from scalerlt_mcore.shared_prefix import SavedTensorProbe
from scalerlt_mcore.shared_prefix.planner import GroupPlan, Planner
from scalerlt_mcore.testing import model_parallel_context, run_distributed, thread_count

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


def _measured_peak(plan, recompute: bool = False, run: list = RUN,
                   shape: tuple = (P, S, G)) -> int:
    """``SavedTensorProbe``'s peak of the run's schedule training one group of ``shape`` (P,
    S, G) by ``plan`` on CPU (the ``run`` flags' model as the run builds it, real weights;
    ``recompute``: with ``RECOMPUTE``); inside the run's MCore model-parallel state."""
    extra = (["--shared-prefix-schedule", "naive", "--micro-batch-size", str(plan.wave_size)]
             if plan.naive else
             ["--shared-prefix-wave-size", str(plan.wave_size),
              "--shared-prefix-prompt", "retain" if plan.retain else "recompute"])
    cfg = parse_args(run + extra + RECOMPUTE * recompute)
    model = build_model(cfg, model_config(cfg, "cpu"), run_vocab_size(cfg), "cpu")
    R = cfg.model.looped_num_loops
    P_, S_, G_ = shape
    group = make_group(G_, P_, S_, R, seed=0, dtype=torch.float32, vocab=model.vocab_size)
    with SavedTensorProbe(model) as probe:
        schedule_from(cfg, model)(
            forward_step_func=rl_forward_step(objective_from(cfg)), data_iterator=iter([group]),
            model=model, num_microbatches=1, num_loops=R, seq_length=P_ + S_,
            micro_batch_size=G_)
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
    segments as prompt tokens): a long prompt, short responses (a small cache); one GPU of
    one prompt per step, so that no wider TP degree is tried before the prompt."""
    flags = TINY + ["--plan-prompt-length", "56", "--rl-max-response-length", "4",
                    "--world-size", "1", "--global-batch-size", str(G)]
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


def test_a_run_plan_over_the_gpu_names_a_budget_that_fits(capsys):
    """The run's own budget (1000 MiB) picks one wave of G, over a GPU that holds a smaller
    plan: the line names what the GPU leaves beside the model state as the
    --shared-prefix-memory-budget in MiB, to three digits (a tiny model's 2.46 MiB, not the
    whole MiB 2), with which the run fits (status 0)."""
    flags = TINY + ["--shared-prefix-wave-size", "auto", "--shared-prefix-memory-budget", "1000"]
    cfg, workload = parse(flags)
    with model_parallel_context(seed=1):
        report = make_report(cfg, workload)
    least = min(row.memory.peak_bytes for row in report.rows)
    gib = (report.state_bytes + (least + report.run_memory.peak_bytes) / 2) / GIB
    code = main(flags + ["--plan-gpu-memory-gib", repr(gib)])
    err = capsys.readouterr().err
    assert code == 1, err
    budget = re.fullmatch(r"error: the run's plan \(.+\) needs [\d.]+ MiB per GPU, the GPU has "
                          r"[\d.]+ MiB: set --shared-prefix-memory-budget ([\d.]+) \(MiB\) or "
                          r"lower\n", err)
    left = (gib * GIB - report.resident_bytes) / 2**20
    assert budget and float(budget[1]) == pytest.approx(left, rel=5e-3), (err, left)
    budgeted = flags[:-1] + [budget[1], "--plan-gpu-memory-gib", repr(gib)]
    assert main(budgeted) == 0, capsys.readouterr()


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
    but above it at 2: on one GPU the command names ``--looped-num-loops 2`` (the most loops
    that fit), and the run with it fits (status 0); on two it names TP 2 first (loops come
    after it), and the run at TP 2 fits."""
    flags = TINY + RECOMPUTE + ["--world-size", "1"]
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
    two = flags + budget + ["--world-size", "2"]
    assert main(two) == 1
    err = capsys.readouterr().err
    assert re.search(r"; the smallest change that fits: add --tensor-model-parallel-size 2 "
                     r"\(waves of \d+, prompt [\w ]+, [\d.]+ MiB per GPU\)\n$", err), err
    assert main(two + ["--tensor-model-parallel-size", "2"]) == 0, capsys.readouterr()


def test_model_state_over_the_gpu_is_refused_by_name(capsys):
    code = main(TINY + ["--plan-gpu-memory-gib", "1e-6"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert re.fullmatch(r"error: the model state and rollout cache need [\d.]+ MiB per GPU, the "
                        r"GPU has 0.00 MiB: lower --inference-max-requests \(the samples "
                        r"decoded at once\), --plan-prompt-length, --grpo-group-size or "
                        r"the prompts per GPU \(--global-batch-size\), or raise --world-size; "
                        r"neither fewer samples decoded at once, activation recompute, a wider "
                        r"tensor-parallel degree, fewer loops nor a shorter prompt fits\n",
                        err), err


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


# ---- tensor parallelism -----------------------------------------------------------------------

P2 = 12
GPT = ["--config", str(REPO / "configs" / "cpu_tp2.yaml")]
"""The tiny GPT config of TP 2 (fp32; 4 heads in 2 K/V groups; S 6, G 8 from the file)."""
GPT_PLAN = GPT + ["--world-size", "2", "--plan-prompt-length", str(P2)]
"""The plan command's flags: 2 GPUs, prompts of P2 (the file's TP 2: one data-parallel rank)."""


FAMILY_TP2 = {name: ["--config", str(REPO / "configs" / f"{name}_tiny_cpu.yaml"),
                      "--tensor-model-parallel-size", "2"]
              for name in ("ouro", "huginn", "nanbeige")}
"""The tiny Ouro (GQA, exit gate, sandwich norms), Huginn (MHA, prelude / coda, injection,
truncated backprop) and Nanbeige configs at TP 2, randomly initialised."""


def _tp_rank_peak(rank, world_size, plan, run, shape) -> int:
    """One rank of a 2-rank TP 2 run: ``_measured_peak`` of the ``run`` config's group of
    ``shape`` by ``plan``."""
    return _measured_peak(plan, run=run, shape=shape)


@pytest.mark.parametrize("run", [GPT, *FAMILY_TP2.values()], ids=["gpt", *FAMILY_TP2])
def test_predictions_at_tp2_match_a_two_rank_run(run):
    """At TP 2 the command plans rank 0's shards (its model on meta in a one-process TP 2
    context): naive micro-batch 1's and joint replay's predicted saved bytes are within 10% of
    ``SavedTensorProbe``'s peak on rank 0 of a real 2-rank gloo run at TP 2 training one group
    of the same P, S, G by the same plan, for the GPT layout and the looped families."""
    cfg, workload = parse(run + ["--world-size", "2", "--plan-prompt-length", str(P2)])
    assert cfg.model.tensor_model_parallel_size == 2
    shape = (P2, cfg.rl.rl_max_response_length, cfg.rl.grpo_group_size)
    with tp_context(cfg):
        report = make_report(cfg, workload)
    assert "TP 2, DP 1" in format_report(report)
    for row in (report.rows[0], report.rows[2]):
        got = run_distributed(_tp_rank_peak, 2, row.plan, run, shape,
                              tensor_model_parallel_size=2, mcore_seed=cfg.training.seed,
                              timeout=400)[0]
        err = abs(row.memory.saved_bytes / got - 1)
        print(f"\n[plan] TP 2 {row.name} {row.plan}: predicted {row.memory.saved_bytes} B, "
              f"measured {got} B on rank 0 ({err:.1%})")
        assert err <= RTOL, (row.plan, row.memory.saved_bytes, got)


def _report_at(flags: list, gpu: Optional[float] = None):
    """The command's report for ``flags`` (a GPU of ``gpu`` bytes where given), built in a
    context of the run's TP."""
    cfg, workload = parse(flags)
    if gpu is not None:
        workload = dataclasses.replace(workload, gpu_bytes=gpu)
    with tp_context(cfg):
        return make_report(cfg, workload)


def test_tp2_parameters_are_about_half_of_tp1():
    """The per-GPU parameters at TP 2 are rank 0's: between half and 0.6 of TP 1's (what is
    replicated over the TP ranks, about a tenth of this model, holds them above half: the
    position table, the injection's linear, the norms and the row-parallel biases)."""
    one, two = (_report_at(GPT_PLAN + ["--tensor-model-parallel-size", t]) for t in "12")
    ratio = two.state["parameters"] / one.state["parameters"]
    print(f"\n[plan] parameters per GPU: TP 1 {one.state['parameters']} B, TP 2 "
          f"{two.state['parameters']} B ({ratio:.3f})")
    assert 0.5 < ratio < 0.6, ratio
    text = format_report(two)
    assert re.search(rf"^  parameters +{two.state['parameters'] / 2**20:.2f}$", text, re.M)
    assert "per GPU, 2 loops" in text and "TP 2, DP 1" in text


def test_a_run_that_fits_only_at_tp2_is_told_to_add_it(capsys):
    """The GPT config at TP 1 with recompute (not a change left) on a GPU between what TP 2
    needs (the model state and the run's plan on a large GPU) and the least TP 1 needs (its
    model state and the smallest step of any row): status 1, the change named is TP 2; the
    same flags at TP 2: status 0."""
    flags = GPT_PLAN + RECOMPUTE + ["--shared-prefix-wave-size", "auto"]
    two = _report_at(flags + ["--tensor-model-parallel-size", "2"])
    one = _report_at(flags + ["--tensor-model-parallel-size", "1"])
    tight = _report_at(flags + ["--tensor-model-parallel-size", "1"], one.state_bytes + 1)
    need_two = two.resident_bytes + two.run_memory.peak_bytes
    least_one = one.state_bytes + min(row.memory.peak_bytes for row in tight.rows)
    assert need_two < least_one, (need_two, least_one)
    gpu = ["--plan-gpu-memory-gib", repr((need_two + least_one) / 2 / GIB)]
    code = main(flags + gpu + ["--tensor-model-parallel-size", "1"])
    err = capsys.readouterr().err
    assert code == 1, err
    assert re.search(r"; the smallest change that fits: add --tensor-model-parallel-size 2 "
                     r"\(waves of \d+, prompt [\w ]+, [\d.]+ MiB per GPU\)\n$", err), err
    assert main(flags + gpu + ["--tensor-model-parallel-size", "2"]) == 0, capsys.readouterr()


def test_a_run_that_refuses_tp_is_not_offered_it():
    """On a large GPU the GPT config at TP 1 is offered TP 2 (it fits there); with graphed
    decoding, which runs without tensor parallelism (``validate`` refuses it at TP 2), it is
    offered none."""
    cfg, workload = parse(GPT_PLAN + ["--tensor-model-parallel-size", "1"])
    assert re.fullmatch(r"add --tensor-model-parallel-size 2 \(waves of 4, prompt retained, "
                        r"[\d.]+ MiB per GPU\)", wider_tp(cfg, workload))
    cfg, workload = parse(GPT_PLAN + ["--tensor-model-parallel-size", "1",
                                      "--rl-decode-cuda-graph"])
    assert at_degree(cfg, 2, workload.world_size) is None
    assert wider_tp(cfg, workload) == ""
    assert not dist.is_initialized()


def test_tp_degrees_the_world_size_refuses_are_refused_by_name(capsys):
    with pytest.raises(SystemExit) as e:
        main(GPT_PLAN + ["--world-size", "3"])
    assert e.value.code == 2
    assert "world size (3) must be divisible by tensor_model_parallel_size (2)" in \
        capsys.readouterr().err


def test_two_tp2_contexts_in_a_row_leak_nothing():
    """The one-process TP 2 context (PyTorch's fake backend) twice in a row, a meta model
    built in each: MCore sees TP 2, and after each no process group is left and the threads
    do not grow."""
    from megatron.core import parallel_state

    cfg, _ = parse(GPT_PLAN)
    before = thread_count()
    for _ in range(2):
        with model_parallel_context(tensor_model_parallel_size=2):
            assert parallel_state.get_tensor_model_parallel_world_size() == 2
            assert parallel_state.get_data_parallel_world_size() == 1
            model = meta_model(cfg)
            assert model.embedding.word_embeddings.weight.shape[0] == run_vocab_size(cfg) // 2
        assert not dist.is_initialized()
        assert not parallel_state.model_parallel_is_initialized()
    del model
    assert thread_count() <= before, (before, thread_count())


def test_plan_words_name_a_prefix_state_of_layer_inputs():
    assert plan_text(GroupPlan(1, prompt_segments=4, state_kind="inputs")) == (
        "waves of 1, prompt recomputed in 4 segments, prefix state of layer inputs")
    assert plan_text(GroupPlan(2, retain=True)) == "waves of 2, prompt retained"
    assert plan_text(GroupPlan(3, naive=True, state_kind="inputs")) == "naive, micro-batch 3"
