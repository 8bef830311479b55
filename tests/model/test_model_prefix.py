"""Prefix state: a prompt computed once, suffixes computed against its per-depth K/V.

The suffix's per-loop logits (and `suffix_logprobs`) must equal those of one forward over
prompt + suffix, for both prefix attentions, with one prompt shared by a batch and with one
prompt per sequence. The two prefix attention functions must agree with each other and with
an explicit masked softmax, in value and gradient.
"""

import math
from functools import partial

import pytest
import torch

from scalerlt_mcore.model import LoopedGPTModel, get_looped_gpt_layer_local_spec
from scalerlt_mcore.model.config import LoopedTransformerConfig
from scalerlt_mcore.model.kernels import cascade_prefix_attention, concat_prefix_attention
from scalerlt_mcore.shared_prefix.planner import ModelShape, prefix_bytes

VOCAB, PROMPT, SUFFIX = 64, 7, 6



def build(pe: str, mode: str, groups: int = 4) -> LoopedGPTModel:
    """R=3, prelude + coda + injection, random weights, fp64."""
    cfg = LoopedTransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=groups,
        use_cpu_initialization=True, looped_num_loops=3, looped_num_prelude_layers=1,
        looped_num_coda_layers=1, looped_injection="linear_concat",
        looped_prefix_attention=mode,
    )
    model = LoopedGPTModel(cfg, get_looped_gpt_layer_local_spec(), VOCAB, 32,
                           position_embedding_type=pe).double()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            p.copy_(1 + 0.1 * noise if "layernorm.weight" in name else 0.2 * noise)
    return model


def batch(prefix_batch: int, seed: int = 0) -> torch.Tensor:
    """[3, P + S] tokens; with prefix_batch 1 every row shares the same prompt."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB, (3, PROMPT + SUFFIX), generator=gen)
    if prefix_batch == 1:
        tokens[:, :PROMPT] = tokens[:1, :PROMPT]
    return tokens


CASES = [
    pytest.param(pe, mode, bp, id=f"{pe}-{mode}-prefix{bp}")
    for pe in ("learned_absolute", "rope") for mode in ("cascade", "concat") for bp in (1, 3)
]


@pytest.mark.parametrize("pe, mode, prefix_batch", CASES)
def test_suffix_logits_match_full_forward(mcore_single, pe, mode, prefix_batch):
    model = build(pe, mode, groups=2 if prefix_batch == 1 else 4)
    tokens = batch(prefix_batch)
    with torch.no_grad():
        full = model(tokens).logits  # R x [3, P+S, V]
        out = model(tokens[:prefix_batch, :PROMPT], return_prefix_state=True, readout=False)
        state = out.prefix_state
        suffix = model(tokens[:, PROMPT:], prefix_state=state).logits
    assert out.logits is None and state.batch == prefix_batch and state.length == PROMPT
    assert len(suffix) == 3
    err = max((f[:, PROMPT:] - s).abs().max().item() for f, s in zip(full, suffix, strict=True))
    assert err <= 1e-10
    # The boundary (last prompt position's readout input) gives the first suffix token's logits.
    boundary_logits = model.readout(state.boundary)  # loops in the sequence slot: [Bp, R, V]
    for r in range(3):
        want = full[r][:prefix_batch, PROMPT - 1]
        assert (boundary_logits[:, r] - want).abs().max().item() <= 1e-10


@pytest.mark.parametrize("mode, prefix_batch", [
    pytest.param(mode, bp, id=f"{mode}-prefix{bp}")
    for mode in ("cascade", "concat") for bp in (1, 3)
])
def test_suffix_logprobs_match_full_forward(mcore_single, mode, prefix_batch):
    model = build("rope", mode)
    tokens = batch(prefix_batch, seed=1)
    with torch.no_grad():
        full = model(tokens).logits
        state = model(tokens[:prefix_batch, :PROMPT], return_prefix_state=True,
                      readout=False).prefix_state
        got = model.suffix_logprobs(state, tokens[:, PROMPT:])  # [R, 3, S]
    targets = tokens[:, PROMPT:, None]
    want = torch.stack([
        lg[:, PROMPT - 1 : -1].log_softmax(-1).gather(-1, targets)[..., 0] for lg in full
    ])
    assert got.shape == (3, 3, SUFFIX)
    assert (got - want).abs().max().item() <= 1e-10


def test_suffix_logprobs_single_token(mcore_single):
    """A one-token suffix is read from the boundary alone."""
    model = build("rope", "cascade")
    tokens = batch(1, seed=2)[:, : PROMPT + 1]
    with torch.no_grad():
        full = model(tokens).logits
        state = model(tokens[:1, :PROMPT], return_prefix_state=True, readout=False).prefix_state
        got = model.suffix_logprobs(state, tokens[:, PROMPT:])
    want = torch.stack([lg[:, -2].log_softmax(-1).gather(-1, tokens[:, -1:]) for lg in full])
    assert got.shape == (3, 3, 1)
    assert (got - want).abs().max().item() <= 1e-10


def test_prefix_state_gradient_matches_full_forward(mcore_single):
    """Parameter gradients of the suffix log-probs: prefix path == one full forward."""
    model = build("rope", "cascade")
    tokens = batch(1, seed=3)
    full = model(tokens[:, :-1], labels=tokens[:, 1:]).logprobs  # [R, 3, P+S-1]
    full[:, :, PROMPT - 1 :].sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    state = model(tokens[:1, :PROMPT], return_prefix_state=True, readout=False).prefix_state
    model.suffix_logprobs(state, tokens[:, PROMPT:]).sum().backward()
    err = max((p.grad - want[n]).abs().max().item() for n, p in model.named_parameters())
    assert err <= 1e-10


# ---- the two prefix attention functions ---------------------------------------------------


def explicit_prefix_attention(q, k, v, pk, pv, scale):
    """Masked softmax over [prefix; own keys], prefix all visible, own keys causal."""
    S, B, heads, _ = q.shape
    rep = heads // k.shape[2]
    keys = torch.cat([pk.expand(-1, B, -1, -1), k]).repeat_interleave(rep, dim=2)  # [P+S,B,h,d]
    vals = torch.cat([pv.expand(-1, B, -1, -1), v]).repeat_interleave(rep, dim=2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q, keys) * scale
    P = pk.shape[0]
    future = torch.ones(S, P + S, dtype=torch.bool).triu(diagonal=P + 1)
    probs = scores.masked_fill(future, float("-inf")).softmax(-1)
    return torch.einsum("bhqk,kbhd->bhqd", probs, vals)  # [B, heads, S, d]


def _inputs(dtype, prefix_batch: int, seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    S, B, P, heads, groups, d = 5, 3, 6, 4, 2, 8
    shapes = [(S, B, heads, d), (S, B, groups, d), (S, B, groups, d),
              (P, prefix_batch, groups, d), (P, prefix_batch, groups, d)]
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
            for s in shapes]


def _value_and_grads(fn, inputs, cotangent):
    out = fn(*inputs, 1 / math.sqrt(inputs[0].shape[-1]))
    grads = torch.autograd.grad(out, inputs, cotangent)
    return [out, *grads]


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)],
                         ids=["fp64", "fp32"])
@pytest.mark.parametrize("prefix_batch", [1, 3])
@pytest.mark.parametrize("kernel", ["cpu_flash", "matmul"], ids=["cpu-flash", "matmul"])
def test_cascade_equals_concat_attention(dtype, tol, prefix_batch, kernel):
    """Values and gradients w.r.t. q, k, v, prefix k, prefix v, with GQA (4 heads, 2 groups);
    both cascade kernels (CPU flash with its custom backward, and the matmul path)."""
    inputs = _inputs(dtype, prefix_batch, seed=prefix_batch)
    cot = torch.randn(3, 4, 5, 8, generator=torch.Generator().manual_seed(9),
                      dtype=torch.float64).to(dtype)  # [B, heads, S, d]
    cascade = _value_and_grads(partial(cascade_prefix_attention, kernel=kernel), inputs, cot)
    concat = _value_and_grads(concat_prefix_attention, inputs, cot)
    explicit = _value_and_grads(explicit_prefix_attention, inputs, cot)
    names = ["out", "dq", "dk", "dv", "dpk", "dpv"]
    for name, a, b, c in zip(names, cascade, concat, explicit, strict=True):
        assert a.shape == b.shape == c.shape, name
        assert (a - b).abs().max().item() <= tol, name
        assert (a - c).abs().max().item() <= tol, name


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


@pytest.mark.parametrize("pe,groups", [("rope", 2), ("learned_absolute", 4)])
def test_prefix_state_keeps_only_k_and_v(mcore_single, pe, groups):
    """A prefix state recorded without a graph (the prompt producer's, scoring's), and one
    recorded by fully recomputed layers, hold K and V of every depth and nothing else of each
    depth's QKV output (no queries): storage bytes = depths x 2 x P x kv groups x head dim,
    as the planner counts them (``prefix_bytes``)."""
    model = build(pe, "cascade", groups)
    tokens = torch.randint(0, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(2))
    c = model.config
    kv_bytes = c.looped_num_depths * 2 * PROMPT * groups * c.kv_channels * 8  # fp64
    with torch.no_grad():
        state = model(tokens, return_prefix_state=True, readout=False).prefix_state
    assert _storage_bytes(state.keys + state.values) == kv_bytes
    assert prefix_bytes(ModelShape.from_model(model), PROMPT) == kv_bytes  # the planner's
    c.recompute_granularity, c.recompute_method, c.recompute_num_layers = "full", "uniform", 1
    state = model(tokens, return_prefix_state=True, readout=False).prefix_state
    assert state.keys[-1].requires_grad  # recorded through the checkpoint, with its graph
    assert _storage_bytes(state.keys + state.values) == kv_bytes
