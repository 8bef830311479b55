"""Joint replay over a prefix tree, depth first: every group under a joint plan. A one-level
group is the depth-1 tree of its prompt and one leaf per row (``SharedPrefixGroup.as_tree``),
its waves in the group layout; its descent is the prompt producer, its units the waves, its
replay the joint replay.

For node N with the state P of its ancestors (their K/V concatenated along positions):
  1. descend   - N's own per-(loop, layer) K/V and boundary once without grad against P,
                 detached into grad leaves L_N; N's path state = cat(P, L_N);
  2. units     - N's children but the last unit are trained against the path: internal
                 children first (each its whole subtree and its own replay, one backward),
                 then its leaf children in waves; every leaf of the path collects its adjoint
                 (autograd sums through the cats);
  3. replay    - one backward of the chain N -> its last unit -> ... -> a last leaf wave:
                 every chain node's state recomputed with grad against its recomputed
                 ancestors (the chain's top against P), its own trained tokens' loss, the last
                 leaf wave's loss and sum_k <state_k, adjoint_k> (the leaves' grads).
Per node, the plan (``GroupPlan.node_retained``) retains or recomputes: a retained node's
step 1 runs with grad against the chain's retained ancestors, its graph (and own-token loss)
kept for the replay instead of the recompute; the graphs held are still those of one
root-to-leaf path. A node continuing its parent's chain (``chain_parent``) is retained only
with its parent (its graph must attend to the parent's graph, not to leaves whose adjoint the
replay has already read), so a chain's retained nodes are its top.
A non-root replay's top attends to P, the leaves of its ancestors: its backward passes its
adjoint up into them. The root's replay is the group's last backward and always holds a
leaf wave, so every parameter gets its gradient in it: the schedule runs everything else in
``waves_context`` (the step's ``no_sync``) and the root's replay is the one sync-enabled
backward of the step, whatever the tree's shape. With prompt segments
(``GroupPlan.prompt_segments`` > 1) the root's state is computed segment by segment into its
leaves, its chain is replayed against them inside ``waves_context`` as a non-root replay is,
and the root's segments are replayed last (``replay.replay_segments``): the first segment's
backward is then the step's sync-enabled one.

An internal node's own trained tokens are one loss call whose rows are every row below the
node: its log-probs, computed once (batch 1), expanded over those rows; the loss weighs them
with each row's own weights (advantages), as the naive rows do.

Scoring (forward_only, ``TreeReplay.score``) makes the same loss calls under no grad (each
node once against its path, its own tokens at batch 1, its leaf children in the same waves)
and lays their results out in the rows: the scored log-probs are the training forward's bit
for bit at the same weights.
"""

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from ..model.host_syncs import upload_indices
from ..model.kv import PrefixState, trained_depths
from .group import WaveBatch
from .naive import is_report_pair, readout_dict
from .replay import (
    GroupRun,
    as_prefix,
    merge,
    replay_segments,
    segment_bounds,
    segmented_leaves,
    segmented_state,
)


def row_indices(tree, has_loss, size: int, device) -> dict:
    """The group rows of every node's own-token loss (key n) and of its k-th leaf wave of
    ``size`` (key (n, k)) on ``device``, uploaded in one copy (no host sync per wave)."""
    row = {leaf: g for g, leaf in enumerate(tree.leaf_of_row)}
    lists = {n: tree.rows_below(n) for n in range(tree.num_nodes) if has_loss[n]}
    lists.update({(n, k): [row[c] for c in wave] for n in range(tree.num_nodes)
                  for k, wave in enumerate(tree.leaf_waves(n, size))})
    return dict(zip(lists, upload_indices(list(lists.values()), device)))


@dataclass
class _Wave:
    """A unit: a wave of leaf children of one node."""

    batch: WaveBatch


@dataclass
class _Node:
    """A unit: an internal child node."""

    node: int


@dataclass
class _Link:
    """A node of a replay chain: its adjoint leaves (None: no unit read them) and, when
    retained, its state's graph and own-token loss."""

    node: int
    leaves: Optional[PrefixState]
    state: Optional[PrefixState] = None
    loss: Optional[Tensor] = None


class FixedReadouts:
    """The ``model`` a node's own-token loss receives: the node's readouts, computed once
    against its path (``logprobs`` [R, W, L] and with the exit gate ``exit_logprobs``;
    ``loop_weights`` [R] with learned loop credit), whatever wave it is asked for."""

    def __init__(self, inner, readouts: dict):
        self.config, self.result = inner.config, readouts

    def __call__(self, wave: WaveBatch) -> Tensor:
        return self.result["logprobs"]

    def readouts(self, wave: WaveBatch) -> dict:
        return self.result


class TreeReplay:
    """Trains (or scores) one tree group with the calls of its ``replay.GroupRun``: its wave
    losses, the guard, the phase callbacks."""

    def __init__(self, run: GroupRun):
        self.run = run
        self.group, self.tree = run.group, run.group.as_tree()
        self.flat = self.tree.depth == 1  # one level: waves in the group layout [..., T]
        self.retained = run.plan.node_retained(self.tree.num_nodes)
        _check_chains(self.tree, self.retained)
        self.trained = trained_depths(run.inner.config.with_loops(run.num_loops))
        # a flat tree's root is the prompt (no loss) and its leaves are never own-forwarded
        self.has_loss = [False] * self.tree.num_nodes if self.flat else nodes_with_loss(self.group)
        self.rows = None if self.flat else row_indices(self.tree, self.has_loss,
                                                       run.plan.wave_size, self.group.tokens.device)
        self.calls = 0  # loss calls so far: each one's number in the group's results
        self.num_waves = 0
        segments = run.plan.prompt_segments
        # the root is the prompt: no token of it is trained (``tree.check_rows``)
        self.bounds = segment_bounds(self.tree.ends[0], segments) if segments > 1 else None

    def train(self, waves_context) -> int:
        """The whole group: the root's descent and every non-root replay inside
        ``waves_context``, then the root's replay. -> the number of leaf waves. With prompt
        segments the root's state is leaves from the start (``replay.segmented_leaves``): its
        chain below is replayed against them as a non-root replay is, then the root's
        segments, the first one last (``replay.replay_segments``)."""
        with waves_context():
            chain = self._descend(0, None, None)
            if self.bounds:
                self._replay(chain[1:], chain[0].leaves)
        if self.bounds:
            replay_segments(self.run, chain[0].leaves, self.bounds, waves_context)
            return self.num_waves
        self.run.guard.verify("joint replay", contents=True)
        self._replay(chain, None)
        return self.num_waves

    @torch.no_grad()
    def score(self) -> object:
        """forward_only: every loss call of ``train``, on the numbers ``train`` computes (each
        node once against its path's state, its own tokens' readouts at batch 1, its leaf
        children in the same waves against the same state), its ``loss_func`` called as
        MCore calls it (``GroupRun.score_call``) -> the calls' results in the
        group's layout (``lay_out``). So scored log-probs equal the training forward's at the
        same weights bit for bit, as a one-level group's do (docs/prefix_trees.md, Scoring)."""
        self.calls, calls = 0, []
        self._score_node(0, None, calls)
        if self.flat:  # whole waves: their results concatenated over the rows
            return merge(dict(enumerate(result for _, result in calls)), self.run.per_token)
        return lay_out(calls, self.group, self.run.per_token)

    def _score_node(self, n: int, prefix: Optional[PrefixState], calls: list) -> None:
        """Node n's own-token call (when trained) and its units against its path, as in
        ``_descend`` (the path: its nodes' states as the fp32 leaves the units train against)."""
        if n == 0 and self.bounds:  # the numbers training reads
            own = segmented_state(self.run, self.bounds)
        else:
            tokens, node_prefix, out = self._node_forward(n, prefix, self.has_loss[n])
            if self.has_loss[n]:
                wave, readouts = self._own_readouts(n, node_prefix, tokens, out)
                calls.append((wave, self._call(wave, None, readouts, score=True)))
            own = out.prefix_state.detached_leaves(torch.float32, self.trained)
        path = _cat(prefix, own)
        for unit in self._units(n):
            if isinstance(unit, _Wave):
                state = as_prefix(path, self.run.state_dtype)
                calls.append((unit.batch, self._call(unit.batch, state, None, score=True)))
            else:
                self._score_node(unit.node, path, calls)

    # ---- the plan of a node ----------------------------------------------------------------

    def _units(self, n: int) -> list:
        """Node n's internal children, then its leaf children in waves of the plan's size (a
        flat tree's: the group's waves)."""
        if self.flat:
            return [_Wave(wave) for wave in self.group.waves(self.run.plan.wave_size)]
        units = [_Node(c) for c in self.tree.inner_children(n)]
        for k, wave in enumerate(self.tree.leaf_waves(n, self.run.plan.wave_size)):
            index = self.rows[(n, k)]
            end = max(self.tree.ends[c] for c in wave)
            span = slice(self.tree.ends[n] - 1, end - 1)  # the labels of the wave's tokens
            units.append(_Wave(WaveBatch(self.group, index, span)))
        return units

    # ---- phases ----------------------------------------------------------------------------

    def _descend(self, n: int, prefix: Optional[PrefixState],
                 chain: Optional[PrefixState]) -> list:
        """Phases 1-2 for node n and, through its last unit, its chain down to a last leaf
        wave -> the chain: [_Link, ..., the last _Wave]. ``prefix``: the ancestors' leaves;
        ``chain`` (retain): the state n's retained graph is computed against (the chain's
        retained ancestors after the chain top's ``prefix``)."""
        retain, units = self.retained[n], self._units(n)
        if n == 0 and self.bounds:  # never retained
            own = leaves = segmented_leaves(self.run, self.bounds)
        elif n == 0 and not retain and len(units) == 1 and isinstance(units[0], _Wave):
            return [_Link(n, None), units[0]]  # one wave: only the replay reads the prompt
        else:
            self.run.guard.verify("prompt producer" if n == 0 else "tree node state")
            with contextlib.nullcontext() if retain else torch.no_grad():
                own, loss = self._own(n, chain if retain else prefix,
                                      loss=retain and self.has_loss[n])
            self.run.phase("prompt_producer")
            leaves = own.detached_leaves(torch.float32, self.trained)
        path = _cat(prefix, leaves)
        for unit in units[:-1]:
            self._train_unit(unit, path)
        last = units[-1]
        link = _Link(n, leaves, own, loss) if retain else _Link(n, leaves)
        if isinstance(last, _Wave):
            return [link, last]
        return [link, *self._descend(last.node, path, _cat(chain, own) if retain else None)]

    def _train_unit(self, unit, path: PrefixState) -> None:
        if isinstance(unit, _Wave):
            self._wave_loss(path, unit.batch).backward()
            self.run.phase("wave")
        else:
            self._replay(self._descend(unit.node, path, path), path)

    def _replay(self, chain: list, prefix: Optional[PrefixState]) -> None:
        """Phase 3: one backward of the chain's recomputed states, own-token losses, its last
        leaf wave and the adjoints the chain's leaves collected."""
        roots, grads, state = [], [], prefix
        for link in chain[:-1]:
            own, loss = link.state, link.loss
            if own is None:  # recompute
                own, loss = self._own(link.node, state, loss=self.has_loss[link.node])
            if loss is not None:
                roots.append(loss)
                grads.append(None)
            for t, leaf in zip(own.tensors(), link.leaves.tensors() if link.leaves else ()):
                if t.requires_grad and leaf.requires_grad and leaf.grad is not None:
                    roots.append(t)
                    grads.append(leaf.grad.to(t.dtype))
            state = _cat(state, own)
        roots.append(self._wave_loss(state, chain[-1].batch))
        torch.autograd.backward(roots, [*grads, None])
        self.run.phase("joint_replay")

    # ---- one node's forward and the loss calls ---------------------------------------------

    def _own(self, n: int, prefix: Optional[PrefixState], loss: bool) -> tuple:
        """Node n's own state against ``prefix`` (its ancestors; None for the root) and, with
        ``loss``, the loss of its own trained tokens -> (PrefixState of its L positions, the
        scaled loss or None)."""
        tokens, prefix, out = self._node_forward(n, prefix, loss)
        if not loss:
            return out.prefix_state, None
        wave, readouts = self._own_readouts(n, prefix, tokens, out)
        return out.prefix_state, self._call(wave, None, readouts)

    def _node_forward(self, n: int, prefix: Optional[PrefixState], readout: bool) -> tuple:
        """Node n's forward against ``prefix``, with ``readout`` its own positions' log-probs
        -> (its tokens [1, L], the prefix as the forward took it, the model's output)."""
        g, tree, run = self.group, self.tree, self.run
        row = tree.rows_below(n)[0]
        start, end = tree.starts[n], tree.ends[n]
        tokens = g.tokens[row : row + 1, start:end]  # [1, L]
        labels = g.labels[row : row + 1, start:end] if readout else None  # [1, L]: L-1 unused
        runs = g.exit_runs(run.num_loops)  # recorded exit depths: the same in every row below
        prefix = as_prefix(prefix, run.state_dtype)
        out = run.inner(tokens, labels=labels, prefix_state=prefix, return_prefix_state=True,
                        readout=readout, num_loops=run.num_loops, state_kind=run.state_kind,
                        exit_depths=None if runs is None else runs[row : row + 1, start:end])
        if run.state_dtype is None:
            run.state_dtype = out.prefix_state.boundary.dtype
        return tokens, prefix, out

    def _own_readouts(self, n: int, prefix: PrefixState, tokens: Tensor, out) -> tuple:
        """The loss call of node n's tokens' labels (positions start-1 .. end-2): the first
        from its parent's boundary, the rest from its own positions 0 .. L-2, over every row
        below -> (its WaveBatch, the ``FixedReadouts`` the loss receives)."""
        run = self.run
        first = run.inner.boundary_readouts(prefix, tokens[:, 0], num_loops=run.num_loops)
        rows = self.rows[n]
        exits = (None if out.exit_logprobs is None
                 else _own_span(first.exit_logprobs, out.exit_logprobs, len(rows)))
        readouts = readout_dict(run.inner, run.num_loops,
                                _own_span(first.logprobs, out.logprobs, len(rows)), exits)
        wave = WaveBatch(self.group, rows, self.tree.positions(n))
        return wave, FixedReadouts(run.inner, readouts)

    def _wave_loss(self, state: PrefixState, wave: WaveBatch) -> Tensor:
        self.num_waves += 1
        return self._call(wave, state, None)

    def _call(self, wave: WaveBatch, state, model, score: bool = False):
        """The group's next loss call (its number the count so far): the scaled loss, or with
        ``score`` the scored result (``GroupRun.wave_loss`` / ``score_call``)."""
        number, self.calls = self.calls, self.calls + 1
        call = self.run.score_call if score else self.run.wave_loss
        return call(wave, state, number, model)


def chain_parent(tree, n: int) -> Optional[int]:
    """The node whose replay chain node n continues: its parent when n is the parent's last
    unit (the parent has no leaf children and n is its last internal child), else None (n
    tops a chain of its own, or is a leaf)."""
    p = tree.parents[n]
    if p < 0 or tree.is_leaf(n) or tree.leaf_children(p):
        return None
    return p if tree.children(p)[-1] == n else None


def _check_chains(tree, retained: tuple) -> None:
    for n in range(tree.num_nodes):
        p = chain_parent(tree, n)
        if retained[n] and p is not None and not retained[p]:
            raise ValueError(f"GroupPlan.retain_nodes: node {n} continues the replay chain of "
                             f"node {p}, so it can be retained only if node {p} is")


def _own_span(first: Tensor, rest: Tensor, rows: int) -> Tensor:
    """[R, 1, 1] (from the parent's boundary) and [R, 1, L] (the node's positions) -> the
    node's labels [R, rows, L], one row expanded over every row below the node."""
    return torch.cat([first, rest[:, :, :-1]], dim=2).expand(-1, rows, -1)


def _cat(prefix: Optional[PrefixState], own: PrefixState) -> PrefixState:
    """The path state: the ancestors' K/V (or inputs) then the node's, along positions; its
    boundary."""
    if prefix is None:
        return own
    path = [torch.cat([p, o]) for p, o in zip(prefix.tensors()[:-1], own.tensors()[:-1])]
    return own.like([*path, own.boundary])  # [P + L, 1, ...] each


def nodes_with_loss(group) -> list:
    """Per node: whether any row below it trains one of its tokens (one read on the host)."""
    tree, mask = group.tree, group.loss_mask != 0
    flags = torch.stack([mask[list(tree.rows_below(n))][:, tree.positions(n)].any()
                         for n in range(tree.num_nodes)])
    return flags.tolist()


def lay_out(calls: list, group, per_token: bool = False) -> object:
    """A tree group's forward_only result from its loss calls' (``WaveBatch``, result): a
    tensor [..., W, L] of a call's W rows and L positions (``wave.span``) is written into
    [..., G, T] of the group's rows and positions (a node's values in every row below it;
    0 where no call wrote: the prompt, padding, T-1), 0-dim tensors (and with ``per_token``
    [sum, count] pairs) are summed, dicts are merged key by key."""
    waves, results = zip(*calls)
    return _lay_out_values(list(waves), list(results), group, "result", per_token)


def _lay_out_values(waves: list, items: list, group, name: str, per_token: bool = False):
    first = items[0]
    if isinstance(first, dict):
        return {k: _lay_out_values(waves, [it[k] for it in items], group, f"{name}[{k!r}]",
                                   per_token)
                for k in first}
    if not isinstance(first, Tensor):
        return items
    if first.dim() == 0 or is_report_pair(first, per_token):
        return torch.stack(items).sum(0)
    G, T = group.tokens.shape
    out = first.new_zeros(*first.shape[:-2], G, T)  # [..., G, T]
    for wave, value in zip(waves, items):
        span = range(T)[wave.span]
        if value.dim() < 2 or tuple(value.shape[-2:]) != (len(wave.index), len(span)):
            raise ValueError(f"a tree group's forward_only {name} must hold tensors "
                             f"[..., W, L] of a call's rows and positions ({len(wave.index)}, "
                             f"{len(span)}) or 0-dim ones, got shape {tuple(value.shape)}")
        out[..., wave.index, wave.span] = value.to(out.dtype)
    return out
