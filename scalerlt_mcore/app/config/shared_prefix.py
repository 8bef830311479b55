"""The shared-prefix section: the schedule that trains a group of responses sharing one
prompt (its keys reach the schedule and its ``Planner`` through ``SCHEDULE_FLAGS``)."""

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Optional, Union

from ...shared_prefix.planner import DEFAULT_PROMPT, DEFAULT_SEGMENTS, DEFAULT_STATE
from .builders import schedule_from
from .library import SCHEDULE_FLAGS, library_errors

if TYPE_CHECKING:
    from .run import RunConfig


@dataclass
class SharedPrefixArgs:
    """The schedule that trains a group of responses sharing one prompt."""

    shared_prefix_schedule: Literal["joint_replay", "naive", "auto"] = "joint_replay"
    """``joint_replay`` (prompt computed once, one replay backward), ``naive``, or ``auto``
    (per group, whichever a cost model calibrated at start predicts faster)."""
    shared_prefix_wave_size: Union[int, Literal["auto"]] = 4
    """Responses per wave in joint replay, or ``auto``: per group the largest wave whose
    predicted activations and prefix adjoints fit ``shared_prefix_memory_budget``."""
    shared_prefix_checkpoint_waves: bool = False
    """Recompute each wave in backward instead of keeping its activations."""
    shared_prefix_prompt: Literal["retain", "recompute", "auto"] = DEFAULT_PROMPT
    """``retain`` (keep the prompt's graph: the prompt is computed once), ``recompute`` (run
    it again in the joint replay), or ``auto`` (retain unless only recompute fits the budget)."""
    shared_prefix_prompt_segments: Union[int, Literal["auto"]] = DEFAULT_SEGMENTS
    """Query segments the joint replay recomputes the prompt in, each in a backward of its own
    (a long prompt's replay then holds one segment's graph, not the whole prompt's; > 1 needs
    the prompt recomputed), or ``auto``: one, or the fewest that fit
    ``shared_prefix_memory_budget`` where nothing else does."""
    shared_prefix_state: Literal["kv", "inputs", "auto"] = DEFAULT_STATE
    """What the prompt's prefix state keeps per (loop, layer): ``kv`` (its K and V), ``inputs``
    (the attention's input, half of K and V with MHA, and so are its adjoints: every wave
    projects the K/V again), or ``auto``: K/V unless only inputs fit
    ``shared_prefix_memory_budget``."""
    shared_prefix_memory_budget: Optional[float] = None
    """MiB of saved activations plus prefix adjoints allowed per group (planner prediction);
    None: on a GPU 90% of the memory the device has left beside the model state, on CPU no
    budget."""


def check_shared_prefix(cfg: "RunConfig", gpu: bool) -> list[str]:
    """The schedule's and its planner's own checks (the loss's bytes per position change none
    of them: a placeholder, so that an invalid objective is reported once, by its own check);
    ``gpu``: the run defaults its budget from the device (a placeholder here)."""
    return library_errors(lambda c: schedule_from(c, loss_per_position=1.0,
                                                  default_budget=1.0 if gpu else None),
                          cfg, SCHEDULE_FLAGS)
