"""Shared-prefix training: prompt once, responses in waves, one joint replay backward.

The schedule takes the per-wave loss from the caller's ``forward_step_func`` (as MCore's
schedules do); nothing here knows the RL objective, in code or in data: a loss's own tensors
are fields of a group subclass (``SharedPrefixGroup.EXTRAS``), checked and guarded like the
group's, and the planner takes the loss's saved bytes per position from its caller.
"""

from .group import ReplayGuard, ReplayInputError, SharedPrefixGroup, WaveBatch
from .naive import FullSequenceModel, naive_microbatches, naive_step
from .probe import SavedTensorProbe
from .replay import WaveModel
from .schedule import PHASES, SharedPrefixSchedule, get_shared_prefix_forward_backward_func
from .scoring import logprobs_forward_step
from .tree import PrefixTree, TreeError, TreeSegment

__all__ = [
    "PHASES", "FullSequenceModel", "PrefixTree", "ReplayGuard", "ReplayInputError",
    "SavedTensorProbe", "SharedPrefixGroup", "SharedPrefixSchedule", "TreeError", "TreeSegment",
    "WaveBatch", "WaveModel", "get_shared_prefix_forward_backward_func", "logprobs_forward_step",
    "naive_microbatches", "naive_step",
]
