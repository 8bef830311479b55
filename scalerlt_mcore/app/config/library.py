"""The reflection layer: config fields taken from the library's dataclasses, their help, and
the library's error messages in the keys' names.

The library's dataclasses are the source of truth: the ``looped_*`` keys are the fields of
``LoopedTransformerConfig`` and the RL loss keys those of ``RLObjective`` (``OBJECTIVE_FLAGS``),
with their types, defaults and docstrings (``with_library_fields``); a choice is a ``Literal``
written once in the library. A key reaches its library object through one map (``LOOPED_FLAGS``,
``OBJECTIVE_FLAGS``, ``SCHEDULE_FLAGS``) and one builder (``builders.py``), and the object's own
check reaches the user with the key's name (``library_errors``)."""

import ast
import dataclasses
import inspect
import re
import textwrap
import typing
from collections.abc import Callable
from dataclasses import field

from ...model.config import LoopedTransformerConfig


def field_docs(cls: type) -> dict[str, str]:
    """Help text of each field of dataclass ``cls`` that has one: the attribute docstring (the
    string under the field in the source of ``cls`` or a base class), or the ``doc`` metadata
    of a field taken from a library dataclass."""
    docs = {}
    for klass in reversed(cls.__mro__):
        docs.update(_source_docs(klass))
    docs.update({f.name: f.metadata["doc"] for f in dataclasses.fields(cls) if "doc" in f.metadata})
    return {f.name: docs[f.name] for f in dataclasses.fields(cls) if f.name in docs}


def _source_docs(cls: type) -> dict[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # builtins, classes made at run time
        return {}
    body = ast.parse(source).body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def rename(text: str, flags: dict[str, str]) -> str:
    """``text`` with the library names of ``{flag: name}`` turned into their flags: a
    snake_case name anywhere, a one-word name only in ``code`` quotes (else it is a word)."""
    names = {name: flag for flag, name in flags.items() if name != flag}
    if not names:
        return text
    alt = "|".join(map(re.escape, names))

    def sub(m: re.Match) -> str:
        quoted, bare = m.group(1), m.group(2)
        if bare and "_" not in bare:
            return bare
        return f"``{names[quoted]}``" if quoted else names[bare]

    return re.sub(rf"``({alt})``|\b({alt})\b", sub, text)


def library_fields(library: type, flags: dict[str, str]) -> list[tuple]:
    """``make_dataclass`` specs of the flags ``{flag: field of library}``: each has the field's
    type and default, and its docstring (field names turned into flags) as metadata ``doc``."""
    hints, docs = typing.get_type_hints(library), field_docs(library)
    fields = {f.name: f for f in dataclasses.fields(library)}
    specs = []
    for flag, name in flags.items():
        f = fields[name]
        meta = {"doc": rename(docs[name], flags)} if name in docs else {}
        specs.append((flag, hints[name], field(default=f.default,
                                               default_factory=f.default_factory, metadata=meta)))
    return specs


def with_library_fields(library: type, flags: dict[str, str]) -> Callable[[type], type]:
    """Class decorator: dataclass ``cls`` plus a field for each flag of ``{flag: field of
    library}`` that ``cls`` does not declare itself (``library_fields``)."""

    def extend(cls: type) -> type:
        own = {f.name for f in dataclasses.fields(cls)}
        specs = [s for s in library_fields(library, flags) if s[0] not in own]
        new = dataclasses.make_dataclass(cls.__name__, specs, bases=(cls,))
        new.__module__, new.__qualname__, new.__doc__ = (
            cls.__module__, cls.__qualname__, cls.__doc__)
        return new

    return extend


LOOPED_FLAGS = {f.name: f.name for f in dataclasses.fields(LoopedTransformerConfig)
                if f.name.startswith("looped_")}
"""The model section's ``looped_*`` keys: every ``looped_*`` field of LoopedTransformerConfig."""

OBJECTIVE_FLAGS = {
    "rl_loss_normalization": "normalization",
    "grpo_clamp_eps_lower": "clip_low",
    "grpo_clamp_eps_upper": "clip_high",
    "grpo_kl_beta": "kl_coef",
    "grpo_entropy_term_weight": "entropy_weight",
    "rl_loop_weights": "loop_weights",
    "rl_exit_gate_coef": "exit_gate_coef",
    "rl_exit_entropy_coef": "exit_entropy_coef",
    "rl_max_response_length": "constant_length",
}
"""Key -> ``RLObjective`` field, one entry per field. Each key is that field, except
``rl_max_response_length``, which ``RLArgs`` declares (the rollout length) and which is also
the length of the ``constant`` normalisation."""

SCHEDULE_FLAGS = {
    "shared_prefix_schedule": "schedule",
    "shared_prefix_wave_size": "wave_size",
    "shared_prefix_checkpoint_waves": "checkpoint_waves",
    "rl_max_response_length": "max_response_length",
    "shared_prefix_prompt": "prompt",
    "shared_prefix_memory_budget": "memory_budget",
    "micro_batch_size": "naive_micro_batch_size",
}
"""Key -> keyword of ``get_shared_prefix_forward_backward_func`` (the schedule and its
``Planner``): the only route of these keys into the library (the memory budget is in MiB here,
in bytes there: ``schedule_from`` converts it)."""


LIBRARY_ERRORS = (ValueError, TypeError, AssertionError, NotImplementedError)
"""What a library constructor raises for a bad argument."""


def library_errors(build: Callable, cfg, flags: dict[str, str]) -> list[str]:
    """[] when ``build(cfg)`` constructs its library object, else the library's message with
    its names turned into the keys of ``{key: library name}``."""
    try:
        build(cfg)
    except LIBRARY_ERRORS as e:
        return [rename(str(e), flags)]
    return []


def positive(section, *keys: str, minimum: float = 1) -> list[str]:
    """An error for each key of ``section`` below ``minimum``."""
    return [f"{k} must be >= {minimum}, got {getattr(section, k)}"
            for k in keys if getattr(section, k) < minimum]


def to_dict(cfg) -> dict:
    """The flat key -> value mapping of a ``RunConfig``, in section and field order."""
    return {k: v for s in dataclasses.fields(cfg)
            for k, v in dataclasses.asdict(getattr(cfg, s.name)).items()}
