"""Decoding on CUDA (``make gpu-check`` runs these; skipped without a GPU): the static cache
(the CUDA default: fixed shapes every step) samples the sliced cache's greedy tokens, a
rollout's decoded tokens make the host wait for the device 0 times in steady state, and 8
decode steps queued behind a sleeping GPU return to the host before the GPU finishes them."""

import pytest
import torch
from helpers.decode import VOCAB, build

from scalerlt_mcore.model.host_syncs import count_host_syncs
from scalerlt_mcore.rl.rollout import DecodeRecord, Sampling, decode_tokens, generate

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9, 10]]


def _greedy(model, steps: int, **kwargs):
    return generate(model, PROMPTS, 2, steps, eos_id=VOCAB + 1, pad_id=0,
                    sampling=Sampling(temperature=0.0, banned=(0,)), **kwargs)


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


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("prompt_once", [False, True])
def test_graphed_decoding_yields_the_eager_tokens(mcore_single, prompt_once, temperature):
    model = build("rope", torch.float32)[0].cuda().eval()
    model.rotary_pos_emb.inv_freq = model.rotary_pos_emb.inv_freq.cuda()

    def run(graph: bool):
        gen = torch.Generator(device="cuda").manual_seed(5)
        return generate(model, PROMPTS, 2, 8, eos_id=VOCAB + 1, pad_id=0, prompt_once=prompt_once,
                        cuda_graph=graph,
                        sampling=Sampling(banned=(0,), temperature=temperature, generator=gen))

    eager, graphed = run(False), run(True)
    assert torch.equal(eager.responses, graphed.responses)
    assert torch.allclose(eager.loop_logprobs, graphed.loop_logprobs, atol=1e-5)


@pytest.mark.parametrize("prompt_once", [False, True])
def test_kept_graphs_capture_once_per_shape(mcore_single, prompt_once):
    """Rollouts through one ``DecodeGraphs`` (``--rl-decode-cuda-graph``): prompts that pad
    to the same width replay the first rollout's graph and sample the eager tokens."""
    from scalerlt_mcore.model.decode_graph import DecodeGraphs

    model = build("rope", torch.float32)[0].cuda().eval()
    model.rotary_pos_emb.inv_freq = model.rotary_pos_emb.inv_freq.cuda()
    graphs = DecodeGraphs()
    for prompts in (PROMPTS, [[3, 4], [5, 6, 7, 8, 9, 10], [11]]):
        graphed, eager = (generate(model, prompts, 2, 8, eos_id=VOCAB + 1, pad_id=0,
                                   prompt_once=prompt_once, cuda_graph=graph,
                                   sampling=Sampling(temperature=0.0, banned=(0,)))
                          for graph in (graphs, False))
        assert torch.equal(eager.responses, graphed.responses)
    assert graphs.captures == 1


def test_graphed_step_rejects_a_sliced_cache(mcore_single):
    from scalerlt_mcore.model.decode_graph import DecodeGraph

    model = build("learned_absolute", torch.float32)[0].cuda().eval()
    with pytest.raises(ValueError, match="needs a static cache"):
        DecodeGraph(model, model.new_kv_cache(2, 8, static=False))


def test_eight_decode_steps_run_ahead_of_the_gpu(mcore_single):
    """Sampling 9 tokens and feeding 8 (the ban mask uploaded, the static cache) behind a GPU
    busy for about a second: the host is back while the GPU still sleeps, so nothing in the
    steps waits for the device (a sync would block until the sleep ends)."""
    model = build("rope", torch.float32)[0].cuda().eval()
    model.rotary_pos_emb.inv_freq = model.rotary_pos_emb.inv_freq.cuda()
    prompts = torch.tensor([[1, 2, 3, 4]] * 6, device="cuda")  # [B, Tp]
    lengths = torch.full((6,), 4, dtype=torch.long)

    @torch.no_grad()
    def decode(steps: int = 9):  # 9 tokens sampled, 8 fed through decode steps
        gen = torch.Generator(device="cuda").manual_seed(0)
        cache = model.new_kv_cache(6, 4 + steps, static=True)
        logits, exit_lp = model.prefill(cache, prompts, lengths, with_exit=True)
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)  # cycles: about a second
        sampling = Sampling(generator=gen, banned=(0,), stop_check_interval=100)
        rec = DecodeRecord(logits.shape[0], 6, steps, 0, VOCAB + 1, logits.device, False)
        step = lambda t: model.decode_step(cache, t, with_exit=True)  # noqa: E731
        decode_tokens(step, logits, exit_lp, rec, steps, sampling.on(logits.shape[-1], "cuda"))
        done = torch.cuda.Event()
        done.record()
        ahead = not done.query()
        torch.cuda.synchronize()
        return ahead

    decode()  # warm-up: kernels loaded, the allocators' blocks cached
    assert decode(), "the host waited for the GPU inside the decode steps"
