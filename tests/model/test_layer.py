"""The layer's direct forward (``model/layer.py``): without a recorded graph
``LoopedTransformerLayer`` gives MCore's ``TransformerLayer`` output bitwise; with a graph, with
dropout in training, or with MCore-only arguments MCore's forward runs."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.transformer_layer import TransformerLayer

from scalerlt_mcore.model import LoopedTransformerConfig, get_looped_gpt_layer_local_spec
from scalerlt_mcore.model.layer import LoopedMLP, LoopedTransformerLayer, _plain_add
from scalerlt_mcore.model.specs import _mlp_entry, get_looped_sandwich_layer_local_spec

H = 32


def _config(dtype, **kwargs):
    return LoopedTransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=4,
                                   num_query_groups=2, use_cpu_initialization=True,
                                   params_dtype=dtype, bf16=dtype == torch.bfloat16, **kwargs)


def _pair(spec_fn, dtype=torch.float32, **kwargs) -> tuple:
    """(MCore's TransformerLayer with MCore's MLP, the looped layer with the looped MLP) from
    one layer spec, the same random weights (every parameter drawn, biases and norms
    included). A sandwich MLP stays in both."""
    spec = spec_fn()
    assert spec.module is LoopedTransformerLayer  # what the looped specs build
    config = _config(dtype, **kwargs)
    ours = LoopedTransformerLayer(config, spec.submodules, layer_number=1)
    mlp = _mlp_entry(spec.submodules.mlp, LoopedMLP, MLP) or spec.submodules.mlp
    stock = TransformerLayer(config, dataclasses.replace(spec.submodules, mlp=mlp),
                             layer_number=1)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(torch.randn(p.shape, generator=gen).to(dtype) * 0.3 + (p.dim() == 1))
    stock.load_state_dict(ours.state_dict())
    return stock.eval(), ours.eval()


def _input(dtype, s=5, b=3):
    return torch.randn(s, b, H, generator=torch.Generator().manual_seed(1)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("normalization,glu", [("LayerNorm", False), ("RMSNorm", True)])
def test_direct_forward_equals_mcores(mcore_single, dtype, bias, normalization, glu):
    """Biases (added by MCore's bias-dropout-add), dropout configured (off in eval), both
    norms, a plain and a gated (SwiGLU) MLP, bf16 (its residual adds rounded as MCore rounds
    them)."""
    act = dict(gated_linear_unit=True, activation_func=F.silu) if glu else {}
    stock, ours = _pair(lambda: get_looped_gpt_layer_local_spec(normalization=normalization),
                        dtype, add_bias_linear=bias, hidden_dropout=0.1,
                        normalization=normalization, **act)
    x = _input(dtype)
    with torch.no_grad():
        got, context = ours(x)
        want, _ = stock(x)
    assert context is None and got.dtype == dtype and torch.equal(got, want)


def test_sandwich_layer_direct_forward_equals_mcores(mcore_single):
    """Ouro's sandwich norms live in the attention and MLP submodules: the same layer."""
    stock, ours = _pair(get_looped_sandwich_layer_local_spec, normalization="RMSNorm",
                        add_bias_linear=False)
    x = _input(torch.float32)
    with torch.no_grad():
        assert torch.equal(ours(x)[0], stock(x)[0])


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("residual_dtype", [torch.bfloat16, torch.float32])
def test_residual_add_is_mcores_bias_dropout_add(mcore_single, fused, with_bias, residual_dtype):
    """Against MCore's inference bias-dropout-add (unfused and TorchScript-fused) of a bf16
    output, with and without a bias, with a residual of its dtype or of fp32: the plain add
    where it is one add, MCore's own function otherwise (fused, it rounds once; the result's
    dtype is the installed MCore's: 0.16 casts the residual to the output's, 0.19 does not)."""
    _, layer = _pair(get_looped_gpt_layer_local_spec, torch.bfloat16,
                     bias_dropout_fusion=fused)
    gen = torch.Generator().manual_seed(2)
    out = torch.randn(4, 2, H, generator=gen).bfloat16()
    bias = torch.randn(H, generator=gen).bfloat16() if with_bias else None
    residual = torch.randn(4, 2, H, generator=gen).to(residual_dtype)
    with torch.no_grad():
        want = get_bias_dropout_add(False, fused)((out.clone(), bias), residual, 0.1)
        got = layer._residual_add(layer.mlp_bda, (out, bias), residual)
    assert got.dtype == want.dtype and torch.equal(got, want)
    assert _plain_add((out, bias), residual) == (not with_bias and residual_dtype == out.dtype)


def _counting(monkeypatch) -> list:
    calls = []
    original = TransformerLayer._forward_attention
    monkeypatch.setattr(TransformerLayer, "_forward_attention",
                        lambda self, *a, **k: calls.append(1) or original(self, *a, **k))
    return calls


def test_mcores_forward_where_the_direct_path_does_not_apply(mcore_single, monkeypatch):
    stock, ours = _pair(get_looped_gpt_layer_local_spec, hidden_dropout=0.5)
    calls = _counting(monkeypatch)
    x = _input(torch.float32)
    with torch.no_grad():
        ours(x)
        assert calls == []  # eval, no graph: direct
        ours(x, context=None)  # an argument only MCore's forward takes
        assert calls == [1]
    out, _ = ours(x)  # a graph recorded: MCore's forward, the same tensor
    assert calls == [1, 1] and out.requires_grad
    with torch.no_grad():
        assert torch.equal(out, stock(x)[0])
    ours.train()
    with torch.no_grad():
        dropped, _ = ours(x)  # training with dropout 0.5: MCore's forward draws the mask
    assert calls == [1, 1, 1, 1] and not torch.equal(dropped, out.detach())


GLU = dict(gated_linear_unit=True, activation_func=F.silu)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_gated_mlp_direct_forward_equals_mcores(mcore_single, dtype, bias):
    stock, ours = _pair(get_looped_gpt_layer_local_spec, dtype, add_bias_linear=bias, **GLU)
    x = _input(dtype)
    with torch.no_grad():
        got, want = ours.mlp(x), stock.mlp(x)
    assert type(ours.mlp) is LoopedMLP and type(stock.mlp) is MLP
    assert torch.equal(got[0], want[0]) and (got[1] is None) == (want[1] is None)
    assert not bias or torch.equal(got[1], want[1])


@pytest.mark.parametrize("extra", [dict(glu_linear_offset=1.0),
                                   dict(activation_func_clamp_value=0.5),
                                   dict(gated_linear_unit=False)], ids=["offset", "clamp", "plain"])
def test_mlp_takes_mcores_forward_where_the_offset_add_matters(mcore_single, monkeypatch,
                                                               extra):
    """A nonzero offset or a clamp (MCore's glu does them) and an ungated MLP: MCore's
    forward, the same tensor; a gated MLP with a graph recorded too."""
    _, ours = _pair(get_looped_gpt_layer_local_spec, **{**GLU, **extra})
    calls = []
    original = MLP.forward
    monkeypatch.setattr(MLP, "forward", lambda self, *a, **k: calls.append(1)
                        or original(self, *a, **k))
    x = _input(torch.float32)
    with torch.no_grad():
        ours.mlp(x)
    assert calls == [1]
    _, gated = _pair(get_looped_gpt_layer_local_spec, **GLU)
    with torch.no_grad():
        gated.mlp(x)
    assert calls == [1]
    assert gated.mlp(x)[0].requires_grad and calls == [1, 1]
