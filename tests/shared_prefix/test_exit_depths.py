"""Replaying a serving engine's exit depths (vllm-rlt's ``last_exited`` K/V layout).

A response token sampled at loop e was read out at loop e of the position before it, and that
position's K/V stopped at loop e: a later query at loop d reads loop min(d, e)'s
(``LoopKV.exit_kv``). The prompt runs every loop. Held in fp64 against
``helpers.reference_exit``, an engine simulated one position at a time in plain PyTorch (K/V
planes per loop, exit-loop K/V copied into the deeper planes):

- the full-sequence forward and the prompt's prefix state with the suffix forward give every
  position's log-prob at its read loop as the engine does (<= 1e-12), with MCore's full
  recompute too; every position at R is the forward without exit depths, bitwise;
- the RL loss with recorded exit depths (each token's log-prob read at its own exit loop)
  trains the same by joint replay (waves of 2, prompt retained and recomputed, with and
  without recompute) as by naive training through stock MCore's schedule (loss and every
  gradient <= 1e-12), and the loss and the gradients of the embedding, the output layer, the
  final norm and the injection equal the reference's (<= 1e-12);
- the project's decoder with ``Sampling.exit_kv`` (``exit_mode`` threshold) keeps each
  exited position's K/V as the engine does: the replay of its rollout's exit depths scores
  every sampled token as it was sampled, per row and prompt once (to the fp32 rounding of the
  recorded log-probs, ``FP32_LOGPROB``; without ``exit_kv`` it does not);
- a depth-2 tree (each node replayed once) trains as naive training of its rows and as the
  reference of each row (<= 1e-12, with and without recompute); rows that disagree on a
  node's depths are refused;
- bad exit depths and other loop weights than final are refused by name.
"""

import dataclasses

import pytest
import torch
from helpers.decode import LOOPS, VOCAB, build
from helpers.exit_gate import _gated
from helpers.reference_exit import engine_logprobs
from helpers.sp import LossSpec, grads, joint_step, make_group, ref_rl_loss, ref_token_weights
from helpers.tree import DEPTH2, tree_group

from scalerlt_mcore.rl.batch import attach_exit_depths, build_groups
from scalerlt_mcore.rl.rollout import Sampling, generate
from scalerlt_mcore.testing import model_parallel_context

G, P, T = 4, 4, 10
TOL = 1e-12
FP32_LOGPROB = 1e-6
"""A rollout records its log-probs in fp32 (as an engine's records hold them): an fp64 replay
that reads the same K/V agrees to their rounding (measured 1.1e-7 to 1.6e-7 at log-probs
near -4); one that does not (no ``exit_kv``) is off by 3.7e-3 to 7.7e-3."""


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


def _case(seed: int = 0) -> tuple:
    """tokens, labels [G, T]; the loop each label is read at and the loops each position runs
    [G, T] (the prompt's positions run R; response position t runs the loop its label was
    read at, the position before the prompt's end reads at its label's but runs R)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (G, T), generator=gen)
    labels = torch.roll(tokens, -1, dims=1)
    reads = torch.randint(1, LOOPS + 1, (G, T), generator=gen)
    reads[:, : P - 1] = LOOPS
    runs = torch.where(torch.arange(T) < P, LOOPS, reads)
    return tokens, labels, reads, runs


def _build(recompute: bool) -> tuple:
    """``helpers.decode.build``'s model (and its reference weights), with MCore's full
    recompute of every layer application where ``recompute``."""
    model, ref, weights = build("rope")
    if recompute:
        model.config.recompute_granularity, model.config.recompute_method = "full", "uniform"
        model.config.recompute_num_layers = 1
    return model, ref, weights


def _reference(weights, ref, tokens, labels, reads, runs) -> torch.Tensor:
    return torch.stack([engine_logprobs(weights, ref, tokens[g].tolist(), labels[g].tolist(),
                                        runs[g].tolist(), reads[g].tolist())
                        for g in range(tokens.shape[0])])  # [G, T]


def _at(per_loop: torch.Tensor, reads: torch.Tensor) -> torch.Tensor:
    """[R, G, T] -> [G, T]: each position's log-prob at its read loop."""
    return per_loop.gather(0, (reads - 1)[None]).squeeze(0)


@pytest.mark.parametrize("recompute", [False, True])
def test_forward_reads_the_engine_layout(recompute):
    with model_parallel_context(seed=1):
        model, ref, weights = _build(recompute)
        tokens, labels, reads, runs = _case()
        want = _reference(weights, ref, tokens, labels, reads, runs)
        got = _at(model(tokens, labels=labels, exit_depths=runs).logprobs, reads)
        assert _rel(got, want) <= TOL, _rel(got, want)
        state = model(tokens[:, :P], return_prefix_state=True, readout=False).prefix_state
        suffix = model.suffix_logprobs(state, tokens[:, P:], labels[:, P - 1 : T - 1],
                                       exit_depths=runs[:, P:])  # [R, G, T - P]
        part = _at(suffix, reads[:, P - 1 : T - 1])
        assert _rel(part, want[:, P - 1 : T - 1]) <= TOL


def test_full_depth_is_the_forward_without_exit_depths():
    with model_parallel_context(seed=1):
        model, _, _ = build("rope")
        tokens, labels, _, _ = _case(1)
        plain = model(tokens, labels=labels).logprobs
        full = model(tokens, labels=labels, exit_depths=torch.full_like(tokens, LOOPS)).logprobs
        assert torch.equal(plain, full)


@pytest.mark.parametrize("exits, match", [
    (lambda t: torch.zeros_like(t), r"exit_depths must lie in 1\.\.3"),
    (lambda t: torch.full_like(t, LOOPS + 1), r"exit_depths must lie in 1\.\.3"),
    (lambda t: t[:, :-1], r"exit_depths must be integers of input_ids' shape"),
    (lambda t: t.double(), r"exit_depths must be integers of input_ids' shape"),
])
def test_bad_exit_depths_are_refused(exits, match):
    with model_parallel_context(seed=1):
        model, _, _ = build("rope")
        tokens = torch.ones(2, 5, dtype=torch.long)
        with pytest.raises(ValueError, match=match):
            model(tokens, exit_depths=exits(torch.ones_like(tokens)))


# ---- training with recorded exit depths ------------------------------------------------------

S = 6
SPEC = LossSpec(normalization="token_mean", loop_weights="final")
CHECKED = {"embedding.word_embeddings.weight": "tok", "output_layer.weight": "out",
           "decoder.final_layernorm.weight": "norm_w", "decoder.injection.weight": "inject"}
"""Parameters the reference's weights hold as they are (the layers' fused QKV are split)."""


def _recorded_group(seed: int = 3):
    """A group of G responses (uneven lengths) whose every token was sampled at a random loop
    (0 off the responses)."""
    g = make_group(G, P, S, LOOPS, seed=seed, dtype=torch.float64, vocab=VOCAB)
    gen = torch.Generator().manual_seed(seed + 1)
    reads = torch.randint(1, LOOPS + 1, g.tokens.shape, generator=gen)
    on = g.loss_mask != 0
    return dataclasses.replace(g, exit_depths=torch.where(on, reads, 0))


def _reference_step(weights, ref, g):
    """The loss (token mean of PPO at each token's read loop) and its gradient of the
    reference's weights."""
    leaves = {k: weights[k].clone().requires_grad_(True) for k in CHECKED.values()}
    w = {**weights, **leaves}
    runs = g.exit_runs(LOOPS)
    reads = torch.where(g.exit_depths == 0, LOOPS, g.exit_depths)
    lp = _reference(w, ref, g.tokens, g.labels, reads, runs)  # [G, T]
    old = _at(g.old_logprobs, reads)
    loss = ref_rl_loss(dataclasses.replace(SPEC, loop_weights="final"), lp[None], old[None],
                       g.advantages, ref_token_weights(SPEC, g.loss_mask))
    loss.backward()
    return loss.detach(), {name: leaves[k].grad for name, k in CHECKED.items()}


def _trains_as_reference_and_naive(model, ref, weights, g, prompt: str, state: str) -> None:
    """Joint replay of ``g`` (waves of 2, the prompt as ``prompt`` says, prefix states of kind
    ``state``): its loss and the reference weights' gradients equal the engine reference's,
    and its loss and every gradient equal naive training's (<= 1e-12)."""
    want_loss, want = _reference_step(weights, ref, g)
    out = joint_step(model, [g], SPEC, wave_size=2, prompt=prompt, state_kind=state)
    loss = float(out[0]["loss"])
    assert abs(loss - float(want_loss)) <= TOL * abs(float(want_loss)), (loss, want_loss)
    got = grads(model)
    for name, w in want.items():
        assert _rel(got[name], w) <= TOL, (name, _rel(got[name], w))
    model.zero_grad(set_to_none=True)
    naive = joint_step(model, [g], SPEC, wave_size=2, schedule="naive", naive_micro_batch_size=2)
    assert abs(float(naive[0]["loss"]) - loss) <= TOL * abs(loss)
    for name, tensor in grads(model).items():
        assert _rel(got[name], tensor) <= TOL, name


@pytest.mark.parametrize("state", ["kv", "inputs"])
@pytest.mark.parametrize("prompt", ["retain", "recompute"])
@pytest.mark.parametrize("recompute", [False, True])
def test_joint_replay_trains_recorded_exit_depths(prompt, recompute, state):
    with model_parallel_context(seed=1):
        model, ref, weights = _build(recompute)
        _trains_as_reference_and_naive(model, ref, weights, _recorded_group(), prompt, state)


def test_recorded_exit_depths_need_final_loop_weights():
    with model_parallel_context(seed=1):
        model, _, _ = build("rope")
        spec = dataclasses.replace(SPEC, loop_weights="uniform")
        with pytest.raises(ValueError, match="recorded exit depths .* need loop_weights final, "
                                             "got 'uniform'"):
            joint_step(model, [_recorded_group()], spec, wave_size=2)


def _tree_depths(g, seed: int) -> torch.Tensor:
    """Recorded exit depths [G, T] of a tree group's rows: every token after the prompt
    sampled, the depth of each drawn once per (node, offset) of the position that sampled it,
    so every row below a node agrees (the node was decoded once)."""
    tree, gen = g.tree, torch.Generator().manual_seed(seed)
    table, depths = {}, torch.zeros_like(g.tokens)
    for row, leaf in enumerate(tree.leaf_of_row):
        path = [leaf]
        while tree.parents[path[-1]] >= 0:
            path.append(tree.parents[path[-1]])
        for node in path:
            for p in range(max(tree.starts[node], g.prompt_length - 1), tree.ends[node]):
                if p < tree.ends[leaf] - 1:  # the position's label is a token of the row
                    key = (node, p - tree.starts[node])
                    if key not in table:
                        table[key] = int(torch.randint(1, LOOPS + 1, (1,), generator=gen))
                    depths[row, p] = table[key]
    return depths


@pytest.mark.parametrize("state,prompt", [("kv", "retain"), ("inputs", "retain"),
                                          ("inputs", "recompute")])
@pytest.mark.parametrize("recompute", [False, True])
def test_a_tree_replays_recorded_exit_depths(recompute, state, prompt):
    """A depth-2 tree whose every answer token was sampled at a recorded depth: the tree
    replay (each node once) trains as naive training of its rows (every gradient <= 1e-12) and
    as the engine reference of each row (loss and the four gradients <= 1e-12); with prefix
    states of K/V and of layer inputs (a node's inputs past a position's exit are those of its
    exit loop, as its K/V are), the nodes retained or recomputed in their replay."""
    with model_parallel_context(seed=1):
        model, ref, weights = _build(recompute)
        g = tree_group(DEPTH2, LOOPS, seed=2, masks="leaves")
        g.exit_depths = _tree_depths(g, seed=3)
        assert len(set(g.exit_depths[g.exit_depths > 0].tolist())) == LOOPS
        _trains_as_reference_and_naive(model, ref, weights, g, prompt, state)


def test_a_tree_node_with_two_depths_is_refused():
    """A node is decoded once: rows below it that disagree on its positions' depths are
    refused before any compute."""
    with model_parallel_context(seed=1):
        model, _, _ = build("rope")
        g = tree_group(DEPTH2, LOOPS, seed=2, masks="leaves")
        g.exit_depths = _tree_depths(g, seed=3)
        first = g.tree.rows_below(1)[0]
        g.exit_depths[first, g.tree.starts[1]] = LOOPS + 1 - g.exit_depths[first,
                                                                           g.tree.starts[1]]
        with pytest.raises(ValueError, match="node 1's recorded exit depths differ between "
                                             "the rows below it"):
            joint_step(model, [g], SPEC, wave_size=2)


@pytest.mark.parametrize("prompt_once", [False, True])
def test_decoding_with_exit_kv_is_what_the_replay_reads(prompt_once):
    with model_parallel_context(seed=1):
        model = _gated(R=3, hidden=32, heads=4).double()
        prompts = [[5, 9, 13, 2], [7, 3, 11]]

        def rollout(exit_kv: bool):
            sampling = Sampling(exit_mode="threshold", exit_threshold=0.5, exit_kv=exit_kv,
                                generator=torch.Generator().manual_seed(4))
            return generate(model, prompts, 3, 6, eos_id=VOCAB + 1, pad_id=0,
                            sampling=sampling, prompt_once=prompt_once)

        ro = rollout(True)
        depths = ro.exit_depths[ro.exit_depths > 0]
        assert {1, 2, 3} <= set(depths.tolist()), depths  # tokens exit at every loop
        assert torch.equal(ro.exit_depths, ro.exit_loops)
        plain = rollout(False)
        assert plain.exit_depths is None
        for r, want_match in ((ro, True), (plain, False)):
            groups = attach_exit_depths(build_groups(r.prompts, r.responses, r.lengths, 0, 0),
                                        ro.exit_depths if r is plain else r.exit_depths)
            for n, g in enumerate(groups):
                with torch.no_grad():
                    per_loop = model(g.tokens, labels=g.labels,
                                     exit_depths=g.exit_runs(3)).logprobs
                scored = _at(per_loop, torch.where(g.exit_depths == 0, 3, g.exit_depths))
                sampled = g.to_layout(r.logprobs[n, :, : g.response_length].double())
                err = float(torch.where(g.loss_mask != 0, scored - sampled, 0).abs().max())
                assert (err <= FP32_LOGPROB) == want_match, (prompt_once, want_match, err)
