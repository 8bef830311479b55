"""Prefix trees: a group whose rows share more than one level of prefix (multi-turn episodes,
branching rollouts). A tree is metadata over the group's rows: row g is the root-to-leaf
sequence of the g-th leaf, so the naive reference is the rows themselves.

A rollout gives the nodes as ``TreeSegment``s (tokens, parent, per-token loss mask);
``build_tree`` checks them (errors name the node) and returns the ``PrefixTree`` and the
per-node tokens and masks from which ``SharedPrefixGroup.from_tree`` lays out the rows.
"""

import operator
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor


class TreeError(ValueError):
    """A malformed prefix tree; the message names the node."""


@dataclass
class TreeSegment:
    """One node of a prefix tree, as a rollout gives it.

    tokens:    [L] token ids, L >= 1.
    parent:    index of the parent in the segment list; None for the root (exactly one root,
               at index 0; parents form no cycle).
    loss_mask: [L], 1 where token j of the segment is trained (its prediction gets the loss).
               None: every token of a leaf trained, no token of the root or an internal node.
               The root's tokens are the prompt: a non-zero mask there is an error.
    start:     position of tokens[0] in every row through the node; None: the parent's end
               (given, it must equal it).
    """

    tokens: object
    parent: Optional[int]
    loss_mask: Optional[object] = None
    start: Optional[int] = None


@dataclass(frozen=True)
class PrefixTree:
    """The nodes of a group whose rows are its root-to-leaf sequences (one row per leaf).

    parents:     [N] parent node of each node, -1 for the root (node 0).
    starts:      [N] first position of each node in the rows through it.
    ends:        [N] end position (exclusive).
    leaf_of_row: [G] the leaf node of each row (leaves in node order).
    """

    parents: tuple
    starts: tuple
    ends: tuple
    leaf_of_row: tuple

    def __post_init__(self):
        _check_structure(self.parents, self.starts, self.ends)
        leaves = tuple(n for n in range(self.num_nodes) if self.is_leaf(n))
        if tuple(self.leaf_of_row) != leaves:
            raise TreeError(f"tree: leaf_of_row {tuple(self.leaf_of_row)} must list the leaves "
                            f"in node order, {leaves}")

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    def children(self, n: int) -> tuple:
        """The children of node ``n`` in node order."""
        return tuple(c for c, p in enumerate(self.parents) if p == n)

    def is_leaf(self, n: int) -> bool:
        return n not in self.parents

    def leaf_children(self, n: int) -> tuple:
        return tuple(c for c in self.children(n) if self.is_leaf(c))

    def inner_children(self, n: int) -> tuple:
        return tuple(c for c in self.children(n) if not self.is_leaf(c))

    @property
    def inner_nodes(self) -> tuple:
        """The nodes with children, the root first."""
        return tuple(n for n in range(self.num_nodes) if not self.is_leaf(n))

    def leaf_waves(self, n: int, size: int) -> list:
        """Node n's leaf children in waves of ``size``."""
        leaves = self.leaf_children(n)
        return [leaves[k : k + size] for k in range(0, len(leaves), size)]

    def path(self, n: int) -> tuple:
        """Nodes from the root down to ``n``."""
        nodes = [n]
        while self.parents[nodes[-1]] >= 0:
            nodes.append(self.parents[nodes[-1]])
        return tuple(reversed(nodes))

    def rows_below(self, n: int) -> tuple:
        """Indices of the rows whose path passes through node ``n``."""
        return tuple(g for g, leaf in enumerate(self.leaf_of_row) if n in self.path(leaf))

    @property
    def depth(self) -> int:
        """Levels below the root (1: a one-level group of responses to a prompt)."""
        return max(len(self.path(leaf)) for leaf in self.leaf_of_row) - 1

    def positions(self, n: int) -> slice:
        """The positions of the group layout whose labels are node ``n``'s tokens (label t is
        token t + 1); empty for the root."""
        if n == 0:
            return slice(0, 0)
        return slice(self.starts[n] - 1, self.ends[n] - 1)


def flat_tree(P: int, T: int, G: int) -> PrefixTree:
    """The depth-1 tree of a one-level group of G rows of T positions: the prompt (node 0,
    positions 0 .. P-1) and one leaf per row (positions P .. T-1, padding included)."""
    return PrefixTree((-1, *[0] * G), (0, *[P] * G), (P, *[T] * G), tuple(range(1, G + 1)))


def build_tree(segments: list) -> tuple:
    """Check ``segments`` and lay them out -> (PrefixTree, tokens [N] x [L_n] long,
    loss masks [N] x [L_n] float64). Errors name the node."""
    if not segments:
        raise TreeError("tree: no segments (a tree needs a root)")
    parents = tuple(_parent(n, s) for n, s in enumerate(segments))
    tokens = [_segment_tokens(n, s) for n, s in enumerate(segments)]
    _check_parents(parents)
    starts, ends = _layout(segments, parents, [len(t) for t in tokens])
    leaves = tuple(n for n in range(len(segments)) if n not in parents)
    tree = PrefixTree(parents, starts, ends, leaves)
    masks = [_segment_mask(n, s, len(tokens[n]), tree.is_leaf(n)) for n, s in enumerate(segments)]
    return tree, tokens, masks


def _parent(n: int, segment: TreeSegment) -> int:
    """The segment's parent as an int, -1 for None (the root); an integer-like (a numpy integer,
    a one-element integer tensor) is taken, another type refused."""
    if segment.parent is None:
        return -1
    try:
        if isinstance(segment.parent, bool):
            raise TypeError
        return operator.index(segment.parent)
    except TypeError:
        raise TreeError(f"tree node {n}: parent must be an integer node index, got "
                        f"{type(segment.parent).__name__} {segment.parent!r}") from None


def _segment_tokens(n: int, segment: TreeSegment) -> Tensor:
    tokens = torch.as_tensor(segment.tokens, dtype=torch.long, device="cpu")
    if tokens.dim() != 1:
        raise TreeError(f"tree node {n}: tokens must be [L], got shape {tuple(tokens.shape)}")
    if tokens.numel() == 0:
        raise TreeError(f"tree node {n}: the node is empty (a segment has >= 1 token)")
    return tokens


def _segment_mask(n: int, segment: TreeSegment, length: int, leaf: bool) -> Tensor:
    """[L] float64: the segment's loss mask (default: 1 on a leaf, 0 elsewhere)."""
    if segment.loss_mask is None:
        return torch.full((length,), float(leaf and n != 0), dtype=torch.float64, device="cpu")
    mask = torch.as_tensor(segment.loss_mask, device="cpu").to(torch.float64)
    if tuple(mask.shape) != (length,):
        raise TreeError(f"tree node {n}: loss_mask has shape {tuple(mask.shape)}, its tokens "
                        f"({length},)")
    if n == 0 and (mask != 0).any():
        raise TreeError("tree node 0: loss_mask is non-zero on the root, whose tokens are the "
                        "prompt (no prompt token is trained)")
    return mask


def _check_parents(parents: tuple) -> None:
    """One root, node 0; every parent an existing node; no cycle."""
    _check_structure(parents, None, None)


def _check_structure(parents: tuple, starts: Optional[tuple], ends: Optional[tuple]) -> None:
    N = len(parents)
    if N == 0 or parents[0] != -1:
        raise TreeError("tree node 0: the root (the prompt) must be node 0, with no parent")
    for n, p in enumerate(parents[1:], start=1):
        if p == -1:
            raise TreeError(f"tree node {n}: a second root (no parent); a tree has one root, "
                            f"node 0")
        if not isinstance(p, int) or not 0 <= p < N or p == n:
            raise TreeError(f"tree node {n}: parent {p!r} is not another node in [0, {N})")
    for n in range(N):
        seen, m = {n}, parents[n]
        while m != -1:
            if m in seen:
                raise TreeError(f"tree node {n}: its parents form a cycle (through node {m})")
            seen.add(m)
            m = parents[m]
    if starts is None:
        return
    if len(starts) != N or len(ends) != N:
        raise TreeError(f"tree: parents, starts and ends must have one entry per node ({N}), "
                        f"got {len(starts)} starts and {len(ends)} ends")
    if starts[0] != 0:
        raise TreeError(f"tree node 0: the root starts at {starts[0]}, not at position 0")
    for n in range(N):
        if ends[n] <= starts[n]:
            raise TreeError(f"tree node {n}: the node is empty (positions [{starts[n]}, "
                            f"{ends[n]}))")
        if n and starts[n] != ends[parents[n]]:
            raise TreeError(f"tree node {n}: starts at position {starts[n]}, but its parent "
                            f"node {parents[n]} ends at {ends[parents[n]]} (a child starts where "
                            f"its parent ends)")


def _layout(segments: list, parents: tuple, lengths: list) -> tuple:
    """(starts, ends) of every node, from the root down; a given ``start`` must be the
    parent's end."""
    starts, ends = [None] * len(parents), [None] * len(parents)

    def place(n: int, start: int) -> None:
        given = segments[n].start
        if given is not None and given != start:
            where = "the root starts at 0" if n == 0 else f"its parent node {parents[n]} ends there"
            raise TreeError(f"tree node {n}: start {given} is not position {start} ({where}; a "
                            f"child starts where its parent ends)")
        starts[n], ends[n] = start, start + lengths[n]
        for c in (c for c, p in enumerate(parents) if p == n):
            place(c, ends[n])

    place(0, 0)
    return tuple(starts), tuple(ends)


def tree_rows(tree: PrefixTree, tokens: list, masks: list, pad_id: int) -> tuple:
    """The naive rows of a tree: (tokens [G, T] long, labels [G, T], loss mask [G, T] float64),
    row g the path of leaf ``leaf_of_row[g]``, right-padded with ``pad_id`` to T."""
    T, G = max(tree.ends), len(tree.leaf_of_row)
    rows = torch.full((G, T), pad_id, dtype=torch.long, device="cpu")
    trained = torch.zeros(G, T + 1, dtype=torch.float64, device="cpu")  # [G, T+1]: token t trained
    for g, leaf in enumerate(tree.leaf_of_row):
        for n in tree.path(leaf):
            rows[g, tree.starts[n] : tree.ends[n]] = tokens[n]
            trained[g, tree.starts[n] : tree.ends[n]] = masks[n]
    labels = torch.full_like(rows, pad_id)
    labels[:, :-1] = rows[:, 1:]
    return rows, labels, trained[:, 1:]  # loss_mask[g, t]: the label t (token t + 1) trained


def check_rows(tree: PrefixTree, tag: str, tokens: Tensor, loss_mask: Tensor,
               prompt_length: int) -> None:
    """A tree group's rows are its tree's: one row per leaf, each holding its path's tokens
    (a node's tokens the same in every row below it), no loss past a row's leaf."""
    G, T = tokens.shape
    if len(tree.leaf_of_row) != G:
        raise ValueError(f"{tag}: the tree has {len(tree.leaf_of_row)} leaves, the group {G} rows")
    if max(tree.ends) > T or tree.ends[0] != prompt_length:
        raise ValueError(f"{tag}: the tree spans positions [0, {max(tree.ends)}) with a root of "
                         f"{tree.ends[0]}, the group has T = {T} and prompt_length "
                         f"{prompt_length}")
    for n in range(1, tree.num_nodes):
        rows = list(tree.rows_below(n))
        span = tokens[rows, tree.starts[n] : tree.ends[n]]  # [rows, L]
        differ = (span != span[:1]).any(dim=1)
        if differ.any():
            g = rows[int(differ.nonzero()[0])]
            raise ValueError(f"{tag}: tree node {n}: row {g} holds other tokens at positions "
                             f"[{tree.starts[n]}, {tree.ends[n]}) than row {rows[0]} (every row "
                             f"below a node holds its tokens)")
    for g, leaf in enumerate(tree.leaf_of_row):
        if (loss_mask[g, tree.ends[leaf] - 1 :] != 0).any():
            raise ValueError(f"{tag}: row {g} (leaf node {leaf}) has loss_mask non-zero at or "
                             f"after position {tree.ends[leaf] - 1}, past its leaf's tokens")
