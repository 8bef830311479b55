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


def test_loop_count_is_the_calls_own(mcore_single):
    """Two models sharing one config run 2 and 4 loops concurrently (two threads): each call's
    every loop matches the reference of its own R, and the shared config keeps its R = 3."""
    import dataclasses
    import threading

    model, ref = build("rope", looped_num_loops=3, looped_num_prelude_layers=1,
                       looped_num_coda_layers=1, looped_injection="linear_concat")
    twin = LoopedGPTModel(model.config, get_looped_gpt_layer_local_spec(), VOCAB, MAX_LEN,
                          position_embedding_type="rope")
    twin.load_state_dict(model.state_dict())
    tokens = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(3))
    want = {}
    for R in (2, 4):
        loops_ref = dataclasses.replace(ref, loops=R)
        want[R], _ = reference_forward(weights_from_state_dict(model.state_dict(), loops_ref),
                                       loops_ref, tokens)
    errors, barrier = {}, threading.Barrier(2)

    def run(m, R):
        barrier.wait()
        with torch.no_grad():
            errors[R] = max(max_diff(m(tokens, num_loops=R).logits, want[R]) for _ in range(8))

    threads = [threading.Thread(target=run, args=(m, R)) for m, R in ((model, 2), (twin, 4))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors[2] <= 1e-5 and errors[4] <= 1e-5, errors
    assert model.config.looped_num_loops == 3 and len(model(tokens).logits) == 3


def test_prefix_state_and_cache_carry_their_loop_count(mcore_single):
    """A prefix state or decoding cache made with R loops continues with R (whatever another
    call ran in between); a different count (the config's by default) is refused naming the
    loops."""
    model, _ = build("rope", looped_num_loops=3, looped_num_prelude_layers=1,
                     looped_injection="linear_concat")
    tokens = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))
    tokens[1, :5] = tokens[0, :5]  # one prompt of 5 tokens, two continuations
    with torch.no_grad():
        full = model(tokens, labels=tokens.roll(-1, 1), num_loops=2).logprobs  # [2, B, T]
        state = model(tokens[:1, :5], return_prefix_state=True, readout=False,
                      num_loops=2).prefix_state
        model(tokens, num_loops=4)  # another count in between
        suffix = model.suffix_logprobs(state, tokens[:, 5:], num_loops=2)  # [2, B, 4]
        cache = model.new_kv_cache(2, 9, num_loops=4)
        assert model.prefill(cache, tokens, torch.full((2,), 9), num_loops=4).shape[0] == 4
    assert state.num_loops == 2 and suffix.shape[0] == 2 and cache.num_loops == 4
    assert (suffix - full[:, :, 4:8]).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="loops 2 != 3"):
        model(tokens[:, 5:], prefix_state=state)
    with pytest.raises(ValueError, match="kv_cache was built for a different model config"):
        model.prefill(cache, tokens, torch.full((2,), 9))


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_bad_loop_count_is_refused(mcore_single, bad):
    model, _ = build("rope", looped_num_loops=2)
    with pytest.raises(ValueError, match=rf"num_loops must be an integer >= 1, got {bad!r}"):
        model(torch.zeros(1, 3, dtype=torch.long), num_loops=bad)
