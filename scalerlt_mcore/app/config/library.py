"""The keys' route to the library: each section's help (its fields' docstrings), one map per
library object from key to field, and the library's own checks reported in the keys' names.

Every key is a field declared in its section's source: the ``looped_*`` keys are inherited
from ``LoopedFields`` (the ``looped_*`` fields of ``LoopedTransformerConfig``, declared once),
the other library keys are declared with the library's default (``RLObjective.clip_low``).
A key whose library field has another name reaches it through one map (``OBJECTIVE_FLAGS``,
``SCHEDULE_FLAGS``, ``SAMPLING_FLAGS``) and one builder (``builders.py``); a library object
checks itself and raises a ``FieldError`` naming its field, which ``library_errors`` says in
the key's name through the same map."""

import ast
import dataclasses
import inspect
import textwrap
from collections.abc import Callable

from ...model.config import FieldError


def field_docs(cls: type) -> dict[str, str]:
    """Help text of each field of dataclass ``cls`` that has one: the attribute docstring (the
    string under the field in the source of ``cls`` or a base class)."""
    docs = {}
    for klass in reversed(cls.__mro__):
        docs.update(_source_docs(klass))
    return {f.name: docs[f.name] for f in dataclasses.fields(cls) if f.name in docs}


def _source_docs(cls: type) -> dict[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # builtins
        return {}
    body = ast.parse(source).body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


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
    "rl_inference_logprobs_is_correction": "inference_is_correction",
    "rl_importance_sampling_truncation_coef": "is_truncation_coef",
}
"""Key -> ``RLObjective`` field, one entry per field. ``rl_max_response_length`` (the rollout
length, an ``RLArgs`` key of its own) is also the length of the ``constant`` normalisation."""

SCHEDULE_FLAGS = {
    "shared_prefix_schedule": "schedule",
    "shared_prefix_wave_size": "wave_size",
    "shared_prefix_checkpoint_waves": "checkpoint_waves",
    "rl_max_response_length": "max_response_length",
    "shared_prefix_prompt": "prompt",
    "shared_prefix_prompt_segments": "prompt_segments",
    "shared_prefix_state": "state_kind",
    "shared_prefix_memory_budget": "memory_budget",
    "micro_batch_size": "naive_micro_batch_size",
}
"""Key -> keyword of ``get_shared_prefix_forward_backward_func`` (the schedule and its
``Planner``): the only route of these keys into the library (the memory budget is in MiB here,
in bytes there: ``schedule_from`` converts it)."""

SAMPLING_FLAGS = {
    "rl_temperature": "temperature",
    "rl_top_p": "top_p",
    "rl_rollout_exit": "exit_mode",
    "rl_exit_threshold": "exit_threshold",
    "rl_stop_check_interval": "stop_check_interval",
}
"""Key -> field of ``rl.rollout.Sampling``, how rollouts draw tokens (``sampling_from``)."""


LIBRARY_ERRORS = (ValueError, TypeError, AssertionError, NotImplementedError)
"""What a library constructor raises for a bad argument."""


def library_errors(build: Callable, cfg, flags: dict[str, str]) -> list[str]:
    """[] when ``build(cfg)`` constructs its library object, else the library's message; a
    ``FieldError`` in the name of its key (``flags``: key -> library field)."""
    try:
        build(cfg)
    except LIBRARY_ERRORS as e:
        return [in_key_names(e, flags)]
    return []


def in_key_names(error: Exception, flags: dict[str, str]) -> str:
    """The message of ``error``; a ``FieldError`` of a field of ``{key: field}`` names the
    key instead."""
    if not isinstance(error, FieldError):
        return str(error)
    key = {field: key for key, field in flags.items()}.get(error.field, error.field)
    return f"{key} {error.reason}"


def positive(section, *keys: str, minimum: float = 1) -> list[str]:
    """An error for each key of ``section`` below ``minimum``."""
    return [f"{k} must be >= {minimum}, got {getattr(section, k)}"
            for k in keys if getattr(section, k) < minimum]


def to_dict(cfg) -> dict:
    """The flat key -> value mapping of a ``RunConfig``, in section and field order."""
    return {k: v for s in dataclasses.fields(cfg)
            for k, v in dataclasses.asdict(getattr(cfg, s.name)).items()}
