"""What a run prints and logs, and its one-line errors from the command line.

- The progress bar is drawn only on a terminal, described ``warm-up`` during the warm-up and
  ``RL`` after it (written to a file, the log lines alone: ``tests/app/test_train_signals.py``).
- Several configuration problems are one ``error:`` line; Megatron's ``--sequence-parallel``
  and ``--context-parallel-size`` are accepted keys, any other value than the default refused
  with the reason (a real command).
- ``scalerlt_mcore.generate`` errors are one line too (a real command for a missing
  checkpoint); generate and export, one process each, read a tensor-parallel run's config at
  TP 1 with the vocabulary the run padded.
- The reward plot says what it plots (sampled rollouts, held-out greedy) and marks the end of
  the supervised warm-up.
- Weights & Biases in offline mode (no network): the run's scalars, by step, in a W&B run
  under ``--wandb-save-dir``; without the package ``--wandb-project`` is refused at start.
"""

import importlib.util
import io
import json
import re
import sys

import pytest
from helpers.train_runs import FAST, TRAIN, _run

from scalerlt_mcore.app import metrics
from scalerlt_mcore.app.config import ConfigError, parse_args
from scalerlt_mcore.app.train import one_line, progress_bar

GENERATE = [sys.executable, "-m", "scalerlt_mcore.generate"]


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_the_bar_is_drawn_on_a_terminal_only_and_says_warm_up_then_rl():
    tty, file = _Terminal(), io.StringIO()
    bar = progress_bar(0, 4, 2, enabled=True, stream=tty)
    quiet = progress_bar(0, 4, 2, enabled=True, stream=file)
    hidden = progress_bar(0, 4, 2, enabled=False, stream=_Terminal())
    for step in range(4):
        if step == 2:
            for b in (bar, quiet, hidden):
                b.set_description("RL")
        for b in (bar, quiet, hidden):
            b.update()
    for b in (bar, quiet, hidden):
        b.close()
    drawn = re.findall(r"(warm-up|RL): +\d+%\|[^|]*\| (\d)/4", tty.getvalue())
    assert drawn[0] == ("warm-up", "0") and drawn[-1] == ("RL", "4"), drawn
    assert all((name == "RL") == (int(done) >= 2) for name, done in drawn), drawn
    assert file.getvalue() == "" and hidden.disable


def test_a_resumed_run_past_the_warm_up_starts_as_rl():
    bar = progress_bar(3, 5, 2, enabled=True, stream=_Terminal())
    assert bar.desc == "RL"
    bar.close()


def test_one_line_joins_a_list_of_problems():
    assert one_line("invalid configuration:\n  a is bad\n  b is bad") == (
        "invalid configuration: a is bad; b is bad")
    assert one_line("one problem") == "one problem"
    assert one_line("first\nsecond") == "first; second"


def test_parallelism_flags_are_refused_with_the_reason_on_one_line(tmp_path):
    proc = _run(TRAIN + FAST + ["--sequence-parallel", "true", "--context-parallel-size", "2"],
                tmp_path, timeout=600)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        "error: invalid configuration: sequence_parallel (--sequence-parallel) must be false: "
        "the looped GPT does not support sequence parallelism; context_parallel_size "
        "(--context-parallel-size) must be 1, got 2: the looped GPT does not support context "
        "parallelism"], proc.stderr


def test_generate_errors_are_one_line(tmp_path, capsys):
    proc = _run(GENERATE + ["--load", str(tmp_path / "missing"), "--prompt", "abca>"], tmp_path,
                timeout=600)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [
        f"error: no checkpoint to load: {tmp_path / 'missing'} does not exist"], proc.stderr
    from scalerlt_mcore.generate import cli

    with pytest.raises(SystemExit) as exit_:
        cli(["--prompt", "x"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == (
        "error: the following arguments are required: --load (see python -m "
        "scalerlt_mcore.generate --help)\n")


def test_the_reward_plot_marks_the_warm_up_and_names_held_out_greedy(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    figures, savefig = [], Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (figures.append(fig),
                                                                  savefig(fig, *a, **k)))
    records = ([{"kind": "sft", "step": s} for s in range(3)]
               + [{"kind": "train", "step": s, "reward_mean": 0.5} for s in range(3, 6)]
               + [{"kind": "eval", "step": s, "eval_reward": 0.5, "eval_per_loop": [0.4, 0.5]}
                  for s in (0, 5)])
    assert metrics.plot_rewards(records, tmp_path / "r.png").stat().st_size > 0
    (fig,) = figures
    reward, per_loop = fig.axes
    labels = [t.get_text() for t in reward.get_legend().get_texts()]
    assert labels == ["sampled rollouts (training prompts)", "held-out greedy",
                      "end of warm-up (step 3)"]
    assert "end of warm-up (step 3)" in [t.get_text() for t in per_loop.get_legend().get_texts()]
    assert "held-out greedy" in per_loop.get_title()
    marks = [line.get_xdata()[0] for line in reward.lines if line.get_linestyle() == "--"]
    assert marks == [3]


def test_wandb_project_without_the_package_is_refused(monkeypatch):
    cfg = parse_args(FAST + ["--wandb-project", "p"])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match=r"^wandb_project: needs the wandb package"):
        metrics.check_wandb(cfg)


def test_wandb_offline_run_logs_every_scalar(tmp_path, monkeypatch):
    import wandb

    from scalerlt_mcore.app.train import run

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logged, runs, init = [], [], wandb.init

    def recording_init(**kwargs):
        live = init(**kwargs)
        runs.append((kwargs, live))
        log = live.log
        live.log = lambda data, step: (logged.append((step, data)), log(data, step=step))
        return live

    monkeypatch.setattr(wandb, "init", recording_init)
    run(parse_args(FAST + ["--train-iters", "3", "--wandb-project", "proj", "--wandb-exp-name",
                           "exp", "--wandb-save-dir", str(tmp_path / "wandb"), "--run-dir",
                           str(tmp_path / "run"), "--no-plot", "true"]))
    (kwargs, live), = runs
    assert (kwargs["project"], kwargs["name"]) == ("proj", "exp")
    assert kwargs["config"]["train_iters"] == 3
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert logged == [(r["step"], metrics.scalars(r)) for r in records]
    assert {"train/reward_mean", "sft/loss", "eval/eval_reward"} <= set().union(
        *(d for _, d in logged))
    assert list((tmp_path / "wandb" / "wandb").glob("offline-run-*/run-*.wandb"))


def test_one_process_commands_read_a_tensor_parallel_run_at_tp1():
    """generate and export run one process: a TP=2 run's config becomes TP 1 with the
    vocabulary the run padded (49 -> 256 at TP 2, not 128), so its checkpoint's tensors fit."""
    from scalerlt_mcore.app.pretrained import run_vocab_size
    from scalerlt_mcore.generate import one_process

    cfg = parse_args(FAST[:2] + ["--tensor-model-parallel-size", "2",
                                  "--make-vocab-size-divisible-by", "128"])
    padded = run_vocab_size(cfg)
    assert padded == 256
    single = one_process(cfg)
    assert (single.model.tensor_model_parallel_size, run_vocab_size(single)) == (1, padded)
