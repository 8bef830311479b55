"""Tasks by name: the built-in ones (``rl/tasks.py``), ``mix``, ``multiturn``,
``reasoning_gym:<dataset>``
(``rl/reasoning_gym.py``), and the user's (``rl/user_task.py``): ``jsonl:PATH`` /
``parquet:PATH`` rows and ``module.path:factory``. The task modules sit below this one: none
imports another's builder."""

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any, Optional

from .reasoning_gym import reasoning_gym_task
from .tasks import (
    HINTS,
    KeyValueRetrieval,
    ModularArithmetic,
    Problem,
    Reverse,
    Sort,
    Task,
    hint_reply,
    require,
)
from .user_task import dataset_task, factory_task, is_dataset

TASKS: dict[str, type[Task]] = {t.name: t for t in (ModularArithmetic, Reverse, Sort,
                                                    KeyValueRetrieval)}
"""Registry of built-in tasks by name (besides ``mix``, ``multiturn``, ``reasoning_gym:<dataset>``
and the
user's: ``jsonl:PATH``, ``parquet:PATH``, ``module.path:factory``)."""


def get_task(name: str, *, rl_reward: Optional[str] = None, **options) -> Task:
    """The task ``name`` built with ``options`` (a dataset task scored by ``rl_reward``,
    ``module.path:function``); unknown names or options raise ValueError."""
    require(rl_reward is None or is_dataset(name), f"rl_reward scores a dataset task "
             f"(jsonl:PATH or parquet:PATH), not {name!r}")
    if is_dataset(name):
        return dataset_task(name, options, rl_reward)
    if name.startswith("reasoning_gym:"):
        return reasoning_gym_task(name, options)
    if name == "mix":
        require(set(options) <= {"tasks"}, f"task 'mix' takes only the option 'tasks', got "
                 f"{sorted(options)}")
        return MixedTask(**options)
    if name == "multiturn":
        require(set(options) <= {"task", "options", "hint"}, f"task 'multiturn' takes the "
                 f"options 'task', 'options' and 'hint', got {sorted(options)}")
        return MultiTurnTask(**options)
    if ":" in name:
        return factory_task(name, options)
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(sorted(TASKS))}, "
                         "mix, reasoning_gym:<dataset>, multiturn, jsonl:PATH, parquet:PATH, "
                         "module.path:factory")
    cls = TASKS[name]
    allowed = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"task {name!r} has no option {unknown[0]!r}; options: {allowed}")
    for f in dataclasses.fields(cls):
        if f.name in options and type(options[f.name]) is not type(f.default):
            expected = type(f.default).__name__
            raise ValueError(f"task option {f.name!r} expects {expected}, got {options[f.name]!r}")
    return cls(**options)


@dataclass
class MixedTask(Task):
    """Several tasks drawn with weights: ``rl_task: mix`` with ``rl_task_options:
    {tasks: [{task: reverse, weight: 2, options: {max_len: 3}}, {task: reasoning_gym:chain_sum}]}``
    (weight defaults to 1, options to {}; a dataset entry may name its ``reward``,
    ``module.path:function``). Each response is scored by its own task."""

    name = "mix"
    tasks: list = field(default_factory=list)
    """Entries ``{task: NAME, weight: W, options: {...}, reward: SPEC}``."""

    def __post_init__(self):
        require(isinstance(self.tasks, list) and len(self.tasks) > 0,
                 "task 'mix' needs options {tasks: [{task: NAME, weight: W, options: {...}}]}")
        self._tasks, self._weights = [], []
        for i, entry in enumerate(self.tasks):
            task, weight = _mix_entry(i, entry)
            self._tasks.append(task)
            self._weights.append(weight)

    def sample(self, seed: int, n: int, split: str = "train") -> list[Problem]:
        rng, out = random.Random(seed), []
        for _ in range(n):
            k = rng.choices(range(len(self._tasks)), weights=self._weights)[0]
            inner = self._tasks[k].sample(rng.randrange(2**31 - 1), 1, split)[0]
            out.append(Problem(inner.prompt, inner.answer, entry=(k, inner)))
        return out

    def reward(self, problem: Problem, completion: str, *, partial_credit: bool = False) -> float:
        k, inner = problem.entry
        return self._tasks[k].reward(inner, completion, partial_credit=partial_credit)

    @property
    def max_prompt_chars(self):
        return _max_or_none(t.max_prompt_chars for t in self._tasks)

    @property
    def max_answer_chars(self):
        return _max_or_none(t.max_answer_chars for t in self._tasks)


@dataclass
class MultiTurnTask(Task):
    """A single-turn task made multi-turn: ``rl_task: multiturn`` with ``rl_task_options:
    {task: reverse, options: {max_len: 3}, hint: prefix}``. The model answers the task's
    prompt; the environment replies (``reply``: a verdict, ``+`` right or ``-`` wrong, and a
    hint computed from the problem, ``tasks.hint_reply``); the model answers again, and so on
    for as many turns as the rollout tree is deep (``rl_tree_branches``). The reward is the
    inner task's, on the final answer alone.

    ``"abc>"`` -> ``"cab"`` -> (environment) ``"-cb>"`` -> ``"cba"``: reward 1."""

    name = "multiturn"
    task: str = "reverse"
    """The inner task: any name ``get_task`` builds (not ``multiturn``)."""
    options: dict = field(default_factory=dict)
    """The inner task's options."""
    hint: str = "prefix"
    """The hint after an answer (``tasks.HINTS``): ``prefix`` (the correct answer up to and
    including the first wrong character) or ``none`` (the verdict alone: "wrong, try
    again")."""

    def __post_init__(self):
        require(isinstance(self.task, str) and self.task != "multiturn",
                 f"task 'multiturn': option 'task' must name another task, got {self.task!r}")
        require(isinstance(self.options, dict),
                 f"task 'multiturn': option 'options' must be a mapping, got {self.options!r}")
        require(self.hint in HINTS,
                 f"task 'multiturn': option 'hint' must be one of {HINTS}, got {self.hint!r}")
        self._inner = get_task(self.task, **self.options)

    def sample(self, seed: int, n: int, split: str = "train") -> list[Problem]:
        return self._inner.sample(seed, n, split)

    def supervised_pairs(self, seed: int, n: int) -> list[tuple[str, str]]:
        """The inner task's pairs: the first turn's (``supervised_episodes`` has the later
        ones, whose context holds each earlier answer's eos, which no text prompt can)."""
        return self._inner.supervised_pairs(seed, n)

    def supervised_episodes(self, seed: int, n: int, turns: int) -> list[tuple]:
        """``n`` warm-up episodes of the training split, ``(problem, earlier answers)``: 0 ..
        ``turns`` - 1 earlier answers (uniform), each the right answer (one in three) or it
        with one character changed (``corrupt``); the environment replies after each
        (``reply``) and the final answer is the problem's. Later turns then learn to read the
        reply before RL, as the first learns the task."""
        rng, out = random.Random(seed), []
        for problem in self.sample(rng.randrange(2**31 - 1), n):
            earlier = [problem.answer if rng.random() < 1 / 3 else corrupt(problem, rng)
                       for _ in range(rng.randrange(turns))]
            out.append((problem, earlier))
        return out

    def reward(self, problem: Problem, completion: str, *, partial_credit: bool = False) -> float:
        """The inner task's reward of the final answer ``completion``."""
        return self._inner.reward(problem, completion, partial_credit=partial_credit)

    def reply(self, problem: Problem, answer_text: str) -> str:
        """The environment's turn after the answer ``answer_text`` (``tasks.hint_reply``)."""
        return hint_reply(problem, answer_text, self.hint)

    @property
    def max_prompt_chars(self):
        return self._inner.max_prompt_chars

    @property
    def max_answer_chars(self):
        return self._inner.max_answer_chars

    @property
    def max_reply_chars(self) -> Optional[int]:
        """Longest reply: verdict, the whole answer, marker; None when the answer's is unknown."""
        answer = self._inner.max_answer_chars
        return None if answer is None else answer + 2 if self.hint == "prefix" else 2


def corrupt(problem: Problem, rng: random.Random) -> str:
    """A wrong answer: the right one with one position changed to another character of the
    problem's text (or cut there when its text has no other character)."""
    answer = problem.answer
    if not answer:
        return "x"
    i = rng.randrange(len(answer))
    others = sorted(set(problem.prompt[:-1] + answer) - {answer[i]})
    return answer[:i] + (rng.choice(others) + answer[i + 1:] if others else "")


def _mix_entry(i: int, entry: Any) -> tuple:
    """(task, weight) of entry ``i`` of a mix."""
    where = f"task 'mix' entry {i}"
    require(isinstance(entry, dict) and "task" in entry,
             f"{where} must be a mapping with a 'task' key, got {entry!r}")
    unknown = sorted(set(entry) - {"task", "weight", "options", "reward"})
    require(not unknown, f"{where} has unknown key {unknown[0] if unknown else ''!r}; "
             "keys: task, weight, options, reward")
    weight = entry.get("weight", 1)
    require(isinstance(weight, (int, float)) and not isinstance(weight, bool) and weight > 0,
             f"{where}: weight must be a number > 0, got {weight!r}")
    require(entry["task"] != "mix", f"{where}: a mix cannot contain a mix")
    task = get_task(entry["task"], rl_reward=entry.get("reward"), **entry.get("options", {}))
    return task, float(weight)


def _max_or_none(values) -> Optional[int]:
    values = list(values)
    return None if None in values else max(values)
