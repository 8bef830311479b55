"""The main job as a user runs it: run directories, checkpoints on disk, and user errors.

- ``--save`` into a directory that cannot be written is refused at start with one line.
- A damaged checkpoint (a truncated shard, index or common state) is refused, naming the
  file, the iteration and the newest intact iteration; ``--load <save>/iter_<step>`` resumes
  from that one.
- A resumed run continues its run directory by default: ``metrics.jsonl`` holds the whole run
  (records from the checkpoint's step on are dropped and written again) and
  ``reward_curve.png`` is drawn from it.
- Two runs started in the same second get a run directory each.
- From the command line, errors a user causes print one ``error:`` line and exit with status
  2; other errors keep their traceback.
"""

import shutil
import threading
import time

import pytest
from helpers.train_runs import FAST, TRAIN, _records, _run

from scalerlt_mcore.app.checkpoint import CheckpointError
from scalerlt_mcore.app.config import ConfigError, parse_args
from scalerlt_mcore.app.metrics import CLOCK_KEYS
from scalerlt_mcore.app.trainer import TIMED_METRICS
from scalerlt_mcore.mcore_compat import dist_checkpoint_files

TIMESTAMP = "runs/20260101-000000"


def _untimed(records: list) -> list:
    return [{k: v for k, v in r.items() if k not in TIMED_METRICS + CLOCK_KEYS} for r in records]


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A 3-step run (2 warm-up steps, 1 RL step) saving after every step: (checkpoint
    root, run dir)."""
    from scalerlt_mcore.app.train import run

    root = tmp_path_factory.mktemp("saved")
    ckpt, run_dir = root / "ckpt", root / "run"
    run(parse_args(FAST + ["--train-iters", "3", "--save", str(ckpt), "--save-interval", "1",
                           "--run-dir", str(run_dir)]))
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "iter_0000001", "iter_0000002", "iter_0000003", "latest"]
    return ckpt, run_dir


# ---- damaged checkpoints ----------------------------------------------------------------------


def _largest_shard(ckpt_iter):
    return max(ckpt_iter.glob("*.distcp"), key=lambda p: p.stat().st_size).name


# MCore 0.19 has no common.pt: its common state is in the shards
@pytest.mark.parametrize("victim", ["shard", *(f for f in dist_checkpoint_files()
                                              if f != "metadata.json")])
def test_damaged_checkpoint_is_refused_naming_file_and_iteration(saved_run, tmp_path, victim):
    from scalerlt_mcore.app.train import run

    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved_run[0], ckpt)
    newest = ckpt / "iter_0000003"
    damaged = newest / (_largest_shard(newest) if victim == "shard" else victim)
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])  # truncated copy
    with pytest.raises(CheckpointError) as err:
        run(parse_args(FAST + ["--train-iters", "4", "--load", str(ckpt),
                               "--run-dir", str(tmp_path / "run")]))
    message = str(err.value)
    assert f"checkpoint iteration 3 ({newest}) is damaged: {damaged} is " in message, message
    assert ("truncated" if victim == "shard" else "unreadable") in message, message
    assert message.endswith("The newest intact iteration is 2: resume from it with "
                            f"--load {ckpt / 'iter_0000002'}"), message
    assert not (tmp_path / "run").exists(), "refused before anything was written"


def test_resume_from_an_iteration_continues_its_run_dir(saved_run, tmp_path, monkeypatch,
                                                        capsys):
    """``--load <save>/iter_2`` without ``--run-dir``: the run goes on in the checkpoint's run
    directory; its metrics.jsonl ends as the uninterrupted run's (records from step 2 on
    dropped and written again by the same steps) and the curve is drawn from all of it."""
    from scalerlt_mcore.app.train import run

    ckpt, run_dir = saved_run
    before = _records(run_dir)
    monkeypatch.chdir(tmp_path)
    run(parse_args(FAST + ["--train-iters", "3", "--load", str(ckpt / "iter_0000002")]))
    out = capsys.readouterr().out
    assert not (tmp_path / "runs").exists(), "a new run dir was made"
    assert _untimed(_records(run_dir)) == _untimed(before)
    assert [(r["kind"], r["step"]) for r in before] == [
        ("eval", 0), ("sft", 0), ("sft", 1), ("train", 2), ("eval", 3)]
    assert f"{run_dir / 'metrics.jsonl'}: dropped 2 records from step 2 on" in out, out
    assert f"reward curve: {run_dir / 'reward_curve.png'} (steps 0-3 of metrics.jsonl)" in out


def test_resume_with_a_kl_penalty_needs_the_checkpoints_reference(tmp_path):
    """A checkpoint past the warm-up saved without a KL penalty has no reference to restore:
    resuming it with one is refused (the policy at the start of RL cannot be rebuilt)."""
    from scalerlt_mcore.app.train import run

    ckpt = str(tmp_path / "ckpt")
    run(parse_args(FAST + ["--train-iters", "3", "--grpo-kl-beta", "0", "--save", ckpt,
                           "--run-dir", str(tmp_path / "run"), "--no-plot"]))
    with pytest.raises(CheckpointError, match=r"iter_0000003 \(step 3, past the warm-up\) "
                                              r"holds no KL reference"):
        run(parse_args(FAST + ["--train-iters", "4", "--load", ckpt, "--no-plot",
                               "--override-opt-param-scheduler", "true"]))


# ---- Megatron's --manual-gc ------------------------------------------------------------------


@pytest.mark.parametrize("manual", [False, True])
def test_manual_gc_collects_only_at_its_interval(tmp_path, monkeypatch, manual):
    """``--manual-gc``: automatic collection is off during the steps, ``gc.collect()`` runs once
    at start and after every ``--manual-gc-interval`` steps, and collection is on again after
    the run. Without it nothing changes."""
    import gc

    import scalerlt_mcore.app.train as train

    events = []
    real_collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *a: events.append("collect") or real_collect(*a))
    monkeypatch.setattr(train.RLTrainer, "sft_step", _recording(
        train.RLTrainer.sft_step, lambda: events.append(("step", gc.isenabled()))))
    flags = ["--manual-gc", "true", "--manual-gc-interval", "2"] if manual else []
    train.run(parse_args(FAST + ["--train-iters", "4", "--rl-warmup-sft-steps", "4",
                                 "--run-dir", str(tmp_path / "run"), "--no-plot"] + flags))
    assert gc.isenabled()
    if manual:
        assert events == ["collect", ("step", False), ("step", False), "collect",
                          ("step", False), ("step", False), "collect"]
    else:
        assert events == [("step", True)] * 4


def _recording(method, record):
    def wrapped(self, *args, **kwargs):
        record()
        return method(self, *args, **kwargs)
    return wrapped


# ---- run directories --------------------------------------------------------------------------


def test_two_runs_in_the_same_second_get_their_own_run_dirs(tmp_path, monkeypatch):
    from scalerlt_mcore.app.train import run

    strftime = time.strftime
    monkeypatch.setattr(time, "strftime", lambda fmt, *args: TIMESTAMP if fmt.startswith("runs/")
                        else strftime(fmt, *args))
    monkeypatch.chdir(tmp_path)
    for _ in range(2):
        run(parse_args(FAST + ["--train-iters", "1", "--no-plot"]))
    runs = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert runs == ["20260101-000000", "20260101-000000-2"]
    for name in runs:
        records = _records(tmp_path / "runs" / name)
        assert [(r["kind"], r["step"]) for r in records] == [("eval", 0), ("sft", 0), ("eval", 1)]


def test_run_dirs_made_at_once_are_distinct(tmp_path, monkeypatch):
    from scalerlt_mcore.app.rundir import make_run_dir

    monkeypatch.setattr(time, "strftime", lambda fmt, *args: TIMESTAMP)
    monkeypatch.chdir(tmp_path)
    made, start = [], threading.Barrier(8)

    def make():
        start.wait()
        made.append(make_run_dir())

    threads = [threading.Thread(target=make) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(made)) == 8 and all(p.is_dir() for p in made)


# ---- user errors: one line, no traceback --------------------------------------------------------


@pytest.mark.parametrize("argv, line", [
    (["--train-iter", "3"], "error: unknown key 'train_iter' on the command line"),
    (["--config", "bad.yaml"], "error: key 'num_layers' expects int, got 2.5"),
    (["--load", "nowhere"], "error: no checkpoint to load: nowhere does not exist"),
    (["--save", "a_file/ckpt"], "error: save: cannot write to a_file/ckpt (Not a directory)"),
])
def test_user_errors_print_one_line_and_exit_2(tmp_path, argv, line):
    """``line``: how the one line starts."""
    (tmp_path / "bad.yaml").write_text("num_layers: 2.5\n")
    (tmp_path / "a_file").write_text("not a directory\n")
    proc = _run(TRAIN + FAST + ["--train-iters", "3"] + argv, tmp_path, timeout=400)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(line), errors
    assert proc.stderr.rstrip().splitlines()[-1] == errors[0]
    assert proc.stdout == "", "refused before the run started"


def test_cli_keeps_the_traceback_of_internal_errors(monkeypatch, capsys):
    from scalerlt_mcore.app import train

    def fails(error):
        def run(cfg):
            raise error
        return run

    monkeypatch.setattr(train, "run", fails(RuntimeError("an internal error")))
    with pytest.raises(RuntimeError, match="an internal error"):
        train.cli(FAST)
    monkeypatch.setattr(train, "run", fails(ConfigError("a user's error")))
    with pytest.raises(SystemExit) as exit_:
        train.cli(FAST)
    assert exit_.value.code == 2 and capsys.readouterr().err == "error: a user's error\n"
