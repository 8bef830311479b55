"""Decoding on CUDA (``make gpu-check`` runs these; skipped without a GPU): the static cache
(the CUDA default: fixed shapes every step) samples the sliced cache's greedy tokens, and a
rollout's decoded tokens make the host wait for the device 0 times in steady state."""

import pytest
import torch
from helpers.decode import VOCAB, build

from scalerlt_mcore.model.host_syncs import count_host_syncs
from scalerlt_mcore.rl.rollout import generate

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10]]


def _greedy(model, steps: int, **kwargs):
    return generate(model, PROMPTS, 2, steps, eos_id=VOCAB + 1, pad_id=0, temperature=0.0,
                    banned=(0,), **kwargs)


@pytest.mark.parametrize("prompt_once", [False, True])
def test_static_cache_on_cuda_greedy_tokens_and_no_syncs(mcore_single, prompt_once):
    model = build("rope", torch.float32)[0].cuda().eval()
    model.rotary_pos_emb.inv_freq = model.rotary_pos_emb.inv_freq.cuda()
    static = _greedy(model, 6, prompt_once=prompt_once)
    sliced = _greedy(model, 6, prompt_once=prompt_once, static_cache=False)
    assert torch.equal(static.responses, sliced.responses)
    assert torch.allclose(static.logprobs, sliced.logprobs, atol=1e-4)
    counts = [count_host_syncs(_greedy, model, n, prompt_once=prompt_once,
                               stop_check_interval=100)[1].total for n in (3, 9)]
    print(f"\n[decode cuda] host syncs of a rollout of 3 / 9 tokens: {counts}")
    assert counts[0] == counts[1]
