"""Shared-prefix training: prompt once, responses in waves, one joint replay backward."""

from .group import ReplayGuard, ReplayInputError, SharedPrefixGroup
from .naive import naive_step
from .objective import RLObjective, loop_weights
from .probe import SavedTensorProbe
from .schedule import (
    SharedPrefixSchedule,
    get_shared_prefix_forward_backward_func,
    wave_logprobs,
)

__all__ = [
    "RLObjective", "ReplayGuard", "ReplayInputError", "SavedTensorProbe",
    "SharedPrefixGroup", "SharedPrefixSchedule", "get_shared_prefix_forward_backward_func",
    "loop_weights", "naive_step", "wave_logprobs",
]
