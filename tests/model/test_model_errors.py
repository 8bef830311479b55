"""Bad input raises a clear error that names what is wrong."""

import dataclasses

import pytest
import torch

from scalerlt_mcore.model import LoopedGPTModel, get_looped_gpt_layer_local_spec
from scalerlt_mcore.model.config import FieldError, LoopedTransformerConfig

VOCAB = 64
BASE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
            looped_num_loops=2, looped_num_prelude_layers=1, looped_num_coda_layers=1)


def build(**overrides) -> LoopedGPTModel:
    cfg = LoopedTransformerConfig(**{**BASE, **overrides})
    return LoopedGPTModel(cfg, get_looped_gpt_layer_local_spec(), VOCAB, 16)


def prompt_state(model, batch: int = 1, length: int = 5):
    tokens = torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(tokens, return_prefix_state=True, readout=False).prefix_state


def suffix(batch: int = 1, length: int = 3) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(1))


# ---- configuration -------------------------------------------------------------------------


@pytest.mark.parametrize("field, value, match", [
    ("looped_num_loops", 0, "looped_num_loops must be an integer >= 1, got 0"),
    ("looped_num_loops", -2, "looped_num_loops must be an integer >= 1"),
    ("looped_num_loops", 1.5, "looped_num_loops must be an integer"),
    ("looped_num_prelude_layers", -1, "looped_num_prelude_layers must be an integer >= 0"),
    ("looped_num_coda_layers", -1, "looped_num_coda_layers must be an integer >= 0"),
    ("looped_injection", "add", "looped_injection must be one of .*'add'"),
    ("looped_initial_state", "noise", "looped_initial_state must be one of"),
    ("looped_prefix_attention", "flash", "looped_prefix_attention must be one of"),
])
def test_bad_looped_config(field, value, match):
    with pytest.raises(ValueError, match=match):
        LoopedTransformerConfig(**{**BASE, field: value})


@pytest.mark.parametrize("overrides, field, reason", [
    (dict(looped_num_loops=0), "looped_num_loops", "must be an integer >= 1, got 0"),
    (dict(looped_num_coda_layers=-1), "looped_num_coda_layers",
     "must be an integer >= 0, got -1"),
    (dict(looped_readout_tile=-4), "looped_readout_tile", "must be an integer >= 0, got -4"),
    (dict(looped_injection="add"), "looped_injection",
     "must be one of ('none', 'linear_concat'), got 'add'"),
    (dict(looped_initial_state_std=-1.0), "looped_initial_state_std", "must be >= 0, got -1.0"),
    (dict(looped_family="ouro"), "looped_family",
     "'ouro' loops the whole stack: looped_num_prelude_layers and looped_num_coda_layers must "
     "be 0, got 1 and 1"),
    (dict(looped_family="huginn", looped_num_prelude_layers=0, looped_num_coda_layers=0),
     "looped_family", "'huginn' needs looped_injection 'linear_concat' (its adapter), got 'none'"),
    (dict(recompute_method="block"), "recompute_method",
     "'block' (--recompute-method) needs recompute_granularity 'full', got None"),
])
def test_looped_config_errors_name_their_field(overrides, field, reason):
    """The config raises a ``FieldError``: the field and the reason apart, so that a caller
    with its own name for the field says that name without rewriting the message."""
    with pytest.raises(FieldError) as e:
        LoopedTransformerConfig(**{**BASE, **overrides})
    assert (e.value.field, e.value.reason, str(e.value)) == (field, reason, f"{field} {reason}")


@pytest.mark.parametrize("overrides, match", [
    (dict(sequence_parallel=True, tensor_model_parallel_size=2),
     r"sequence_parallel=True \(--sequence-parallel\).*does not support sequence parallelism"),
    (dict(context_parallel_size=2),
     r"context_parallel_size=2 \(--context-parallel-size\).*does not support context"),
])
def test_sequence_and_context_parallelism_rejected(overrides, match):
    with pytest.raises(NotImplementedError, match=match):
        LoopedTransformerConfig(**{**BASE, **overrides})


def test_tensor_parallel_size_must_match_the_group(mcore_single):
    """A TP=2 config on a TP=1 process group: the per-rank K/V shapes would disagree."""
    cfg = LoopedTransformerConfig(**{**BASE, "tensor_model_parallel_size": 2})
    with pytest.raises(ValueError, match="tensor_model_parallel_size is 2 but the "
                                         "tensor-parallel group has 1 ranks"):
        LoopedGPTModel(cfg, get_looped_gpt_layer_local_spec(), VOCAB, 16)


@pytest.mark.parametrize("vocab, divisible_by, tp, padded", [
    (49, 128, 1, 128), (49, 128, 2, 256), (49, 4, 2, 56), (56, 4, 2, 56), (1, 1, 1, 1),
])
def test_padded_vocab_size(vocab, divisible_by, tp, padded):
    from scalerlt_mcore.model import padded_vocab_size

    assert padded_vocab_size(vocab, divisible_by, tp) == padded


def test_padded_vocab_size_rejects_non_positive():
    from scalerlt_mcore.model import padded_vocab_size

    with pytest.raises(ValueError, match=r"make_vocab_size_divisible_by \(0\)"):
        padded_vocab_size(49, 0, 2)


def test_bad_position_embedding_type(mcore_single):
    cfg = LoopedTransformerConfig(**BASE)
    with pytest.raises(ValueError, match="position_embedding_type must be"):
        LoopedGPTModel(cfg, get_looped_gpt_layer_local_spec(), VOCAB, 16,
                       position_embedding_type="alibi")


def test_attention_dropout_rejected(mcore_single):
    with pytest.raises(ValueError, match="attention_dropout"):
        build(attention_dropout=0.1)


# ---- forward inputs ------------------------------------------------------------------------


def test_labels_of_wrong_shape(mcore_single):
    model = build()
    tokens = suffix(2, 6)
    with pytest.raises(ValueError, match=r"labels shape \(2, 5\) != input_ids shape \(2, 6\)"):
        model(tokens, labels=tokens[:, :5])


def test_input_ids_not_2d(mcore_single):
    with pytest.raises(ValueError, match=r"input_ids must be \[batch, seq\]"):
        build()(suffix(1, 6)[0])


# ---- prefix state --------------------------------------------------------------------------


def test_prefix_state_key_of_wrong_shape(mcore_single):
    model = build()
    state = prompt_state(model)
    bad = dataclasses.replace(state, keys=[*state.keys])
    bad.keys[2] = bad.keys[2][..., :4]  # kv channels 8 -> 4
    with pytest.raises(ValueError, match=r"prefix state depth 2: key \(5, 1, 4, 4\)"):
        model(suffix(), prefix_state=bad)


def test_prefix_state_boundary_of_wrong_shape(mcore_single):
    model = build()
    state = prompt_state(model)
    bad = dataclasses.replace(state, boundary=state.boundary[:1])
    with pytest.raises(ValueError, match="prefix state boundary has shape"):
        model(suffix(), prefix_state=bad)


def test_prefix_state_missing_depth(mcore_single):
    model = build()
    state = prompt_state(model)
    bad = dataclasses.replace(state, keys=state.keys[:-1], values=state.values[:-1])
    with pytest.raises(ValueError, match="model needs 7"):
        model(suffix(), prefix_state=bad)


def test_prefix_state_from_other_loop_count(mcore_single):
    """A state from an R=2 model given to an R=3 model (same weights' shapes)."""
    state = prompt_state(build(looped_num_loops=2))
    with pytest.raises(ValueError, match="loops 2 != 3"):
        build(looped_num_loops=3)(suffix(), prefix_state=state)
    with pytest.raises(ValueError, match="loops 2 != 3"):
        build(looped_num_loops=3).suffix_logprobs(state, suffix())


@pytest.mark.parametrize("other, match", [
    (dict(hidden_size=64), "hidden 32 != 64"),
    (dict(num_layers=3), "core 2 != 3"),
    (dict(looped_num_prelude_layers=0), "prelude 1 != 0"),
    (dict(looped_num_coda_layers=2), "coda 1 != 2"),
    (dict(num_query_groups=2), "kv groups 4 != 2"),
])
def test_prefix_state_from_other_config(mcore_single, other, match):
    state = prompt_state(build())
    with pytest.raises(ValueError, match=f"different model config.*{match}"):
        build(**other)(suffix(), prefix_state=state)


def test_prefix_state_batch_mismatch(mcore_single):
    model = build()
    state = prompt_state(model, batch=2)
    with pytest.raises(ValueError, match="prefix state batch 2 must be 1 or the input batch 3"):
        model(suffix(3), prefix_state=state)
    with pytest.raises(ValueError, match="prefix state batch 2 must be 1 or the input batch 3"):
        model.suffix_logprobs(state, suffix(3))


def test_prefix_state_and_cache_together(mcore_single):
    model = build()
    with pytest.raises(ValueError, match="either prefix_state or kv_cache"):
        model(suffix(), prefix_state=prompt_state(model), kv_cache=model.new_kv_cache(1, 8))


# ---- decoding cache ------------------------------------------------------------------------


def test_kv_cache_overflow_on_decode(mcore_single):
    model = build()
    cache = model.new_kv_cache(2, 6)
    model.prefill(cache, suffix(2, 5), torch.tensor([5, 4]))
    model.decode_step(cache, torch.tensor([1, 2]))  # position 5 of sequence 0: the last slot
    with pytest.raises(ValueError, match="kv_cache holds 6 positions; this step would write past"):
        model.decode_step(cache, torch.tensor([1, 2]))


def test_kv_cache_overflow_on_prefill(mcore_single):
    model = build()
    cache = model.new_kv_cache(1, 4)
    with pytest.raises(ValueError, match="kv_cache holds 4 positions"):
        model.prefill(cache, suffix(1, 5), torch.tensor([5]))


def test_kv_cache_from_other_config(mcore_single):
    cache = build(looped_num_loops=2).new_kv_cache(1, 8)
    with pytest.raises(ValueError, match="kv_cache was built for a different model config"):
        build(looped_num_loops=3).prefill(cache, suffix(1, 3), torch.tensor([3]))
