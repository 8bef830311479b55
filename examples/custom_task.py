"""A task of the user's own, used as ``--rl-task examples/custom_task.py:make_task`` (or
``--rl-task my_package.my_module:make_task`` for an importable module).

``--rl-task SPEC:factory`` calls ``factory(**rl_task_options)``; it returns a
``scalerlt_mcore.rl.Task``. Subclassing ``Task`` and writing ``_problem(rng)`` gives the rest:
problems drawn from the run's seed, each prompt in the training or the evaluation split by a
hash of its text, and the exact-match reward (override ``reward`` for another).
"""

import random
from dataclasses import dataclass

from scalerlt_mcore.rl import Problem, Task


@dataclass
class Rotate(Task):
    """``"abcd@"`` -> ``"bcda"``: the string rotated left by ``shift`` letters."""

    name = "rotate"
    length: int = 4
    """Letters per string."""
    alphabet: str = "abc"
    """Letters the string is drawn from."""
    shift: int = 1
    """Letters moved from the front to the back."""

    def _problem(self, rng: random.Random) -> Problem:
        text = "".join(rng.choices(self.alphabet, k=self.length))
        k = self.shift % self.length
        return Problem(text + "@", text[k:] + text[:k])

    @property
    def max_prompt_chars(self) -> int:
        return self.length + 1

    @property
    def max_answer_chars(self) -> int:
        return self.length


def make_task(**options) -> Rotate:
    """The factory: ``--rl-task-options`` as keyword arguments (e.g. ``{shift: 2}``)."""
    return Rotate(**options)
