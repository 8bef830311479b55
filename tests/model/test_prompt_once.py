"""Prompt-once decoding (Hydragen): each prompt prefilled once into a cache of N rows; its G
samples keep only their own K/V and read the prompt's single copy through
``prompt_once_attention``.

- Teacher-forced decoding gives every loop's logits of the independent plain-PyTorch reference
  forward of each full sequence (several prompts of different lengths, G samples each).
- Each sample reads its own prompt: corrupting one prompt's cached K/V changes only its G rows.
- ``generate(prompt_once=True)`` samples the same tokens as per-row rollouts from the same
  seed, with the same per-loop log-probs up to fp32 rounding.
"""

import pytest
import torch
from helpers.decode import LOOPS, VOCAB, build
from helpers.reference_looped import reference_forward

from scalerlt_mcore.rl.rollout import Sampling, default_prompt_kv, generate

LENGTHS = torch.tensor([3, 7, 5])  # prompt lengths; prompts right-padded to 7
G, STEPS = 2, 4  # samples per prompt; teacher-forced decode steps after the prefill


def data(seed: int = 0) -> tuple:
    """Right-padded prompts [3, 7] (junk padding) and continuations [3 * G, STEPS + 1]."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, VOCAB, (3, int(LENGTHS.max())), generator=gen)
    conts = torch.randint(0, VOCAB, (3 * G, STEPS + 1), generator=gen)
    return prompts, conts


def decode_prompt_once(model, prompts, conts, prompt_kv: str = "shared") -> tuple:
    """Prefill the 3 prompts once, then STEPS teacher-forced steps of the 3 * G rows ->
    ([STEPS + 1] x [R, 3G, V], prefix cache, continuation cache). ``prompt_kv`` copied: the
    rows decode in a per-row cache that holds their prompt's K/V (``copy_rows_of``)."""
    prefix = model.new_kv_cache(3, int(LENGTHS.max()))
    first = model.prefill(prefix, prompts, LENGTHS)  # [R, 3, V]
    if prompt_kv == "copied":
        cache = model.new_kv_cache(3 * G, prefix.max_length + STEPS + 1)
        cache.copy_rows_of(prefix)
    else:
        cache = model.new_kv_cache(3 * G, STEPS + 1, prefix=prefix)
    outs = [first.repeat_interleave(G, dim=1)]
    for j in range(STEPS):
        outs.append(model.decode_step(cache, conts[:, j]))
    return outs, prefix, cache


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)],
                         ids=["fp64", "fp32"])
@pytest.mark.parametrize("pe", ["learned_absolute", "rope"])
@pytest.mark.parametrize("prompt_kv", ["shared", "copied"])
def test_prompt_once_decode_matches_reference(mcore_single, pe, dtype, tol, prompt_kv):
    model, ref, weights = build(pe, dtype)
    prompts, conts = data()
    with torch.no_grad():
        outs, prefix, cache = decode_prompt_once(model, prompts, conts, prompt_kv)
    assert (prefix.max_length, prefix.batch) == (int(LENGTHS.max()), 3)
    if prompt_kv == "shared":  # the prompt is cached once per prompt, the continuations G times
        assert (cache.max_length, cache.batch) == (STEPS + 1, 3 * G)
        # [D, B, ng, T, hn]
        assert cache.keys.shape[1] == 3 * G and cache.keys.shape[3] == STEPS + 1
        assert cache.lengths.tolist() == [STEPS] * (3 * G)
    else:  # every row holds its prompt and its continuation
        assert cache.prefix is None and cache.batch == 3 * G
        assert cache.lengths.tolist() == (LENGTHS.repeat_interleave(G) + STEPS).tolist()
    err = 0.0
    for b in range(3 * G):
        n = b // G
        P = int(LENGTHS[n])
        seq = torch.cat([prompts[n, :P], conts[b, :STEPS]])[None]  # [1, P + STEPS]
        want, _ = reference_forward(weights, ref, seq)
        for r in range(LOOPS):
            got = torch.stack([o[r, b] for o in outs])  # [STEPS + 1, V]
            err = max(err, (got - want[r][0, P - 1 :]).abs().max().item())
    assert err <= tol


def test_each_sample_reads_its_own_prompt(mcore_single):
    """Zeroing prompt 1's cached K/V changes rows G .. 2G-1 (its samples) and no other row."""
    model, _, _ = build("rope")
    prompts, conts = data(seed=1)
    with torch.no_grad():
        _, prefix, cache = decode_prompt_once(model, prompts, conts)
        clean = model.decode_step(cache, conts[:, STEPS])  # [R, 3G, V]
        prefix.keys[:, 1].zero_()  # [D, B, ng, T, hn]: prompt 1
        prefix.values[:, 1].zero_()
        cache.lengths -= 1  # rerun the same step against the corrupted prompt
        dirty = model.decode_step(cache, conts[:, STEPS])
    diff = (clean - dirty).abs().amax(dim=(0, 2))  # [3G]
    mine = torch.zeros(3 * G, dtype=torch.bool)
    mine[G : 2 * G] = True
    assert (diff[mine] > 1e-6).all()
    assert (diff[~mine] == 0).all()


def _prompts(seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (4, 9, 1, 6)]


@pytest.mark.parametrize("prompt_kv", ["shared", "copied"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("pe", ["learned_absolute", "rope"])
@pytest.mark.parametrize("group_size, temperature, top_p", [(4, 1.0, 1.0), (3, 0.8, 0.9),
                                                            (1, 0.0, 1.0)])
def test_generate_prompt_once_samples_as_per_row(mcore_single, pe, dtype, group_size,
                                                 temperature, top_p, prompt_kv):
    """Same seed: the same tokens and lengths; per-loop log-probs equal up to fp32 rounding
    (fp64 model: the stored fp32 values differ by at most one fp32 ulp; fp32 model: a few
    ulps of rounding through the layers, as the decode tests' 1e-5), whether the samples
    read one shared copy of their prompt's K/V or their own copies of it."""
    model, _, _ = build(pe, dtype)
    model.eval()
    eos = 5
    runs = []
    for prompt_once in (False, True):
        gen = torch.Generator().manual_seed(11)
        runs.append(generate(model, _prompts(2), group_size, 8, eos_id=eos, pad_id=0,
                             prompt_once=prompt_once, prompt_kv=prompt_kv,
                             sampling=Sampling(temperature=temperature, top_p=top_p, generator=gen,
                                               banned=(0, 1))))
    per_row, once = runs
    assert torch.equal(per_row.responses, once.responses)
    assert torch.equal(per_row.lengths, once.lengths)
    assert per_row.loop_logprobs.shape == (LOOPS, 4, group_size, 8)
    lp = per_row.loop_logprobs
    ulp = torch.finfo(torch.float32).eps * lp.abs().max().item()
    tol = ulp if dtype == torch.float64 else 1e-5
    assert (once.loop_logprobs - lp).abs().max().item() <= tol
    assert torch.equal(once.logprobs, once.loop_logprobs[-1])
    sampled = per_row.responses != 0
    assert (lp[:, ~sampled] == 0).all() and (lp[:, sampled] < 0).all()


def test_copy_rows_of_holds_each_prompt_in_its_rows(mcore_single):
    """A per-row cache filled from a prefilled prompt cache: row b holds prompt b // G's K/V
    at every depth and its length; its slots after the prompt stay empty."""
    model, _, _ = build("rope", torch.float32)
    prompts, _ = data()
    prefix = model.new_kv_cache(3, int(LENGTHS.max()))
    model.prefill(prefix, prompts, LENGTHS)
    cache = model.new_kv_cache(3 * G, int(LENGTHS.max()) + 4)
    cache.copy_rows_of(prefix)
    assert cache.lengths.tolist() == LENGTHS.repeat_interleave(G).tolist()
    P = prefix.max_length
    for d in range(model.config.looped_num_depths):
        want = prefix.read(d, P, torch.float32)  # [P, 3, ng, hn]
        got = cache.read(d, cache.max_length, torch.float32)  # [P + 4, 3G, ng, hn]
        for w, g in zip(want, got):
            assert torch.equal(g[:P], w.repeat_interleave(G, dim=1))
            assert not g[P:].any()


def test_copy_rows_of_errors(mcore_single):
    model, _, _ = build("learned_absolute")
    prefix = model.new_kv_cache(3, 7)
    with pytest.raises(ValueError, match="this one continues a prefix"):
        model.new_kv_cache(6, 4, prefix=prefix).copy_rows_of(prefix)
    with pytest.raises(ValueError, match="holds 7 positions per row, this cache 5"):
        model.new_kv_cache(6, 5).copy_rows_of(prefix)
    with pytest.raises(ValueError, match="cache of batch 5 cannot continue 3 prompts"):
        model.new_kv_cache(5, 9).copy_rows_of(prefix)


def test_prompt_kv_by_device_and_checked(mcore_single):
    assert default_prompt_kv("cpu") == "copied"
    assert default_prompt_kv("cuda") == default_prompt_kv("meta") == "shared"
    model, _, _ = build("learned_absolute")
    with pytest.raises(ValueError, match=r"prompt_kv must be one of \('shared', 'copied'\)"):
        generate(model, _prompts(2), 2, 3, eos_id=5, pad_id=0, prompt_once=True,
                 prompt_kv="once")


def test_prompt_once_cache_errors(mcore_single):
    model, _, _ = build("learned_absolute")
    other, _, _ = build("rope", torch.float32)
    prefix = model.new_kv_cache(3, 7)
    with pytest.raises(ValueError, match="batch must be a multiple"):
        model.new_kv_cache(5, 4, prefix=prefix)
    with pytest.raises(ValueError, match="prefix cache is torch.float64 on cpu"):
        other.new_kv_cache(6, 4, prefix=prefix)
    level = model.new_kv_cache(6, 4, prefix=prefix)  # a chain (tree decoding) is allowed
    assert level.chain() == [prefix]
    with pytest.raises(ValueError, match="cache of batch 9 cannot continue 6 prompts"):
        model.new_kv_cache(9, 4, prefix=level)
