"""Decoding without host syncs.

- A decode step (per row and prompt once, RoPE, GQA, the drawn initial state) runs end to end
  on ``meta``: no value is read on the host inside it (``meta`` cannot be read).
- A rollout's uploads (flat, prompt once, tree, teacher-forced tree) are non-blocking, up to
  its first read on ``meta``.
- ``HostSyncCounter`` counts 0 syncs per decoded token of a rollout in steady state on CPU
  (greedy and sampled, per row and prompt once, with banned ids and vocabulary padding), and
  one per ``stop_check_interval`` tokens for the stop check.
- A static cache (the whole preallocated cache under a mask: fixed shapes, what a CUDA graph
  needs) gives the independent reference's logits, per row and prompt once.
"""

from functools import partial

import pytest
import torch
from helpers.decode import LOOPS, VOCAB, build
from helpers.reference_looped import reference_forward

from scalerlt_mcore.model.host_syncs import HostSyncCounter, count_host_syncs
from scalerlt_mcore.rl.rollout import Sampling, draw, generate
from scalerlt_mcore.rl.tree_rollout import generate_tree, tree_logprobs
from scalerlt_mcore.shared_prefix import TreeSegment

META = torch.device("meta")
LENGTHS = torch.tensor([3, 7, 5])  # prompt lengths; prompts right-padded to 7
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10]]


def _meta_model(pe: str, **config):
    model, _, _ = build(pe, torch.float32)
    for key, value in config.items():
        setattr(model.config, key, value)
    model = model.to(META).eval()
    if pe == "rope":  # MCore keeps inv_freq as a plain attribute, made on the init device
        model.rotary_pos_emb.inv_freq = model.rotary_pos_emb.inv_freq.to(META)
    return model


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("pe", ["learned_absolute", "rope"])
def test_decode_step_runs_on_meta(mcore_single, pe, static):
    model = _meta_model(pe)
    cache = model.new_kv_cache(3, 12, static=static)
    assert cache.keys.device == META and cache.lengths.device.type == "cpu"
    cache.lengths.copy_(LENGTHS)
    logits = model.decode_step(cache, torch.zeros(3, dtype=torch.long, device=META))
    assert logits.device == META and logits.shape == (LOOPS, 3, VOCAB)
    assert cache.lengths.tolist() == (LENGTHS + 1).tolist()


@pytest.mark.parametrize("static", [False, True])
def test_prompt_once_decode_step_runs_on_meta(mcore_single, static):
    model = _meta_model("rope")
    prefix = model.new_kv_cache(3, 7, static=static)
    prefix.lengths.copy_(LENGTHS)
    cache = model.new_kv_cache(6, 5, prefix=prefix, static=static)
    cache.lengths.fill_(2)
    logits, _ = model.decode_step(cache, torch.zeros(6, dtype=torch.long, device=META),
                                  with_exit=True)
    assert logits.device == META and logits.shape == (LOOPS, 6, VOCAB)


def test_copied_prompt_once_decode_step_runs_on_meta(mcore_single):
    """``prompt_kv`` copied: the prompts' K/V copied into a per-row cache, then decoded per row,
    end to end on meta (no host sync in the copy or the step)."""
    model = _meta_model("rope")
    prefix = model.new_kv_cache(3, 7)
    prefix.lengths.copy_(LENGTHS)
    cache = model.new_kv_cache(6, 12)
    cache.copy_rows_of(prefix)
    assert cache.lengths.tolist() == LENGTHS.repeat_interleave(2).tolist()
    logits = model.decode_step(cache, torch.zeros(6, dtype=torch.long, device=META))
    assert logits.device == META and logits.shape == (LOOPS, 6, VOCAB)


def test_decode_step_with_the_drawn_initial_state_runs_on_meta(mcore_single):
    model = _meta_model("rope", looped_initial_state="random")
    cache = model.new_kv_cache(3, 12)
    cache.lengths.copy_(LENGTHS)
    model.decode_step(cache, torch.zeros(3, dtype=torch.long, device=META))


def _counts_to_the_first_read(fn) -> dict:
    """The counter's counts of ``fn`` on meta up to its first read of a device value (a copy
    out of meta raises)."""
    with HostSyncCounter() as counter:
        with pytest.raises(NotImplementedError, match="Cannot copy out of meta"):
            fn()
    return dict(counter.counts)


def test_rollouts_upload_without_blocking_on_meta(mcore_single):
    """Every host-to-device copy of a rollout is non-blocking (on CUDA a blocking one ends in
    a stream synchronize): the prompts and the ban mask, and a tree level's dropped rows; the
    teacher-forced tree's prompts and its level's tokens, uploaded once for the tokens and the
    labels. Each runs to its first read: the flat rollout's one read of its results, the
    tree's of its first level's answers and scores."""
    model = _meta_model("rope")
    sampling = Sampling(banned=(0,), stop_check_interval=100)
    flat = partial(generate, model, PROMPTS, 2, 3, eos_id=VOCAB + 1, pad_id=0, sampling=sampling)
    for kw in ({}, dict(prompt_once=True, prompt_kv="shared"),
               dict(prompt_once=True, prompt_kv="copied")):
        assert _counts_to_the_first_read(partial(flat, **kw)) == {"h2d": 2, "d2h": 1}, kw
    tree = partial(generate_tree, model, PROMPTS, [2, 2], [2, 2], eos_id=VOCAB + 1, pad_id=0,
                   sampling=sampling)
    assert _counts_to_the_first_read(tree) == {"h2d": 3, "d2h": 1}
    segments = [TreeSegment([1, 2, 3], None), TreeSegment([4, 5], 0), TreeSegment([6], 0)]
    assert _counts_to_the_first_read(partial(tree_logprobs, model, [segments])) == {
        "h2d": 2, "d2h": 1}


def _syncs(model, steps: int, prompt_once: bool, prompt_kv, **sampling) -> int:
    sampling = Sampling(generator=torch.Generator().manual_seed(0), **sampling)
    _, counter = count_host_syncs(generate, model, PROMPTS, 2, steps, eos_id=VOCAB + 1,
                                  pad_id=0, prompt_once=prompt_once, prompt_kv=prompt_kv,
                                  sampling=sampling)
    return counter.total


@pytest.mark.parametrize("prompt_once, prompt_kv", [(False, None), (True, "shared"),
                                                    (True, "copied")])
@pytest.mark.parametrize("temperature, top_p", [(0.0, 1.0), (1.0, 0.9)])
def test_no_host_sync_per_decoded_token(mcore_single, prompt_once, prompt_kv, temperature,
                                        top_p):
    model, _, _ = build("rope", torch.float32)
    kw = dict(prompt_once=prompt_once, prompt_kv=prompt_kv, temperature=temperature,
              top_p=top_p, banned=(0, 5),
              vocab_size=VOCAB - 4, stop_check_interval=100)
    assert _syncs(model, 3, **kw) == _syncs(model, 9, **kw)  # setup only, none per token
    kw["stop_check_interval"] = 2  # one stop check every 2 tokens
    assert _syncs(model, 9, **kw) - _syncs(model, 3, **kw) == 3


def test_draw_is_multinomials_draw():
    probs = torch.rand(5, 40, dtype=torch.float64).softmax(-1)
    probs[:, :7] = 0
    for seed in range(5):
        want = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(seed))
        assert torch.equal(draw(probs, torch.Generator().manual_seed(seed)), want[:, 0])


def _reference_logits(weights, ref, seq: torch.Tensor, first: int) -> torch.Tensor:
    """[R, S - first + 1, V]: the reference's per-loop logits of positions first - 1 ... ."""
    want, _ = reference_forward(weights, ref, seq[None])
    return torch.stack([w[0, first - 1 :] for w in want])


@pytest.mark.parametrize("prompt_once", [False, True])
@pytest.mark.parametrize("pe", ["learned_absolute", "rope"])
def test_static_cache_decode_matches_reference(mcore_single, pe, prompt_once):
    """Teacher-forced decoding with static caches (fp64) against the plain-PyTorch reference
    forward of every full sequence."""
    model, ref, weights = build(pe, torch.float64)
    gen = torch.Generator().manual_seed(0)
    steps, G = 3, 2 if prompt_once else 1
    prompts = torch.randint(0, VOCAB, (3, 7), generator=gen)  # right-padded, junk padding
    conts = torch.randint(0, VOCAB, (3 * G, steps), generator=gen)
    with torch.no_grad():
        if prompt_once:
            prefix = model.new_kv_cache(3, 7, static=True)
            first = model.prefill(prefix, prompts, LENGTHS).repeat_interleave(G, dim=1)
            cache = model.new_kv_cache(3 * G, steps + 1, prefix=prefix, static=True)
        else:
            cache = model.new_kv_cache(3, 7 + steps + 1, static=True)
            first = model.prefill(cache, prompts, LENGTHS)
        outs = [first] + [model.decode_step(cache, conts[:, j]) for j in range(steps)]
    got = torch.stack(outs, dim=2)  # [R, 3G, steps + 1, V]
    for b in range(3 * G):
        n = int(LENGTHS[b // G])
        seq = torch.cat([prompts[b // G, :n], conts[b]])
        err = (got[:, b] - _reference_logits(weights, ref, seq, n)).abs().max().item()
        assert err <= 1e-10, (b, err)


def test_rollout_without_banned_ids_or_padding(mcore_single):
    model, _, _ = build("learned_absolute", torch.float32)
    out = generate(model, PROMPTS, 2, 3, eos_id=VOCAB + 1, pad_id=0,
                   sampling=Sampling(temperature=0.0))
    assert out.responses.shape == (3, 2, 3)


def test_cuda_graph_decoding_needs_a_static_cuda_cache(mcore_single):
    model, _, _ = build("rope", torch.float32)
    with pytest.raises(ValueError, match="needs a CUDA cache; this one is on cpu"):
        generate(model, PROMPTS, 2, 3, eos_id=VOCAB + 1, pad_id=0, cuda_graph=True,
                 sampling=Sampling(temperature=0.0))
