"""GPU-path behaviour that a CPU run cannot time or see, checked by what reaches torch.

- the cost model's timing brackets a CUDA step with device syncs (else it plans from launch
  time);
- the main job binds its CUDA device before creating the process group, and hands it to
  ``init_process_group`` as ``device_id`` (a bad NCCL setup then fails at once);
- SDPA never gets an explicit mask together with ``enable_gqa`` (on CUDA that pair runs the
  math kernel, materialising the scores), and the rollout prefill from an empty cache is
  plain causal (``is_causal``, no mask: a fused kernel on CUDA). The decode tests
  (test_model_decode.py) check the values of both paths against an independent reference.
"""

import math
import types

import pytest
import torch
import torch.distributed as dist

from scalerlt_mcore.app import runtime
from scalerlt_mcore.model import LoopedGPTModel, get_looped_gpt_layer_local_spec, kernels
from scalerlt_mcore.model.config import LoopedTransformerConfig
from scalerlt_mcore.shared_prefix import planner


class _CudaTokens:
    """What ``_time_step`` asks of a CUDA token batch."""

    is_cuda = True


def test_cost_model_timing_syncs_the_device_around_the_step(monkeypatch):
    events = []
    weight = torch.nn.Parameter(torch.ones(3))
    weight.register_hook(lambda g: events.append("backward"))

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = weight

        def forward(self, tokens, labels):
            events.append("forward")
            return types.SimpleNamespace(logprobs=self.weight * 2)

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: events.append("sync"))
    seconds = planner._time_step(Model(), _CudaTokens())
    assert events == ["sync", "forward", "backward", "sync"] and seconds >= 0
    events.clear()
    planner._time_step(Model(), torch.zeros(2, dtype=torch.long))  # CPU: no sync
    assert events == ["forward", "backward"]


def test_cuda_device_is_set_before_the_process_group_and_passed_as_device_id(monkeypatch):
    events = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: events.append(("set_device", d)))
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: events.append(
        ("init_process_group", backend, kw.get("device_id"))))
    monkeypatch.setattr(runtime.parallel_state, "initialize_model_parallel", lambda **kw: None)
    monkeypatch.setattr(runtime, "model_parallel_cuda_manual_seed", lambda seed: None)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    cfg = types.SimpleNamespace(
        training=types.SimpleNamespace(distributed_timeout_minutes=1, seed=0),
        model=types.SimpleNamespace(tensor_model_parallel_size=1,
                                    pipeline_model_parallel_size=1))
    assert runtime.init_distributed(cfg) == "cuda"
    device = torch.device("cuda", 1)
    assert events == [("set_device", device), ("init_process_group", "nccl", device)]


class _SdpaCalls:
    """Records every ``F.scaled_dot_product_attention`` call of the attention kernels."""

    def __init__(self, monkeypatch):
        self.calls, real = [], kernels.F.scaled_dot_product_attention

        def record(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
            self.calls.append((attn_mask is not None, is_causal, enable_gqa))
            return real(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                        enable_gqa=enable_gqa)

        monkeypatch.setattr(kernels.F, "scaled_dot_product_attention", record)


def test_masked_sdpa_repeats_kv_heads_instead_of_enable_gqa(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(5, 2, 4, 8, generator=gen, dtype=torch.float64)  # [s, b, np, hn]
    k, v = (torch.randn(7, 2, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    allowed = torch.rand(5, 7, generator=gen) > 0.3
    allowed[:, 0] = True
    sdpa = _SdpaCalls(monkeypatch)
    out = kernels.sdpa(q, k, v, allowed, 0.25)  # [b, np, s, hn]
    assert sdpa.calls == [(True, False, False)]
    keys, vals = (t.repeat_interleave(2, dim=2) for t in (k, v))  # [7, b, np, hn]
    scores = torch.einsum("sbhd,tbhd->bhst", q, keys) * 0.25
    probs = scores.masked_fill(~allowed, -math.inf).softmax(-1)
    assert torch.allclose(out, torch.einsum("bhst,tbhd->bhsd", probs, vals), atol=1e-12)
    kernels.sdpa(q, k, v, None, 0.25, causal=True)  # unmasked GQA keeps enable_gqa
    assert sdpa.calls[-1] == (False, True, True)
    with torch.no_grad():  # decoding on CPU: the CPU kernel takes the pair, the same output
        fast = kernels.sdpa(q, k, v, allowed, 0.25)
    assert sdpa.calls[-1] == (True, False, True) and torch.equal(fast, out)


@pytest.mark.usefixtures("mcore_single")
def test_prefill_from_an_empty_cache_is_plain_causal(monkeypatch):
    cfg = LoopedTransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                                  num_query_groups=2, use_cpu_initialization=True,
                                  looped_num_loops=2)
    model = LoopedGPTModel(cfg, get_looped_gpt_layer_local_spec(), 64, 32)
    cache = model.new_kv_cache(3, 12)
    sdpa = _SdpaCalls(monkeypatch)
    model.prefill(cache, torch.randint(0, 64, (3, 6)), torch.tensor([6, 2, 4]))
    assert sdpa.calls and set(sdpa.calls) == {(False, True, True)}  # 2 loops x 2 layers
    assert not cache.fresh
    sdpa.calls.clear()
    model.decode_step(cache, torch.randint(0, 64, (3,)))  # decoding reads the cache, masked
    assert sdpa.calls and set(sdpa.calls) == {(True, False, True)}  # CPU: GQA unrepeated
