"""Shared-prefix joint replay as a drop-in for MCore's ``get_forward_backward_func()``.

Per group (one prompt, G responses):
  1. prompt producer   - the prompt under no_grad (``prompt="recompute"``) or with grad, its
                         graph kept (``"retain"``); its prefix state becomes grad leaves;
  2. waves 1..n-1      - W responses each against the leaves, backward under no_sync:
                         parameter grads accumulate, the leaves collect the prefix adjoints;
  3. joint replay      - verify inputs, recompute the prompt with grad (or take the retained
                         graph), run the last wave, and backpropagate
                         loss_last + sum_k <state_k, adjoint_k> in ONE backward.
Earlier groups of a step run entirely under ``config.no_sync_func`` (as MCore's schedule runs
microbatches 1..n-1), so the sync-enabled part of every step is exactly one backward call.

Every group is a prefix tree (a one-level group: the depth-1 tree of its prompt and one leaf
per response, ``SharedPrefixGroup.as_tree``), trained depth first by the one replay engine,
``tree_schedule.TreeReplay``, with the same three phases per node (the plan retains or
recomputes each node's graph, ``GroupPlan.retain_nodes``); its root's replay is its one
backward outside ``no_sync``. The engine's calls are ``replay.GroupRun``'s; this module keeps
MCore's interface.

The schedule knows nothing about the loss. As in MCore, ``forward_step_func(data_iterator,
model)`` returns ``(output, loss_func)``; for a group it is called once per wave with an
iterator yielding one ``WaveBatch`` and, as ``model``, a ``WaveModel`` whose call returns the
wave's per-loop log-probs. ``loss_func(output)`` returns ``(loss, stats)``: the wave's share of
the group's loss (normalised over the whole group) and a dict of tensors. With the config's
``calculate_per_token_loss`` (MCore's per-token-loss contract) it returns ``(loss, num_tokens,
stats)``: the wave's loss summed over its tokens and their count; as MCore's schedule, the
schedule then neither divides by the number of groups nor by any count, sums the token counts
of the step and passes them to ``config.finalize_model_grads_func(..., num_tokens)``, which
all-reduces them over data-parallel ranks and divides the gradients by the total: the step's
loss is the mean over every trained token of the step. A group's reported [sum, count] pairs
(shape [2], MCore's reporting form of a per-token loss) are summed over its waves.

Up-front checks, before any compute (no phase runs, no grad changes when one fails): every
group's ``SharedPrefixGroup.check`` (shapes, shared prompt, token ids and labels in the model's
vocabulary, labels the tokens shifted by one, lengths within the position table); stochastic
layers (dropout) are rejected, since the replay would draw other masks than the prompt producer;
and, if ``forward_step_func`` has a ``check_group`` attribute and the loss is computed (any step
but forward_only with ``collect_non_loss_data``), ``forward_step_func.check_group(group)`` is
called for every group, so a loss can reject what it cannot use (e.g. a group without the extra
tensors it reads) before any compute.

A refused step: every field the replay reads is fingerprinted after the up-front checks and
verified before each group's prompt producer, every wave (re)compute and the joint replay
(``ReplayGuard``). A ``ReplayInputError`` raised once compute
has begun leaves the gradients of the waves and groups that already ran in the parameters'
grad buffers (parameters and optimizer are untouched: the schedule never steps). The caller
must discard them (MCore DDP ``zero_grad_buffer()`` and ``optimizer.zero_grad()``) and must not
step the optimizer; the error message says so.

The step's loop count R is the call's keyword ``num_loops`` (None: the model config's
``looped_num_loops``): the prompt producer, the waves and naive microbatches run R loops; the
model's config is never changed. Its keyword ``temperature`` (default 1) is the sampling
temperature of the responses: every log-prob the step computes is log_softmax(logits / T).

Each group is trained by its plan (``planner.GroupPlan``: wave size and prompt mode, or naive:
full sequences in microbatches, the last one sync-enabled), chosen per group by the schedule's
``Planner`` (fixed, ``wave_size="auto"`` within a memory budget, ``schedule="naive"``, or
``"auto"`` by a cost model) or by a caller's ``chooser``. Each group's result dict carries its
plan as tensors: ``num_waves``, ``wave_size``, ``retain``, ``naive``, ``prompt_segments``,
``state_inputs`` (1: prefix states of kind ``inputs``).
"""

import contextlib
import itertools
from collections.abc import Callable
from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.utils import get_model_config, unwrap_model
from torch import Tensor

from ..mcore_compat import stock_schedule_kwargs
from .group import ReplayGuard, ReplayInputError, SharedPrefixGroup
from .naive import logprobs_at
from .planner import GroupPlan, Planner
from .replay import GroupRun, merge, score_naive, train_naive
from .tree_schedule import TreeReplay

PHASES = ("prompt_producer", "wave", "joint_replay", "naive")

DROPOUT_FIELDS = {"hidden_dropout": "--hidden-dropout", "attention_dropout": "--attention-dropout"}
"""Config dropout fields joint replay rejects when > 0, with their Megatron flags."""

_EXHAUSTED = object()
"""``next``'s default: the data iterator had no microbatch left."""

PARTIAL_GRADS = ("the step was refused after compute began: gradients of the waves that already "
                 "ran remain in the grad buffers; discard them (DDP zero_grad_buffer() and "
                 "optimizer.zero_grad()) and do not step the optimizer")


def get_shared_prefix_forward_backward_func(wave_size, checkpoint_waves: bool = False,
                                            max_response_length: Optional[int] = None,
                                            phase_callback: Optional[Callable] = None, *,
                                            chooser: Optional[Callable] = None, **plan):
    """The shared-prefix schedule, called like the function ``get_forward_backward_func()``
    returns. Microbatches that are ``SharedPrefixGroup``s go through joint replay (or a naive
    plan); any other step goes to stock MCore unchanged. ``phase_callback(phase, group)`` runs
    after each phase (``PHASES``); ``plan``: the ``Planner``'s keywords (``prompt``,
    ``memory_budget``, ``schedule``, ...). See ``SharedPrefixSchedule``."""
    return SharedPrefixSchedule(wave_size, checkpoint_waves, max_response_length,
                                phase_callback, chooser=chooser, **plan)


class SharedPrefixSchedule:
    """See the module docstring. Reaches DDP only through ``config.no_sync_func`` and
    ``config.finalize_model_grads_func``; grad reduction with ``overlap_grad_reduce`` is
    launched by DDP's hooks during the single sync-enabled backward.

    The plan of each group (wave size, prompt mode, or naive training) comes from
    ``chooser(group, model) -> GroupPlan``; without one, from a ``planner.Planner`` built from
    ``wave_size`` and the keywords ``plan`` (``prompt``: ``planner.DEFAULT_PROMPT`` when not
    given, ``memory_budget`` in bytes,
    ``schedule``: joint_replay | naive | auto, ``cost_model``, ``naive_micro_batch_size``,
    ``loss_per_position``), which checks them. ``checkpoint_waves``: recompute each wave in
    its backward; ``max_response_length``: groups with longer responses are rejected.
    """

    def __init__(self, wave_size, checkpoint_waves: bool = False,
                 max_response_length: Optional[int] = None,
                 phase_callback: Optional[Callable] = None, *,
                 chooser: Optional[Callable] = None, **plan):
        if chooser is None:
            chooser = Planner(wave_size, checkpoint_waves=checkpoint_waves, **plan)
        elif any(v is not None for v in plan.values()):
            raise ValueError(f"a chooser replaces the schedule's planner: give "
                             f"{sorted(k for k, v in plan.items() if v is not None)} to it")
        self.chooser = chooser
        self.checkpoint_waves = checkpoint_waves
        self.max_response_length = max_response_length
        self.phase_callback = phase_callback or (lambda phase, group: None)

    def __call__(self, *, num_loops: Optional[int] = None, temperature: float = 1.0, **kwargs):
        """Takes every keyword argument of the installed MCore's forward-backward function
        (``stock_schedule_kwargs``) and hands a step of plain microbatches to it unchanged;
        ``num_loops``: R of a step of groups (None: the config's ``looped_num_loops``);
        ``temperature``: the sampling temperature of the responses, at which every log-prob of
        the step is computed (``naive.logprobs_at``; 1: as the logits are)."""
        stock_kwargs = stock_schedule_kwargs(get_forward_backward_func(), kwargs)
        with logprobs_at(kwargs.get("model"), temperature):
            return self._step(stock_kwargs, num_loops, **stock_kwargs)

    def _step(self, stock_kwargs: dict, num_loops, *, forward_step_func, data_iterator, model,
              num_microbatches: int, forward_only: bool = False,
              collect_non_loss_data: bool = False, first_val_step=None,
              adjust_tensor_shapes_fn=None, pg_collection=None, force_all_reduce: bool = False,
              **_):
        del stock_kwargs["data_iterator"]
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            raise NotImplementedError("shared-prefix joint replay needs pipeline parallel size 1")
        first = next(_single(data_iterator, "data_iterator"), _EXHAUSTED)
        if first is _EXHAUSTED:
            raise ValueError(f"num_microbatches = {num_microbatches}, but data_iterator "
                             f"yielded no microbatch")
        if not isinstance(first, SharedPrefixGroup):
            if num_loops is not None:
                raise ValueError("num_loops is the loop count of a step of SharedPrefixGroups; "
                                 "a stock step's forward_step_func passes it to the model")
            rest = _single(data_iterator, "data_iterator")
            return get_forward_backward_func()(
                data_iterator=itertools.chain([first], rest), **stock_kwargs)
        if forward_step_func is None:
            raise ValueError("a shared-prefix step needs forward_step_func: it supplies each "
                             "wave's loss (see scalerlt_mcore.shared_prefix.schedule)")
        if adjust_tensor_shapes_fn is not None:
            raise ValueError("adjust_tensor_shapes_fn is for pipeline parallelism; joint "
                             "replay runs without it (as MCore's non-pipelined schedule)")
        model = _single(model, "model")
        it = _single(data_iterator, "data_iterator")
        groups = _take_groups(first, it, num_microbatches)
        inner, config = unwrap_model(model), get_model_config(model)
        num_loops = inner.config.with_loops(num_loops).looped_num_loops  # checked
        loss_runs = not (forward_only and collect_non_loss_data)  # the loss's needs matter
        check_group = getattr(forward_step_func, "check_group", None) if loss_runs else None
        self._check_groups(groups, inner, forward_only, config, check_group, num_loops)
        runs = self._runs(inner, groups, config, forward_step_func, forward_only,
                          collect_non_loss_data, first_val_step, num_loops)
        if forward_only:
            return [self.score_group(run) for run in runs]
        try:
            results = self._train_groups(runs, config)
        except ReplayInputError as e:
            raise ReplayInputError(f"{e}. {PARTIAL_GRADS}") from e
        if config.finalize_model_grads_func is not None:
            num_tokens = _step_tokens(runs, groups[0].tokens.device) if runs[0].per_token else None
            config.finalize_model_grads_func([model], num_tokens, pg_collection=pg_collection,
                                             force_all_reduce=force_all_reduce)
        return results

    # ---- checks ----------------------------------------------------------------------------

    def _check_groups(self, groups, inner, forward_only, config, check_group,
                      num_loops: int) -> None:
        if not forward_only or inner.training:
            _check_deterministic(inner)
        for g in groups:
            if not isinstance(g, SharedPrefixGroup):
                raise TypeError("a shared-prefix step must contain only SharedPrefixGroup "
                                f"microbatches, got {type(g).__name__}")
            g.check_for(inner, num_loops, self.max_response_length)
            if check_group is not None:
                check_group(g)

    def _runs(self, inner, groups, config, forward_step_func, forward_only,
              collect_non_loss_data, first_val_step, num_loops: int) -> list:
        """One ``GroupRun`` per group. Every group is fingerprinted now, right after the
        up-front checks: a later group changed while an earlier one trains is caught."""
        first = first_val_step if forward_only and first_val_step is not None else True
        per_token = bool(getattr(config, "calculate_per_token_loss", False))
        return [GroupRun(inner, g, ReplayGuard(g), config, forward_step_func,
                         1.0 if per_token else 1.0 / len(groups), num_loops,
                         per_token=per_token, first_microbatch=first and n == 0,
                         collect_non_loss_data=collect_non_loss_data,
                         plan=self._plan(g, inner, num_loops),
                         checkpoint_waves=self.checkpoint_waves,
                         phase=lambda name, g=g: self.phase_callback(name, g))
                for n, g in enumerate(groups)]

    def _plan(self, group: SharedPrefixGroup, inner, num_loops: int) -> GroupPlan:
        """The group's plan, the chooser's (scoring uses its wave size); the schedule's own
        ``Planner`` plans for the step's loop count."""
        if isinstance(self.chooser, Planner):
            plan = self.chooser(group, inner, num_loops=num_loops)
        else:
            plan = self.chooser(group, inner)
        if not isinstance(plan, GroupPlan):
            raise TypeError(f"chooser must return a GroupPlan, got {type(plan).__name__}")
        return plan

    # ---- training --------------------------------------------------------------------------

    def _train_groups(self, runs: list, config) -> list:
        no_sync = config.no_sync_func or contextlib.nullcontext
        results = []
        with no_sync():
            for run in runs[:-1]:
                results.append(self.train_group(run, contextlib.nullcontext))
        results.append(self.train_group(runs[-1], no_sync))
        return results

    def train_group(self, run: GroupRun, waves_context) -> dict:
        """All three phases for one group (``TreeReplay.train``), or a naive plan's
        microbatches (``replay.train_naive``); phases 1-2 inside ``waves_context``."""
        plan = run.plan
        num_waves = (train_naive(run, waves_context) if plan.naive
                     else TreeReplay(run).train(waves_context))
        return merge(run.results, run.per_token, num_waves=num_waves, wave_size=plan.wave_size,
                     retain=int(plan.retain and not plan.naive), naive=int(plan.naive),
                     prompt_segments=plan.prompt_segments,
                     state_inputs=int(plan.state_kind == "inputs" and not plan.naive))

    def score_group(self, run: GroupRun):
        """forward_only, no graph: the group's loss calls as its training makes them, each
        ``loss_func`` called as MCore calls it (``TreeReplay.score``; a naive plan's rows as
        full sequences, ``replay.score_naive``)."""
        return score_naive(run) if run.plan.naive else TreeReplay(run).score()


def _step_tokens(runs: list, device) -> Tensor:
    """The step's token count, the sum of every loss call's ``num_tokens``, as MCore's
    schedule accumulates it (an int tensor)."""
    total = torch.zeros([], dtype=torch.int, device=device)
    for run in runs:
        for num_tokens in run.num_tokens.values():
            total += num_tokens
    return total


def _check_deterministic(inner) -> None:
    """Reject dropout: the replay recomputes the prompt and the waves, and the prefix adjoints
    of one dropout mask would meet a recompute drawn with another (masks are not replayed).
    Checks the config (also a config changed after the model was built) and every module in
    training mode: an ``nn.Dropout`` with p > 0, or an MCore layer that keeps its own
    ``hidden_dropout`` > 0 (its bias-dropout-add reads that copy, not the config)."""
    for name, flag in DROPOUT_FIELDS.items():
        p = getattr(inner.config, name, 0.0) or 0.0
        if p > 0:
            raise ValueError(f"shared-prefix joint replay does not support dropout: config."
                             f"{name} = {p} (flag {flag}); set it to 0")
    for mname, m in inner.named_modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd):
            what, p = "drops with p", m.p
        else:
            what, p = "applies hidden_dropout", getattr(m, "hidden_dropout", None)
        if m.training and isinstance(p, (int, float)) and p > 0:
            raise ValueError(f"shared-prefix joint replay does not support dropout: module "
                             f"'{mname}' ({type(m).__name__}) {what} = {p} in training mode "
                             f"(MCore builds its dropouts from --hidden-dropout)")


def _take_groups(first, rest, num_microbatches: int) -> list:
    """``first`` and the next ``num_microbatches - 1`` microbatches of ``rest``; an iterator
    that runs out first is an error saying how many it yielded."""
    if not isinstance(num_microbatches, int) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be an integer >= 1, got {num_microbatches!r}")
    groups = [first, *itertools.islice(rest, num_microbatches - 1)]
    if len(groups) < num_microbatches:
        raise ValueError(f"num_microbatches = {num_microbatches}, but data_iterator yielded "
                         f"only {len(groups)} groups")
    return groups


def _single(obj, name: str):
    if isinstance(obj, list):
        if len(obj) != 1:
            raise NotImplementedError(f"shared-prefix joint replay takes one {name} chunk")
        return obj[0]
    return obj
