"""A group's run state and the calls every phase makes (``GroupRun``), the model a wave's loss
receives (``WaveModel``), a naive plan's microbatches, and the prompt replayed in segments.
``tree_schedule.TreeReplay`` runs every joint plan's phases with these calls: a one-level group
is a depth-1 tree."""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from ..model.kv import PrefixState, trained_depths
from .group import ReplayGuard, SharedPrefixGroup, WaveBatch
from .naive import FullSequenceModel, is_report_pair, readout_dict, split_loss


class WaveModel:
    """The ``model`` a group's ``forward_step_func`` receives: ``model(wave)`` returns the
    per-loop log-probs [R, W, T] of ``wave.group.labels`` for the wave's rows, in the group's
    layout (positions P-1 .. T-2, the response labels; zero on the prompt and at T-1), computed
    against the prompt's prefix state instead of re-running the prompt. A wave of a tree's
    leaves: [R, W, span] of its ``span``, against the state of the leaves' path. With recorded
    exit depths each position runs its loops (``SharedPrefixGroup.exit_runs``)."""

    def __init__(self, inner, state: PrefixState, num_loops: Optional[int] = None):
        self.inner, self.state, self.num_loops = inner, state, num_loops
        self.config = inner.config

    def __call__(self, wave: WaveBatch) -> Tensor:
        return self.readouts(wave)["logprobs"]

    def readouts(self, wave: WaveBatch) -> dict:
        """``logprobs`` [R, W, T] as ``__call__``; with the model's exit gate ``exit_logprobs``
        [R, W, T] (log p(exit at loop r) of the same positions, 0 off the response); with
        learned loop credit ``loop_weights`` [R] (``naive.readout_dict``)."""
        tokens, labels = wave.suffix()  # [W, S]
        runs = wave.group.exit_runs(self.state.num_loops)  # [G, T] or None
        span = wave.group.response_positions if wave.whole else wave.span
        exits = None if runs is None else wave.rows(runs)[:, span.start + 1 : span.stop + 1]
        out = self.inner.suffix_readouts(self.state, tokens, labels=labels,
                                         num_loops=self.num_loops,
                                         exit_depths=exits)  # [R, W, S]
        layout = wave.group.to_layout if wave.whole else (lambda t: t)
        exits = None if out.exit_logprobs is None else layout(out.exit_logprobs)
        return readout_dict(self.inner, self.state.num_loops, layout(out.logprobs), exits)


@dataclass
class GroupRun:
    """Everything the phases of one group share, and the calls they make."""

    inner: torch.nn.Module
    group: SharedPrefixGroup
    guard: ReplayGuard
    config: object
    forward_step_func: Callable
    scale: float  # 1 / number of groups, as MCore divides every microbatch loss (per-token: 1)
    num_loops: int  # R of the step
    per_token: bool = False  # config.calculate_per_token_loss: losses are token sums
    num_tokens: dict = field(default_factory=dict)  # wave number -> its loss_func's num_tokens
    first_microbatch: bool = False
    collect_non_loss_data: bool = False
    plan: object = None  # the group's planner.GroupPlan
    results: dict = field(default_factory=dict)  # wave number -> loss_func's dict
    state_dtype: Optional[torch.dtype] = None  # the prompt producer's state dtype
    checkpoint_waves: bool = False  # recompute each wave in its backward
    phase: Callable = lambda name: None  # called with each phase's name as it ends (PHASES)

    def scaled(self, loss: Tensor) -> Tensor:
        """``loss`` through the config's ``grad_scale_func`` (mixed precision), as MCore's
        schedule scales every loss it backpropagates."""
        scale = self.config.grad_scale_func
        return scale(loss) if scale is not None else loss

    def prompt_state(self, start: int = 0, end: Optional[int] = None,
                     prefix: Optional[PrefixState] = None) -> PrefixState:
        """The prefix state (R loops) of prompt positions ``start`` .. ``end`` (default: the
        whole prompt) against ``prefix`` (the earlier positions' state), with grad unless
        called under no_grad."""
        g = self.group
        end = g.prompt_length if end is None else end
        return self.inner(g.tokens[:1, start:end], prefix_state=as_prefix(prefix, self.state_dtype),
                          return_prefix_state=True, readout=False, num_loops=self.num_loops,
                          state_kind=self.state_kind).prefix_state

    @property
    def state_kind(self) -> str:
        """What the group's prefix states keep per depth (``GroupPlan.state_kind``)."""
        return "kv" if self.plan is None else self.plan.state_kind

    def wave_loss(self, wave: WaveBatch, state: Optional[PrefixState], wave_no: int,
                  model=None) -> Tensor:
        """The ``scaled`` ``objective`` of the wave against ``state`` (recomputed in its
        backward with ``checkpoint_waves``), or, without a state, of ``model``'s call (the
        rows as full sequences by default)."""
        if state is None:
            return self.scaled(self.objective(wave, None, wave_no, model))

        def fn(*state_tensors):
            return self.objective(wave, as_prefix(state.like(list(state_tensors)),
                                                  self.state_dtype), wave_no)

        if self.checkpoint_waves:
            return self.scaled(checkpoint(fn, *state.tensors(), use_reentrant=False))
        return self.scaled(fn(*state.tensors()))

    def objective(self, wave: WaveBatch, state: Optional[PrefixState], wave_no: int,
                  model=None) -> Tensor:
        """One wave's share of the group loss, divided as MCore divides a microbatch's loss
        (re-run on recompute, so it re-verifies the inputs; its token count is kept per wave,
        so a recompute does not count it twice); ``model``: what the loss's
        ``forward_step_func`` gets (default: the wave against ``state``)."""
        self.guard.verify("wave recompute" if wave_no in self.results else "wave")
        output, loss_func = self.forward_step(wave, state, wave_no, model)
        loss, num_tokens, stats = split_loss(loss_func(output), self.per_token)
        self.results[wave_no] = stats
        if self.per_token:
            self.num_tokens[wave_no] = num_tokens
        return loss * self.scale

    def forward_step(self, wave: WaveBatch, state: Optional[PrefixState], wave_no: int,
                     model=None):
        """``forward_step_func`` on the wave; without a prefix state (a naive plan) the wave's
        rows run as full sequences."""
        inner = self.inner
        if self.first_microbatch and wave_no == 0 and hasattr(inner, "set_is_first_microbatch"):
            inner.set_is_first_microbatch()
        if model is None:
            model = (FullSequenceModel(inner, self.num_loops) if state is None
                     else WaveModel(inner, state, self.num_loops))
        return self.forward_step_func(iter([wave]), model)

    def score_call(self, wave: WaveBatch, state: Optional[PrefixState], wave_no: int,
                   model=None):
        """One scored call: ``forward_step_func`` on the wave and its ``loss_func``'s result as
        MCore's forward_only keeps it (the non-loss data with ``collect_non_loss_data``, else
        the stats)."""
        output, loss_func = self.forward_step(wave, state, wave_no, model)
        if self.collect_non_loss_data:
            return loss_func(output, non_loss_data=True)
        return split_loss(loss_func(output), self.per_token)[2]


def train_naive(run: GroupRun, waves_context) -> int:
    """A naive plan: the group's rows as full sequences, one microbatch per wave; every
    microbatch but the last inside ``waves_context``, so the sync-enabled part is still one
    backward. -> the number of microbatches."""
    waves = run.group.waves(run.plan.wave_size)
    with waves_context():
        for n, wave in enumerate(waves[:-1]):
            run.wave_loss(wave, None, n).backward()
            run.phase("naive")
    run.guard.verify("naive step", contents=True)
    run.wave_loss(waves[-1], None, len(waves) - 1).backward()
    run.phase("naive")
    return len(waves)


@torch.no_grad()
def score_naive(run: GroupRun) -> object:
    """forward_only under a naive plan: its microbatches scored as full sequences -> the
    merged result."""
    for n, wave in enumerate(run.group.waves(run.plan.wave_size)):
        run.results[n] = run.score_call(wave, None, n)
    return merge(run.results, run.per_token)


# ---- the subdivided replay: the prompt replayed in query segments ----------------------------
#
# Phase 1 runs the prompt segment by segment under no_grad, each segment against the earlier
# segments' K/V as the replay reads them (>= fp32 leaves), written into one state of P
# positions; its leaves collect every wave's adjoints (phase 2 trains all the waves). Phase 3
# recomputes each segment, from the last to the first, with grad against the leaves' earlier
# positions and backpropagates it alone: its adjoint in, the earlier positions' adjoints out,
# into the leaves' grads. Every backward but the first segment's runs inside
# ``waves_context``; the first segment's is the group's last, and adds an exact zero through
# every parameter (``zero_touch``), so that every parameter's gradient hook runs in it as in
# a plain replay (MCore DDP's overlapped reduction launches a bucket once all its parameters
# are ready): one sync-enabled backward per step. A moment holds the K/V leaves and their
# adjoints beside one wave's graph or one segment's, never the whole prompt's.


def segment_bounds(P: int, segments: int) -> list:
    """[(start, end)] of ``segments`` query segments of P prompt positions (at most P), as
    equal as they can be, the longer ones first."""
    n = min(segments, P)
    q, r = divmod(P, n)
    ends = [q * (k + 1) + min(k + 1, r) for k in range(n)]
    return list(zip([0, *ends[:-1]], ends))


def segmented_state(run: GroupRun, bounds: list) -> PrefixState:
    """The prompt's state computed segment by segment under no_grad, each against the earlier
    positions of the state built so far (trained depths promoted to >= fp32, as the leaves)."""
    trained = trained_depths(run.inner.config.with_loops(run.num_loops))
    full = None
    with torch.no_grad():
        for s, e in bounds:
            own = run.prompt_state(s, e, None if full is None else _first(full, s))
            if full is None:
                run.state_dtype = own.boundary.dtype
                full = [t.new_empty((bounds[-1][1], *t.shape[1:]),
                                    dtype=_wide(t.dtype) if grad else t.dtype)
                        for t, grad in zip(own.tensors()[:-1], own.depth_flags(trained))]
                full = own.like([*full, own.boundary])  # [P, 1, ...] each
            for buf, t in zip(full.tensors()[:-1], own.tensors()[:-1]):
                buf[s:e] = t
            full.boundary = own.boundary
    return full


def segmented_leaves(run: GroupRun, bounds: list) -> PrefixState:
    """Phase 1 of a subdivided prompt: its state segment by segment under no_grad, detached
    into the grad leaves every wave's adjoints collect in."""
    run.guard.verify("prompt producer")
    trained = trained_depths(run.inner.config.with_loops(run.num_loops))
    leaves = segmented_state(run, bounds).detached_leaves(torch.float32, trained)
    run.phase("prompt_producer")
    return leaves


def replay_segments(run: GroupRun, leaves: PrefixState, bounds: list, waves_context) -> None:
    """Phase 3 of a subdivided prompt: each segment from the last to the second inside
    ``waves_context``, then the first, the group's last backward, with ``zero_touch``."""
    with waves_context():
        run.guard.verify("joint replay", contents=True)
        for k in range(len(bounds) - 1, 0, -1):
            _replay_segment(run, leaves, bounds[k])
    _replay_segment(run, leaves, bounds[0], zero_touch(run.inner))


def _replay_segment(run: GroupRun, leaves: PrefixState, bounds: tuple,
                    extra: Optional[Tensor] = None) -> None:
    """One backward of prompt segment ``bounds`` recomputed with grad against the leaves'
    earlier positions (its K/V's adjoints in; with the prompt's last segment its boundary's)
    and of ``extra`` (a scalar)."""
    s, e = bounds
    own = run.prompt_state(s, e, _first(leaves, s) if s else None)
    roots, grads = ([extra], [None]) if extra is not None else ([], [])
    for t, leaf in zip(own.tensors()[:-1], leaves.tensors()[:-1]):  # per depth
        if t.requires_grad and leaf.requires_grad and leaf.grad is not None:
            roots.append(t)
            grads.append(leaf.grad[s:e].to(t.dtype, copy=True))  # not a view the backward adds to
    if own.boundary.requires_grad:  # before the prompt's end a zero: its graph is freed too
        last = e == run.group.prompt_length and leaves.boundary.grad is not None
        roots.append(own.boundary)
        grads.append(leaves.boundary.grad.to(own.boundary.dtype) if last
                     else torch.zeros_like(own.boundary))
    torch.autograd.backward(roots, grads)
    run.phase("joint_replay")


def zero_touch(module) -> Tensor:
    """An exact 0 through one element of every trainable parameter (its gradient: zeros)."""
    return torch.stack([p.view(-1)[0] for p in module.parameters() if p.requires_grad]).sum() * 0


def _first(state: PrefixState, n: int) -> PrefixState:
    """The state's first n positions (views; the boundary as it is)."""
    return state.like([*(t[:n] for t in state.tensors()[:-1]), state.boundary])


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def as_prefix(state: Optional[PrefixState], dtype) -> Optional[PrefixState]:
    """A state as a forward's prefix: K/V (or inputs) as they are (wider adjoint leaves, fp32
    in a bf16 model, let the attention's prefix backward return wide gradients); the boundary
    in the model's ``dtype``, as the readout's norm runs in it."""
    if state is None or dtype is None or state.boundary.dtype == dtype:
        return state
    return state.like([*state.tensors()[:-1], state.boundary.to(dtype)])


def merge(per_wave: dict, per_token: bool = False, **extra) -> object:
    """One microbatch result from the waves' results: 0-dim tensors are summed; tensors with
    a response dimension ([R, W, ...] as the wave model's output, or [W]) are concatenated
    over it, except, with ``per_token``, [2] ones: [sum, count] pairs, summed; dicts merge
    key by key. ``extra`` adds 0-dim floating tensors (e.g. num_waves)
    in the dtype of the stats, so that a training loop can average every value as Megatron-LM
    averages loss dicts (``torch.cat([d[k].view(-1) ...]).mean()``)."""
    items = [per_wave[k] for k in sorted(per_wave)]
    merged = _merge_values(items, per_token)
    if extra and isinstance(merged, dict):
        ref = next((v for v in merged.values()
                    if isinstance(v, Tensor) and v.is_floating_point()), None)
        dtype, device = (ref.dtype, ref.device) if ref is not None else (None, None)
        merged.update({k: torch.full((), float(v), dtype=dtype, device=device)  # no upload
                       for k, v in extra.items()})
    return merged


def _merge_values(items: list, per_token: bool = False):
    first = items[0]
    if isinstance(first, dict):
        return {k: _merge_values([it[k] for it in items], per_token) for k in first}
    if isinstance(first, Tensor):
        if first.dim() == 0 or is_report_pair(first, per_token):
            return torch.stack(items).sum(0)
        return torch.cat(items, dim=0 if first.dim() == 1 else 1)
    if isinstance(first, (int, float)):
        return sum(items)
    return items
