"""Prefix-tree workload (``tree`` in cpu.json): a depth-3 tree (a prompt, turn-1 branches of
an answer and the environment's reply, turn-2 leaves under each) trained three ways on one
model: ``naive`` (every root-to-leaf row an independent sequence), ``tree_mask`` (every unique
token once in one packed sequence under a tree attention mask), ``joint`` and ``joint_retain``
(joint replay over ``SharedPrefixGroup.from_tree``; every internal node's state recomputed in
its replay, or its graph kept from the first forward). Per way: causal FLOPs (analytic), peak
saved bytes, wall seconds (best of a few) and, beside them, ``flops_limit_ratio`` = naive
tokens / unique tokens. Method: docs/benchmarks.md, "Prefix-tree workload".

``python -m benchmarks.tree [--out DIR]`` runs it alone and merges it into DIR/cpu.{json,md}.
"""

import argparse
import os
import sys
import time
from dataclasses import asdict, dataclass

import torch

# Megatron-Core and the project are imported inside the functions below (as in workloads.py).


@dataclass(frozen=True)
class TreeWorkload:
    """A prefix tree of uniform branching and the benchmark model."""

    name: str = "tree"
    prompt_length: int = 512  # the root's tokens (the prompt: never trained)
    branches: tuple = (4, 4)  # children of every node at depth 0, 1, ...
    node_lengths: tuple = (96, 64)  # tokens of a node at depth 1, 2, ...
    trained_lengths: tuple = (64, 64)  # the first n of them trained (the model's answer);
    # the rest (the environment's reply) carry no loss
    wave_size: int = 4  # leaves per wave (joint replay)
    num_loops: int = 2  # R
    core_layers: int = 1  # L_core
    hidden: int = 256  # as the A/B workloads: the FLOP ratios depend on it (docs/benchmarks.md)
    heads: int = 4
    vocab: int = 64  # small on purpose, as in workloads.py
    repetitions: int = 3  # timed steps per way; wall = the fastest

    def describe(self) -> dict:
        return asdict(self)


TREE = TreeWorkload()
"""The workload of ``make bench``: P = 512, 4 x (64 + 32), 4 x 64 under each: 16 leaves."""


# ---- the tree -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Node:
    """One node of the tree: its parent (-1: the root), first position, length, and how many
    of its first tokens are trained."""

    parent: int
    start: int
    length: int
    trained: int

    @property
    def end(self) -> int:
        return self.start + self.length


def tree_nodes(wl: TreeWorkload) -> list:
    """The nodes in depth-first order (a parent before its children, a child's subtree before
    its next sibling): the segment order, so leaves come in row order."""
    if len(wl.branches) != len(wl.node_lengths) or len(wl.branches) != len(wl.trained_lengths):
        raise ValueError(f"branches {wl.branches}, node_lengths {wl.node_lengths} and "
                         f"trained_lengths {wl.trained_lengths} must have one entry per depth")
    nodes = [Node(-1, 0, wl.prompt_length, 0)]

    def grow(index: int, depth: int) -> None:
        if depth == len(wl.branches):
            return
        for _ in range(wl.branches[depth]):
            nodes.append(Node(index, nodes[index].end, wl.node_lengths[depth],
                              wl.trained_lengths[depth]))
            grow(len(nodes) - 1, depth + 1)

    grow(0, 0)
    return nodes


def leaves(nodes: list) -> list:
    parents = {n.parent for n in nodes}
    return [i for i in range(len(nodes)) if i not in parents]


def path(nodes: list, index: int) -> list:
    """Root-to-``index`` node indices."""
    out = []
    while index >= 0:
        out.append(index)
        index = nodes[index].parent
    return out[::-1]


def token_counts(wl: TreeWorkload) -> dict:
    """naive = the tokens of every root-to-leaf row; unique = every node's tokens once."""
    nodes = tree_nodes(wl)
    naive = sum(nodes[leaf].end for leaf in leaves(nodes))
    unique = sum(n.length for n in nodes)
    return {"naive": naive, "unique": unique, "rows": len(leaves(nodes)),
            "row_length": nodes[leaves(nodes)[0]].end}


def make_segments(wl: TreeWorkload, seed: int = 0) -> list:
    """Random tokens per node: [{tokens [L], parent (None: root), loss_mask [L]}], in node
    order (``TreeSegment``'s fields)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in tree_nodes(wl):
        mask = torch.zeros(n.length)
        mask[: n.trained] = 1
        out.append({"tokens": torch.randint(1, wl.vocab, (n.length,), generator=gen),
                    "parent": None if n.parent < 0 else n.parent, "loss_mask": mask})
    return out


def naive_rows(wl: TreeWorkload, segments: list, seed: int = 0, pad_id: int = 0):
    """The naive reference: an ``RLGroup`` of every root-to-leaf sequence (rows in leaf order),
    labels = tokens shifted by one, loss_mask[g, t] = 1 where the token at t + 1 is trained,
    one advantage per leaf; old log-probs are a placeholder (``attach_old_logprobs``)."""
    from scalerlt_mcore.rl.batch import RLGroup

    nodes = tree_nodes(wl)
    rows = [path(nodes, leaf) for leaf in leaves(nodes)]
    tokens = torch.stack([torch.cat([segments[n]["tokens"] for n in p]) for p in rows])  # [G, T]
    trained = torch.stack([torch.cat([segments[n]["loss_mask"] for n in p]) for p in rows])
    labels = torch.full_like(tokens, pad_id)
    labels[:, :-1] = tokens[:, 1:]
    loss_mask = torch.zeros_like(trained)
    loss_mask[:, :-1] = trained[:, 1:]
    G, T = tokens.shape
    advantages = torch.randn(G, generator=torch.Generator().manual_seed(seed + 2))
    return RLGroup(tokens=tokens, labels=labels, loss_mask=loss_mask,
                   prompt_length=wl.prompt_length, advantages=advantages,
                   old_logprobs=torch.zeros(wl.num_loops, G, T))


# ---- the packed tree mask ---------------------------------------------------------------------

def packed_tree(wl: TreeWorkload, segments: list) -> dict:
    """Every unique token once, in node order: tokens [1, U], position ids [1, U] (the token's
    position in the rows through its node), the MCore mask [1, 1, U, U] (True = masked; a token
    sees its ancestors' tokens and the tokens of its own node up to itself) and ``index``
    [G, T]: the packed index of row g's token at position t."""
    nodes = tree_nodes(wl)
    lengths = torch.tensor([n.length for n in nodes])
    offsets = torch.cumsum(lengths, 0) - lengths  # packed index of each node's token 0
    owner = torch.repeat_interleave(torch.arange(len(nodes)), lengths)  # [U]
    positions = torch.cat([torch.arange(n.start, n.end) for n in nodes])
    ancestor = torch.zeros(len(nodes), len(nodes), dtype=torch.bool)  # [a, d]: a on d's path
    for d in range(len(nodes)):
        ancestor[path(nodes, d), d] = True
    U = owner.shape[0]
    # depth-first order puts every ancestor's tokens before a node's: "up to itself" is tril
    visible = ancestor[owner][:, owner].T & torch.ones(U, U, dtype=torch.bool).tril()
    index = torch.stack([torch.cat([offsets[n] + torch.arange(nodes[n].length)
                                    for n in path(nodes, leaf)]) for leaf in leaves(nodes)])
    tokens = torch.cat([s["tokens"] for s in segments])
    return {"tokens": tokens[None], "positions": positions[None], "mask": ~visible[None, None],
            "index": index}


def tree_mask_logprobs(model, packed: dict, labels: torch.Tensor) -> torch.Tensor:
    """Per-loop log-probs [R, G, T] of the rows' labels from one forward of the packed tree:
    each unique position's log-softmax once, read at every row through it."""
    out = model(packed["tokens"], position_ids=packed["positions"],
                attention_mask=packed["mask"])
    logits = torch.stack(out.logits)[:, 0]  # [R, U, V]
    logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)
    return logp[:, packed["index"], labels]  # [R, G, T]


def tree_mask_step(model, group, objective, packed: dict) -> torch.Tensor:
    """One training step (forward + backward) of the group's loss through the packed tree."""
    logprobs = tree_mask_logprobs(model, packed, group.labels)
    loss, _ = objective.loss(logprobs, group.old_logprobs, group.advantages,
                             objective.token_weights(group.loss_mask))
    loss.backward()
    return loss.detach()


# ---- joint replay over the tree ---------------------------------------------------------------

def tree_group(segments: list, rows):
    """The joint-replay group: ``RLGroup.from_tree`` over the segments with the rows'
    advantages and old log-probs."""
    from scalerlt_mcore import shared_prefix
    from scalerlt_mcore.rl.batch import RLGroup

    segs = [shared_prefix.TreeSegment(tokens=s["tokens"], parent=s["parent"],
                                      loss_mask=s["loss_mask"]) for s in segments]
    return RLGroup.from_tree(segs, 0, advantages=rows.advantages,
                             old_logprobs=rows.old_logprobs)


def joint_tree_step(model, group, objective, wave_size: int,
                    prompt: str = "recompute") -> torch.Tensor:
    """One step of joint replay over the tree; ``prompt``: ``recompute`` (every internal node's
    state without grad, then again in its replay) or ``retain`` (its graph kept)."""
    from scalerlt_mcore.rl.objective import rl_forward_step
    from scalerlt_mcore.shared_prefix import get_shared_prefix_forward_backward_func

    schedule = get_shared_prefix_forward_backward_func(wave_size, prompt=prompt)
    out = schedule(forward_step_func=rl_forward_step(objective), data_iterator=iter([group]),
                   model=model, num_microbatches=1, seq_length=0, micro_batch_size=1)
    return out[0]["loss"].detach()


# ---- analytic FLOPs ---------------------------------------------------------------------------

def layer_shape(hidden: int, ffn: int, heads: int, head_dim: int, query_groups: int,
                gated: bool, layers: int) -> dict:
    """Matmul FLOPs per token of one forward of one layer (qkv, output projection, fc1, fc2;
    2 per multiply-add), attention FLOPs per (query, key) pair of one layer (QK^T and PV)."""
    fc1 = hidden * ffn * (2 if gated else 1)
    macs = (hidden * (heads + 2 * query_groups) * head_dim + heads * head_dim * hidden + fc1
            + ffn * hidden)
    return {"matmul_per_token": 2 * macs, "attention_per_pair": 2 * 2 * heads * head_dim,
            "layers": layers, "hidden": hidden}


def config_shape(config) -> dict:
    """``layer_shape`` of a looped GPT config."""
    heads = config.num_attention_heads
    return layer_shape(config.hidden_size, config.ffn_hidden_size, heads, config.kv_channels,
                       config.num_query_groups or heads, config.gated_linear_unit,
                       config.num_layers)


def pass_flops(shape: dict, vocab: int, loops: int, tokens: int, pairs: int, readouts: int,
               multiplier: int) -> int:
    """FLOPs of ``multiplier`` forward-equivalents (3: forward + backward, the backward twice
    the forward; 1: a forward without grad) of ``tokens`` through every layer of every loop,
    attending over ``pairs`` (query, key) pairs, and ``readouts`` positions read out per loop."""
    layer = shape["matmul_per_token"] * tokens + shape["attention_per_pair"] * pairs
    return multiplier * loops * (shape["layers"] * layer + 2 * shape["hidden"] * vocab
                                 * readouts)


def node_pairs(nodes: list, n: int, tokens: int = None) -> int:
    """(query, key) pairs of node n's first ``tokens`` tokens (default all): every ancestor
    token, and causal in the node."""
    L, above = nodes[n].length if tokens is None else tokens, nodes[n].start
    return L * above + L * (L + 1) // 2


def analytic_passes(wl: TreeWorkload) -> dict:
    """way -> [(tokens, pairs, readout positions, multiplier)]: what each way computes.

    naive: every row through the model (causal), read out at every position; tree_mask: every
    unique token once over its ancestor keys, read out at every unique position; joint: every
    internal node's tokens (the root's included) once without grad (its K/V) and once in its
    replay (forward + backward), read out at its own positions and its parent's boundary when
    it has trained tokens; every leaf once in its wave without its last token (whose output
    predicts nothing), read out there, and once per wave at the parent's boundary (the first
    label of every leaf of the wave); joint_retain: joint without the no-grad passes (every
    internal node's graph kept). Checked against PyTorch's count for trees whose non-root
    internal nodes all carry trained tokens (as the workload's); with one that carries none
    the count is a little lower."""
    nodes = tree_nodes(wl)
    leaf = leaves(nodes)
    rows = [nodes[n].end for n in leaf]
    unique = sum(n.length for n in nodes)
    tree_pairs = sum(node_pairs(nodes, i) for i in range(len(nodes)))
    internal = [i for i in range(len(nodes)) if i not in leaf]
    k_v = [(nodes[i].length, node_pairs(nodes, i), 0, 1) for i in internal]
    replays = [(nodes[i].length, node_pairs(nodes, i),
                nodes[i].length + 1 if i and nodes[i].trained else 0, 3) for i in internal]
    waves = [(nodes[i].length - 1, node_pairs(nodes, i, nodes[i].length - 1),
              nodes[i].length - 1, 3) for i in leaf]
    for n in internal:  # one boundary readout per wave
        below = sum(1 for i in leaf if nodes[i].parent == n)
        waves.append((0, 0, -(-below // wl.wave_size), 3))
    return {"naive": [(sum(rows), sum(T * (T + 1) // 2 for T in rows), sum(rows), 3)],
            "tree_mask": [(unique, tree_pairs, unique, 3)], "joint": k_v + replays + waves,
            "joint_retain": replays + waves}


def analytic_flops(wl: TreeWorkload, shape: dict) -> dict:
    """way -> causal FLOPs of one step (forward + backward), docs/benchmarks.md's formula;
    ``joint_retain``: joint replay with every internal node's graph kept (no recompute)."""
    return {way: sum(pass_flops(shape, wl.vocab, wl.num_loops, *p) for p in passes)
            for way, passes in analytic_passes(wl).items()}


SCALING_HIDDEN = (1024, 4096)
"""Hidden sizes (head dim 128, FFN 4H) at which the analytic naive / way ratios are also
given: attention's share of the FLOPs, and so the distance to the limit, shrinks with H."""


def analytic_scaling(wl: TreeWorkload) -> dict:
    """hidden -> way -> naive / way analytic causal FLOPs, at ``wl``'s layers and loops."""
    out = {}
    for H in SCALING_HIDDEN:
        flops = analytic_flops(wl, layer_shape(H, 4 * H, H // 128, 128, H // 128, False,
                                               wl.core_layers))
        out[str(H)] = {way: flops["naive"] / f for way, f in flops.items() if way != "naive"}
    return out


# ---- the run ----------------------------------------------------------------------------------

WAYS = ("naive", "tree_mask", "joint", "joint_retain")
JOINT_WAYS = ("joint", "joint_retain")


def build(wl: TreeWorkload, seed: int = 0):
    """(model, naive rows with old log-probs, packed tree, joint-replay group)."""
    from .workloads import Workload, attach_old_logprobs, build_model

    torch.manual_seed(seed)
    counts = token_counts(wl)
    model = build_model(Workload(wl.name, group_size=counts["rows"],
                                 prompt_length=counts["row_length"], response_length=0,
                                 wave_size=wl.wave_size, num_loops=wl.num_loops,
                                 core_layers=wl.core_layers, hidden=wl.hidden, heads=wl.heads,
                                 vocab=wl.vocab))
    segments = make_segments(wl, seed)
    rows = attach_old_logprobs(model, naive_rows(wl, segments, seed), seed)
    return model, rows, packed_tree(wl, segments), tree_group(segments, rows)


def step_functions(model, rows, packed, joint_group, wave_size: int) -> dict:
    """way -> zero-argument callable running one full step (grads zeroed first)."""
    from scalerlt_mcore.rl.objective import rl_forward_step
    from scalerlt_mcore.shared_prefix import naive_step

    from .workloads import objective

    obj = objective()
    raw = {"naive": lambda: sum(o["loss"] for o in naive_step(
               [model], [rows], rl_forward_step(obj), micro_batch_size=rows.group_size)),
           "tree_mask": lambda: tree_mask_step(model, rows, obj, packed),
           "joint": lambda: joint_tree_step(model, joint_group, obj, wave_size),
           "joint_retain": lambda: joint_tree_step(model, joint_group, obj, wave_size,
                                                   prompt="retain")}

    def zeroed(fn):
        def step():
            model.zero_grad(set_to_none=True)
            return fn()
        return step

    return {name: zeroed(fn) for name, fn in raw.items()}


def run_tree_bench(wl: TreeWorkload = TREE, seed: int = 0, log=print) -> dict:
    """Agreement with naive (raises AgreementError), FLOPs (analytic, and counted), saved
    bytes, wall time (fastest of ``wl.repetitions``): the ``tree`` entry of cpu.json."""
    from .measure import check_agreement, count_flops, peak_saved_bytes, time_round_robin

    t0 = time.perf_counter()
    model, rows, packed, joint_group = build(wl, seed)
    steps = step_functions(model, rows, packed, joint_group, wl.wave_size)
    agreement = check_agreement(steps, model, loss_scale=float(rows.advantages.abs().mean()))
    analytic = analytic_flops(wl, config_shape(model.config))
    counted = {n: count_flops(s) for n, s in steps.items()}
    saved = {n: peak_saved_bytes(s, model) for n, s in steps.items()}
    times = time_round_robin(steps, wl.repetitions, warmup=0)  # the passes above warmed up
    result = tree_result(wl, analytic, counted, saved, times, agreement)
    result["bench_seconds"] = time.perf_counter() - t0
    best = result["joint_variant"]
    log(f"[tree] {result['bench_seconds']:.0f}s  limit {result['flops_limit_ratio']:.2f}  "
        f"naive/{best} flops {result['naive_over'][best]['flops_causal']:.2f}  "
        f"saved {best}/tree_mask {result['joint_over_tree_mask_saved_bytes']:.2f}", flush=True)
    return result


def tree_result(wl: TreeWorkload, analytic: dict, counted: dict, saved: dict, times: dict,
                agreement: dict) -> dict:
    """The JSON object: per way the figures, the ratios against naive, ``flops_limit_ratio``
    and the target rows."""
    counts = token_counts(wl)
    limit = counts["naive"] / counts["unique"]
    ways = {}
    for way in WAYS:
        ways[way] = {"flops_causal": analytic[way], "counted_flops": counted[way]["dense"],
                     "counted_flops_causal": counted[way]["causal"],
                     "saved_bytes": saved[way], "wall_s": min(times[way]),
                     "wall_all_s": times[way]}
    naive = ways["naive"]
    naive_over = {way: {"flops_causal": naive["flops_causal"] / w["flops_causal"],
                        "saved_bytes": naive["saved_bytes"] / w["saved_bytes"],
                        "wall": naive["wall_s"] / w["wall_s"]}
                  for way, w in ways.items() if way != "naive"}
    best = best_joint(ways)
    joint_saved = ways[best]["saved_bytes"] / ways["tree_mask"]["saved_bytes"]
    return {"workload": wl.describe(), "tokens": counts, "flops_limit_ratio": limit,
            "ways": ways, "naive_over": naive_over, "joint_variant": best,
            "joint_over_tree_mask_saved_bytes": joint_saved,
            "analytic_naive_over_by_hidden": analytic_scaling(wl),
            "targets": tree_targets(wl.name, limit, best, naive_over[best]["flops_causal"],
                                    joint_saved),
            "agreement_max_rel_err": agreement}


def best_joint(ways: dict):
    """The joint variant the targets judge: the fewest causal FLOPs, then the fewest saved
    bytes (figures the same in every run, as report.best_joint)."""
    return min(JOINT_WAYS, key=lambda w: (ways[w]["flops_causal"], ways[w]["saved_bytes"]))


def tree_targets(name: str, limit: float, variant: str, flops: float,
                 saved_over_tree_mask: float) -> list:
    """Rows in report.check_targets' format, for the joint ``variant``: naive / joint causal
    FLOPs (``flops``) >= 0.9 x the limit; joint's peak saved bytes below the tree mask's."""
    return [{"workload": name, "figure": f"naive_over.joint.flops_causal ({variant}) >=",
             "measured": flops, "target": 0.9 * limit, "ok": flops >= 0.9 * limit},
            {"workload": name, "figure": f"joint_over_tree_mask_saved_bytes ({variant}) <",
             "measured": saved_over_tree_mask, "target": 1.0, "ok": saved_over_tree_mask < 1.0}]


# ---- report -----------------------------------------------------------------------------------

MD_HEADING = "## Prefix-tree workload (tree)"


def markdown(result: dict) -> str:
    """The tree section of cpu.md."""
    from .report import _fmt, targets_table

    t, w = result["tokens"], result["workload"]
    lines = [f"Depth {len(w['branches']) + 1}: prompt {w['prompt_length']}, branches "
             f"{'x'.join(map(str, w['branches']))}, node lengths {w['node_lengths']} (trained "
             f"{w['trained_lengths']}); {t['rows']} rows of {t['row_length']}: naive tokens "
             f"{t['naive']}, unique {t['unique']}, flops_limit_ratio "
             f"{_fmt(result['flops_limit_ratio'])}. Hidden {w['hidden']}, {w['heads']} heads, "
             f"{w['core_layers']} core layers x {w['num_loops']} loops; wall: fastest of "
             f"{w['repetitions']}.", "",
             "| way | GFLOP causal (analytic) | GFLOP counted causal [all scores] | saved MiB "
             "| wall s | naive / way FLOPs | saved | wall |", "|---|---|---|---|---|---|---|---|"]
    for way, s in result["ways"].items():
        r = result["naive_over"].get(way, {"flops_causal": 1.0, "saved_bytes": 1.0, "wall": 1.0})
        lines.append(f"| {way} | {_fmt(s['flops_causal'] / 1e9)} "
                     f"| {_fmt(s['counted_flops_causal'] / 1e9)} "
                     f"[{_fmt(s['counted_flops'] / 1e9)}] | {_fmt(s['saved_bytes'] / 2**20, 1)} "
                     f"| {_fmt(s['wall_s'], 3)} | {_fmt(r['flops_causal'])} "
                     f"| {_fmt(r['saved_bytes'])} | {_fmt(r['wall'])} |")
    scaling = "; ".join(f"H={H}: " + ", ".join(f"{way} {_fmt(x)}" for way, x in r.items())
                        for H, r in result["analytic_naive_over_by_hidden"].items())
    lines += ["", f"Targets judge {result['joint_variant']}. Analytic naive / way causal FLOPs "
              f"at larger hidden sizes (head dim 128): {scaling}."]
    return "\n".join(lines + ["", targets_table(result["targets"])])


def merge_into(out: str, result: dict) -> None:
    """Put ``result`` under ``tree`` in ``out``/cpu.json and its section into ``out``/cpu.md,
    keeping the other results there."""
    from .report import merge_entry

    merge_entry(out, "tree", result, result["targets"], MD_HEADING, markdown(result))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from scalerlt_mcore.testing import model_parallel_context

    with model_parallel_context(seed=args.seed):
        result = run_tree_bench(seed=args.seed)
    merge_into(args.out, result)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
