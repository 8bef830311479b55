"""The core attention is swappable by spec: called with MCore's core-attention signature, a
stock MCore ``DotProductAttention`` runs the plain causal forward; the prefix modes need one
that ``supports_prefix`` and say so; the planner's memory model of attention is the core
attention's own ``saved_bytes``."""

import copy

import pytest
import torch
from helpers.sp import MAX_SEQ, VOCAB
from megatron.core.transformer.dot_product_attention import DotProductAttention

from scalerlt_mcore.model import LoopedGPTModel, get_looped_gpt_layer_local_spec
from scalerlt_mcore.model.attention import LoopedCoreAttention
from scalerlt_mcore.model.config import LoopedTransformerConfig
from scalerlt_mcore.shared_prefix.planner import ModelShape, prefix_bytes, wave_bytes


def _model(core_attention) -> LoopedGPTModel:
    torch.manual_seed(3)
    cfg = LoopedTransformerConfig(num_layers=2, hidden_size=16, num_attention_heads=2,
                                  use_cpu_initialization=True, looped_num_loops=2)
    spec = copy.deepcopy(get_looped_gpt_layer_local_spec())
    spec.submodules.self_attention.submodules.core_attention = core_attention
    return LoopedGPTModel(cfg, spec, VOCAB, MAX_SEQ)


def test_stock_mcore_core_attention_runs_the_causal_path(mcore_single):
    """Same weights, MCore's DotProductAttention in place of LoopedCoreAttention: the same
    per-loop log-probs (an independent implementation of causal attention)."""
    ours, stock = _model(LoopedCoreAttention), _model(DotProductAttention)
    stock.load_state_dict(ours.state_dict())
    tokens = torch.randint(0, VOCAB, (3, 9), generator=torch.Generator().manual_seed(1))
    want = ours(tokens, labels=tokens).logprobs
    got = stock(tokens, labels=tokens).logprobs
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_prefix_mode_needs_a_prefix_core_attention(mcore_single):
    stock = _model(DotProductAttention)
    tokens = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(2))
    state = stock(tokens[:1, :4], return_prefix_state=True, readout=False).prefix_state
    with pytest.raises(NotImplementedError, match="attention to a prefix state needs a core "
                                                  "attention that attends to a prefix .* "
                                                  "DotProductAttention"):
        stock(tokens[:, 4:], labels=tokens[:, 4:], prefix_state=state)


class _CostlyCore(LoopedCoreAttention):
    """A core attention with its own saved-bytes model (a fixed extra per call)."""

    EXTRA = 1000

    @staticmethod
    def saved_bytes(shape, rows, s, mode, prefix=0):
        return LoopedCoreAttention.saved_bytes(shape, rows, s, mode, prefix) + _CostlyCore.EXTRA


def test_planner_reads_the_core_attentions_saved_bytes(mcore_single):
    base = ModelShape.from_model(_model(LoopedCoreAttention))
    costly = ModelShape.from_model(_model(_CostlyCore))
    assert costly.core_attention is _CostlyCore and base.core_attention is LoopedCoreAttention
    calls = costly.depths  # one attention call per depth of the wave's forward
    assert (wave_bytes(costly, 5, 4, 3, 1.0) - wave_bytes(base, 5, 4, 3, 1.0)
            == calls * _CostlyCore.EXTRA)
    assert prefix_bytes(costly, 5) == prefix_bytes(base, 5)


def test_planner_refuses_a_core_attention_without_a_cost_model(mcore_single):
    with pytest.raises(ValueError, match="core attention DotProductAttention has no "
                                         "saved_bytes"):
        ModelShape.from_model(_model(DotProductAttention))
