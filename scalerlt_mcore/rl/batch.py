"""A rollout batch as shared-prefix groups: ``RLGroup`` (a group with the RL loss's tensors),
the groups of a rollout (one-level groups, or prefix trees: ``build_tree_groups``), their old
log-probs taken from the rollout, and the rollout-vs-training drift. Slices of the group
layout are the group's own (``SharedPrefixGroup.response_positions``, ``to_layout``; a tree's
nodes: ``PrefixTree.positions``)."""

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch
from torch import Tensor

from ..shared_prefix import SharedPrefixGroup
from .objective import read_depths


@dataclass
class RLGroup(SharedPrefixGroup):
    """A GRPO group: the shared-prefix group and the RL loss's tensors (``EXTRAS``: checked,
    moved and guarded by the schedule like the group's own)."""

    advantages: Optional[Tensor] = None
    """[G] per-response advantage (training)."""

    old_logprobs: Optional[Tensor] = None
    """[R, G, T] per-loop log-probs of labels under the behaviour policy (training)."""

    ref_logprobs: Optional[Tensor] = None
    """[R, G, T] per-loop log-probs of labels under a frozen reference (the KL term)."""

    inference_logprobs: Optional[Tensor] = None
    """[R, G, T] per-loop log-probs of labels as the rollout engine computed them (the
    inference importance-sampling correction)."""

    exit_depths: Optional[Tensor] = None
    """[G, T] long: the loop each label was sampled at by a serving engine that exits early
    (its recorded exit depths, 1..R; 0 off the responses), None: every token at R. The replay
    runs each response position to its label's loop (``SharedPrefixGroup.exit_runs``) and the
    loss reads each token there (``RLObjective.loss``'s ``reads``)."""

    EXTRAS: ClassVar[dict] = {"advantages": ("G",), "old_logprobs": ("R", "G", "T"),
                              "ref_logprobs": ("R", "G", "T"),
                              "inference_logprobs": ("R", "G", "T"), "exit_depths": ("G", "T")}


def build_groups(prompts: list, responses, lengths, pad_id: int, step: int, device=None,
                 advantages=None) -> list:
    """``RLGroup``s on ``device`` from host rollout tensors [N, G, S] and, when given, their
    advantages [N, G]."""
    return [RLGroup.from_rollout(
        prompt, responses[n], lengths[n], pad_id, device=device, group_id=step * 100_000 + n,
        advantages=None if advantages is None else advantages[n])
        for n, prompt in enumerate(prompts)]


def attach_exit_depths(groups: list, exit_depths: Optional[torch.Tensor]) -> list:
    """``groups`` (one per prompt of a rollout) holding a serving engine's recorded exit
    depths [N, G, S] (``Rollout.exit_depths``) in their layout [G, T] (0 off the responses);
    as they are without."""
    if exit_depths is not None:
        for n, g in enumerate(groups):
            depths = exit_depths[n, :, : g.response_length].to(g.tokens.device)
            g.exit_depths = g.to_layout(depths)
    return groups


def rollout_old_logprobs(group: RLGroup, loop_logprobs: torch.Tensor) -> torch.Tensor:
    """Old log-probs [R, G, T] in the group's layout (position t holds the log-prob of label t)
    from the rollout's per-loop log-probs [R, G, S'] of the sampled tokens (0 on padding)."""
    S = group.response_length
    return group.to_layout(loop_logprobs[:, :, :S].to(group.tokens.device))  # [R, G, T]


def build_tree_groups(trees: list, pad_id: int, step: int, device=None,
                      advantages=None) -> list:
    """``RLGroup``s on ``device`` of prefix trees, one per prompt: ``trees`` the
    ``TreeSegment`` lists (the root the prompt), ``advantages`` [N] x [G_n] per leaf (leaves
    in segment order: the rows)."""
    return [RLGroup.from_tree(
        segments, pad_id, device=device, group_id=step * 100_000 + n,
        advantages=None if advantages is None else advantages[n])
        for n, segments in enumerate(trees)]


def leaf_answers(segments: list) -> list:
    """Per leaf (segment order: the rows of the tree's group), the ids of its trained tokens:
    the model's final answer (an environment's reply in the same node is untrained)."""
    inner = {s.parent for s in segments}
    return [_trained(s, m) for n, (s, m) in enumerate(zip(segments, trained_masks(segments)))
            if n not in inner]


def first_answers(segments: list) -> list:
    """The trained tokens of the root's children (the model's first answers)."""
    return [_trained(s, m) for s, m in zip(segments, trained_masks(segments)) if s.parent == 0]


def _trained(segment, mask: torch.Tensor) -> list:
    return torch.as_tensor(segment.tokens, device="cpu")[mask].tolist()


def trained_masks(segments: list) -> list:
    """Per node of a tree, [L_n] bool: its trained tokens (without a loss mask: all of a
    leaf's, none of an internal node's)."""
    inner = {s.parent for s in segments}
    return [torch.full((len(s.tokens),), n not in inner, dtype=torch.bool, device="cpu")
            if s.loss_mask is None else torch.as_tensor(s.loss_mask, device="cpu") != 0
            for n, s in enumerate(segments)]


def tree_old_logprobs(group: RLGroup, node_logprobs: list) -> torch.Tensor:
    """Old log-probs [R, G, T] of a tree group in its rows' layout from the rollout's per-node
    ``node_logprobs[n]`` [R, L_n] (the root's ignored; untrained tokens any value): position
    t of row g holds token t + 1 of the row (as labels), in every row below its node."""
    tree = group.tree
    lead = node_logprobs[1].shape[:-1]
    out = node_logprobs[1].new_zeros(*lead, *group.tokens.shape)  # [..., G, T]
    for n in range(1, tree.num_nodes):
        rows = torch.tensor(tree.rows_below(n), device="cpu")
        values = node_logprobs[n].to(out.device)
        out[..., rows, tree.positions(n)] = values.unsqueeze(-2).expand(*lead, len(rows), -1)
    return out.to(group.tokens.device)


def sampled_loop(group: RLGroup, per_loop: torch.Tensor) -> torch.Tensor:
    """[G, T] of per-loop values [R, G, T]: each token's at the loop it was sampled at (the
    last, or with recorded exit depths its own)."""
    if group.exit_depths is None:
        return per_loop[-1]
    reads = read_depths(group.exit_depths, per_loop.shape[0]).to(per_loop.device)
    return per_loop.gather(0, (reads - 1)[None])[0]


def trained_drift(group: RLGroup, rollout_layout: torch.Tensor) -> torch.Tensor:
    """max |training - rollout| log-prob at the sampled loop (``sampled_loop``) over the
    group's trained positions, with ``rollout_layout`` [R, G, T] in the group layout
    (``rollout_old_logprobs``, ``tree_old_logprobs``; an engine's [1, G, T]; 0-dim, on the
    group's device)."""
    rollout = rollout_layout[-1].to(group.tokens.device)
    diff = (sampled_loop(group, group.old_logprobs).float() - rollout).abs()
    return torch.where(group.loss_mask != 0, diff, 0.0).max()


def inference_layout(group: RLGroup, rollout_layout: torch.Tensor) -> torch.Tensor:
    """The group's ``inference_logprobs`` [R, G, T] from a rollout's log-probs in its layout:
    per loop [R, G, T] as they are; an engine's one behaviour log-prob per token [1, G, T]
    (its sampled loop's: the last, or its recorded exit depth) as old - old[e] + behaviour,
    so that every loop's importance weight is the token's exp(old[e] - behaviour). Needs the
    group's old log-probs."""
    rollout = rollout_layout.to(group.old_logprobs)
    if rollout.shape[0] == group.old_logprobs.shape[0]:
        return rollout
    return group.old_logprobs - sampled_loop(group, group.old_logprobs)[None] + rollout


def recording_drift(forward_step, drift: list):
    """``forward_step`` whose loss_func also appends max |training - old| final-loop log-prob
    of the wave's trained tokens to ``drift``: with old log-probs from the rollout and the
    update's first forward (the rollout's weights), the rollout-vs-training difference."""

    def step(data_iterator, model):
        wave = next(data_iterator)
        output, loss_func = forward_step(iter([wave]), model)

        def recorded(output, non_loss_data: bool = False):
            logprobs = output["logprobs"] if isinstance(output, dict) else output
            if not non_loss_data:
                g = wave.group
                old = wave.positions(wave.rows(g.old_logprobs, 1))[-1]  # [W, T']
                diff = logprobs[-1].detach().float() - old.float()
                trained = wave.positions(wave.rows(g.loss_mask)) != 0  # [W, T']
                drift.append(torch.where(trained, diff.abs(), 0.0).max())
            return loss_func(output, non_loss_data=non_loss_data)

        return output, recorded

    step.check_group = getattr(forward_step, "check_group", None)
    return step
