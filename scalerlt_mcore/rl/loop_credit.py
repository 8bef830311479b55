"""Loop credit: how a loss over all-loop readouts weights the R loops.

One registry, ``LOOP_CREDIT``, serves the RL objective (``RLObjective.loop_coef``), the
supervised warm-up (``warmup_weights``) and the run's checks (``model_errors``). A new scheme
is one entry here (and, when its weights come from a new model part, that part in the model).

Each scheme's weights are broadcastable to [R, B, T'] (B rows, T' positions): fixed schemes
[R, 1, 1] from R alone; ``exit_pdf`` per token from the exit gate; ``learned`` [R, 1, 1] from
the model's trainable logits.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Optional

import torch
from torch import Tensor

from ..model.config import FieldError


def _final(R: int, device) -> Tensor:
    w = torch.zeros(R, dtype=torch.float64, device=device)
    w[-1] = 1.0
    return w


def _uniform(R: int, device) -> Tensor:
    return torch.full((R,), 1.0 / R, dtype=torch.float64, device=device)


def _progressive(R: int, device) -> Tensor:
    r = torch.arange(1, R + 1, dtype=torch.float64, device=device)
    return r / r.sum()


def _exit_pdf(readouts: dict, like: Tensor) -> Tensor:
    """p(exit at r) per token [R, B, T'], detached: credit follows the gate, but the policy
    loss does not move it (the gate learns from its own term)."""
    exit_logprobs = readouts.get("exit_logprobs")
    if exit_logprobs is None:
        raise ValueError("loop weights 'exit_pdf' need the model's exit gate (looped_exit_gate)")
    return exit_logprobs.detach().exp().to(like.dtype)


def _learned(readouts: dict, like: Tensor) -> Tensor:
    """softmax of the model's per-loop logits [R] -> [R, 1, 1], with grad."""
    learned = readouts.get("loop_weights")
    if learned is None:
        raise ValueError("loop weights 'learned' need the model's learned loop weights "
                         "(looped_learned_loop_weights)")
    return learned.to(like.dtype)[:, None, None]


@dataclass(frozen=True)
class LoopCredit:
    """One loop-credit scheme."""

    fixed: Optional[Callable[[int, object], Tensor]] = None
    """(R, device) -> w [R] in fp64 summing to 1, for weights that depend on R alone."""

    from_model: Optional[Callable[[dict, Tensor], Tensor]] = None
    """(readouts, like) -> weights broadcastable to [R, B, T'] in ``like``'s dtype, for weights
    the model computes (``readouts``: the wave model's ``exit_logprobs`` / ``loop_weights``)."""

    model_part: Optional[str] = None
    """The model config flag (``looped_*``) of the part the weights come from; it must be on."""

    trains_part: bool = False
    """The scheme is what trains ``model_part`` (on without the scheme, it gets no gradient)."""

    per_loop_part: bool = False
    """``model_part`` holds one parameter per loop of ``looped_num_loops``: no step may run
    more loops."""

    warmup: Optional[str] = None
    """The scheme the supervised warm-up uses instead (None: this one), e.g. uniform weights
    while the exit gate is still untrained."""


LOOP_CREDIT = {
    "final": LoopCredit(fixed=_final),
    "uniform": LoopCredit(fixed=_uniform),
    "progressive": LoopCredit(fixed=_progressive),
    "exit_pdf": LoopCredit(from_model=_exit_pdf, model_part="looped_exit_gate",
                           warmup="uniform"),
    "learned": LoopCredit(from_model=_learned, model_part="looped_learned_loop_weights",
                          trains_part=True, per_loop_part=True),
}
"""Scheme name -> ``LoopCredit``: final readout only, uniform, growing with r (RLTT), the exit
gate's p(r) per token (Ouro), learned softmax logits (RLTT)."""

LoopWeights = Literal[tuple(LOOP_CREDIT)]
LOOP_WEIGHTS = tuple(LOOP_CREDIT)
FIXED_LOOP_WEIGHTS = tuple(k for k, c in LOOP_CREDIT.items() if c.fixed is not None)
"""Loop weights that depend on R alone (``loop_weights``); the others come from the model."""


def credit(scheme: str) -> LoopCredit:
    """The registry's entry of ``scheme``; an unknown name is an error listing the schemes."""
    if scheme not in LOOP_CREDIT:
        raise ValueError(f"loop weights must be one of {tuple(LOOP_CREDIT)}, got {scheme!r}")
    return LOOP_CREDIT[scheme]


def loop_weights(scheme: str, num_loops: int, device=None) -> Tensor:
    """Per-loop credit w_r [R] in fp64 on ``device`` (sums to 1) of a fixed scheme."""
    c = credit(scheme)
    if c.fixed is None:
        raise ValueError(f"loop weights {scheme!r} come from the model's outputs (exit gate or "
                         f"learned logits), not from R alone")
    return c.fixed(num_loops, device)


def needs_readouts(scheme: str) -> bool:
    """Whether the scheme's weights need more of the model than per-loop log-probs."""
    return credit(scheme).from_model is not None


def coefficients(scheme: str, readouts: dict, like: Tensor) -> Tensor:
    """The weights of ``scheme`` broadcastable to ``like`` [R, B, T'] in its dtype and on its
    device; ``readouts``: the model's outputs (``exit_logprobs``, ``loop_weights``)."""
    c = credit(scheme)
    if c.fixed is not None:
        return loop_weights(scheme, like.shape[0], like.device).to(like.dtype)[:, None, None]
    return c.from_model(readouts, like)


def warmup_weights(scheme: str, readouts: dict, like: Tensor) -> Tensor:
    """The supervised warm-up's weights for a run whose RL credit is ``scheme``."""
    return coefficients(credit(scheme).warmup or scheme, readouts, like)


def model_errors(scheme: str, model, max_loops: Optional[int] = None) -> list:
    """What the scheme needs of a model (``model``: anything with its ``looped_*`` fields,
    e.g. its config) and what the model's parts need of the scheme; ``max_loops``: the most
    loops a step runs. -> a ``FieldError`` of ``loop_weights`` per problem (empty: fine)."""
    errors = []
    for name, c in LOOP_CREDIT.items():
        part = c.model_part
        on = part is not None and bool(getattr(model, part, False))
        if name == scheme and part is not None and not on:
            errors.append(FieldError("loop_weights", f"{name} needs {part} true"))
        if c.trains_part and on and name != scheme:
            errors.append(FieldError("loop_weights", f"must be {name} with {part} (otherwise "
                                     f"its parameters get no gradient)"))
        loops = model.looped_num_loops
        if c.per_loop_part and on and max_loops is not None and max_loops > loops:
            errors.append(FieldError("loop_weights", f"{name}: {part} holds looped_num_loops = "
                                     f"{loops} per-loop weights, but looped_num_loops_sampling "
                                     f"draws up to {max_loops} loops"))
    return errors
