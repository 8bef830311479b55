"""Tree decoding: a cache continuing a chain of prefix caches, one per tree level, each segment
stored once.

- The cascade over 2 and 3 prefix segments (``chain_prefix_attention``, uneven rows per
  segment, padding) equals softmax attention over the concatenated keys, written here.
- Teacher-forced decoding of a fixed tree (two prompts, branching 2 then 3, or uneven
  branching with leaves at depths 1 to 3; uneven node lengths; RoPE and learned positions,
  plain and static caches) gives per-token per-loop log-probs equal to the plain-PyTorch
  reference forward of every root-to-leaf row (fp64); malformed trees are named.
- Single-token decode steps down a 3-level chain give the reference's logits.
"""

import math

import pytest
import torch
from helpers.decode import LOOPS, VOCAB, build
from helpers.reference_looped import reference_forward

from scalerlt_mcore.model.kernels import chain_prefix_attention
from scalerlt_mcore.rl.tree_rollout import tree_logprobs
from scalerlt_mcore.shared_prefix import TreeSegment


def explicit_chain_attention(q, k, v, allowed, prefixes, scale):
    """Masked softmax over [segment 0 keys of the row's path; ...; own keys] in plain PyTorch,
    row by row. Returns [B, heads, s, d]."""
    s, B, heads, d = q.shape
    rep = heads // k.shape[2]
    out = torch.empty(B, heads, s, d, dtype=q.dtype)
    for b in range(B):
        keys, vals, seen = [], [], []
        for pk, pv, mask in prefixes:
            row = b // (B // pk.shape[1])
            keys.append(pk[:, row])
            vals.append(pv[:, row])
            seen.append(mask[row][None].expand(s, -1))
        keys, vals = torch.cat(keys + [k[:, b]]), torch.cat(vals + [v[:, b]])  # [K, ng, d]
        seen = torch.cat(seen + [allowed[b]], dim=1)  # [s, K]
        keys, vals = (t.repeat_interleave(rep, dim=1) for t in (keys, vals))  # [K, heads, d]
        scores = torch.einsum("qhd,khd->hqk", q[:, b], keys) * scale
        probs = scores.masked_fill(~seen, -math.inf).softmax(-1)
        out[b] = torch.einsum("hqk,khd->hqd", probs, vals)
    return out


@pytest.mark.parametrize("recording", [True, False], ids=["graph", "cpu_decode"])
@pytest.mark.parametrize("levels", [1, 2, 3])
def test_chain_attention_equals_concatenated_keys(levels, recording):
    """Both paths: with a graph recorded (the matmul parts) and without (decoding on CPU: the
    CPU flash op's parts, merged by lerp)."""
    gen = torch.Generator().manual_seed(levels)
    heads, groups, d, s, T = 4, 2, 8, 3, 6
    batches = [2, 4, 8][:levels]  # rows per segment level; the queries' rows: twice the last
    B = 2 * batches[-1]

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    prefixes = []
    for j, n in enumerate(batches):
        P = 5 + j
        lengths = torch.randint(1, P + 1, (n,), generator=gen)
        seen = torch.arange(P)[None] < lengths[:, None]  # [N_j, P_j]
        prefixes.append((rnd(P, n, groups, d), rnd(P, n, groups, d), seen))
    q, k, v = rnd(s, B, heads, d), rnd(T, B, groups, d), rnd(T, B, groups, d)
    own = torch.randint(0, T - s + 1, (B,), generator=gen)  # cached tokens before the queries
    slots = own[:, None] + torch.arange(s)[None]  # [B, s]
    allowed = torch.arange(T)[None, None] <= slots[:, :, None]  # [B, s, T]
    with torch.set_grad_enabled(recording):
        got = chain_prefix_attention(q, k, v, allowed, prefixes, 0.3)
    want = explicit_chain_attention(q, k, v, allowed, prefixes, 0.3)
    assert (got - want).abs().max().item() <= 1e-13


# ---- a fixed tree: 2 prompts, 2 children each, 3 grandchildren each -------------------------

PROMPT_LENGTHS = (3, 5)
BRANCHES = (2, 3)


def fixed_trees(seed: int = 0) -> list:
    """Two trees with uneven node lengths (1 ... 4 tokens), depth-first segment lists."""
    gen = torch.Generator().manual_seed(seed)

    def tokens(n):
        return torch.randint(0, VOCAB, (n,), generator=gen).tolist()

    trees = []
    for P in PROMPT_LENGTHS:
        tree = [TreeSegment(tokens(P), None)]
        for _ in range(BRANCHES[0]):
            tree.append(TreeSegment(tokens(int(torch.randint(1, 5, (), generator=gen))), 0))
            mid = len(tree) - 1
            for _ in range(BRANCHES[1]):
                tree.append(TreeSegment(tokens(int(torch.randint(1, 5, (), generator=gen))),
                                        mid))
        trees.append(tree)
    return trees


def path(tree, node) -> list:
    out = [node]
    while tree[out[-1]].parent is not None:
        out.append(tree[out[-1]].parent)
    return out[::-1]


UNEVEN = [  # (parent, length) per node, depth-first: leaves at depths 1, 2 and 3
    [(None, 4), (0, 2), (0, 3), (2, 1), (2, 4), (0, 1), (5, 2), (6, 3), (6, 1)],
    [(None, 2), (0, 3)],
]


def uneven_trees(seed: int = 0) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [[TreeSegment(torch.randint(0, VOCAB, (L,), generator=gen).tolist(), parent)
             for parent, L in tree] for tree in UNEVEN]


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("pe", ["learned_absolute", "rope"])
@pytest.mark.parametrize("shape", ["even", "uneven"])
def test_tree_decoding_matches_every_row(mcore_single, pe, static, shape):
    model, ref, weights = build(pe, torch.float64)
    trees = fixed_trees() if shape == "even" else uneven_trees()
    got = tree_logprobs(model, trees, static_cache=static)
    err, checked = 0.0, set()
    for n, (tree, scores) in enumerate(zip(trees, got)):
        leaves = [i for i in range(len(tree)) if all(s.parent != i for s in tree)]
        for leaf in leaves:
            nodes = path(tree, leaf)
            row = torch.tensor([t for i in nodes for t in tree[i].tokens])
            logits, _ = reference_forward(weights, ref, row[None])
            want = torch.stack([lg[0].log_softmax(-1)[:-1].gather(-1, row[1:, None])[:, 0]
                                for lg in logits])  # [R, S - 1]: log p(token t + 1)
            start = len(tree[0].tokens)
            for i in nodes[1:]:
                L = len(tree[i].tokens)
                assert scores[i].shape == (LOOPS, L)
                err = max(err, (scores[i] - want[:, start - 1 : start - 1 + L]).abs().max().item())
                start += L
                checked.add((n, i))
    assert len(checked) == sum(len(t) - 1 for t in trees)
    assert err <= 1e-12


def test_tree_logprobs_names_bad_trees(mcore_single):
    model, _, _ = build("rope", torch.float64)
    cases = [
        ([TreeSegment([1, 2], None), TreeSegment([], 0)], "tree 0: node 1 is empty"),
        ([TreeSegment([1], None), TreeSegment([2], None)], "tree 0: node 1 has no parent"),
        ([TreeSegment([1], 0)], "tree 0: node 0 has a parent"),
        ([TreeSegment([1], None), TreeSegment([2], 5)], "node 1 has parent 5, not another"),
        ([TreeSegment([1], None), TreeSegment([2], 2), TreeSegment([3], 1)],
         "node 1 is not below the root"),
    ]
    for tree, message in cases:
        with pytest.raises(ValueError, match=message):
            tree_logprobs(model, [tree])
    with pytest.raises(ValueError, match="non-empty list of non-empty trees"):
        tree_logprobs(model, [])


def test_decode_steps_down_a_three_level_chain(mcore_single):
    """Prompts (2) -> level 1 (4 rows) -> level 2 (8 rows, decoding one token per step): each
    step's logits equal the reference's at that position of the row's full sequence."""
    model, ref, weights = build("rope", torch.float64)
    gen = torch.Generator().manual_seed(5)
    prompts = torch.randint(0, VOCAB, (2, 4), generator=gen)
    p_len = torch.tensor([4, 2])
    mid = torch.randint(0, VOCAB, (4, 3), generator=gen)
    m_len = torch.tensor([3, 1, 2, 3])
    steps = torch.randint(0, VOCAB, (8, 3), generator=gen)
    with torch.no_grad():
        root = model.new_kv_cache(2, 4)
        model.prefill(root, prompts, p_len)
        level = model.new_kv_cache(4, 3, prefix=root)
        model.extend(level, mid, m_len)
        leaf = model.new_kv_cache(8, 3, prefix=level)
        assert leaf.chain() == [root, level]
        # each level holds only its own tokens' K/V: no shared segment is copied per row
        assert [(c.max_length, c.batch) for c in (root, level, leaf)] == [(4, 2), (3, 4), (3, 8)]
        assert leaf.offsets().tolist() == (p_len.repeat_interleave(2) + m_len).repeat_interleave(
            2).tolist()
        outs = [model.decode_step(leaf, steps[:, j]) for j in range(3)]  # 3 x [R, 8, V]
    err = 0.0
    for b in range(8):
        n, m = b // 4, b // 2
        row = torch.cat([prompts[n, : p_len[n]], mid[m, : m_len[m]], steps[b]])
        want, _ = reference_forward(weights, ref, row[None])
        first = int(p_len[n] + m_len[m])
        for j in range(3):
            for r in range(LOOPS):
                err = max(err, (outs[j][r, b] - want[r][0, first + j]).abs().max().item())
    assert err <= 1e-10


@pytest.mark.parametrize("static", [False, True])
def test_chained_decode_step_runs_on_meta(mcore_single, static):
    """A decode step and an extend down a 3-level chain read no value on the host (``meta``
    cannot be read)."""
    meta = torch.device("meta")
    model, _, _ = build("rope", torch.float32)
    model = model.to(meta).eval()
    model.rotary_pos_emb.inv_freq = model.rotary_pos_emb.inv_freq.to(meta)
    root = model.new_kv_cache(2, 4, static=static)
    root.lengths.copy_(torch.tensor([4, 2]))
    level = model.new_kv_cache(4, 5, prefix=root, static=static)
    logits, _, scored = model.extend(level, torch.zeros(4, 3, dtype=torch.long, device=meta),
                                     torch.tensor([3, 1, 2, 0]),
                                     labels=torch.zeros(4, 3, dtype=torch.long, device=meta))
    assert logits.shape == (LOOPS, 4, VOCAB) and scored.shape == (LOOPS, 4, 3)
    assert level.lengths.tolist() == [3, 1, 2, 0]
    leaf = model.new_kv_cache(8, 3, prefix=level, static=static)
    logits = model.decode_step(leaf, torch.zeros(8, dtype=torch.long, device=meta))
    assert logits.device == meta and logits.shape == (LOOPS, 8, VOCAB)
    assert leaf.lengths.tolist() == [1] * 8
