"""Naive training for comparison: every response a full prompt+response sequence through
stock MCore ``get_forward_backward_func()``, with the same per-wave ``forward_step_func`` as
joint replay (a microbatch of full sequences is a ``WaveBatch`` of the group)."""

import contextlib
from functools import partial
from typing import Optional

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import unwrap_model

from ..model.vocab_parallel import logprob_temperature
from .group import SharedPrefixGroup, WaveBatch


class FullSequenceModel:
    """The ``model`` a per-wave ``forward_step_func`` receives in a naive step: ``model(wave)``
    runs the wave's rows as full sequences and returns per-loop log-probs [R, W, T]."""

    def __init__(self, model, num_loops: Optional[int] = None):
        self.model, self.num_loops = model, num_loops
        self.config = getattr(model, "config", None)

    def __call__(self, wave: WaveBatch) -> torch.Tensor:
        return self.readouts(wave)["logprobs"]

    def readouts(self, wave: WaveBatch) -> dict:
        """As ``WaveModel.readouts``: ``logprobs`` [R, W, T], ``exit_logprobs`` [R, W, T] with
        the exit gate, ``loop_weights`` [R] with learned loop credit."""
        g = wave.group
        runs = g.exit_runs(self.num_loops or unwrap_model(self.model).config.looped_num_loops)
        exits = {} if runs is None else {"exit_depths": wave.rows(runs)}
        out = self.model(wave.rows(g.tokens), labels=wave.rows(g.labels),
                         num_loops=self.num_loops, **exits)
        return readout_dict(unwrap_model(self.model), out.logprobs.shape[0], out.logprobs,
                            out.exit_logprobs)


def readout_dict(inner, num_loops: int, logprobs: torch.Tensor,
                 exit_logprobs: Optional[torch.Tensor] = None) -> dict:
    """The readouts every wave model returns: ``logprobs``, ``exit_logprobs`` when the model
    has the exit gate, and the model's learned loop credit ``loop_weights`` [R] (R =
    ``num_loops``) when it has one."""
    result = {"logprobs": logprobs}
    if exit_logprobs is not None:
        result["exit_logprobs"] = exit_logprobs
    weights = getattr(inner, "loop_weights", lambda R: None)(num_loops)
    if weights is not None:
        result["loop_weights"] = weights
    return result


def logprobs_at(model, temperature: float):
    """The context in which ``model`` (DDP-wrapped, or MCore's list of chunks) scores labels at
    sampling ``temperature`` (``LoopedGPTModel.logprobs_at``); nothing to do at temperature 1
    (or greedy, 0), whatever the model."""
    if logprob_temperature(temperature) == 1.0:
        return contextlib.nullcontext()
    inner = unwrap_model(model[0] if isinstance(model, (list, tuple)) else model)
    if not hasattr(inner, "logprobs_at"):
        raise TypeError(f"temperature {temperature} needs a model that scores at a sampling "
                        f"temperature (LoopedGPTModel.logprobs_at), got {type(inner).__name__}")
    return inner.logprobs_at(temperature)


def naive_microbatches(groups: list, micro_batch_size: int) -> list:
    """Every group split into ``WaveBatch``es of ``micro_batch_size`` full sequences."""
    return [wave for g in groups for wave in g.waves(micro_batch_size)]


def split_loss(outputs: tuple, per_token: bool) -> tuple:
    """A per-wave ``loss_func``'s result -> (loss, num_tokens or None, stats). With MCore's
    ``calculate_per_token_loss`` it must be (the wave's token sum, its token count, stats),
    else (the wave's share of the group loss, stats): a per-wave count cannot normalise a
    group split into waves, and a group share cannot be divided by the step's count."""
    if per_token and len(outputs) != 3:
        raise ValueError(f"config.calculate_per_token_loss: the loss_func must return (loss "
                         f"summed over the wave's tokens, num_tokens, stats), got "
                         f"{len(outputs)} values (a loss normalised per group cannot be "
                         f"divided by the step's token count)")
    if not per_token and len(outputs) != 2:
        raise ValueError(f"a shared-prefix loss_func returns (loss, stats): the wave's share of "
                         f"the group loss, normalised over the whole group (a per-wave token "
                         f"count cannot normalise a group split into waves; (loss, num_tokens, "
                         f"stats) needs config.calculate_per_token_loss), got {len(outputs)} "
                         f"values")
    return (outputs[0], outputs[1], outputs[2]) if per_token else (outputs[0], None, outputs[1])


def is_report_pair(value: torch.Tensor, per_token: bool) -> bool:
    """Whether a loss_func's stat is MCore's reporting form of a per-token loss, a [sum,
    count] pair (shape [2]) summed over microbatches: only with ``per_token``."""
    return per_token and tuple(value.shape) == (2,)


def _forward_step(forward_step_func, scale: float, num_loops, per_token: bool, data_iterator,
                  model):
    output, loss_func = forward_step_func(data_iterator, FullSequenceModel(model, num_loops))

    def scaled_loss(output_tensor, non_loss_data: bool = False):
        if non_loss_data:
            return loss_func(output_tensor, non_loss_data=True)
        loss, num_tokens, stats = split_loss(loss_func(output_tensor), per_token)
        if per_token:  # MCore sums; finalize_model_grads divides by the step's token count
            return loss, num_tokens, stats
        return loss * scale, stats

    return output, scaled_loss


def naive_step(model, groups: list, forward_step_func, micro_batch_size: int,
               forward_only: bool = False, collect_non_loss_data: bool = False,
               num_loops: Optional[int] = None, temperature: float = 1.0) -> list:
    """One step of the groups' full sequences through the stock MCore schedule; one result
    per microbatch. ``forward_step_func`` is the per-wave one joint replay takes; ``num_loops``:
    R of the step (None: the config's ``looped_num_loops``); ``temperature``: the sampling
    temperature of the groups' responses, at which their log-probs are computed
    (``logprobs_at``). Every group is checked first as joint replay checks it (a row with no
    trained token would give 0 / 0 = NaN). With the config's ``calculate_per_token_loss`` the
    loss_func returns (token sum, num_tokens, stats) and MCore normalises by the step's
    tokens (``split_loss``)."""
    if not all(isinstance(g, SharedPrefixGroup) for g in groups):
        raise TypeError("naive_step takes SharedPrefixGroup objects")
    inner = unwrap_model(model[0] if isinstance(model, (list, tuple)) else model)  # MCore: chunks
    R = inner.config.with_loops(num_loops).looped_num_loops
    check_group = getattr(forward_step_func, "check_group", None)  # the loss's own needs
    loss_runs = not (forward_only and collect_non_loss_data)
    for g in groups:  # joint replay's checks: a response with no trained token is refused
        g.check_for(inner, R)
        if check_group is not None and loss_runs:
            check_group(g)
    batches = naive_microbatches(groups, micro_batch_size)
    # MCore divides every microbatch loss by their number; the step loss is the mean over
    # groups, as in joint replay. With calculate_per_token_loss MCore divides by the step's
    # token count instead (finalize_model_grads), and the losses are token sums.
    scale = len(batches) / len(groups)
    per_token = bool(getattr(inner.config, "calculate_per_token_loss", False))
    with logprobs_at(model, temperature):
        return get_forward_backward_func()(
            forward_step_func=partial(_forward_step, forward_step_func, scale, num_loops,
                                      per_token),
            data_iterator=iter(batches), model=model, num_microbatches=len(batches),
            seq_length=groups[0].tokens.shape[1], micro_batch_size=micro_batch_size,
            forward_only=forward_only, collect_non_loss_data=collect_non_loss_data,
        )
