"""Tasks with verifiable rewards, generated from a seed (no downloads).

Every prompt is a few characters ending in a marker (``=``, ``>``, ``|``) and every answer
is checked exactly, so a tiny model can learn them and the reward needs no judge:

- ``modular_arithmetic``: ``"17+5%7="`` -> ``"1"``
- ``reverse``: ``"abc>"`` -> ``"cba"``
- ``sort``: ``"c3a|"`` -> ``"3ac"``

and one long-prompt task, where a shared prompt dominates the work of an RL step (as in
agentic and long-context RL): ``kv_retrieval``, the value of one key from a context of N
key-value pairs, ``"abcdef:1234,...,uvwxyz:9876|abcdef="`` -> ``"1234"`` (511 characters by
default: 512 tokens with bos).

``reasoning_gym:<dataset>`` draws from a reasoning-gym dataset (``rl/reasoning_gym.py``),
``mix`` draws from several tasks with weights, ``multiturn`` makes any of them a multi-turn
task (the environment answers each answer with a verdict and a hint, ``MultiTurnTask`` in
``rl/task_registry.py``, the reply rule ``hint_reply`` here), ``jsonl:PATH`` /
``parquet:PATH`` from the rows of a file and ``module.path:factory`` is the user's own task
(``rl/user_task.py``);
``rl/task_registry.py`` builds any of them by name (``get_task``) and holds ``MixedTask``.

Every prompt belongs to one split, fixed by a hash of its text (``split_of``): training draws
(``sample(..., split="train")``, ``supervised_pairs``) never produce an evaluation prompt and
evaluation draws (``split="eval"``) never produce a training prompt.
"""

import random
import string
import zlib
from dataclasses import dataclass, field
from typing import Any, Optional

SPLITS = ("train", "eval")
EVAL_BUCKETS = 4
"""One prompt in ``EVAL_BUCKETS`` (by the hash of its text) belongs to the evaluation split."""


def split_of(prompt: str) -> str:
    """``"eval"`` or ``"train"``: the split of ``prompt``, from a stable hash of its text (the
    same in every process and Python version)."""
    return "eval" if zlib.crc32(prompt.encode()) % EVAL_BUCKETS == 0 else "train"


@dataclass(frozen=True)
class Problem:
    """One prompt and its unique correct answer."""

    prompt: str
    answer: str
    entry: Any = field(default=None, compare=False, repr=False)
    """What the task's reward needs besides the answer (a reasoning-gym entry), or None."""


class Task:
    """A problem generator with an exact-match reward. Subclasses define ``_problem``."""

    name = "task"

    def sample(self, seed: int, n: int, split: str = "train") -> list[Problem]:
        """``n`` problems of ``split`` drawn from ``random.Random(seed)`` (draws of the other
        split are rejected): the same seed gives the same list, whatever the global RNG state."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        rng = random.Random(seed)
        return [self._draw(rng, split) for _ in range(n)]

    def _draw(self, rng: random.Random, split: str, attempts: int = 10_000) -> Problem:
        for _ in range(attempts):
            problem = self._problem(rng)
            if split_of(problem.prompt) == split:
                return problem
        raise ValueError(f"task {self.name!r} drew no {split} prompt in {attempts} draws: its "
                         f"prompts are too few to split into training and evaluation")

    def supervised_pairs(self, seed: int, n: int) -> list[tuple[str, str]]:
        """``(prompt, answer)`` pairs of the training split for an optional supervised
        warm-up."""
        return [(p.prompt, p.answer) for p in self.sample(seed, n)]

    def reward(self, problem: Problem, completion: str, *, partial_credit: bool = False) -> float:
        """1.0 when ``completion`` equals the answer, else 0.0; with ``partial_credit``, a
        wrong completion earns the fraction of positions it gets right (in [0, 1))."""
        if completion == problem.answer:
            return 1.0
        return positional_match(problem.answer, completion) if partial_credit else 0.0

    @property
    def max_prompt_chars(self) -> Optional[int]:
        """Longest prompt this task can produce; None when unknown (then measured on a
        sample, ``measure_lengths``)."""
        raise NotImplementedError

    @property
    def max_answer_chars(self) -> Optional[int]:
        """Longest answer this task can produce; None when unknown."""
        raise NotImplementedError

    def _problem(self, rng: random.Random) -> Problem:
        raise NotImplementedError


def positional_match(answer: str, completion: str) -> float:
    """Matching characters at equal positions over the longer length; 1.0 only on equality."""
    longest = max(len(answer), len(completion))
    if longest == 0:
        return 1.0
    return sum(a == c for a, c in zip(answer, completion)) / longest


@dataclass
class ModularArithmetic(Task):
    """``"a<op>b%m="`` -> ``str((a <op> b) % m)``; operands uniform in [min, max]_operand."""

    name = "modular_arithmetic"
    modulus: int = 7
    """m, written in the prompt; answers lie in [0, m)."""
    min_operand: int = 0
    """Smallest operand (>= 0)."""
    max_operand: int = 20
    """Largest operand."""
    ops: str = "+*"
    """Operators to draw from, a subset of ``+-*``."""

    def __post_init__(self):
        require(self.modulus >= 2, f"modulus must be >= 2, got {self.modulus}")
        lo, hi = self.min_operand, self.max_operand
        require(0 <= lo <= hi, f"need 0 <= min_operand <= max_operand, got {lo}, {hi}")
        require(bool(self.ops) and set(self.ops) <= set("+-*"),
                 f"ops must be a non-empty subset of '+-*', got {self.ops!r}")

    def _problem(self, rng):
        a, b = (rng.randint(self.min_operand, self.max_operand) for _ in range(2))
        op = rng.choice(self.ops)
        value = {"+": a + b, "-": a - b, "*": a * b}[op] % self.modulus
        return Problem(f"{a}{op}{b}%{self.modulus}=", str(value))

    @property
    def max_prompt_chars(self):
        return 2 * len(str(self.max_operand)) + len(str(self.modulus)) + 3

    @property
    def max_answer_chars(self):
        return len(str(self.modulus - 1))


@dataclass
class _StringTask(Task):
    """Shared options of the string tasks: a random string, then ``marker``."""

    min_len: int = 3
    """Shortest input string."""
    max_len: int = 6
    """Longest input string."""
    alphabet: str = string.ascii_lowercase
    """Characters the input is drawn from."""
    marker = ">"

    def __post_init__(self):
        require(1 <= self.min_len <= self.max_len,
                 f"need 1 <= min_len <= max_len, got {self.min_len}, {self.max_len}")
        require(bool(self.alphabet), "alphabet must not be empty")

    def _problem(self, rng):
        text = "".join(rng.choices(self.alphabet, k=rng.randint(self.min_len, self.max_len)))
        return Problem(text + self.marker, self._answer(text))

    def _answer(self, text: str) -> str:
        raise NotImplementedError

    @property
    def max_prompt_chars(self):
        return self.max_len + 1

    @property
    def max_answer_chars(self):
        return self.max_len


@dataclass
class Reverse(_StringTask):
    """``"abc>"`` -> ``"cba"``."""

    name = "reverse"

    def _answer(self, text):
        return text[::-1]


@dataclass
class Sort(_StringTask):
    """``"c3a|"`` -> ``"3ac"`` (characters in code-point order: digits before letters)."""

    name = "sort"
    alphabet: str = string.digits + string.ascii_lowercase
    """Characters the input is drawn from."""
    marker = "|"

    def _answer(self, text):
        return "".join(sorted(text))


@dataclass
class KeyValueRetrieval(Task):
    """``"k1:v1,k2:v2,...,kN:vN|kq="`` -> ``vq``: N distinct lowercase keys with digit values,
    then the queried key (one of the N, uniform); the answer is its value, exact match.

    Every prompt has the same length, ``num_pairs * (key_len + value_len + 2) + key_len + 1``
    characters; the defaults give 511 (512 tokens with bos)."""

    name = "kv_retrieval"
    num_pairs: int = 42
    """N, key-value pairs in the context."""
    key_len: int = 6
    """Letters per key."""
    value_len: int = 4
    """Digits per value (the answer's length)."""

    def __post_init__(self):
        require(self.num_pairs >= 1, f"num_pairs must be >= 1, got {self.num_pairs}")
        require(self.key_len >= 1, f"key_len must be >= 1, got {self.key_len}")
        require(self.value_len >= 1, f"value_len must be >= 1, got {self.value_len}")
        require(26**self.key_len >= 2 * self.num_pairs,
                 f"key_len {self.key_len} gives too few distinct keys for num_pairs "
                 f"{self.num_pairs} (26 ** key_len must be >= 2 * num_pairs)")

    def _problem(self, rng):
        keys = []  # distinct, in order of drawing (a list: no hash order enters the draw)
        while len(keys) < self.num_pairs:
            key = "".join(rng.choices(string.ascii_lowercase, k=self.key_len))
            if key not in keys:
                keys.append(key)
        values = ["".join(rng.choices(string.digits, k=self.value_len)) for _ in keys]
        q = rng.randrange(self.num_pairs)
        context = ",".join(f"{k}:{v}" for k, v in zip(keys, values))
        return Problem(f"{context}|{keys[q]}=", values[q])

    @property
    def max_prompt_chars(self):
        return self.num_pairs * (self.key_len + self.value_len + 2) + self.key_len + 1

    @property
    def max_answer_chars(self):
        return self.value_len


HINTS = ("prefix", "none")
"""The environment's hint after an answer (``hint_reply``): ``prefix``, the correct answer up
to and including its first wrong character; ``none``, the verdict alone."""


def correct_prefix(answer: str, completion: str) -> str:
    """``answer`` up to and including the first position where ``completion`` differs from
    it (the whole answer when ``completion`` is right or has it as a prefix)."""
    same = 0
    while same < min(len(answer), len(completion)) and answer[same] == completion[same]:
        same += 1
    return answer[: same + 1]


def hint_reply(problem: Problem, completion: str, hint: str = "prefix") -> str:
    """The environment's turn after ``completion``, verifiable from the problem alone: a
    verdict (``+`` right, ``-`` wrong), the ``hint`` (``HINTS``) and the prompt's last
    character (its marker, after which the model answers again). ``"abc>"`` (answer
    ``"cba"``) answered ``"cab"`` -> ``"-cb>"``; answered ``"cba"`` -> ``"+cba>"``."""
    require(hint in HINTS, f"hint must be one of {HINTS}, got {hint!r}")
    verdict = "+" if completion == problem.answer else "-"
    shown = correct_prefix(problem.answer, completion) if hint == "prefix" else ""
    return verdict + shown + problem.prompt[-1:]


def is_multiturn(task) -> bool:
    """Whether ``task`` has an environment turn (``reply(problem, answer_text) -> str``)."""
    return callable(getattr(task, "reply", None))


def measure_lengths(task: Task, encode, n: int = 256, seed: int = 0,
                    problems: Optional[list[Problem]] = None) -> tuple[int, int]:
    """(longest prompt, longest answer) in tokens of ``encode`` over ``problems`` (by default
    ``n`` sampled ones): the bound used where the task states none."""
    problems = task.sample(seed, n) if problems is None else problems
    return (max(len(encode(p.prompt)) for p in problems),
            max(len(encode(p.answer)) for p in problems))


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
