"""Loop semantics: LoopedGPTModel against the independent plain-PyTorch reference.

Every loop's logits (and log-probs) must match the reference built from the same weights, with
prelude and coda on, injection on and off, R in {1, 3}, both position embeddings.
"""

import pytest
import torch
from helpers.reference_looped import RefConfig, reference_forward, weights_from_state_dict

from scalerlt_mcore.model import LoopedGPTModel, get_looped_gpt_layer_local_spec
from scalerlt_mcore.model.config import LoopedTransformerConfig

HIDDEN, HEADS, VOCAB, MAX_LEN = 32, 4, 64, 32



def build(pe: str, groups: int = HEADS, **looped) -> tuple:
    """A tiny looped GPT with random weights (norms and biases too) and its RefConfig."""
    cfg = LoopedTransformerConfig(
        num_layers=2, hidden_size=HIDDEN, num_attention_heads=HEADS, num_query_groups=groups,
        use_cpu_initialization=True, **looped,
    )
    model = LoopedGPTModel(cfg, get_looped_gpt_layer_local_spec(), VOCAB, MAX_LEN,
                           position_embedding_type=pe)
    randomize_(model, seed=7)
    ref = RefConfig(
        hidden=HIDDEN, heads=HEADS, groups=groups, n_core=cfg.num_layers,
        n_prelude=cfg.looped_num_prelude_layers, n_coda=cfg.looped_num_coda_layers,
        loops=cfg.looped_num_loops, injection=cfg.looped_injection,
        initial_state=cfg.looped_initial_state, position=pe,
    )
    return model, ref


@torch.no_grad()
def randomize_(model, seed: int) -> None:
    """Norm weights 1 + 0.1 N(0,1), everything else 0.2 N(0,1), so no term is trivial."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        p.copy_(1 + 0.1 * noise if "layernorm.weight" in name else 0.2 * noise)


def max_diff(a: list, b: list) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


CASES = [
    pytest.param(dict(looped_num_loops=r, looped_injection=inj), pe, id=f"R{r}-{inj}-{pe}")
    for r in (1, 3) for inj in ("none", "linear_concat") for pe in ("learned_absolute", "rope")
]


@pytest.mark.parametrize("looped, pe", CASES)
def test_logits_every_loop_match_reference(mcore_single, looped, pe):
    model, ref = build(pe, looped_num_prelude_layers=1, looped_num_coda_layers=1, **looped)
    tokens = torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = model(tokens).logits
        want, _ = reference_forward(weights_from_state_dict(model.state_dict(), ref), ref, tokens)
    assert len(got) == len(want) == looped["looped_num_loops"]
    assert got[0].shape == (3, 12, VOCAB)
    assert max_diff(got, want) <= 1e-5


@pytest.mark.parametrize("looped", [
    pytest.param(dict(looped_initial_state="zeros", looped_injection="linear_concat",
                      looped_num_prelude_layers=1, looped_num_coda_layers=1), id="zeros-init"),
    pytest.param(dict(looped_num_prelude_layers=0, looped_num_coda_layers=0),
                 id="ouro-no-pre-coda"),
    pytest.param(dict(looped_num_prelude_layers=2, looped_num_coda_layers=2,
                      looped_injection="linear_concat"), id="two-pre-two-coda"),
])
def test_structural_variants_match_reference(mcore_single, looped):
    model, ref = build("rope", looped_num_loops=3, **looped)
    tokens = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got = model(tokens).logits
        want, _ = reference_forward(weights_from_state_dict(model.state_dict(), ref), ref, tokens)
    assert max_diff(got, want) <= 1e-5


@pytest.mark.parametrize("pe", ["learned_absolute", "rope"])
def test_gqa_matches_reference(mcore_single, pe):
    """Grouped K/V (2 groups for 4 heads): checks the fused-qkv row layout per group."""
    model, ref = build(pe, groups=2, looped_num_loops=3, looped_num_prelude_layers=1,
                       looped_num_coda_layers=1, looped_injection="linear_concat")
    tokens = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = model(tokens).logits
        want, _ = reference_forward(weights_from_state_dict(model.state_dict(), ref), ref, tokens)
    assert max_diff(got, want) <= 1e-5


def test_labels_give_per_loop_logprobs(mcore_single):
    """forward(labels=...) -> [R, B, S] log-probs of the labels under every loop's readout."""
    model, ref = build("learned_absolute", looped_num_loops=3, looped_num_prelude_layers=1,
                       looped_num_coda_layers=1, looped_injection="linear_concat")
    gen = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, VOCAB, (2, 9), generator=gen)
    labels = torch.randint(0, VOCAB, (2, 9), generator=gen)
    with torch.no_grad():
        out = model(tokens, labels=labels)
        want, _ = reference_forward(weights_from_state_dict(model.state_dict(), ref), ref, tokens)
    want = torch.stack([lg.log_softmax(-1).gather(-1, labels[..., None])[..., 0] for lg in want])
    assert out.logits is None and out.logprobs.shape == (3, 2, 9)
    assert (out.logprobs - want).abs().max().item() <= 1e-5


def test_explicit_positions_match_reference(mcore_single):
    """position_ids offset by 5 (as for a continuation) reach both embeddings and RoPE."""
    for pe in ("learned_absolute", "rope"):
        model, ref = build(pe, looped_num_loops=2, looped_num_prelude_layers=1)
        tokens = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(5))
        positions = (torch.arange(8) + 5)[None].expand(2, -1)
        with torch.no_grad():
            got = model(tokens, position_ids=positions).logits
            weights = weights_from_state_dict(model.state_dict(), ref)
            want, _ = reference_forward(weights, ref, tokens, positions)
        assert max_diff(got, want) <= 1e-5, pe


def test_loops_share_weights_but_differ(mcore_single):
    """R loops reuse one core (same parameter count as R=1) yet give different readouts."""
    one, _ = build("rope", looped_num_loops=1, looped_num_prelude_layers=1)
    three, _ = build("rope", looped_num_loops=3, looped_num_prelude_layers=1)
    assert sum(p.numel() for p in one.parameters()) == sum(p.numel() for p in three.parameters())
    tokens = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        logits = three(tokens).logits
        first = one(tokens).logits[0]
    assert torch.equal(logits[0], first)  # same weights: loop 1 of R=3 is the R=1 model
    assert (logits[1] - logits[0]).abs().max() > 1e-3
    assert (logits[2] - logits[1]).abs().max() > 1e-3
