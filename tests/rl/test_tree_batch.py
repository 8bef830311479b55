"""Tree groups of a rollout: leaf answers for the reward, the rollout's per-node log-probs in
the rows' layout, drift over the trained positions (hand-laid rows)."""

import torch

from scalerlt_mcore.rl.batch import (
    build_tree_groups,
    first_answers,
    leaf_answers,
    trained_drift,
    tree_old_logprobs,
)
from scalerlt_mcore.shared_prefix import TreeSegment

# root [1, 5]; node 1: answer [6, 7] then reply [8] (untrained); leaves 2: [9], 3: [10, 11];
# node 4: a first answer that is a leaf, [12]
SEGMENTS = [TreeSegment([1, 5], None), TreeSegment([6, 7, 8], 0, [1, 1, 0]),
            TreeSegment([9], 1), TreeSegment([10, 11], 1), TreeSegment([12], 0)]
LOGPROBS = [None, torch.tensor([[-1.0, -2.0, 0.0]]), torch.tensor([[-3.0]]),
            torch.tensor([[-4.0, -5.0]]), torch.tensor([[-6.0]])]  # R = 1


def test_leaf_and_first_answers_are_the_trained_tokens():
    assert leaf_answers(SEGMENTS) == [[9], [10, 11], [12]]
    assert first_answers(SEGMENTS) == [[6, 7], [12]]
    inner_without_mask = [TreeSegment([1], None), TreeSegment([2], 0), TreeSegment([3], 1)]
    assert first_answers(inner_without_mask) == [[]]  # no mask: an inner node trains nothing


def test_rollout_logprobs_in_the_rows_layout():
    (g,) = build_tree_groups([SEGMENTS], pad_id=0, step=0,
                             advantages=[torch.tensor([1.0, -1.0, 0.5])])
    assert g.tokens.tolist() == [[1, 5, 6, 7, 8, 9, 0], [1, 5, 6, 7, 8, 10, 11],
                                 [1, 5, 12, 0, 0, 0, 0]]
    old = tree_old_logprobs(g, LOGPROBS)  # [R, G, T]: position t holds token t + 1's
    assert old.tolist() == [[[0, -1, -2, 0, -3, 0, 0], [0, -1, -2, 0, -4, -5, 0],
                             [0, -6, 0, 0, 0, 0, 0]]]
    assert g.loss_mask.tolist() == [[0, 1, 1, 0, 1, 0, 0], [0, 1, 1, 0, 1, 1, 0],
                                    [0, 1, 0, 0, 0, 0, 0]]
    g.old_logprobs = old + 0.25 * (g.loss_mask == 0)  # off the trained positions: ignored
    assert trained_drift(g, old) == 0
    g.old_logprobs = old - 0.5 * g.loss_mask
    assert trained_drift(g, old) == 0.5
