"""Tasks from the ``reasoning-gym`` package: procedural datasets with verifiable answers.

``--rl-task reasoning_gym:<dataset>`` with ``--rl-task-options`` passed to the dataset's config
(``reasoning_gym.create_dataset(<dataset>, **options)``); every response is scored by the
dataset's own ``score_answer``: 1.0 for the exact answer, and with ``rl_partial_credit`` the
dataset's own partial credit (else 0.0 for anything less than 1.0).

    task = get_task("reasoning_gym:chain_sum", min_terms=2, max_terms=2, max_digits=1)
    problems = task.sample(seed=0, n=4)       # Problem(prompt=question, answer, entry)
    task.reward(problems[0], "7")
"""

import random
from dataclasses import dataclass, field
from typing import Any

from ..model.config import FieldError
from .tasks import Problem, Task

PREFIX = "reasoning_gym:"
"""``rl_task`` prefix of a reasoning-gym dataset."""

INDEX_SPACE = 2**31 - 1
"""Items are drawn by index from this range: item ``i`` of a dataset is a pure function of
(dataset seed, options, i), so a seed gives the same problems in every process."""


def _create(dataset: str, options: dict):
    try:
        import reasoning_gym
    except ImportError as e:  # an install without the package
        raise FieldError("rl_task", "reasoning_gym:* needs the reasoning-gym package "
                         "(pip install reasoning-gym)") from e
    if dataset not in reasoning_gym.factory.DATASETS:
        known = ", ".join(sorted(reasoning_gym.factory.DATASETS))
        raise ValueError(f"unknown reasoning-gym dataset {dataset!r}; known: {known}")
    if "seed" in options or "size" in options:
        raise FieldError("rl_task_options", "of a reasoning-gym task set neither seed nor "
                         "size (problems are drawn from the run's --seed)")
    try:
        return reasoning_gym.create_dataset(dataset, seed=0, size=INDEX_SPACE, **options)
    except (TypeError, AssertionError, ValueError) as e:
        raise ValueError(f"reasoning-gym dataset {dataset!r} rejects options {options}: "
                         f"{e}") from e


@dataclass
class ReasoningGymTask(Task):
    """One reasoning-gym dataset; ``options`` are its config fields (not seed or size)."""

    dataset: str
    """The dataset's registered name, e.g. ``chain_sum``."""
    options: dict = field(default_factory=dict)
    """Its config fields, e.g. ``{min_terms: 2, max_terms: 2}``."""

    def __post_init__(self):
        self._data = _create(self.dataset, self.options)

    @property
    def name(self) -> str:
        return PREFIX + self.dataset

    def _problem(self, rng: random.Random) -> Problem:
        return self._problem_at(rng.randrange(INDEX_SPACE))

    def _problem_at(self, index: int) -> Problem:
        entry = self._data[index]
        return Problem(entry["question"], str(entry["answer"]), entry=entry)

    def reward(self, problem: Problem, completion: str, *, partial_credit: bool = False) -> float:
        """The dataset's ``score_answer``: as it is with ``partial_credit``, else 1.0 only where
        it says 1.0 (the exact answer) and 0.0 otherwise, as the built-in tasks' exact match."""
        score = float(self._data.score_answer(completion, problem.entry))
        return score if partial_credit else float(score == 1.0)

    @property
    def max_prompt_chars(self):
        return None  # unknown: measured on a sample (``measure_lengths``)

    @property
    def max_answer_chars(self):
        return None


def reasoning_gym_task(name: str, options: dict[str, Any]) -> ReasoningGymTask:
    """The task of ``rl_task`` ``reasoning_gym:<dataset>``."""
    return ReasoningGymTask(name[len(PREFIX):], dict(options))
