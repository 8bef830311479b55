"""Tree rollouts (``generate_tree``): prompt-once decoding down a prefix tree.

- Greedy trees (multi-turn: answer, the environment's reply, answer again) hold the tokens of
  greedy per-row decoding (``generate``) continuing each path, with the same log-probs up to
  fp32 rounding; the segments' parents, starts and loss masks describe the rows.
- Sampled trees' recorded per-loop log-probs (node by node, and laid out as the group's old
  log-probs) equal the plain-PyTorch reference forward of every root-to-leaf row at the
  sampling temperature.
- The segments build the RL group (``RLGroup.from_tree``) with the rollout's old log-probs.
- A node ended by eos with no reply is a leaf (its children are dropped).
- No host sync per decoded token in steady state (``HostSyncCounter``).
- `reply_fn` is told the index of each node's prompt (prompts sharing a prefix, or equal).
- Bad input is named.
"""

import pytest
import torch
from helpers.decode import EOS, LOOPS, PAD, PROMPTS, VOCAB, build, check_segments, reply
from helpers.exit_gate import _gated
from helpers.reference_looped import reference_forward

from scalerlt_mcore.model.host_syncs import count_host_syncs
from scalerlt_mcore.rl.batch import RLGroup
from scalerlt_mcore.rl.rollout import Sampling, exit_loop_at, generate
from scalerlt_mcore.rl.tokenizer import CharTokenizer
from scalerlt_mcore.rl.tree_rollout import generate_tree


@pytest.mark.parametrize("pe", ["learned_absolute", "rope"])
def test_greedy_tree_is_greedy_per_row_decoding(mcore_single, pe):
    model, _, _ = build(pe, torch.float64)
    model.eval()
    budgets = [4, 3]
    tree = generate_tree(model, PROMPTS, [2, 3], budgets, eos_id=EOS, pad_id=PAD, reply_fn=reply,
                         sampling=Sampling(temperature=0.0, banned=(PAD,)))
    first = generate(model, PROMPTS, 1, budgets[0], eos_id=EOS, pad_id=PAD,
                     sampling=Sampling(temperature=0.0, banned=(PAD,)))
    ulp = torch.finfo(torch.float32).eps * 8
    for n, prompt in enumerate(PROMPTS):
        check_segments(tree, n, reply)
        segs = tree.segments[n]
        assert len(segs) == 1 + 2 + 6 and len(tree.leaves[n]) == 6
        answer = first.responses[n, 0].tolist()
        path = prompt + answer + reply(n, prompt, answer)
        second = generate(model, [path], 1, budgets[1], eos_id=EOS, pad_id=PAD,
                          sampling=Sampling(temperature=0.0, banned=(PAD,)))
        for i in (1, 5):  # the two depth-1 nodes (depth-first: 1, its 3 leaves, 5, ...)
            assert segs[i].parent == 0 and segs[i].tokens == path[len(prompt):]
            lp = tree.loop_logprobs[n][i]  # [R, L]
            assert torch.allclose(lp[:, :4], first.loop_logprobs[:, n, 0], atol=ulp, rtol=0)
            assert (lp[:, 4:] == 0).all()
        for leaf in tree.leaves[n]:
            assert segs[leaf].tokens == second.responses[0, 0].tolist()
            assert tree.leaf_tokens(n)[tree.leaves[n].index(leaf)] == path + segs[leaf].tokens
            assert torch.allclose(tree.loop_logprobs[n][leaf], second.loop_logprobs[:, 0, 0],
                                  atol=ulp, rtol=0)
            assert torch.equal(tree.logprobs[n][leaf], tree.loop_logprobs[n][leaf][-1])
        chars = CharTokenizer("".join(chr(65 + i) for i in range(VOCAB - 3)))  # VOCAB ids
        texts = tree.leaf_texts(n, chars)
        assert texts == [chars.decode(segs[leaf].tokens) for leaf in tree.leaves[n]]
        assert all(len(t) == 3 for t in texts)  # no eos: the whole answer


@pytest.mark.parametrize("static", [False, True])
def test_sampled_tree_logprobs_match_every_row(mcore_single, static):
    """Three levels below the root (2, 2, 2), replies after depths 1 and 2, sampled with
    temperature and top-p: each node's recorded per-loop log-probs and the group layout of
    ``old_logprobs`` equal the reference forward of every row at the sampling temperature,
    log_softmax(logits / 0.9) (fp64 model, fp32 records)."""
    model, ref, weights = build("rope", torch.float64)
    gen = torch.Generator().manual_seed(3)
    tree = generate_tree(model, PROMPTS[:2], [2, 2, 2], [3, 2, 3], eos_id=EOS, pad_id=PAD,
                         reply_fn=reply, static_cache=static,
                         sampling=Sampling(temperature=0.9, top_p=0.95, generator=gen,
                                           banned=(PAD,)))
    err = 0.0
    for n in range(2):
        check_segments(tree, n, reply)
        segs, rows = tree.segments[n], tree.leaf_tokens(n)
        assert len(rows) == 8
        old = tree.old_logprobs(n)  # [R, G, T]
        assert old.shape == (LOOPS, 8, max(len(r) for r in rows))
        for g, (leaf, row) in enumerate(zip(tree.leaves[n], rows)):
            logits, _ = reference_forward(weights, ref, torch.tensor(row)[None])
            want = torch.stack([(lg[0] / 0.9).log_softmax(-1)[:-1].gather(
                -1, torch.tensor(row[1:])[:, None])[:, 0] for lg in logits])  # [R, S - 1]
            mask = torch.tensor([m for i in tree.path(n, leaf)[1:] for m in segs[i].loss_mask])
            trained = torch.cat([torch.zeros(len(PROMPTS[n]) - 1), mask]).bool()  # [S - 1]
            err = max(err, (old[:, g, : len(row) - 1] - want)[:, trained].abs().max().item())
            assert (old[:, g, : len(row) - 1][:, ~trained] == 0).all()
            assert (old[:, g, len(row) - 1 :] == 0).all()
    # siblings differ (sampling), so the rows are not all one sequence
    assert len({tuple(r) for r in tree.leaf_tokens(0)}) > 1
    assert err <= torch.finfo(torch.float32).eps * 16


@pytest.mark.parametrize("mode", ["mixture", "threshold"])
def test_exit_gate_trees_record_the_training_readouts(mcore_single, mode):
    """With the exit gate (fp32): every answer token's per-loop log-probs, exit distribution
    and sampling log-prob (the mixture's, or the exit loop's) are a training forward's of the
    row, within 1e-5 (as rl/rollout.py's rollouts)."""
    model = _gated(R=3).eval()
    gen = torch.Generator().manual_seed(5)
    tree = generate_tree(model, [[3, 9, 4, 7, 1], [5, 2, 8]], [2, 2], [4, 3], eos_id=EOS,
                         pad_id=PAD, reply_fn=reply,
                         sampling=Sampling(generator=gen, banned=(PAD,), exit_mode=mode,
                                           exit_threshold=0.6))
    for n in range(2):
        segs = tree.segments[n]
        for leaf, row in zip(tree.leaves[n], tree.leaf_tokens(n)):
            seq = torch.tensor(row)[None]
            with torch.no_grad():
                out = model(seq, labels=torch.cat([seq[:, 1:], seq[:, :1]], dim=1))
            nodes = tree.path(n, leaf)[1:]
            P = len(segs[0].tokens)
            trained = torch.tensor([m for i in nodes for m in segs[i].loss_mask]).bool()
            lp, exit_lp = (x[:, 0, P - 1 : len(row) - 1][:, trained]
                           for x in (out.logprobs, out.exit_logprobs))  # [R, answers]
            got = [torch.cat([t[i] for i in nodes], dim=-1)[..., trained]
                   for t in (tree.loop_logprobs[n], tree.exit_logprobs[n], tree.logprobs[n])]
            assert (got[0] - lp).abs().max() <= 1e-5
            assert (got[1] - exit_lp).abs().max() <= 1e-5
            if mode == "mixture":
                want = torch.logsumexp(exit_lp + lp, dim=0)
            else:
                want = lp.gather(0, exit_loop_at(exit_lp, 0.6)[None]).squeeze(0)
            assert (got[2] - want).abs().max() <= 1e-5


def test_segments_build_the_rl_group(mcore_single):
    """``RLGroup.from_tree`` takes a tree's segments as they are: its rows are the leaves'
    paths, its loss mask is 1 exactly where ``old_logprobs`` holds a sampled token's
    log-prob, and ``old_logprobs`` fits its [R, G, T] layout."""
    model, _, _ = build("rope", torch.float64)
    gen = torch.Generator().manual_seed(1)
    tree = generate_tree(model, PROMPTS[:2], [2, 3], [3, 2], eos_id=EOS, pad_id=PAD, reply_fn=reply,
                         sampling=Sampling(generator=gen, banned=(PAD,)))
    for n in range(2):
        G = len(tree.leaves[n])
        rows = tree.leaf_tokens(n)
        T = max(len(r) for r in rows)
        old = tree.old_logprobs(n, T)
        group = RLGroup.from_tree(tree.segments[n], PAD, advantages=torch.zeros(G),
                                  old_logprobs=old)
        assert group.tokens.tolist() == [r + [PAD] * (T - len(r)) for r in rows]
        assert torch.equal(group.loss_mask.bool(), old[-1] != 0)
        assert group.tree.leaf_of_row == tuple(tree.leaves[n])


def test_reply_fn_is_told_the_prompt_of_the_node(mcore_single):
    """Prompts sharing a prefix (one a prefix of another, two equal): ``reply_fn`` gets the
    index of the node's own prompt, so each tree holds its own problem's replies, also where
    the paths alone cannot tell the problems apart."""
    model, _, _ = build("rope", torch.float64)
    model.eval()
    prompts = [[7, 3], [7, 3, 9, 4], [7, 3]]
    calls = []

    def env(prompt: int, path: list, answer: list) -> list:
        calls.append((prompt, path))
        return [10 + prompt, 20 + prompt]  # the problem's own reply

    tree = generate_tree(model, prompts, [2, 2], [2, 2], eos_id=EOS, pad_id=PAD, reply_fn=env,
                         sampling=Sampling(temperature=0.0, banned=(PAD,)))
    assert sorted({n for n, _ in calls}) == [0, 1, 2] and len(calls) == 3 * 2
    assert all(path[: len(prompts[n])] == prompts[n] for n, path in calls)
    for n in range(len(prompts)):
        segs = tree.segments[n]
        internal = [s for i, s in enumerate(segs) if i and i not in tree.leaves[n]]
        assert len(internal) == 2
        assert all(s.tokens[sum(s.loss_mask):] == [10 + n, 20 + n] for s in internal)
    assert tree.leaf_tokens(0) != tree.leaf_tokens(2)  # equal prompts, their own replies


def test_a_node_ended_by_eos_without_a_reply_is_a_leaf(mcore_single):
    model, _, _ = build("learned_absolute", torch.float64)
    model.eval()
    greedy = generate(model, PROMPTS, 1, 1, eos_id=EOS, pad_id=PAD,
                      sampling=Sampling(temperature=0.0, banned=(PAD,)))
    eos = int(greedy.responses[0, 0, 0])  # prompt 0's first greedy token ends its answers
    tree = generate_tree(model, PROMPTS, [2, 2], [3, 3], eos_id=eos, pad_id=PAD,
                         sampling=Sampling(temperature=0.0, banned=(PAD,)))
    segs = tree.segments[0]
    assert len(segs) == 3 and tree.leaves[0] == [1, 2]
    assert all(s.tokens == [eos] and s.loss_mask == [1] for s in segs[1:])
    for n in range(len(PROMPTS)):  # every depth-1 node: a leaf iff its answer ended by eos
        check_segments(tree, n)
        segs = tree.segments[n]
        for i in (i for i, s in enumerate(segs) if s.parent == 0):
            assert (i in tree.leaves[n]) == (segs[i].tokens[-1] == eos)
    assert len(tree.segments[1]) > 3 or len(tree.segments[2]) > 3  # not every tree stopped
    # alone, prompt 0's rows all stop at their first token, before any decode step fed it
    alone = generate_tree(model, PROMPTS[:1], [2, 2], [3, 3], eos_id=eos, pad_id=PAD,
                          sampling=Sampling(temperature=0.0, banned=(PAD,), stop_check_interval=1))
    assert len(alone.segments[0]) == 3 and alone.leaves[0] == [1, 2]


def test_num_loops_is_the_decoding_count(mcore_single):
    """A tree decoded with 2 of the model's 3 loops: its records have R = 2, and its leaves
    are greedy per-row decoding's with 2 loops."""
    model, _, _ = build("rope", torch.float64)
    model.eval()
    tree = generate_tree(model, PROMPTS[:1], [1, 2], [2, 2], eos_id=EOS, pad_id=PAD, num_loops=2,
                         sampling=Sampling(temperature=0.0, banned=(PAD,)))
    rows = generate(model, PROMPTS[:1], 1, 4, eos_id=EOS, pad_id=PAD, num_loops=2,
                    sampling=Sampling(temperature=0.0, banned=(PAD,)))
    assert all(lp.shape[0] == 2 for lp in tree.loop_logprobs[0])
    assert tree.leaf_tokens(0) == [PROMPTS[0] + rows.responses[0, 0].tolist()] * 2


def _syncs(model, steps: int, **kwargs) -> int:
    sampling = Sampling(banned=(PAD,), generator=torch.Generator().manual_seed(0), **kwargs)
    _, counter = count_host_syncs(generate_tree, model, PROMPTS, [2, 2], [steps, steps],
                                  eos_id=EOS, pad_id=PAD, reply_fn=reply, sampling=sampling)
    return counter.total


def test_no_host_sync_per_decoded_token(mcore_single):
    model, _, _ = build("rope", torch.float32)
    kw = dict(temperature=1.0, top_p=0.9, stop_check_interval=100)
    assert _syncs(model, 2, **kw) == _syncs(model, 5, **kw)  # per level only, none per token


BAD_INPUTS = [
    (dict(branches=[2, 0]), "branch factor at depth 1 is 0"),
    (dict(branches=[]), "branches must be a non-empty list"),
    (dict(branches=[2, 1.5]), "branch factor at depth 1 is 1.5"),
    (dict(prompts=[[1, 2], []]), "prompt 1 is empty"),
    (dict(prompts=[]), "non-empty list of prompts"),
    (dict(prompts=[3, 4]), "prompt 0 must be a list of token ids"),
    (dict(max_new_tokens=[2]), "max_new_tokens has 1 entries for 2 depths"),
    (dict(max_new_tokens=[2, 0]), "max_new_tokens at depth 1 is 0"),
    (dict(sampling=dict(exit_mode="sometimes")), "exit_mode must be one of"),
    (dict(sampling=dict(exit_mode="mixture")), "needs the model's exit gate"),
    (dict(reply_fn=lambda n, path, answer: "ok"), "reply_fn must return a list of token ids"),
    (dict(reply_fn=lambda path, answer: []), "reply_fn must take \\(prompt, path, answer\\)"),
    (dict(sampling=dict(stop_check_interval=-1)), "stop_check_interval must be >= 1"),
    (dict(reply_fn=lambda n, path, answer: [1, VOCAB]), "outside the model's vocabulary"),
]


def test_bad_input_is_named(mcore_single):
    model, _, _ = build("rope", torch.float64)
    for kwargs, message in BAD_INPUTS:
        args = {**dict(prompts=PROMPTS, branches=[2, 2], max_new_tokens=[2, 2]), **kwargs}
        with pytest.raises(ValueError, match=message):
            args["sampling"] = Sampling(**args.get("sampling", {}))
            generate_tree(model, args.pop("prompts"), args.pop("branches"),
                          args.pop("max_new_tokens"), eos_id=EOS, pad_id=PAD, **args)
