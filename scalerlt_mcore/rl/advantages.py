"""Group advantages (one-level groups and prefix trees) and per-token policy-gradient losses
(pure torch, any float dtype)."""

from collections.abc import Sequence
from typing import Literal, Optional, get_args

import torch

AdvantageMode = Literal["grpo", "dr_grpo", "none"]
"""``grpo``: (r - mean) / (std + eps); ``dr_grpo``: r - mean; ``none``: r."""
ADVANTAGE_MODES = get_args(AdvantageMode)


def group_advantages(rewards: torch.Tensor, mode: AdvantageMode = "grpo",
                     eps: float = 1e-6) -> torch.Tensor:
    """Advantages of ``rewards`` [n_groups, G], each response against its own group.

    ``grpo`` divides by the population std of the group (``unbiased=False``), so a group whose
    rewards are all equal gets zero advantages, not NaN. ``dr_grpo`` (Dr. GRPO) only centres.
    Non-finite rewards raise ValueError naming the first bad group: the step must be rejected.
    """
    if mode not in ADVANTAGE_MODES:
        raise ValueError(f"unknown advantage mode {mode!r}; choose one of {ADVANTAGE_MODES}")
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [n_groups, G], got shape {tuple(rewards.shape)}")
    bad = (~torch.isfinite(rewards)).any(dim=1).nonzero()
    if len(bad):
        raise ValueError(f"reward is NaN/inf in group {int(bad[0])}: step rejected")
    if mode == "none":
        return rewards.clone()
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if mode == "dr_grpo":
        return centred
    return centred / (rewards.std(dim=1, unbiased=False, keepdim=True) + eps)


TreeBaseline = Literal["root", "parent"]
"""The baseline of a tree's advantages (``tree_advantages``): ``root``, the mean (and std) of
every leaf of the tree; ``parent``, per node, of the leaves below the node's parent."""
TREE_BASELINES = get_args(TreeBaseline)


def tree_leaves(parents: Sequence[Optional[int]]) -> list:
    """The leaves (nodes without children) of the tree of ``parents`` (the parent of each
    node, None or -1 for the root), in node order: the rows of the tree's group."""
    inner = {p for p in parents if p is not None and p >= 0}
    return [n for n in range(len(parents)) if n not in inner]


def tree_paths(parents: Sequence[Optional[int]]) -> list:
    """Per leaf (``tree_leaves`` order), its nodes from the root down."""
    def path(n):
        out = []
        while n is not None and n >= 0:
            out.append(n)
            n = parents[n]
        return out[::-1]

    return [path(leaf) for leaf in tree_leaves(parents)]


def tree_advantages(rewards: torch.Tensor, parents: Sequence[Optional[int]],
                    mode: AdvantageMode = "grpo", baseline: TreeBaseline = "root",
                    eps: float = 1e-6) -> torch.Tensor:
    """GRPO advantages of a prefix tree's leaves: ``rewards`` [G] of its leaves (in
    ``tree_leaves`` order, the rows of its group), ``parents`` the parent of each node (None
    or -1 for the root). A row's tokens are every node on its root-to-leaf path, and a token
    of an internal node n appears once in each of the rows below it (L_n of them).

    ``root`` (the default): the tree is one GRPO group over its leaves, ``group_advantages``
    of the G rewards -> [G], one advantage per row. Summed over the rows below it, node n's
    tokens get L_n (V(n) - V(root)) / std, V(n) the mean reward of the leaves below n:
    TreeRL's global advantage of the node, weighted by its leaves. Unbiased up to GRPO's own
    (the baseline of a row holds its own reward) and what a per-row ``RLGroup`` trains.

    ``parent`` (TreeRL's local, per-parent sibling baseline): row g's tokens of node n are
    scored against the leaves below n's parent, (r_g - V(parent(n))) / std(parent(n)) ->
    [G, N] per (row, node), 0 for the root and for nodes off the row's path. Summed over the
    rows below it, node n gets L_n (V(n) - V(parent(n))) / std: the credit of the step from
    the parent to n alone, a baseline that depends on the state before n only (lower
    variance for late turns). It needs per-token advantages (each position of node n its
    row's A[g, n]); no per-row advantage gives it: with A_g = r_g - V(parent(leaf)) the
    rows below an internal node sum to zero and its tokens would get no gradient. A parent
    with one leaf below it (branch factor 1) gives its child zero advantage.

    ``mode``: as ``group_advantages`` (``grpo``, ``dr_grpo``, ``none``). Non-finite rewards
    raise ValueError."""
    if baseline not in TREE_BASELINES:
        raise ValueError(f"unknown tree baseline {baseline!r}; choose one of {TREE_BASELINES}")
    paths = tree_paths(parents)
    if rewards.dim() != 1 or rewards.shape[0] != len(paths):
        raise ValueError(f"rewards must be [G] for the tree's {len(paths)} leaves, got shape "
                         f"{tuple(rewards.shape)}")
    if baseline == "root":
        return group_advantages(rewards[None], mode, eps)[0]
    below = {}  # node -> the rows (leaf indices) below it
    for g, path in enumerate(paths):
        for n in path:
            below.setdefault(n, []).append(g)
    out = rewards.new_zeros(len(paths), len(parents))  # [G, N]
    for n, rows in below.items():
        if parents[n] is None or parents[n] < 0:
            continue  # the root: the prompt, never trained
        siblings = below[parents[n]]  # the leaves below n's parent
        adv = group_advantages(rewards[siblings][None], mode, eps)[0]
        index = {g: i for i, g in enumerate(siblings)}
        out[rows, n] = adv[[index[g] for g in rows]]
    return out


def ppo_clipped_objective(
    logp_new: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO loss ``-min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)``.

    ``logp_*`` and ``mask`` are [..., S]; ``advantages`` is [..., S] or one per sequence
    [...]. Returns ``(loss, clipped)``, both [..., S] and zero where ``mask`` is 0; ``clipped``
    is 1 where the clipped term won the min strictly (the token gets no gradient). Reducing
    the loss (token mean, sequence mean, ...) is the caller's choice.
    """
    if advantages.dim() == logp_new.dim() - 1:
        advantages = advantages.unsqueeze(-1)
    ratio = torch.exp(logp_new - logp_old)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * advantages
    mask = mask.to(unclipped.dtype)
    loss = -torch.minimum(unclipped, clipped) * mask
    return loss, (clipped < unclipped).to(unclipped.dtype) * mask


def kl_k3(logp_new: torch.Tensor, logp_ref: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(new || ref): ``exp(d) - d - 1`` with ``d = ref - new``.

    Non-negative and zero where the log-probs agree; computed with ``expm1`` for accuracy.
    """
    d = logp_ref - logp_new
    return (torch.expm1(d) - d).clamp_min(0.0)


def entropy_term(logp: torch.Tensor) -> torch.Tensor:
    """Per-token ``-p log p`` of each sampled token from its log-prob ``logp`` (Megatron-LM's
    GRPO entropy term)."""
    return -logp.exp() * logp
