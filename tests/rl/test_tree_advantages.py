"""GRPO advantages over a prefix tree's leaves, against hand computations."""

import math

import pytest
import torch

from scalerlt_mcore.rl.advantages import tree_advantages, tree_leaves, tree_paths

# root 0 -> turn-1 answers 1, 2; under 1: leaves 3, 4; under 2: leaves 5, 6, 7 (uneven)
PARENTS = [None, 0, 0, 1, 1, 2, 2, 2]
REWARDS = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0], dtype=torch.float64)  # leaves 3..7


def test_leaves_and_paths_in_node_order():
    assert tree_leaves(PARENTS) == [3, 4, 5, 6, 7]
    assert tree_paths(PARENTS) == [[0, 1, 3], [0, 1, 4], [0, 2, 5], [0, 2, 6], [0, 2, 7]]
    assert tree_leaves([-1, 0, 0]) == [1, 2]


def test_root_baseline_is_one_grpo_group_over_the_leaves():
    mean = 3 / 5
    std = math.sqrt(sum((r - mean) ** 2 for r in REWARDS.tolist()) / 5)
    expected = [(r - mean) / (std + 1e-6) for r in REWARDS.tolist()]
    assert torch.allclose(tree_advantages(REWARDS, PARENTS), torch.tensor(expected,
                          dtype=torch.float64), rtol=0, atol=1e-15)
    assert torch.equal(tree_advantages(REWARDS, PARENTS, "dr_grpo"), REWARDS - mean)
    assert torch.equal(tree_advantages(REWARDS, PARENTS, "none"), REWARDS)


def test_parent_baseline_per_row_and_node():
    adv = tree_advantages(REWARDS, PARENTS, "dr_grpo", baseline="parent")  # [G, N]
    # turn-1 nodes 1, 2 against the root's leaves (mean 3/5); leaves against their parent's
    # leaves: under 1 mean 1/2, under 2 mean 2/3
    expected = torch.zeros(5, 8, dtype=torch.float64)
    for g, (r, node, parent_mean, leaf) in enumerate(
            [(1, 1, .5, 3), (0, 1, .5, 4), (1, 2, 2 / 3, 5), (1, 2, 2 / 3, 6), (0, 2, 2 / 3, 7)]):
        expected[g, node] = r - 3 / 5
        expected[g, leaf] = r - parent_mean
    assert torch.allclose(adv, expected, rtol=0, atol=1e-15)
    # summed over the rows below it, node n gets L_n (V(n) - V(parent)): TreeRL's local credit
    assert adv[:2, 1].sum() == pytest.approx(2 * (0.5 - 0.6))
    grpo = tree_advantages(REWARDS, PARENTS, baseline="parent")
    under_1 = torch.tensor([0.5, -0.5], dtype=torch.float64) / (0.5 + 1e-6)
    assert torch.allclose(grpo[:2, [3, 4]].diagonal(), under_1, rtol=0, atol=1e-15)


def test_branch_factor_one_gives_zero_advantage_below():
    adv = tree_advantages(torch.tensor([1.0, 0.0]), [None, 0, 0, 1, 2], baseline="parent")
    assert adv[:, [3, 4]].abs().max() == 0 and adv[0, 1] > 0 > adv[1, 2]


def test_bad_inputs():
    with pytest.raises(ValueError, match=r"rewards must be \[G\] for the tree's 5 leaves"):
        tree_advantages(REWARDS[:4], PARENTS)
    with pytest.raises(ValueError, match="unknown tree baseline 'sibling'"):
        tree_advantages(REWARDS, PARENTS, baseline="sibling")
    with pytest.raises(ValueError, match="reward is NaN/inf in group 0"):
        tree_advantages(torch.tensor([1.0, math.nan, 0, 0, 0]), PARENTS)
