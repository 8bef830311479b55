"""External anchor: with R=1, no prelude/coda and no injection, LoopedGPTModel is MCore's
GPTModel (local spec) -- the same parameter names and shapes and, with GPTModel's weights
loaded, the same logits."""

import pytest
import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig

from scalerlt_mcore.model import LoopedGPTModel, get_looped_gpt_layer_local_spec
from scalerlt_mcore.model.config import LoopedTransformerConfig

VOCAB, MAX_LEN = 64, 32



def build_pair(pe: str, tied: bool, groups=None) -> tuple:
    """(MCore GPTModel with random weights, LoopedGPTModel of the same shape)."""
    kw = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=groups,
              use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0)
    args = dict(vocab_size=VOCAB, max_sequence_length=MAX_LEN, position_embedding_type=pe,
                share_embeddings_and_output_weights=tied)
    gpt = GPTModel(TransformerConfig(**kw), get_gpt_layer_local_spec(), **args)
    looped = LoopedGPTModel(LoopedTransformerConfig(**kw), get_looped_gpt_layer_local_spec(),
                            **args)
    gen = torch.Generator().manual_seed(11)
    # Random norms and biases too, so no term is trivially equal; the scale keeps logits O(1)
    # so that 1e-6 in fp32 is a few ulp.
    with torch.no_grad():
        for name, p in gpt.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * noise if "layernorm.weight" in name else 0.05 * noise)
    return gpt.eval(), looped.eval()


CASES = [
    pytest.param(pe, tied, id=f"{pe}-{'tied' if tied else 'untied'}")
    for pe in ("learned_absolute", "rope") for tied in (True, False)
]


@pytest.mark.parametrize("pe, tied", CASES)
def test_same_parameter_names_and_shapes(mcore_single, pe, tied):
    gpt, looped = build_pair(pe, tied)
    shapes = {n: tuple(p.shape) for n, p in gpt.named_parameters()}
    assert {n: tuple(p.shape) for n, p in looped.named_parameters()} == shapes
    assert set(looped.state_dict()) == set(gpt.state_dict())
    assert ("output_layer.weight" in shapes) == (not tied)


def _logits_diff(gpt, looped, tokens: torch.Tensor) -> float:
    looped.load_state_dict(gpt.state_dict())
    positions = torch.arange(tokens.shape[1])[None].expand_as(tokens)
    with torch.no_grad():
        want = gpt(tokens, positions, None)  # [B, S, V]
        got = looped(tokens).logits
    assert len(got) == 1 and got[0].shape == want.shape
    return (got[0] - want).abs().max().item()


@pytest.mark.parametrize("pe, tied", CASES)
def test_same_logits_as_gpt_model(mcore_single, pe, tied):
    gpt, looped = build_pair(pe, tied)
    tokens = torch.randint(0, VOCAB, (3, 16), generator=torch.Generator().manual_seed(0))
    assert _logits_diff(gpt, looped, tokens) <= 1e-6


@pytest.mark.parametrize("pe, tied", CASES)
def test_same_logits_as_gpt_model_fp64(mcore_single, pe, tied):
    gpt, looped = build_pair(pe, tied)
    tokens = torch.randint(0, VOCAB, (3, 16), generator=torch.Generator().manual_seed(0))
    assert _logits_diff(gpt.double(), looped.double(), tokens) <= 1e-12


@pytest.mark.parametrize("pe", ["learned_absolute", "rope"])
def test_same_logits_as_gpt_model_gqa(mcore_single, pe):
    """Grouped-query attention (2 K/V groups for 4 heads)."""
    gpt, looped = build_pair(pe, tied=False, groups=2)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    assert _logits_diff(gpt, looped, tokens) <= 1e-6


def test_labels_give_gpt_model_loss(mcore_single):
    """forward(labels) log-probs are minus GPTModel's per-token cross entropy."""
    gpt, looped = build_pair("rope", tied=True)
    looped.load_state_dict(gpt.state_dict())
    gen = torch.Generator().manual_seed(2)
    tokens, labels = torch.randint(0, VOCAB, (2, 2, 12), generator=gen)
    positions = torch.arange(12)[None].expand(2, -1)
    with torch.no_grad():
        loss = gpt(tokens, positions, None, labels=labels)  # [B, S]
        logprobs = looped(tokens, labels=labels).logprobs  # [1, B, S]
    assert logprobs.shape == (1, 2, 12)
    assert (logprobs[0] + loss).abs().max().item() <= 1e-5


@pytest.mark.parametrize("groups", [None, 2], ids=["mha", "gqa"])
def test_same_logits_with_explicit_attention_mask(mcore_single, groups):
    """An MCore-convention mask (True = masked): causal, plus key 0 hidden from row 0."""
    gpt, looped = build_pair("rope", tied=False, groups=groups)
    looped.load_state_dict(gpt.state_dict())
    tokens = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(10)[None].expand(2, -1)
    mask = torch.ones(10, 10, dtype=torch.bool).triu(1)[None, None].repeat(2, 1, 1, 1)
    mask[0, 0, 1:, 0] = True  # [B, 1, S, S]
    with torch.no_grad():
        want = gpt(tokens, positions, mask)
        got = looped(tokens, attention_mask=mask).logits[0]
        causal = looped(tokens).logits[0]
    assert (got - want).abs().max().item() <= 1e-6
    assert (got[0] - causal[0]).abs().max().item() > 1e-3  # the mask mattered
    assert (got[1] - causal[1]).abs().max().item() <= 1e-6
