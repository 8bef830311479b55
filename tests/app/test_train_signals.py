"""The main job under a scheduler, with real processes: a SIGTERM to the whole process group
(what Slurm sends, and torchrun forwards) during a run with periodic saves ends it after the
current step with a complete checkpoint and status 0, for one process and for torchrun DP=2;
the same job launched as two one-process torchrun nodes (c10d rendezvous on localhost) follows
the global rank: its records and checkpoint files are the single-node job's.

One process and the DP=2 job are started in a session of their own (``setsid``) and signalled
with ``kill -TERM -- -PGID`` once a periodic save has been logged (from the first save on,
MCore 0.16's writer used to keep a helper process in the group, which the signal killed).
"""

import os
import re
import shutil
import signal
import subprocess
import time

import pytest
from helpers.train_runs import ENV, TRAIN, TWO_NODES, _flags, _records, _run, _untimed

from scalerlt_mcore.app.checkpoint import checkpoint_problem
from scalerlt_mcore.testing import _free_port

# 2 prompts x 4 responses per step, 2 evaluation prompts, no periodic evaluation, a save after
# every step
JOB = _flags(global_batch_size=8, eval_iters=1, eval_interval=0, train_iters=40, no_plot=True,
             save_interval=1)
"""torchrun's multi-node form, one process per node (the multi-node line of docs/running.md)."""
STOPPED = re.compile(r"interrupted: checkpoint saved after step (\d+)")


def _torchrun(*launch: str) -> list:
    return [TRAIN[0], "-m", "torch.distributed.run", *launch, "-m", "scalerlt_mcore.train"]


def _signal_group_after(cmd: list, cwd, line: str, timeout: float = 900):
    """Start ``cmd`` in a new session, wait for the stdout ``line``, then SIGTERM its process
    group (``kill -TERM -- -PGID``); -> (return code, stdout, stderr)."""
    err = (cwd / "stderr.txt").open("w")
    proc = subprocess.Popen(cmd, cwd=cwd, env=ENV, stdout=subprocess.PIPE, stderr=err,
                            text=True, start_new_session=True)
    try:
        seen, deadline = [], time.monotonic() + timeout
        for out in proc.stdout:
            seen.append(out)
            if out.startswith(line) or time.monotonic() > deadline:
                break
        os.killpg(proc.pid, signal.SIGTERM)
        seen += proc.communicate(timeout=timeout)[0].splitlines(keepends=True)
    finally:
        proc.kill()
        err.close()
    assert _group_gone(proc.pid), "a process of the job's group outlived it"
    return proc.returncode, "".join(seen), (cwd / "stderr.txt").read_text()


def _assert_clean_stop(out: str, err: str, ckpt) -> int:
    """The run said it stopped with a checkpoint, which is complete and ``latest``; -> its
    step."""
    lines = [x for x in out.splitlines() if x.strip()]
    stopped = STOPPED.fullmatch(lines[-1])
    assert stopped, f"last line {lines[-1]!r}\n{out}\n{err[-3000:]}"
    k = int(stopped[1])
    assert f"saved checkpoint iter {k} to {ckpt.name} in " in out, out
    assert (ckpt / "latest").read_text() == f"iter_{k:07d}"
    assert checkpoint_problem(ckpt / f"iter_{k:07d}") is None
    assert "Traceback" not in err and "BrokenPipeError" not in err, err[-3000:]
    return k


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """One process, keeping the last 2 checkpoints, signalled after its second save:
    (return code, stdout, stderr, checkpoint root)."""
    cwd = tmp_path_factory.mktemp("one")
    rc, out, err = _signal_group_after(
        TRAIN + JOB + ["--save", "ckpt", "--save-keep-last", "2", "--run-dir", "run"], cwd,
        "saved checkpoint iter 2 ")
    return rc, out, err, cwd / "ckpt"


def _group_gone(pgid: int, wait: float = 20) -> bool:
    """Whether no process of group ``pgid`` is left (within ``wait`` seconds)."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def test_sigterm_to_the_group_saves_a_complete_checkpoint_and_exits_0(one_process):
    rc, out, err, ckpt = one_process
    assert rc == 0, f"exit {rc}\n{out}\n{err[-3000:]}"
    k = _assert_clean_stop(out, err, ckpt)
    # --save-keep-last 2: the two newest iterations are kept
    assert sorted(p.name for p in ckpt.glob("iter_*")) == [f"iter_{k - 1:07d}", f"iter_{k:07d}"]


def test_logs_have_no_library_warnings_and_no_bar_in_a_file(one_process):
    """Written to a file: log lines only (no tqdm bar), and none of the deprecation warnings
    MCore and torch raise from their own code."""
    _, out, err, _ = one_process
    assert "it/s" not in err and "warm-up:" not in err and "RL:" not in err, err[-3000:]
    assert "Warning" not in err, err[-3000:]
    assert re.search(r"^warm-up step    1 \| ", out, re.M) and re.search(r"^step    2 \| ", out,
                                                                         re.M), out


def test_an_incomplete_iteration_is_named_with_the_newest_complete_one(one_process, tmp_path):
    """A save cut short leaves ``iter_<step>`` without ``.metadata`` (and ``metadata.json``,
    written after it): ``--load`` of it says so and names the newest complete iteration."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(one_process[3], ckpt)
    *older, newest = sorted(ckpt.glob("iter_*"))
    for name in (".metadata", "metadata.json"):
        (newest / name).unlink()
    proc = _run(TRAIN + JOB + ["--load", str(newest)], tmp_path, timeout=600)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-3000:]
    step = int(newest.name[5:])
    assert proc.stderr.splitlines() == [
        f"error: checkpoint iteration {step} ({newest}) is incomplete: it has no .metadata "
        f"(its save did not finish); refusing to resume from it. The newest intact iteration "
        f"is {step - 1}: resume from it with --load {older[-1]}"], proc.stderr


def test_a_resume_logs_what_it_loaded(one_process, tmp_path, capsys):
    from scalerlt_mcore.app.config import parse_args
    from scalerlt_mcore.app.train import run

    ckpt = one_process[3]
    k = int((ckpt / "latest").read_text()[5:])
    run(parse_args(JOB + ["--load", str(ckpt), "--exit-interval", str(k + 1), "--run-dir",
                          str(tmp_path / "run")]))
    out = capsys.readouterr().out
    assert f"loaded {ckpt / f'iter_{k:07d}'}, resuming at step {k}\n" in out, out
    assert out.rstrip().endswith(f"exit_interval reached: nothing saved (no --save) after step "
                                 f"{k + 1}"), out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """torchrun DP=2 (``cpu_2rank``'s layout on the tiny config), signalled after its second
    save: (return code, stdout, stderr, checkpoint root, run dir)."""
    cwd = tmp_path_factory.mktemp("dp2")
    cmd = _torchrun("--nproc-per-node", "2", "--master-port", str(_free_port()))
    rc, out, err = _signal_group_after(cmd + JOB + ["--save", "ckpt", "--run-dir", "run"], cwd,
                                       "saved checkpoint iter 2 ")
    return rc, out, err, cwd / "ckpt", cwd / "run"


def test_torchrun_sigterm_to_the_group_saves_a_complete_checkpoint(two_ranks):
    """Both ranks stop after the same step (they agree on the signal), save, and exit 0;
    torchrun itself reports the signal it got (its own status is torch's: nonzero)."""
    rc, out, err, ckpt, _ = two_ranks
    _assert_clean_stop(out, err.replace("Traceback", ""), ckpt)  # torchrun's own traceback
    assert "ChildFailedError" not in err and "exitcode" not in err, err[-3000:]
    assert "death signal, shutting down workers" in err, err[-3000:]
    assert "Traceback" not in err.split("death signal, shutting down workers")[0], err[-3000:]
    assert rc != 0


def test_two_nodes_follow_the_global_rank(two_ranks, tmp_path):
    """``torchrun --nnodes 2 --nproc-per-node 1`` (two agents, c10d rendezvous on localhost):
    LOCAL_RANK is 0 on both. The job stops at ``--exit-interval 2`` with a checkpoint; its
    records equal the single-node DP=2 job's (rank 1 drew rank 1's data) and each global rank
    wrote its own checkpoint files."""
    port, procs = _free_port(), []
    launch = TWO_NODES + ["--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", "two-nodes"]
    cmd = _torchrun(*launch) + JOB + ["--save", "ckpt", "--run-dir", "run", "--exit-interval",
                                      "2"]
    logs = [(tmp_path / f"node{n}.out").open("w") for n in range(2)]
    try:
        for n in range(2):
            procs.append(subprocess.Popen(cmd, cwd=tmp_path, env=ENV, stdout=logs[n],
                                          stderr=subprocess.STDOUT))
        codes = [p.wait(timeout=900) for p in procs]
    finally:
        for p in procs:
            p.kill()
        for f in logs:
            f.close()
    text = "\n".join((tmp_path / f"node{n}.out").read_text() for n in range(2))
    assert codes == [0, 0], text[-4000:]
    assert "data-parallel ranks: 2, tensor-parallel ranks: 1" in text, text[-4000:]
    assert "exit_interval reached: checkpoint saved after step 2" in text, text[-4000:]
    ckpt = tmp_path / "ckpt" / "iter_0000002"
    assert checkpoint_problem(ckpt) is None
    single = two_ranks[3] / "iter_0000002"
    assert sorted(p.name for p in ckpt.glob("*.distcp")) == sorted(
        p.name for p in single.glob("*.distcp"))
    assert any(p.name.startswith("__1_") for p in ckpt.glob("*.distcp"))
    mine = [_untimed(r) for r in _records(tmp_path / "run")]
    theirs = [_untimed(r) for r in _records(two_ranks[4]) if r["step"] < 2]
    assert mine == theirs[:len(mine)] and len(mine) == 3, (mine, theirs)
