"""Layer specs of the looped GPT, in the style of MCore's test_spec_customization.py: build on
a tiny config, assert the module types and the exact parameter count (hand formula)."""

import importlib.util
from types import SimpleNamespace

import pytest
import torch
from megatron.core.models.common.embeddings.language_model_embedding import (
    LanguageModelEmbedding,
)
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer

from scalerlt_mcore.mcore_compat import mcore_at_least
from scalerlt_mcore.model import (
    LoopedBlockSubmodules,
    LoopedCoreAttention,
    LoopedGPTModel,
    LoopedSelfAttention,
    RecurrentTransformerBlock,
    get_looped_gpt_block_spec,
    get_looped_gpt_layer_local_spec,
    get_looped_gpt_layer_te_spec,
)
from scalerlt_mcore.model import specs as specs_module
from scalerlt_mcore.model.block import LinearConcatInjection
from scalerlt_mcore.model.config import LoopedTransformerConfig
from scalerlt_mcore.model.layer import LoopedMLP, LoopedTransformerLayer
from scalerlt_mcore.model.linear import ColumnParallelLinear as DirectColumn
from scalerlt_mcore.model.linear import RowParallelLinear as DirectRow
from scalerlt_mcore.model.sandwich import SandwichMLP
from scalerlt_mcore.model.specs import get_looped_sandwich_layer_local_spec

H, HEADS, V, MAX_LEN = 32, 4, 64, 16


def build(spec=None, pe="learned_absolute", tied=False, te=False, **cfg_kw):
    cfg_kw = {"num_layers": 2, "use_cpu_initialization": True, **cfg_kw}
    cfg = LoopedTransformerConfig(hidden_size=H, num_attention_heads=HEADS, **cfg_kw)
    spec = spec or get_looped_gpt_block_spec(cfg, use_transformer_engine=te)
    return LoopedGPTModel(cfg, spec, V, MAX_LEN, position_embedding_type=pe,
                          share_embeddings_and_output_weights=tied)


def all_layers(model) -> list:
    block = model.decoder
    return [*block.prelude, *block.layers, *block.coda]


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


# ---- the spec itself -----------------------------------------------------------------------


def _mlp_spec(spec: ModuleSpec) -> tuple:
    """(module class, submodules) of a layer spec's MLP: a ModuleSpec in MCore 0.16, a
    ``functools.partial`` of ``MLP.as_mlp_submodule`` from MCore 0.19 on."""
    mlp = spec.submodules.mlp
    if mcore_at_least("0.19"):
        return mlp.func.__self__, mlp.keywords["submodules"]
    return mlp.module, mlp.submodules


def _no_qk_norm(norm) -> bool:
    """An attention's q/k norm when qk_layernorm is off: IdentityOp in MCore 0.16, None from
    0.19 on."""
    return norm is None if mcore_at_least("0.19") else isinstance(norm, IdentityOp)


def test_local_spec_swaps_attention_and_linears():
    spec = get_looped_gpt_layer_local_spec()
    stock = get_gpt_layer_local_spec()
    assert isinstance(spec, ModuleSpec) and spec.module is LoopedTransformerLayer
    assert issubclass(LoopedTransformerLayer, TransformerLayer)
    assert stock.module is TransformerLayer  # MCore's own spec is not modified
    attn = spec.submodules.self_attention
    assert attn.module is LoopedSelfAttention and issubclass(LoopedSelfAttention, SelfAttention)
    assert attn.submodules.core_attention is LoopedCoreAttention
    assert attn.submodules.linear_qkv is DirectColumn
    assert attn.submodules.linear_proj is DirectRow
    assert attn.params == stock.submodules.self_attention.params  # causal mask type
    mlp, mlp_parts = _mlp_spec(spec)
    assert mlp is LoopedMLP and issubclass(LoopedMLP, MLP)
    assert _mlp_spec(stock)[0] is MLP  # MCore's own spec is not modified
    assert mlp_parts.linear_fc1 is DirectColumn
    assert mlp_parts.linear_fc2 is DirectRow
    assert spec.submodules.input_layernorm is stock.submodules.input_layernorm
    # MCore's own spec is not modified by building ours
    assert get_gpt_layer_local_spec().submodules.self_attention.module is SelfAttention
    stock_attn = get_gpt_layer_local_spec().submodules.self_attention.submodules
    assert stock_attn.linear_qkv is ColumnParallelLinear
    assert issubclass(DirectColumn, ColumnParallelLinear)
    assert issubclass(DirectRow, RowParallelLinear)
    core = get_gpt_layer_local_spec().submodules.self_attention.submodules.core_attention
    assert core is DotProductAttention


def test_sandwich_spec_keeps_mcores_mlp_form():
    """The sandwich spec swaps MLP for SandwichMLP in the form MCore's spec holds (a ModuleSpec
    in 0.16, an ``as_mlp_submodule`` partial in 0.19) and adds the output norm."""
    spec = get_looped_sandwich_layer_local_spec()
    assert type(spec.submodules.mlp) is type(get_gpt_layer_local_spec().submodules.mlp)
    mlp, mlp_parts = _mlp_spec(spec)
    assert mlp is SandwichMLP
    assert mlp_parts.linear_fc1 is DirectColumn
    assert mlp_parts.linear_fc2 is DirectRow
    assert mlp_parts.post_layernorm is not None


def test_sandwich_layer_builds_a_sandwich_mlp(mcore_single):
    cfg = LoopedTransformerConfig(num_layers=1, hidden_size=H, num_attention_heads=HEADS,
                                  use_cpu_initialization=True, normalization="RMSNorm",
                                  add_bias_linear=False, looped_family="ouro")
    model = LoopedGPTModel(cfg, get_looped_gpt_block_spec(cfg), V, MAX_LEN)
    for layer in all_layers(model):
        assert isinstance(layer.mlp, SandwichMLP)
        assert isinstance(layer.mlp.post_layernorm, torch.nn.RMSNorm)
    model(torch.randint(0, V, (2, 5))).logits[-1].sum().backward()


# ---- module types of the built model -------------------------------------------------------


@pytest.mark.parametrize("pe", ["learned_absolute", "rope"])
def test_built_module_types(mcore_single, pe):
    model = build(pe=pe, num_layers=2, looped_num_loops=3, looped_num_prelude_layers=1,
                  looped_num_coda_layers=2, looped_injection="linear_concat")
    assert isinstance(model.embedding, LanguageModelEmbedding)
    assert hasattr(model, "rotary_pos_emb") == (pe == "rope")
    if pe == "rope":
        assert isinstance(model.rotary_pos_emb, RotaryEmbedding)
    assert isinstance(model.decoder, RecurrentTransformerBlock)
    assert (len(model.decoder.prelude), len(model.decoder.layers), len(model.decoder.coda)) == (
        1, 2, 2)  # the core is built once, not per loop
    for layer in all_layers(model):
        assert isinstance(layer, TransformerLayer)
        attn = layer.self_attention
        assert isinstance(attn, LoopedSelfAttention)
        assert isinstance(attn.core_attention, LoopedCoreAttention)
        assert isinstance(attn.linear_qkv, ColumnParallelLinear)
        assert isinstance(attn.linear_proj, RowParallelLinear)
        assert _no_qk_norm(attn.q_layernorm)
        assert isinstance(layer.input_layernorm, torch.nn.LayerNorm)
        assert isinstance(layer.pre_mlp_layernorm, torch.nn.LayerNorm)
        assert isinstance(layer.mlp, MLP)
        assert isinstance(layer.mlp.linear_fc1, ColumnParallelLinear)
        assert isinstance(layer.mlp.linear_fc2, RowParallelLinear)
    assert isinstance(model.decoder.injection, LinearConcatInjection)
    assert isinstance(model.decoder.final_layernorm, torch.nn.LayerNorm)
    assert isinstance(model.output_layer, ColumnParallelLinear)


def test_layer_numbers_are_distinct(mcore_single):
    """Prelude, core and coda layers are numbered 1..n in order (MCore keys caches by it)."""
    model = build(num_layers=2, looped_num_loops=3, looped_num_prelude_layers=2,
                  looped_num_coda_layers=1)
    numbers = [layer.layer_number for layer in all_layers(model)]
    assert numbers == [1, 2, 3, 4, 5]
    assert [la.self_attention.layer_number for la in all_layers(model)] == numbers


def test_block_spec_names_every_part():
    cfg = LoopedTransformerConfig(num_layers=2, hidden_size=H, num_attention_heads=HEADS,
                                  use_cpu_initialization=True, looped_injection="linear_concat")
    spec = get_looped_gpt_block_spec(cfg)
    assert spec.module is RecurrentTransformerBlock
    sub = spec.submodules
    assert isinstance(sub, LoopedBlockSubmodules)
    for part in (sub.prelude, sub.core, sub.coda):
        assert part.submodules.self_attention.module is LoopedSelfAttention
    assert sub.injection is LinearConcatInjection
    none = get_looped_gpt_block_spec(LoopedTransformerConfig(
        num_layers=2, hidden_size=H, num_attention_heads=HEADS, use_cpu_initialization=True))
    assert none.submodules.injection is None


class _GatedInjection(torch.nn.Module):
    """A user's own injection: x = s + g * e with a learned scalar gate."""

    def __init__(self, config):
        super().__init__()
        self.gate = torch.nn.Parameter(torch.zeros(()))

    def forward(self, state, embed):
        return state + self.gate * embed


def test_parts_swap_by_spec(mcore_single):
    """A user swaps the injection and the core layers' spec without touching the block. (MCore
    0.19 builds a spec's q/k norm only with qk_layernorm in the config, and refuses one without;
    a spec's IdentityOp stays one either way.)"""
    cfg = LoopedTransformerConfig(num_layers=2, hidden_size=H, num_attention_heads=HEADS,
                                  use_cpu_initialization=True, looped_num_prelude_layers=1,
                                  looped_injection="linear_concat", qk_layernorm=True)
    spec = get_looped_gpt_block_spec(cfg)
    spec.submodules.injection = _GatedInjection
    spec.submodules.core = get_looped_gpt_layer_local_spec(qk_layernorm=True)
    model = LoopedGPTModel(cfg, spec, V, MAX_LEN)
    assert isinstance(model.decoder.injection, _GatedInjection)
    assert model.decoder.layers[0].self_attention.q_layernorm is not None
    assert isinstance(model.decoder.prelude[0].self_attention.q_layernorm, IdentityOp)
    model(torch.randint(0, V, (2, 5))).logits[-1].sum().backward()
    assert model.decoder.injection.gate.grad is not None


def test_no_injection_module_without_injection(mcore_single):
    assert build(looped_injection="none").decoder.injection is None


def test_rms_norm_spec(mcore_single):
    model = build(normalization="RMSNorm", looped_num_prelude_layers=1)
    for layer in all_layers(model):
        assert isinstance(layer.input_layernorm, torch.nn.RMSNorm)
    assert isinstance(model.decoder.final_layernorm, torch.nn.RMSNorm)


# ---- exact parameter counts ----------------------------------------------------------------


def expected_params(*, n_layers: int, injection: bool, tied: bool, pe: str, groups: int = HEADS,
                    norm_bias: bool = True) -> int:
    """Hand count. Per MHA layer: attention 4H^2 + 4H (qkv 3H^2 + 3H, proj H^2 + H), MLP
    8H^2 + 5H (fc1 4H^2 + 4H, fc2 4H^2 + H), two LayerNorms 4H. GQA shrinks qkv to
    H * (H + 2 * groups * hd) + its bias. Embedding V*H (+ positions MAX_LEN*H when learned),
    injection 2H^2, final norm 2H, output layer V*H unless tied."""
    hd = H // HEADS
    if groups == HEADS:
        attention = 4 * H**2 + 4 * H
    else:
        qkv = H + 2 * groups * hd
        attention = H * qkv + qkv + H * H + H
    mlp = 8 * H**2 + 5 * H
    norms = (4 if norm_bias else 2) * H
    layer = attention + mlp + norms
    embedding = V * H + (MAX_LEN * H if pe == "learned_absolute" else 0)
    final_norm = (2 if norm_bias else 1) * H
    return (embedding + n_layers * layer + (2 * H**2 if injection else 0) + final_norm
            + (0 if tied else V * H))


COUNT_CASES = [
    pytest.param(dict(num_layers=2), dict(), id="plain-gpt"),
    pytest.param(dict(num_layers=2, looped_num_prelude_layers=1, looped_num_coda_layers=1,
                      looped_injection="linear_concat"), dict(), id="huginn"),
    pytest.param(dict(num_layers=1, looped_num_prelude_layers=2, looped_num_coda_layers=2),
                 dict(tied=True), id="pre2-coda2-tied"),
    pytest.param(dict(num_layers=3, looped_injection="linear_concat"), dict(pe="rope"),
                 id="rope-injection"),
    pytest.param(dict(num_layers=2, num_query_groups=2, looped_num_prelude_layers=1),
                 dict(), id="gqa"),
    pytest.param(dict(num_layers=2, normalization="RMSNorm", looped_num_coda_layers=1),
                 dict(), id="rmsnorm"),
]


@pytest.mark.parametrize("cfg_kw, model_kw", COUNT_CASES)
@pytest.mark.parametrize("loops", [1, 4])
def test_exact_parameter_count(mcore_single, cfg_kw, model_kw, loops):
    """The hand formula, for R = 1 and R = 4 alike (looping adds no parameters)."""
    model = build(looped_num_loops=loops, **model_kw, **cfg_kw)
    n_layers = (cfg_kw["num_layers"] + cfg_kw.get("looped_num_prelude_layers", 0)
                + cfg_kw.get("looped_num_coda_layers", 0))
    want = expected_params(
        n_layers=n_layers, injection=cfg_kw.get("looped_injection") == "linear_concat",
        tied=model_kw.get("tied", False), pe=model_kw.get("pe", "learned_absolute"),
        groups=cfg_kw.get("num_query_groups", HEADS),
        norm_bias=cfg_kw.get("normalization", "LayerNorm") == "LayerNorm",
    )
    assert n_params(model) == want


def test_plain_gpt_count_by_formula(mcore_single):
    """The formula written out once for 2 MHA layers, learned positions, untied output."""
    want = V * H + MAX_LEN * H + 2 * (12 * H**2 + 13 * H) + 2 * H + V * H
    assert n_params(build(num_layers=2)) == want == 30080


# ---- Transformer Engine --------------------------------------------------------------------


def test_te_spec_without_te_raises_clear_import_error(monkeypatch):
    """Where TE is absent, the TE spec and the TE final norm name the fix."""
    monkeypatch.setattr(specs_module, "HAVE_TE", False)
    with pytest.raises(ImportError, match="Transformer Engine is not installed.*local_spec"):
        get_looped_gpt_layer_te_spec()
    with pytest.raises(ImportError, match="Transformer Engine is not installed"):
        specs_module.get_looped_final_norm_spec(SimpleNamespace(normalization="LayerNorm"),
                                              use_transformer_engine=True)


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None,
                    reason="Transformer Engine is installed here")
def test_te_spec_raises_here():
    with pytest.raises(ImportError, match="Transformer Engine is not installed"):
        get_looped_gpt_layer_te_spec()


def test_te_spec_types_and_count(mcore_single):
    pytest.importorskip("transformer_engine", reason="Transformer Engine is not installed "
                        "(GPU-only extra)")
    if not torch.cuda.is_available():
        pytest.skip("Transformer Engine modules need CUDA")
    from megatron.core.extensions.transformer_engine import (
        TELayerNormColumnParallelLinear,
        TERowParallelLinear,
    )

    kw = dict(num_layers=2, looped_num_loops=3, looped_num_prelude_layers=1,
              looped_num_coda_layers=1, looped_injection="linear_concat",
              use_cpu_initialization=False)
    model = build(te=True, **kw)
    for layer in all_layers(model):
        attn = layer.self_attention
        assert isinstance(attn, LoopedSelfAttention)
        assert isinstance(attn.core_attention, LoopedCoreAttention)
        assert isinstance(attn.linear_qkv, TELayerNormColumnParallelLinear)  # LN fused in
        assert isinstance(attn.linear_proj, TERowParallelLinear)
        assert isinstance(layer.input_layernorm, IdentityOp)
        assert isinstance(layer.mlp.linear_fc1, TELayerNormColumnParallelLinear)
        assert isinstance(layer.mlp.linear_fc2, TERowParallelLinear)
    assert n_params(model) == expected_params(n_layers=4, injection=True, tied=False,
                                              pe="learned_absolute")
    tokens = torch.randint(0, V, (2, 8), device="cuda")
    logits = model(tokens).logits
    assert len(logits) == 3 and logits[0].shape == (2, 8, V)
