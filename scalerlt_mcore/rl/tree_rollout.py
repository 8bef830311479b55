"""Tree rollouts: prompt-once decoding generalised to prefix trees.

A tree grows one level at a time. Level 0 is the N prompts, prefilled once into a cache of N
rows. Level k + 1 has ``branches[k]`` rows per row of level k, each decoding its own answer
into a cache of its own tokens only (``DepthKVCache(prefix=<level k's cache>)``): a row
attends to its own K/V and, through the chain of prefix caches, to the single stored copy of
every segment on its root-to-node path (``chain_prefix_attention``: a cascade over the path's
segments merged by log-sum-exp). No shared segment is copied per continuation.

An internal node is its answer (trained) followed by the environment's reply (not trained;
``reply_fn``, multi-turn, told the index of the node's prompt): after the level's answers are
sampled, the rest of each node (its last sampled token, which no decode step has fed yet, and
the reply) is appended to the level's cache in one forward (``LoopedGPTModel.extend``), whose
readout at the node's last token gives its children's first-token logits. Leaves are the last
answers. A node whose answer ended with ``eos_id`` and got no reply is finished: it becomes a
leaf (its child rows decode nothing and are dropped), so trees may be uneven.

Sampling, log-probs, exit modes and the stop check are ``rl/rollout.py``'s
(``decode_tokens``): no decoded token waits for the device; the host reads each level's
answers once (to build the nodes and call ``reply_fn``).

The result per prompt is a list of ``TreeSegment`` in depth-first order (root first; leaves in
that order are the rows of the group, and the rows below any node are contiguous), with loss
masks, the per-node log-probs of the sampled tokens (old log-probs for the update), and the
leaves' tokens for the reward: ``SharedPrefixGroup.from_tree`` / ``RLGroup.from_tree`` take
the segments as they are, ``TreeRollout.old_logprobs`` their rows' old log-probs.
"""

import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Optional, Union

import torch
from torch import Tensor

from ..model.host_syncs import mark_host, upload
from ..model.vocab_parallel import tempered
from ..shared_prefix import TreeSegment
from .rollout import (
    DecodeRecord,
    Sampling,
    check_exit_gate,
    check_generator,
    decode_tokens,
    right_pad,
)


@dataclass
class TreeRollout:
    """One tree per prompt.

    prompts:       the N prompts (token lists).
    segments:      N lists of ``TreeSegment``, depth-first (root first).
    logprobs:      N lists, one [L] float32 tensor per node: the log-prob of each sampled token
                   under the sampling distribution (as ``Rollout.logprobs``); 0 on tokens not
                   sampled (the root's, the replies').
    loop_logprobs: the same under every loop's readout: [R, L] per node.
    exit_logprobs: the exit distribution log p(r) at every sampled token, [R, L] per node (exit
                   gate on; 0 where not sampled), else None.
    leaves:        N lists of the leaves' node indices, in segment order (row g of the group is
                   the path of leaves[n][g]).
    """

    prompts: list
    segments: list
    logprobs: list
    loop_logprobs: list
    exit_logprobs: Optional[list]
    leaves: list

    def path(self, n: int, node: int) -> list:
        """Node indices from the root to ``node`` of tree ``n``."""
        segs, out = self.segments[n], [node]
        while segs[out[-1]].parent is not None:
            out.append(segs[out[-1]].parent)
        return out[::-1]

    def leaf_tokens(self, n: int) -> list:
        """Every row of tree ``n``: the tokens of its root-to-leaf path (token lists)."""
        segs = self.segments[n]
        return [[t for i in self.path(n, leaf) for t in segs[i].tokens]
                for leaf in self.leaves[n]]

    def leaf_answers(self, n: int) -> list:
        """The last answer of every row of tree ``n`` (its leaf's tokens), for the reward."""
        return [list(self.segments[n][leaf].tokens) for leaf in self.leaves[n]]

    def leaf_texts(self, n: int, tokenizer) -> list:
        """The last answer of every row of tree ``n`` as text (``tokenizer.decode``, which
        stops at eos), for a task's reward."""
        return [tokenizer.decode(answer) for answer in self.leaf_answers(n)]

    def old_logprobs(self, n: int, length: Optional[int] = None, loops: bool = True) -> Tensor:
        """Tree ``n``'s log-probs in the group layout of its rows: [R, G, T] (``loops``) or
        [G, T], position t holding the log-prob of row token t + 1 (the label there), 0 on
        the prompt, replies and padding; T = ``length`` (default: the longest row)."""
        segs, per_node = self.segments[n], self.loop_logprobs[n] if loops else self.logprobs[n]
        rows = [self.path(n, leaf) for leaf in self.leaves[n]]
        ends = [segs[p[-1]].start + len(segs[p[-1]].tokens) for p in rows]
        T = max(ends) if length is None else length
        if T < max(ends) - 1:
            raise ValueError(f"old_logprobs: length {T} is shorter than tree {n}'s labels "
                             f"({max(ends) - 1} positions)")
        out = torch.zeros(*per_node[0].shape[:-1], len(rows), T, dtype=per_node[0].dtype,
                          device="cpu")
        for g, path in enumerate(rows):
            for i in path[1:]:
                start, L = segs[i].start, len(segs[i].tokens)
                out[..., g, start - 1 : start - 1 + L] = per_node[i]
        return out


ReplyFn = Callable[[int, list, list], list]
"""reply_fn(prompt, path_tokens, answer_tokens) -> the environment's reply (token ids) after
an internal node's answer; ``prompt``: the index in ``prompts`` of the node's tree (its
problem: prompts may share tokens, or be prefixes of one another); ``path_tokens``: every
token before the answer (root to parent)."""


@dataclass
class _Node:
    tokens: list
    parent: Optional[int]
    mask: list
    logprobs: Tensor  # [L]
    loop_logprobs: Tensor  # [R, L]
    exit_logprobs: Optional[Tensor]  # [R, L]
    start: int
    children: list = field(default_factory=list)


@torch.no_grad()
def generate_tree(model, prompts: list, branches: Sequence[int],
                  max_new_tokens: Union[int, Sequence[int]], *, eos_id: int, pad_id: int,
                  sampling: Optional[Sampling] = None, static_cache: Optional[bool] = None,
                  num_loops: Optional[int] = None, reply_fn: Optional[ReplyFn] = None,
                  max_rows: Optional[int] = None) -> TreeRollout:
    """Grow one tree per prompt (a list of token lists): ``branches[k]`` children per node of
    depth k, each decoding up to ``max_new_tokens[k]`` tokens (an int: every depth), stopping
    at ``eos_id``; internal nodes get ``reply_fn``'s reply appended (untrained; ``ReplyFn``:
    called with the index of the node's prompt, its path and its answer). ``sampling``
    (a ``Sampling``; None: its defaults), ``static_cache`` and ``num_loops`` as
    ``rl/rollout.py``'s ``generate`` (no CUDA graph). Rows of a level are ordered by parent,
    as ``generate``'s rows by prompt. ``max_rows``: the most leaves decoded at once (whole
    trees, in turn from one generator; None: every tree at once), which bounds the K/V cache.
    """
    sampling = sampling or Sampling()
    if sampling.exit_kv:
        raise ValueError("exit_kv (a serving engine's exit K/V) is for one-level rollouts, not "
                         "trees")
    budgets = _check_tree_inputs(prompts, branches, max_new_tokens)
    _check_reply_fn(reply_fn)
    leaves = math.prod(branches)
    per_call = len(prompts) if max_rows is None else max_rows // leaves
    if max_rows is not None and per_call < 1:
        raise ValueError(f"max_rows {max_rows} holds no whole tree: each has {leaves} leaves "
                         f"(branches {list(branches)})")
    if len(prompts) <= per_call:
        return _generate_trees(model, prompts, branches, budgets, eos_id, pad_id,
                               sampling, static_cache, num_loops, reply_fn)
    parts = [_generate_trees(model, prompts[i : i + per_call], branches, budgets,
                             eos_id, pad_id, sampling, static_cache, num_loops,
                             _offset(reply_fn, i))
             for i in range(0, len(prompts), per_call)]
    gated = parts[0].exit_logprobs is not None
    return TreeRollout(*(None if name == "exit_logprobs" and not gated else
                         [x for p in parts for x in getattr(p, name)]
                         for name in ("prompts", "segments", "logprobs", "loop_logprobs",
                                      "exit_logprobs", "leaves")))


def _offset(reply_fn: Optional[ReplyFn], first: int) -> Optional[ReplyFn]:
    """``reply_fn`` for the trees from prompt ``first`` on (it indexes the whole list)."""
    if reply_fn is None or first == 0:
        return reply_fn
    return lambda prompt, path, answer: reply_fn(first + prompt, path, answer)


def _generate_trees(model, prompts: list, branches, budgets: list, eos_id: int, pad_id: int,
                    sampling: Sampling, static_cache, num_loops, reply_fn) -> TreeRollout:
    """``generate_tree``'s one call: every tree of ``prompts`` at once (``budgets``: the
    checked tokens per depth)."""
    device = next(model.parameters()).device
    check_generator(sampling.generator, device)
    grower = _TreeGrower(model, pad_id, eos_id, static_cache, num_loops, reply_fn)
    logits, exit_lp = grower.prefill_roots(prompts)
    check_exit_gate(sampling, exit_lp)
    sampling = sampling.on(logits.shape[-1], device)
    for depth, (G, M) in enumerate(zip(branches, budgets)):
        last = depth == len(branches) - 1
        logits, exit_lp = grower.grow(logits, exit_lp, G, M, sampling, last)
        if logits is None and not last:  # every node of the level finished
            break
    return grower.rollout(prompts)


def _check_tree_inputs(prompts, branches, max_new_tokens) -> list:
    """-> the per-depth token budgets; bad input raises naming it."""
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("generate_tree needs a non-empty list of prompts (token lists)")
    for i, p in enumerate(prompts):
        if not isinstance(p, (list, tuple)):
            raise ValueError(f"prompt {i} must be a list of token ids, got {type(p).__name__}")
        if not p:
            raise ValueError(f"prompt {i} is empty: a tree's root needs at least one token")
    if not isinstance(branches, (list, tuple)) or not branches:
        raise ValueError(f"branches must be a non-empty list of branch factors per depth, got "
                         f"{branches!r}")
    for k, g in enumerate(branches):
        if not isinstance(g, int) or g < 1:
            raise ValueError(f"branch factor at depth {k} is {g!r}: every branch factor must "
                             f"be an int >= 1")
    budgets = ([max_new_tokens] * len(branches) if isinstance(max_new_tokens, int)
               else list(max_new_tokens))
    if len(budgets) != len(branches):
        raise ValueError(f"max_new_tokens has {len(budgets)} entries for {len(branches)} "
                         f"depths (one per branch factor, or one int for all)")
    for k, m in enumerate(budgets):
        if not isinstance(m, int) or m < 1:
            raise ValueError(f"max_new_tokens at depth {k} is {m!r}: it must be an int >= 1 "
                             f"(a tree node cannot be empty)")
    return budgets


def _check_reply_fn(reply_fn) -> None:
    """A ``reply_fn`` must take (prompt index, path, answer) positionally."""
    if reply_fn is None:
        return
    try:
        signature = inspect.signature(reply_fn)
    except (TypeError, ValueError):  # no signature to read (some builtins): called as is
        return
    try:
        signature.bind(0, [], [])
    except TypeError as e:
        raise ValueError(f"reply_fn must take (prompt, path, answer): the index of the node's "
                         f"prompt in prompts, the path's tokens and the answer's ({e})") from e


class _TreeGrower:
    """The levels of the trees being grown: each level's cache (continuing the level above),
    the node of every row (None: a dropped row under a finished node), and the nodes."""

    def __init__(self, model, pad_id: int, eos_id: int, static, num_loops, reply_fn):
        self.model, self.pad_id, self.eos_id = model, pad_id, eos_id
        self.static, self.num_loops, self.reply_fn = static, num_loops, reply_fn
        self.device = next(model.parameters()).device
        self.nodes: list = []  # every prompt's nodes, level by level
        self.rows: list = []  # node id of each row of the current level, or None
        self.cache = None

    def prefill_roots(self, prompts: list) -> tuple:
        """Level 0: the prompts, prefilled once. -> (logits [R, N, V], exit [R, N] or None)."""
        model = self.model
        tokens, lengths = right_pad([list(p) for p in prompts], self.pad_id)  # [N, Tp] host
        self.cache = model.new_kv_cache(len(prompts), tokens.shape[1], static=self.static,
                                        num_loops=self.num_loops)
        logits, exit_lp = model.prefill(self.cache, upload(tokens, self.device), lengths,
                                        with_exit=True, num_loops=self.num_loops)
        R = logits.shape[0]
        gated = exit_lp is not None
        for p in prompts:
            L = len(p)
            self.rows.append(len(self.nodes))
            host = torch.device("cpu")  # the rollout's records live on the host
            self.nodes.append(_Node(list(p), None, [0] * L, torch.zeros(L, device=host),
                                    torch.zeros(R, L, device=host),
                                    torch.zeros(R, L, device=host) if gated else None, 0))
        return logits, exit_lp

    def grow(self, logits, exit_lp, G: int, M: int, sampling: Sampling, last: bool) -> tuple:
        """One level: G children per row, up to M answer tokens each; internal levels
        (``last`` False) get their rest fed (``_finish_level``). -> the next level's
        first-token logits and exit distribution (None on the last level)."""
        model = self.model
        logits = logits.repeat_interleave(G, dim=1)  # [R, B, V]
        exit_lp = None if exit_lp is None else exit_lp.repeat_interleave(G, dim=1)
        parents = [r for r in self.rows for _ in range(G)]
        B = len(parents)
        cache = model.new_kv_cache(B, M, prefix=self.cache, static=self.static,
                                   num_loops=self.num_loops)
        rec = DecodeRecord(logits.shape[0], B, M, self.pad_id, self.eos_id, self.device,
                      exit_lp is not None)
        dropped = [p is None for p in parents]
        rec.done = upload(torch.tensor(dropped, dtype=torch.bool, device="cpu"), self.device)
        step = lambda t: model.decode_step(cache, t, with_exit=True,  # noqa: E731
                                           num_loops=self.num_loops)
        fed = decode_tokens(step, logits, exit_lp, rec, M, sampling)
        answers = self._answers(rec, parents)  # host: the level's one read
        self.cache = cache
        if last:
            self.rows = [self._add(parent, *a, []) if parent is not None else None
                         for parent, a in zip(parents, answers)]
            return None, None
        return self._finish_level(cache, parents, answers, fed)

    def _answers(self, rec: DecodeRecord, parents: list) -> list:
        """Per row: (answer tokens, [L] sampled log-probs, [R, L] loop log-probs, [R, L] exit
        or None), up to and including the first eos; None for dropped rows."""
        out = rec.out.cpu().tolist()
        sampled, loops = rec.sampled.cpu(), rec.loops.cpu()
        exits = None if rec.exits is None else rec.exits.cpu()
        answers = []
        for b, (tokens, parent) in enumerate(zip(out, parents)):
            if parent is None:
                answers.append(None)
                continue
            L = tokens.index(self.eos_id) + 1 if self.eos_id in tokens else len(tokens)
            answers.append((tokens[:L], sampled[b, :L], loops[:, b, :L],
                            None if exits is None else exits[:, b, :L]))
        return answers

    def _finish_level(self, cache, parents: list, answers: list, fed: int) -> tuple:
        """Append every internal node's rest (its last answer token if no decode step fed it,
        then the reply) in one forward; a node ended by eos with no reply is finished (a
        leaf). -> the children's first-token logits [R, B, V] and exit [R, B] or None."""
        kept, pending, rows = [], [], []
        for parent, answer in zip(parents, answers):
            if parent is None:
                kept.append(1)  # any cached length >= 1 keeps a dropped row's attention finite
                pending.append([])
                rows.append(None)
                continue
            tokens = answer[0]
            reply = self._reply(parent, tokens)
            finished = tokens[-1] == self.eos_id and not reply  # a leaf, its child rows dropped
            kept.append(max(min(len(tokens), fed), 1) if finished else min(len(tokens), fed))
            pending.append([] if finished else tokens[kept[-1]:] + reply)
            node = self._add(parent, *answer, reply)
            rows.append(None if finished else node)
        cache.lengths.copy_(torch.tensor(kept, device="cpu"))
        counts = mark_host(torch.tensor([len(r) for r in pending], dtype=torch.long, device="cpu"))
        self.rows = rows
        width = int(counts.max())
        if width == 0:  # every node finished: nothing below
            return None, None
        tokens, _ = right_pad([r or [self.pad_id] for r in pending], self.pad_id)
        cache.reserve(int(cache.lengths.max()) + width)
        logits, exit_lp, _ = self.model.extend(cache, upload(tokens[:, :width], self.device),
                                               counts,
                                               num_loops=self.num_loops)
        return logits, exit_lp

    def _reply(self, parent: int, answer: list) -> list:
        if self.reply_fn is None:
            return []
        nodes = self._path(parent)  # nodes[0]: the root, node n of prompt n
        path = [t for i in nodes for t in self.nodes[i].tokens]
        reply = self.reply_fn(nodes[0], path, list(answer))
        if not isinstance(reply, (list, tuple)) or not all(isinstance(t, int) for t in reply):
            raise ValueError(f"reply_fn must return a list of token ids (ints), got {reply!r}")
        vocab = self.model.vocab_size
        if any(not 0 <= t < vocab for t in reply):
            raise ValueError(f"reply_fn returned token ids outside the model's vocabulary "
                             f"[0, {vocab}): {list(reply)}")
        return list(reply)

    def _path(self, node: int) -> list:
        out = [node]
        while self.nodes[out[-1]].parent is not None:
            out.append(self.nodes[out[-1]].parent)
        return out[::-1]

    def _add(self, parent: int, tokens, lp, loop_lp, exit_lp, reply: list) -> int:
        """A new node: the answer (trained) then the reply (not); log-probs 0 on the reply."""
        n = len(reply)
        pad = lambda t: None if t is None else torch.cat(  # noqa: E731
            [t, t.new_zeros(*t.shape[:-1], n)], dim=-1)
        up = self.nodes[parent]
        node = _Node(list(tokens) + reply, parent, [1] * len(tokens) + [0] * n, pad(lp),
                     pad(loop_lp), pad(exit_lp), up.start + len(up.tokens))
        self.nodes.append(node)
        up.children.append(len(self.nodes) - 1)
        return len(self.nodes) - 1

    def rollout(self, prompts: list) -> TreeRollout:
        """Every prompt's tree, depth-first (the roots are nodes 0 ... N-1)."""
        segs, lps, loop_lps, exits, leaves = [], [], [], [], []
        gated = self.nodes[0].exit_logprobs is not None
        for root in range(len(prompts)):
            order = self._depth_first(root)
            index = {node: i for i, node in enumerate(order)}
            nodes = [self.nodes[i] for i in order]
            segs.append([TreeSegment(n.tokens, None if n.parent is None else index[n.parent],
                                     n.mask, n.start) for n in nodes])
            lps.append([n.logprobs for n in nodes])
            loop_lps.append([n.loop_logprobs for n in nodes])
            exits.append([n.exit_logprobs for n in nodes] if gated else None)
            leaves.append([i for i, n in enumerate(nodes) if not n.children and i > 0])
        return TreeRollout(list(prompts), segs, lps, loop_lps, exits if gated else None, leaves)

    def _depth_first(self, root: int) -> list:
        order, stack = [], [root]
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(reversed(self.nodes[node].children))
        return order


@torch.no_grad()
def tree_logprobs(model, trees: list, static_cache: Optional[bool] = None,
                  num_loops: Optional[int] = None, temperature: float = 1.0) -> list:
    """Teacher-forced tree decoding: every node's tokens prefilled once against its cached
    path (one ``LoopedGPTModel.extend`` per depth, the levels chained as in
    ``generate_tree``). ``trees``: one ``TreeSegment`` list per prompt, any shape (a level
    has as many rows per row above as the widest node of that depth has children; missing
    children are one-token placeholders, scored and dropped). -> per tree, per node, the
    per-loop log-probs [R, L] of the node's tokens (the root's: 0; token 0 of a node from its
    parent's last position) at sampling ``temperature`` (as ``generate_tree`` records them:
    ``LoopedGPTModel.logprobs_at``)."""
    with model.logprobs_at(temperature):
        return _tree_logprobs(model, trees, static_cache, num_loops, temperature)


def _tree_logprobs(model, trees: list, static_cache, num_loops, temperature: float) -> list:
    """``tree_logprobs`` inside the model's ``logprobs_at(temperature)``."""
    device = next(model.parameters()).device
    levels = _levels(trees)  # per depth: (tree, node) or None, in row order
    prompts = [list(_ids(trees[n][i].tokens)) for n, i in levels[0]]
    tokens, lengths = right_pad(prompts, 0)
    cache = model.new_kv_cache(len(prompts), tokens.shape[1], static=static_cache,
                               num_loops=num_loops)
    logits = model.prefill(cache, upload(tokens, device), lengths, num_loops=num_loops)
    R = logits.shape[0]
    out = [[torch.zeros(R, len(_ids(s.tokens)), device="cpu") for s in tree] for tree in trees]
    for above, level in zip(levels, levels[1:]):
        G = len(level) // len(above)
        rows = [[0] if e is None else list(_ids(trees[e[0]][e[1]].tokens)) for e in level]
        padded, counts = right_pad(rows, 0)  # [B, s] host
        on_device = upload(padded, device)  # [B, s]
        first = torch.log_softmax(tempered(logits, temperature), -1)
        first = first.repeat_interleave(G, dim=1)  # [R, B, V]
        first = first.gather(-1, on_device[:, :1][None].expand(R, -1, -1))  # [R, B, 1]
        labels = torch.cat([on_device[:, 1:], on_device[:, :1]], dim=1)  # label j = token j + 1
        cache = model.new_kv_cache(len(rows), padded.shape[1], prefix=cache,
                                   static=static_cache, num_loops=num_loops)
        logits, _, rest = model.extend(cache, on_device, mark_host(counts), labels=labels,
                                       num_loops=num_loops)
        scored = torch.cat([first.to(rest.dtype), rest[..., :-1]], dim=-1).cpu()  # [R, B, s]
        for b, entry in enumerate(level):
            if entry is not None:
                out[entry[0]][entry[1]] = scored[:, b, : len(rows[b])]
    return out


def _ids(tokens) -> list:
    return tokens.tolist() if isinstance(tokens, Tensor) else list(tokens)


def _levels(trees: list) -> list:
    """The nodes of every tree by depth, (tree, node) per row, each level's rows in equal
    groups under the rows above (the levels' caches continue their parent rows so), None
    where a node has fewer children than the widest of its depth."""
    if not trees or not all(trees):
        raise ValueError("tree_logprobs needs a non-empty list of non-empty trees")
    children = [_children(n, tree) for n, tree in enumerate(trees)]
    levels = [[(n, 0) for n in range(len(trees))]]
    while True:
        kids = [[] if e is None else children[e[0]][e[1]] for e in levels[-1]]
        G = max(len(k) for k in kids)
        if G == 0:
            break
        levels.append([None if e is None or j >= len(k) else (e[0], k[j])
                       for e, k in zip(levels[-1], kids) for j in range(G)])
    seen = {e for level in levels for e in level if e is not None}
    for n, tree in enumerate(trees):
        for i in range(len(tree)):
            if (n, i) not in seen:
                raise ValueError(f"tree {n}: node {i} is not below the root (its parents form "
                                 f"a cycle)")
    return levels


def _children(n: int, tree: list) -> list:
    """The children of every node of ``tree`` (tree ``n``), checking the parents."""
    kids = [[] for _ in tree]
    for i, seg in enumerate(tree):
        if (seg.parent is None) != (i == 0):
            raise ValueError(f"tree {n}: node {i} {'has no' if i else 'has a'} parent (the "
                             f"root is node 0, and only it)")
        if i and not (isinstance(seg.parent, int) and 0 <= seg.parent < len(tree)
                      and seg.parent != i):
            raise ValueError(f"tree {n}: node {i} has parent {seg.parent!r}, not another "
                             f"node of the tree (0 ... {len(tree) - 1})")
        if i:
            kids[seg.parent].append(i)
        if not len(_ids(seg.tokens)):
            raise ValueError(f"tree {n}: node {i} is empty")
    return kids
