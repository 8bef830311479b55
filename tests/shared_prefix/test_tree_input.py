"""Prefix trees as data: the layout of the naive rows and the bad-input errors (each names the
node), before any compute."""

import numpy as np
import pytest
import torch
from helpers.tree import DEPTH2, tree_group

from scalerlt_mcore.rl.batch import RLGroup
from scalerlt_mcore.shared_prefix import PrefixTree, SharedPrefixGroup, TreeError, TreeSegment


def _segs():
    return [TreeSegment([1, 2, 3], None), TreeSegment([4, 5], 0, [1, 0]),
            TreeSegment([6], 1), TreeSegment([7, 8], 1, [0, 1]), TreeSegment([9, 9, 9], 0)]


def test_rows_are_the_root_to_leaf_sequences():
    g = SharedPrefixGroup.from_tree(_segs(), pad_id=0, mask_dtype=torch.float64)
    t = g.tree
    assert t.parents == (-1, 0, 1, 1, 0) and t.starts == (0, 3, 5, 5, 3)
    assert t.ends == (3, 5, 6, 7, 6) and t.leaf_of_row == (2, 3, 4)
    assert t.children(0) == (1, 4) and t.children(1) == (2, 3)
    assert t.rows_below(1) == (0, 1) and t.rows_below(0) == (0, 1, 2)
    assert t.depth == 2 and t.is_leaf(4) and not t.is_leaf(1)
    assert t.inner_nodes == (0, 1) and t.leaf_children(0) == (4,)
    assert t.inner_children(0) == (1,) and t.inner_children(1) == ()
    assert t.leaf_waves(1, 1) == [(2,), (3,)] and t.leaf_waves(1, 4) == [(2, 3)]
    assert t.positions(1) == slice(2, 4) and t.positions(0) == slice(0, 0)
    assert g.tokens.tolist() == [[1, 2, 3, 4, 5, 6, 0], [1, 2, 3, 4, 5, 7, 8],
                                 [1, 2, 3, 9, 9, 9, 0]]
    assert g.labels[:, :-1].tolist() == g.tokens[:, 1:].tolist()
    # label t is token t + 1: node 1's mask [1, 0] lands at positions 2, 3; leaves default 1
    assert g.loss_mask.tolist() == [[0, 0, 1, 0, 1, 0, 0], [0, 0, 1, 0, 0, 1, 0],
                                    [0, 0, 1, 1, 1, 0, 0]]
    assert g.prompt_length == 3
    g.check(num_loops=1, vocab_size=16)


def test_rl_group_extras_are_per_row():
    G = 3
    g = RLGroup.from_tree(_segs(), 0, advantages=torch.arange(G, dtype=torch.float32),
                          old_logprobs=torch.zeros(2, G, 7))
    g.check(num_loops=2)
    assert g.advantages.tolist() == [0, 1, 2]


def test_depth_one_tree_is_the_one_level_group():
    segs = [TreeSegment([1, 2, 3], None), TreeSegment([4, 5], 0), TreeSegment([6], 0)]
    tree = SharedPrefixGroup.from_tree(segs, 0)
    flat = SharedPrefixGroup.from_rollout([1, 2, 3], torch.tensor([[4, 5], [6, 0]]), [2, 1], 0)
    assert tree.tree.depth == 1
    for name in ("tokens", "labels", "loss_mask"):
        assert torch.equal(getattr(tree, name), getattr(flat, name)), name


@pytest.mark.parametrize("segs,match", [
    ([TreeSegment([1], None), TreeSegment([2], 0, start=3)],
     r"tree node 1: start 3 is not position 1"),
    ([TreeSegment([1], None), TreeSegment([2], 2), TreeSegment([3], 1)],
     r"tree node 1: its parents form a cycle"),
    ([TreeSegment([1, 2], None), TreeSegment([], 0)], r"tree node 1: the node is empty"),
    ([TreeSegment([1, 2], None, [0, 1]), TreeSegment([3], 0)],
     r"tree node 0: loss_mask is non-zero on the root"),
    ([TreeSegment([1], None), TreeSegment([2], None)], r"tree node 1: a second root"),
    ([TreeSegment([1], 0), TreeSegment([2], None)], r"tree node 0: the root"),
    ([TreeSegment([1], None, start=2), TreeSegment([2], 0)], r"tree node 0: start 2"),
    ([TreeSegment([1], None), TreeSegment([2], 5)], r"tree node 1: parent 5 is not another"),
    ([TreeSegment([1], None), TreeSegment([2], 1)], r"tree node 1: parent 1 is not another"),
    ([TreeSegment([1], None), TreeSegment([2, 3], 0, [1])], r"tree node 1: loss_mask has shape"),
    ([], r"no segments"),
])
def test_bad_segments_name_the_node(segs, match):
    with pytest.raises(TreeError, match=match):
        SharedPrefixGroup.from_tree(segs, 0)


def test_integer_like_parents_are_node_indices():
    """A parent given as a numpy integer or an integer tensor is that node."""
    segs = _segs()
    segs[1].parent, segs[2].parent, segs[3].parent = np.int64(0), torch.tensor(1), np.int32(1)
    assert SharedPrefixGroup.from_tree(segs, 0).tree.parents == (-1, 0, 1, 1, 0)


@pytest.mark.parametrize("parent", [1.0, torch.tensor(1.0), "1", True])
def test_parent_of_another_type_names_it_and_the_group(parent):
    segs = _segs()
    segs[2].parent = parent
    with pytest.raises(TreeError, match=rf"^group 7: tree node 2: parent must be an integer node "
                                        rf"index, got {type(parent).__name__} "):
        SharedPrefixGroup.from_tree(segs, 0, group_id=7)


@pytest.mark.parametrize("build", ["tree", "rollout"])
def test_extras_not_tensors_name_the_field_and_the_group(build):
    with pytest.raises(TypeError, match=r"^group 4: advantages must be a tensor \(None: absent\), "
                                        r"got list"):
        if build == "tree":
            RLGroup.from_tree(_segs(), 0, group_id=4, advantages=[0.0, 1.0, 2.0])
        else:
            RLGroup.from_rollout([1, 2], torch.tensor([[3, 4], [5, 0]]), [2, 1], 0,
                                 group_id=4, advantages=[0.0, 1.0])


@pytest.mark.parametrize("parents,starts,ends,leaves,match", [
    ((-1, 0), (0, 3), (2, 4), (1,), r"tree node 1: starts at position 3, but its parent node "
                                    r"0 ends at 2"),
    ((-1, 0), (0, 2), (2, 2), (1,), r"tree node 1: the node is empty"),
    ((-1, 2, 1), (0, 1, 1), (1, 2, 2), (), r"tree node 1: its parents form a cycle"),
    ((-1, -1), (0, 0), (1, 1), (0, 1), r"tree node 1: a second root"),
    ((-1, 0), (1, 2), (2, 3), (1,), r"tree node 0: the root starts at 1"),
    ((-1, 0), (0, 2), (2, 3), (0,), r"leaf_of_row \(0,\) must list the leaves"),
])
def test_bad_prefix_tree_names_the_node(parents, starts, ends, leaves, match):
    with pytest.raises(TreeError, match=match):
        PrefixTree(parents, starts, ends, leaves)


def _tree_group():
    return tree_group(DEPTH2, R=2, seed=3)


def test_check_rejects_rows_inconsistent_with_the_tree():
    g = _tree_group()
    g.check(num_loops=2)
    t = g.tree
    rows = t.rows_below(1)
    g.tokens[rows[-1], t.starts[1]] += 1  # one row below node 1 holds other tokens
    with pytest.raises(ValueError, match=rf"tree node 1: row {rows[-1]} holds other tokens"):
        g.check(num_loops=2)


def test_check_rejects_loss_past_a_rows_leaf():
    g = _tree_group()
    t = g.tree
    row = next(i for i, leaf in enumerate(t.leaf_of_row) if t.ends[leaf] < g.tokens.shape[1])
    leaf = t.leaf_of_row[row]
    g.loss_mask[row, t.ends[leaf] - 1] = 1
    with pytest.raises(ValueError, match=rf"row {row} \(leaf node {leaf}\) has loss_mask"):
        g.check(num_loops=2)


def test_check_rejects_a_tree_of_other_rows():
    g = _tree_group()
    g.tree = PrefixTree((-1, 0), (0, 6), (6, 8), (1,))
    with pytest.raises(ValueError, match=r"the tree has 1 leaves, the group 5 rows"):
        g.check(num_loops=2)
