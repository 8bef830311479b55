"""The user's own task and reward (``scalerlt_mcore/rl/user_task.py``).

- ``--rl-task jsonl:PATH`` / ``parquet:PATH`` rows scored by ``--rl-reward module:function``:
  a real ``python -m scalerlt_mcore.train`` run trains on a JSONL file with a reward module
  written here (every column reaches the reward); Parquet rows give the same problems.
- ``--rl-task module:factory`` (and ``file.py:factory``): a real run trains on a factory's task.
- The split guarantee holds: a dataset task's training draws (RL and warm-up) never give an
  evaluation prompt and the reverse, every row of a split is drawn; a factory's task whose
  draws break the split is refused naming the spec.
- Bad input is one line naming what is wrong: the module, the attribute, a result that is no
  Task, a row without ``prompt`` / ``answer``, a reward that raises or returns no float (the
  row and the file named).
"""

import itertools
import json
import re
import subprocess
import sys
import textwrap

import pytest
from helpers.train_runs import ENV, TRAIN, _flags

from scalerlt_mcore.app.config import ConfigError, parse_args, validate
from scalerlt_mcore.model.config import FieldError
from scalerlt_mcore.rl import get_task
from scalerlt_mcore.rl.tasks import split_of
from scalerlt_mcore.rl.user_task import RewardError

WORDS = ["".join(w) for n in (2, 3) for w in itertools.product("abc", repeat=n)]
"""36 prompts' strings (of both splits)."""

REWARD = '''
import json, os

def reward(response_text, row):
    with open(os.environ["REWARD_LOG"], "a") as f:
        f.write(json.dumps(row) + "\\n")
    return 1.0 if response_text == row["answer"] else 0.1 * row["bonus"]

def broken(response_text, row):
    return 1 / 0

def text(response_text, row):
    return "high"
'''

TASK = '''
import random
from scalerlt_mcore.rl import Problem, Task

class Rotate(Task):
    name = "rotate"
    def __init__(self, letters="ab"):
        self.letters = letters
    def _problem(self, rng):
        s = "".join(rng.choices(self.letters, k=rng.randint(2, 3)))
        return Problem(s + ">", s[-1] + s[:-1])
    max_prompt_chars = 4
    max_answer_chars = 3

class Leaky(Rotate):
    def sample(self, seed, n, split="train"):  # ignores the split
        rng = random.Random(seed)
        return [self._problem(rng) for _ in range(n)]

def make(**options):
    return Rotate(**options)

def leaky():
    return Leaky()

def not_a_task():
    return 3
'''


def _rows() -> list[dict]:
    return [{"prompt": w + ">", "answer": w[::-1], "bonus": len(w)} for w in WORDS]


@pytest.fixture
def user_files(tmp_path):
    """A JSONL file, the same rows as Parquet, a reward module and a task module in tmp_path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = _rows()
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    (tmp_path / "myreward.py").write_text(textwrap.dedent(REWARD))
    (tmp_path / "mytask.py").write_text(textwrap.dedent(TASK))
    sys.path.insert(0, str(tmp_path))
    yield tmp_path
    sys.path.remove(str(tmp_path))
    for name in ("myreward", "mytask"):
        sys.modules.pop(name, None)


def _ok(proc) -> list:
    """The non-empty stdout lines of a run that must have succeeded."""
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return [line for line in proc.stdout.splitlines() if line.strip()]


def _train(tmp_path, **flags) -> subprocess.CompletedProcess:
    cmd = TRAIN + _flags(train_iters=2, rl_warmup_sft_steps=1, eval_iters=1, eval_interval=0,
                         no_plot=True, run_dir=str(tmp_path / "run"), **flags)
    env = {**ENV, "REWARD_LOG": str(tmp_path / "reward.log")}
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=240)


def test_a_run_trains_on_jsonl_rows_scored_by_the_users_reward(user_files):
    lines = _ok(_train(user_files, rl_task="jsonl:rows.jsonl", rl_task_options={},
                       rl_reward="myreward:reward", rl_partial_credit=False))
    assert lines[-1].startswith("final mean reward "), lines[-1]
    seen = [json.loads(x) for x in (user_files / "reward.log").read_text().splitlines()]
    assert seen and all(r in _rows() for r in seen)  # every column, the row unchanged
    assert {split_of(r["prompt"]) for r in seen} == {"train", "eval"}  # RL and evaluation


def test_a_run_trains_on_a_factorys_task_from_a_file(user_files):
    lines = _ok(_train(user_files, rl_task="mytask.py:make", rl_task_options={"letters": "bc"}))
    assert lines[-1].startswith("final mean reward "), lines[-1]


def test_parquet_rows_are_the_jsonl_rows(user_files):
    jsonl = get_task("jsonl:" + str(user_files / "rows.jsonl"), rl_reward="myreward:reward")
    parquet = get_task("parquet:" + str(user_files / "rows.parquet"),
                       rl_reward="myreward:reward")
    assert parquet.rows == jsonl.rows == _rows()
    for split in ("train", "eval"):
        assert parquet.sample(3, 20, split) == jsonl.sample(3, 20, split)
    cfg = parse_args(_flags(rl_task="parquet:" + str(user_files / "rows.parquet"),
                            rl_task_options={}, rl_reward="myreward:reward",
                            rl_partial_credit=False))
    validate(cfg, 1)


def test_dataset_draws_keep_the_split(user_files):
    task = get_task("jsonl:" + str(user_files / "rows.jsonl"))
    train = {p.prompt for s in range(200) for p in task.sample(s, 8)}
    train |= {prompt for s in range(200) for prompt, _ in task.supervised_pairs(s, 8)}
    evals = {p.prompt for s in range(200) for p in task.sample(s, 8, split="eval")}
    assert {split_of(p) for p in train} == {"train"} and {split_of(p) for p in evals} == {"eval"}
    assert len(train) + len(evals) == len(WORDS) and evals  # every row of its split is drawn
    problem = task.sample(0, 1)[0]
    assert task.reward(problem, problem.answer) == 1.0 and task.reward(problem, "x") == 0.0


def test_a_dataset_without_evaluation_rows_is_refused(tmp_path):
    train_only = [w for w in WORDS if split_of(w + ">") == "train"]
    (tmp_path / "t.jsonl").write_text("".join(
        json.dumps({"prompt": w + ">", "answer": w}) + "\n" for w in train_only))
    flags = _flags(rl_task=f"jsonl:{tmp_path}/t.jsonl", rl_task_options={})
    with pytest.raises(ConfigError, match=f"{tmp_path}/t.jsonl: none of its {len(train_only)} "
                                          "rows is of the eval split"):
        validate(parse_args(flags), 1)


def test_a_factorys_task_that_breaks_the_split_is_refused(user_files):
    task = get_task("mytask:leaky")
    with pytest.raises(ValueError, match=r"rl_task mytask:leaky: a eval draw returned the "
                                         r"prompt '\w+>' of the train split"):
        for seed in range(20):
            task.sample(seed, 8, split="eval")
    good = get_task("mytask:make", letters="bc")
    assert {split_of(p.prompt) for p in good.sample(0, 30, split="eval")} == {"eval"}


@pytest.mark.parametrize("flags, message", [
    (dict(rl_task="nomodule:make"), "rl_task nomodule:make: cannot import 'nomodule' "
     "(ModuleNotFoundError: No module named 'nomodule')"),
    (dict(rl_task="mytask:nothing"), "rl_task mytask:nothing: module 'mytask' has no "
     "attribute 'nothing'"),
    (dict(rl_task="mytask:not_a_task"), "rl_task mytask:not_a_task: the factory returned a "
     "int, not a Task"),
    (dict(rl_task="missing.py:make"), "rl_task missing.py:make: no file missing.py"),
    (dict(rl_task="jsonl:rows.jsonl", rl_reward="myreward:reward"), "rl_partial_credit "
     "applies to the exact-match reward, not to rl_reward"),
    (dict(rl_task="jsonl:rows.jsonl", rl_reward="myreward:nothing"), "rl_reward "
     "myreward:nothing: module 'myreward' has no attribute 'nothing'"),
    (dict(rl_task="reverse", rl_reward="myreward:reward"), "rl_reward scores a dataset task "
     "(jsonl:PATH or parquet:PATH), not 'reverse'"),
    (dict(rl_task="jsonl:rows.jsonl", rl_task_options={"x": 1}), "task jsonl:rows.jsonl takes "
     "no options, got ['x']"),
    (dict(rl_task="jsonl:nofile.jsonl"), "nofile.jsonl: no such file"),
])
def test_bad_specs_are_one_line_naming_the_spec(user_files, monkeypatch, flags, message):
    monkeypatch.chdir(user_files)
    flags.setdefault("rl_task_options", {})
    with pytest.raises(ConfigError) as error:
        validate(parse_args(_flags(**flags)), 1)
    assert message in str(error.value), str(error.value)


@pytest.mark.parametrize("name, reward, field, reason", [
    ("missing.py:make", None, "rl_task", "missing.py:make: no file missing.py"),
    ("mytask:not_a_task", None, "rl_task", "mytask:not_a_task: the factory returned a int, not "
     "a Task (scalerlt_mcore.rl.tasks.Task; it lacks sample, reward, supervised_pairs, "
     "max_prompt_chars, max_answer_chars)"),
    ("jsonl:rows.jsonl", "myreward:nothing", "rl_reward",
     "myreward:nothing: module 'myreward' has no attribute 'nothing'"),
])
def test_a_bad_spec_is_a_field_error_of_its_key(user_files, monkeypatch, name, reward, field,
                                                reason):
    """The task library names the key of a bad spec as a ``FieldError``'s field: the app
    reports it as it is, no check of the message's words."""
    monkeypatch.chdir(user_files)
    with pytest.raises(FieldError) as e:
        get_task(name, rl_reward=reward)
    assert (e.value.field, e.value.reason) == (field, reason)


@pytest.mark.parametrize("row, column", [({"answer": "a"}, "prompt"),
                                         ({"prompt": "ab>", "answer": None}, "answer")])
def test_a_row_without_prompt_or_answer_is_named(tmp_path, row, column):
    (tmp_path / "r.jsonl").write_text('{"prompt": "ab>", "answer": "ba"}\n' + json.dumps(row))
    with pytest.raises(ValueError, match=f"r.jsonl: row 1 has no '{column}' column"):
        get_task(f"jsonl:{tmp_path}/r.jsonl")


def test_a_reward_that_raises_or_returns_no_float_names_the_row_and_the_file(user_files):
    path = user_files / "rows.jsonl"
    for spec, message in [("myreward:broken", "raised ZeroDivisionError on row {i} of {path}"),
                          ("myreward:text", "returned 'high' (str) on row {i} of {path}, not a "
                                            "float")]:
        task = get_task(f"jsonl:{path}", rl_reward=spec)
        problem = task.sample(0, 1)[0]
        i = WORDS.index(problem.prompt[:-1])
        with pytest.raises(RewardError, match=re.escape(message.format(i=i, path=path))):
            task.reward(problem, "ab")


def test_the_command_line_error_is_one_line(user_files):
    proc = subprocess.run(TRAIN + _flags(rl_task="mytask:nothing"), cwd=user_files, env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: invalid configuration: "
                                                           "rl_task mytask:nothing: module")
    assert len([x for x in proc.stderr.splitlines() if x.startswith("error:")]) == 1
