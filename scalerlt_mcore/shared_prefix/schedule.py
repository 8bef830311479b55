"""Shared-prefix joint replay as a drop-in for MCore's ``get_forward_backward_func()``.

Per GRPO group (one prompt, G responses):
  1. prompt producer   - the prompt under no_grad; its prefix state becomes grad leaves;
  2. waves 1..n-1      - W responses each against the leaves, backward under no_sync:
                         parameter grads accumulate, the leaves collect the prefix adjoints;
  3. joint replay      - verify inputs, recompute the prompt with grad, run the last wave, and
                         backpropagate loss_last + sum_k <state_k, adjoint_k> in ONE backward.
Earlier groups of a step run entirely under ``config.no_sync_func`` (as MCore's schedule runs
microbatches 1..n-1), so the sync-enabled part of every step is exactly one backward call.
"""

import contextlib
import itertools
from collections.abc import Callable
from functools import partial
from typing import Optional

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel.schedules import get_forward_backward_func
from megatron.core.utils import get_model_config, unwrap_model
from torch.utils.checkpoint import checkpoint

from ..model.kv import PrefixState
from .group import ReplayGuard, SharedPrefixGroup
from .objective import RLObjective


def get_shared_prefix_forward_backward_func(objective: RLObjective, wave_size: int,
                                            checkpoint_waves: bool = False,
                                            max_response_length: Optional[int] = None,
                                            phase_callback: Optional[Callable] = None):
    """The shared-prefix schedule, called like the function ``get_forward_backward_func()``
    returns. Microbatches that are ``SharedPrefixGroup``s go through joint replay; any other
    step goes to stock MCore. ``phase_callback(phase, group)`` runs after each phase."""
    return SharedPrefixSchedule(objective, wave_size, checkpoint_waves, max_response_length,
                                phase_callback)


class SharedPrefixSchedule:
    """See the module docstring. Reaches DDP only through ``config.no_sync_func`` and
    ``config.finalize_model_grads_func``; grad reduction with ``overlap_grad_reduce`` is
    launched by DDP's hooks during the single sync-enabled backward."""

    def __init__(self, objective: RLObjective, wave_size: int, checkpoint_waves: bool = False,
                 max_response_length: Optional[int] = None,
                 phase_callback: Optional[Callable] = None):
        if wave_size < 1:
            raise ValueError(f"wave_size must be >= 1, got {wave_size}")
        self.objective, self.wave_size = objective, wave_size
        self.checkpoint_waves = checkpoint_waves
        self.max_response_length = max_response_length
        self.phase_callback = phase_callback or (lambda phase, group: None)

    def __call__(self, *, forward_step_func, data_iterator, model, num_microbatches: int,
                 seq_length: int, micro_batch_size: int, decoder_seq_length=None,
                 forward_only: bool = False, collect_non_loss_data: bool = False,
                 first_val_step=None, adjust_tensor_shapes_fn=None, p2p_communicator=None,
                 pg_collection=None, force_all_reduce: bool = False):
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            raise NotImplementedError("shared-prefix joint replay needs pipeline parallel size 1")
        model = _single(model, "model")
        data_iterator = _single(data_iterator, "data_iterator")
        first = next(data_iterator)
        if not isinstance(first, SharedPrefixGroup):
            stock = get_forward_backward_func()
            return stock(
                forward_step_func=forward_step_func,
                data_iterator=itertools.chain([first], data_iterator), model=model,
                num_microbatches=num_microbatches, seq_length=seq_length,
                micro_batch_size=micro_batch_size, decoder_seq_length=decoder_seq_length,
                forward_only=forward_only, collect_non_loss_data=collect_non_loss_data,
                first_val_step=first_val_step, pg_collection=pg_collection,
                force_all_reduce=force_all_reduce,
            )
        groups = [first] + [next(data_iterator) for _ in range(num_microbatches - 1)]
        inner, config = unwrap_model(model), get_model_config(model)
        self._check_groups(groups, inner.config, forward_only, config)
        if forward_only:
            return [self.score_group(inner, g) for g in groups]
        results = self._train_groups(inner, groups, config)
        if config.finalize_model_grads_func is not None:
            config.finalize_model_grads_func([model], None, pg_collection=pg_collection,
                                             force_all_reduce=force_all_reduce)
        return results

    # ---- checks ----------------------------------------------------------------------------

    def _check_groups(self, groups, model_config, forward_only, config) -> None:
        if getattr(config, "calculate_per_token_loss", False):
            raise NotImplementedError("shared-prefix joint replay normalises per group; "
                                      "calculate_per_token_loss is not supported")
        for g in groups:
            if not isinstance(g, SharedPrefixGroup):
                raise TypeError("a shared-prefix step must contain only SharedPrefixGroup "
                                f"microbatches, got {type(g).__name__}")
            g.check(model_config.looped_num_loops, self.max_response_length,
                    training=not forward_only)

    # ---- training --------------------------------------------------------------------------

    def _train_groups(self, inner, groups, config) -> list:
        no_sync = config.no_sync_func or contextlib.nullcontext
        scale = 1.0 / len(groups)  # as MCore divides every microbatch loss by their number
        # Fingerprint every group now, right after the up-front checks: a later group changed
        # while an earlier one trains must not slip past those checks.
        guards = [ReplayGuard(g) for g in groups]
        results = []
        with no_sync():
            for g, guard in zip(groups[:-1], guards):
                results.append(self.train_group(inner, g, config, scale, contextlib.nullcontext,
                                                guard))
        results.append(self.train_group(inner, groups[-1], config, scale, no_sync, guards[-1]))
        return results

    def train_group(self, inner, group, config, scale, waves_context, guard=None) -> dict:
        """All three phases for one group; phases 1-2 inside ``waves_context``. ``guard``:
        the group's fingerprints if taken earlier (default: taken now)."""
        guard = guard or ReplayGuard(group)
        weights = self.objective.token_weights(group.loss_mask)  # [G, T]
        waves = list(torch.arange(group.group_size).split(self.wave_size))
        stats = {}
        adjoints = None
        with waves_context():
            if len(waves) > 1:
                leaves = self._produce_prompt(inner, group)
                adjoints = self._run_waves(inner, group, leaves, waves[:-1], weights, guard,
                                           config, scale, stats)
        self._joint_replay(inner, group, waves[-1], adjoints, weights, guard, config, scale,
                           stats)
        return _summarise(stats, len(waves))

    def _produce_prompt(self, inner, group) -> PrefixState:
        """Phase 1: the prompt under no_grad; its state detached into grad-requiring leaves."""
        with torch.no_grad():
            state = inner(group.tokens[:1, : group.prompt_length], return_prefix_state=True,
                          readout=False).prefix_state
        self.phase_callback("prompt_producer", group)
        return state.detached_leaves()

    def _run_waves(self, inner, group, leaves, waves, weights, guard, config, scale, stats):
        """Phase 2: every wave but the last; returns the summed prefix adjoints (>= fp32)."""
        adjoints = [torch.zeros_like(t, dtype=_acc(t)) for t in leaves.tensors()]
        for n, idx in enumerate(waves):
            loss = self._wave_loss(inner, group, leaves, idx, weights, guard, stats, n)
            _backward(loss * scale, config)
            for adj, leaf in zip(adjoints, leaves.tensors()):
                if leaf.grad is not None:
                    adj.add_(leaf.grad)
                    leaf.grad = None
            self.phase_callback("wave", group)
        return adjoints

    def _joint_replay(self, inner, group, idx, adjoints, weights, guard, config, scale, stats):
        """Phase 3: recompute the prompt with grad, run the last wave, one backward."""
        guard.verify("joint replay")
        state = inner(group.tokens[:1, : group.prompt_length], return_prefix_state=True,
                      readout=False).prefix_state
        loss = self._wave_loss(inner, group, state, idx, weights, guard, stats, len(stats))
        total = _scaled(loss * scale, config)
        if adjoints is not None:
            total = total + sum((t.to(a.dtype) * a).sum()
                                for t, a in zip(state.tensors(), adjoints))
        total.backward()
        self.phase_callback("joint_replay", group)

    def _wave_loss(self, inner, group, state, idx, weights, guard, stats, wave_no):
        fn = partial(self._wave_objective, inner, group, idx, weights, guard, stats, wave_no,
                     state.signature)
        if self.checkpoint_waves:
            return checkpoint(fn, *state.tensors(), use_reentrant=False)
        return fn(*state.tensors())

    def _wave_objective(self, inner, group, idx, weights, guard, stats, wave_no, signature,
                        *state_tensors):
        """One wave's share of the group loss (re-run on recompute, so it re-verifies)."""
        guard.verify("wave recompute" if wave_no in stats else "wave")
        state = PrefixState.from_tensors(list(state_tensors), signature)
        logprobs = wave_logprobs(inner, group, state, idx)  # [R, W, S + 1]
        tail = slice(group.prompt_length - 1, None)
        ref = group.ref_logprobs[:, idx, tail] if group.ref_logprobs is not None else None
        loss, wave_stats = self.objective.loss(
            logprobs, group.old_logprobs[:, idx, tail], group.advantages[idx],
            weights[idx, tail], ref,
        )
        stats[wave_no] = {**wave_stats, "loss": loss.detach()}
        return loss

    # ---- scoring ---------------------------------------------------------------------------

    @torch.no_grad()
    def score_group(self, inner, group) -> dict:
        """forward_only: per-loop log-probs [R, G, T] of the labels (0 on prompt positions
        before P - 1), the prompt computed once; no graph is built."""
        P = group.prompt_length
        state = inner(group.tokens[:1, :P], return_prefix_state=True, readout=False).prefix_state
        waves = torch.arange(group.group_size).split(self.wave_size)
        tail = torch.cat([wave_logprobs(inner, group, state, idx) for idx in waves], dim=1)
        out = tail.new_zeros(tail.shape[0], *group.tokens.shape)
        out[:, :, P - 1 :] = tail
        return {"logprobs": out}


def wave_logprobs(inner, group: SharedPrefixGroup, state: PrefixState, idx) -> torch.Tensor:
    """Per-loop log-probs [R, W, S + 1] of labels[idx, P-1:] given the prompt's state."""
    P = group.prompt_length
    first = inner.boundary_logprobs(state, group.labels[idx, P - 1])  # [R, W, 1]
    rest = inner(group.tokens[idx, P:], labels=group.labels[idx, P:], prefix_state=state)
    return torch.cat([first, rest.logprobs], dim=2)


def _summarise(stats: dict, num_waves: int) -> dict:
    total = {k: sum(s[k] for s in stats.values()) for k in ("loss", "clipped", "kl", "tokens")}
    return {"loss": total["loss"], "clip_fraction": total["clipped"] / total["tokens"],
            "kl": total["kl"] / total["tokens"], "num_tokens": total["tokens"],
            "num_waves": num_waves}


def _acc(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _scaled(loss, config):
    return config.grad_scale_func(loss) if config.grad_scale_func is not None else loss


def _backward(loss, config) -> None:
    _scaled(loss, config).backward()


def _single(obj, name: str):
    if isinstance(obj, list):
        if len(obj) != 1:
            raise NotImplementedError(f"shared-prefix joint replay takes one {name} chunk")
        return obj[0]
    return obj
