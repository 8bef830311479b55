"""Tasks and rewards from the user's code and data (``rl/task_registry.py`` builds them by name).

- ``rl_task: module.path:factory`` (or ``path/to/file.py:factory``): ``factory(**rl_task_options)``
  returns a ``Task`` (``rl/tasks.py``: ``sample(seed, n, split)``, ``reward(problem,
  completion, partial_credit=...)``, ``supervised_pairs(seed, n)``, ``max_prompt_chars``,
  ``max_answer_chars``; subclassing ``Task`` and writing ``_problem`` gives all of them). The
  factory gets the options only: the run's seed reaches the task through ``sample``.
- ``rl_task: jsonl:PATH`` or ``parquet:PATH``: a ``DatasetTask`` over the file's rows, each with a
  ``prompt`` and an ``answer`` column (the answer as text); any other columns are passed through
  to the reward. Rows count from 0 (in a JSONL file, its non-blank lines).
- ``rl_reward: module.path:function`` (or ``path/to/file.py:function``) scores a dataset task's
  responses: ``function(response_text: str, row: dict) -> float`` (the decoded response and a
  copy of the row, every column); without it a response earns 1.0 when it equals the row's
  answer, else 0.0 (with ``rl_partial_credit``, the fraction of positions it gets right).

Both keep the built-in tasks' split: a prompt belongs to the training or the evaluation split
by a hash of its text (``split_of``). A dataset task draws only rows of the split asked for; a
factory's task is checked on every draw, and a prompt of the other split is an error.
"""

import importlib
import importlib.util
import json
import math
import numbers
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from ..model.config import FieldError
from .tasks import EVAL_BUCKETS, SPLITS, Problem, Task, split_of

DATASET_FORMATS = ("jsonl", "parquet")
"""``rl_task`` prefixes of a dataset task: ``jsonl:PATH``, ``parquet:PATH``."""

TASK_PROTOCOL = ("sample", "reward", "supervised_pairs", "max_prompt_chars", "max_answer_chars")
"""What a factory's result must have (the attributes of ``Task``)."""


class RewardError(ValueError):
    """A user's reward function raised or returned something else than a number."""


def is_dataset(name: str) -> bool:
    """Whether ``rl_task`` ``name`` is a dataset task (``jsonl:PATH``, ``parquet:PATH``)."""
    return name.split(":", 1)[0] in DATASET_FORMATS


# ---- user code by spec -------------------------------------------------------------------------


def load_object(spec: str, what: str) -> Any:
    """The object ``module.path:name`` (or ``path/to/file.py:name``); ``what`` names the key
    (``rl_task``, ``rl_reward``) of the ``FieldError`` when the module, the file or the name is
    missing."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise FieldError(what, f"{spec!r} must be module.path:name or path/to/file.py:name")
    module = _load_module(module_name, spec, what)
    if not hasattr(module, attr):
        raise FieldError(what, f"{spec}: module {module_name!r} has no attribute {attr!r}")
    return getattr(module, attr)


def _load_module(name: str, spec: str, what: str):
    """The module ``name``: imported, or executed from the file ``name`` ending in ``.py``."""
    if name.endswith(".py") and not Path(name).is_file():
        raise FieldError(what, f"{spec}: no file {name}")
    try:
        return _module_from_file(Path(name)) if name.endswith(".py") else (
            importlib.import_module(name))
    except Exception as e:  # the user's module: missing, or failing at import
        raise FieldError(what, f"{spec}: cannot import {name!r} ({type(e).__name__}: "
                               f"{e})") from e


def _module_from_file(path: Path):
    module_spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def load_callable(spec: str, what: str) -> Callable:
    """``load_object`` that must be callable."""
    fn = load_object(spec, what)
    if not callable(fn):
        raise FieldError(what, f"{spec}: {type(fn).__name__} object is not callable")
    return fn


# ---- a task from the user's factory ----------------------------------------------------------


def factory_task(spec: str, options: dict) -> "UserTask":
    """The task of ``rl_task`` ``module.path:factory``: ``factory(**options)``, checked to be a
    ``Task`` and wrapped so that every draw keeps the split."""
    factory = load_callable(spec, "rl_task")
    try:
        task = factory(**options)
    except Exception as e:  # the user's code: its error, named
        raise FieldError("rl_task", f"{spec}: the factory raised {type(e).__name__}: "
                                    f"{e}") from e
    missing = [a for a in TASK_PROTOCOL if not hasattr(type(task), a)]
    if missing:
        raise FieldError("rl_task", f"{spec}: the factory returned a {type(task).__name__}, "
                         f"not a Task (scalerlt_mcore.rl.tasks.Task; it lacks "
                         f"{', '.join(missing)})")
    return UserTask(spec, task)


class UserTask(Task):
    """A factory's task, checked: each problem it draws is of the split asked for."""

    def __init__(self, spec: str, inner: Task):
        self.name, self.inner = spec, inner

    def sample(self, seed: int, n: int, split: str = "train") -> list[Problem]:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        problems = list(self.inner.sample(seed, n, split))
        if len(problems) != n:
            raise FieldError("rl_task", f"{self.name}: sample(n={n}) returned "
                                        f"{len(problems)} problems")
        for p in problems:
            self._check_split(p.prompt, split)
        return problems

    def supervised_pairs(self, seed: int, n: int) -> list[tuple[str, str]]:
        pairs = list(self.inner.supervised_pairs(seed, n))
        for prompt, _ in pairs:
            self._check_split(prompt, "train")
        return pairs

    def _check_split(self, prompt: str, split: str) -> None:
        if split_of(prompt) != split:
            raise FieldError("rl_task", f"{self.name}: a {split} draw returned the prompt "
                             f"{prompt[:40]!r} of the {split_of(prompt)} split (a prompt's split "
                             f"is split_of(prompt), scalerlt_mcore.rl.tasks)")

    def reward(self, problem: Problem, completion: str, *, partial_credit: bool = False) -> float:
        return self.inner.reward(problem, completion, partial_credit=partial_credit)

    @property
    def max_prompt_chars(self):
        return self.inner.max_prompt_chars

    @property
    def max_answer_chars(self):
        return self.inner.max_answer_chars


# ---- a task from rows of a file --------------------------------------------------------------


def dataset_task(name: str, options: dict, reward: Optional[str]) -> "DatasetTask":
    """The task of ``rl_task`` ``jsonl:PATH`` / ``parquet:PATH``, scored by ``rl_reward``."""
    if options:
        raise ValueError(f"task {name} takes no options, got {sorted(options)} (a config "
                         f"file's rl_task_options? --rl-task-options '{{}}' replaces them)")
    fmt, path = name.split(":", 1)
    return DatasetTask(fmt, path, reward)


@dataclass
class DatasetTask(Task):
    """The rows of a JSONL or Parquet file as problems: ``prompt`` -> ``answer``; each split
    draws uniformly (with replacement) from the rows whose prompt is of that split."""

    format: str
    """``jsonl`` or ``parquet``."""
    path: str
    """The file (a Parquet dataset may be a directory)."""
    reward_spec: Optional[str] = None
    """``rl_reward``: ``module.path:function``, or None for the exact match of the answer."""

    def __post_init__(self):
        self.rows = read_rows(self.format, self.path)
        for i, row in enumerate(self.rows):
            self._check_row(i, row)
        self.by_split = {s: [i for i, r in enumerate(self.rows) if split_of(r["prompt"]) == s]
                         for s in SPLITS}
        if not self.by_split["train"]:
            raise ValueError(f"{self.path}: none of its {len(self.rows)} rows is of the "
                             f"training split (by a hash of the prompt): add rows")
        self._reward = None if self.reward_spec is None else load_callable(self.reward_spec,
                                                                           "rl_reward")

    @property
    def name(self) -> str:
        return f"{self.format}:{self.path}"

    def _check_row(self, i: int, row: Any) -> None:
        where = f"{self.path}: row {i}"
        if not isinstance(row, dict):
            raise ValueError(f"{where} is a {type(row).__name__}, not a mapping of columns")
        for column in ("prompt", "answer"):
            if row.get(column) is None:
                raise ValueError(f"{where} has no {column!r} column (columns: "
                                 f"{', '.join(map(str, row)) or 'none'})")
        if not isinstance(row["prompt"], str) or not row["prompt"]:
            raise ValueError(f"{where}: 'prompt' must be non-empty text, got {row['prompt']!r}")

    def sample(self, seed: int, n: int, split: str = "train") -> list[Problem]:
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        rows = self.by_split[split]
        if not rows:
            raise ValueError(f"{self.path}: none of its {len(self.rows)} rows is of the {split} "
                             f"split (one prompt in {EVAL_BUCKETS} is, by a hash of its text): "
                             f"add rows")
        rng = random.Random(seed)
        return [self._problem_at(rng.choice(rows)) for _ in range(n)]

    def problems(self) -> list[Problem]:
        """Every row's problem, in file order (both splits)."""
        return [self._problem_at(i) for i in range(len(self.rows))]

    def _problem_at(self, i: int) -> Problem:
        row = self.rows[i]
        return Problem(row["prompt"], str(row["answer"]), entry=i)

    def reward(self, problem: Problem, completion: str, *, partial_credit: bool = False) -> float:
        """``rl_reward``'s ``function(completion, row)``, else the exact match of the answer."""
        if self._reward is None:
            return super().reward(problem, completion, partial_credit=partial_credit)
        i = problem.entry
        where = f"on row {i} of {self.path}"
        try:
            value = self._reward(completion, dict(self.rows[i]))
        except Exception as e:  # the user's code: its error, named with the row
            raise RewardError(f"rl_reward {self.reward_spec} raised {type(e).__name__} {where}: "
                              f"{e}") from e
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            raise RewardError(f"rl_reward {self.reward_spec} returned {value!r} "
                              f"({type(value).__name__}) {where}, not a float")
        if not math.isfinite(value):
            raise RewardError(f"rl_reward {self.reward_spec} returned {value} {where}, not a "
                              f"finite float")
        return float(value)

    @property
    def max_prompt_chars(self) -> int:
        """Longest prompt in UTF-8 bytes (>= characters: a bound for either tokenizer with one
        token per character or per byte)."""
        return max(len(r["prompt"].encode()) for r in self.rows)

    @property
    def max_answer_chars(self) -> int:
        """Longest answer in UTF-8 bytes."""
        return max(len(str(r["answer"]).encode()) for r in self.rows)


def read_rows(fmt: str, path: str) -> list[dict]:
    """The rows of a JSONL file (one JSON object per non-blank line) or of a Parquet file or
    directory (needs pyarrow)."""
    if not Path(path).exists():
        raise ValueError(f"{path}: no such file")
    rows = _read_jsonl(path) if fmt == "jsonl" else _read_parquet(path)
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def _read_jsonl(path: str) -> list:
    rows = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: line {line_no} (row {len(rows)}) is not JSON: "
                                 f"{e.msg}") from e
    return rows


def _read_parquet(path: str) -> list:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:  # an install without the rl extra
        raise FieldError("rl_task", "parquet:PATH needs the pyarrow package (pip install "
                         "pyarrow)") from e
    try:
        return pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow's errors for a file that is not Parquet
        raise ValueError(f"{path}: not a Parquet file ({type(e).__name__}: {e})") from e
