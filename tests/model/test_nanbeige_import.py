"""Nanbeige4.2 (``model_type`` "nanbeige") imported and exported in its own format.

The reference is tests/helpers/reference_nanbeige.py, a plain-PyTorch Nanbeige written from
the public implementations (vllm-rlt's model, llama.cpp's graph) that reads the checkpoint's
own tensor names (it shares no code with the importer). The checkpoints are tiny random ones
written in Nanbeige's format (no download).

- loop r's readout is the public model run with ``num_loops`` = r, fp64, R in {1, 2, 3}
  (relative error <= 1e-10 on the non-padding positions), untied and tied;
- greedy decoding through the depth-indexed cache (a K/V slot per loop) picks the reference's
  tokens, recomputed on the whole sequence;
- joint replay equals naive training through stock MCore (fp64 <= 1e-12);
- import -> export -> import is bitwise, the source's config.json written back;
- the switches 4.2-3B leaves off, and tensors the layout has no place for, are refused by name.
"""

import json

import pytest
import torch
from helpers.reference_nanbeige import (
    load_nanbeige,
    nanbeige_forward,
    write_nanbeige_checkpoint,
)
from helpers.sp import LossSpec, grads, joint_step, make_group, naive_step, rel_errors
from safetensors.torch import load_file, save_file

from scalerlt_mcore.model.hf_export import save_hf
from scalerlt_mcore.model.looped_import import looped_gpt_from_pretrained, read_looped_source
from scalerlt_mcore.rl.rollout import Sampling, generate

TOL = 1e-10
VOCAB = 64
MEASURED = {}


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    for case, err in MEASURED.items():
        print(f"\n[nanbeige import] {case}: max relative error {err:.2e} (fp64)")


@pytest.fixture(scope="module")
def nanbeige_dir(tmp_path_factory):
    return write_nanbeige_checkpoint(tmp_path_factory.mktemp("nanbeige"), seed=3)


def padded_batch(seed: int = 1) -> tuple:
    """tokens [3, 10] right-padded (lengths 10, 7, 4) and the attention mask (1 = token)."""
    tokens = torch.randint(3, VOCAB, (3, 10), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1, 7:] = mask[2, 4:] = 0
    return tokens.masked_fill(mask == 0, 0), mask


def imported(path, loops=None):
    return looped_gpt_from_pretrained(path, num_loops=loops, use_cpu_initialization=True,
                                      max_sequence_length=64).double().eval()


def per_loop_error(path, R: int, case: str, seed: int = 1) -> float:
    """Max relative error of the imported model's R readouts against the reference run with
    num_loops = 1..R on a padded batch."""
    cfg, w = load_nanbeige(path)
    tokens, mask = padded_batch(seed)
    want = torch.stack([nanbeige_forward(cfg, w, tokens, mask, num_loops=r + 1)
                        for r in range(R)])  # [R, B, S, V]
    with torch.no_grad():
        got = torch.stack(imported(path, R)(tokens).logits)
    assert got.shape == want.shape == (R, 3, 10, VOCAB)
    on = mask.bool()
    diff = (got - want).permute(0, 3, 1, 2)[..., on]
    MEASURED[case] = float(diff.abs().max() / want.permute(0, 3, 1, 2)[..., on].abs().max())
    return MEASURED[case]


# ---- 1. the same function as the public code ----------------------------------------------


@pytest.mark.parametrize("R", [1, 2, 3])
def test_per_loop_logits(mcore_single, nanbeige_dir, R):
    assert per_loop_error(nanbeige_dir, R, f"R={R} logits") <= TOL


def test_tied_nanbeige(mcore_single, tmp_path):
    path = write_nanbeige_checkpoint(tmp_path, seed=4, tie_word_embeddings=True)
    assert "lm_head.weight" not in load_nanbeige(path)[1]
    assert per_loop_error(path, 2, "tied R=2 logits", seed=2) <= TOL


def test_config_fields_are_mapped(nanbeige_dir):
    src = read_looped_source(nanbeige_dir)
    a = src.arch
    assert (src.model_type, src.num_loops, src.max_sequence_length) == ("nanbeige", 2, 64)
    assert src.looped == {"looped_family": "nanbeige"} and src.exit_threshold is None
    assert (a.num_layers, a.hidden_size, a.ffn_hidden_size, a.num_attention_heads,
            a.num_query_groups, a.kv_channels, a.vocab_size) == (3, 32, 48, 4, 2, 8, VOCAB)
    assert (a.rotary_base, a.norm_epsilon, a.add_qkv_bias) == (7e7, 1e-5, False)
    assert a.untie_embeddings_and_output_weights and not a.use_rope_scaling
    config = src.config()
    assert config.looped_normed_state and not config.looped_exit_gate


def test_greedy_rollout_uses_a_cache_slot_per_loop(mcore_single, nanbeige_dir):
    """Decoding through the depth-indexed cache at R = 2: every step's greedy token and its
    log-prob are the reference's, recomputed on the whole sequence (a cache shared between the
    loops would give other keys to the second loop)."""
    cfg, w = load_nanbeige(nanbeige_dir)
    model = imported(nanbeige_dir, 2)
    prompts = [[5, 9, 11, 3], [7, 8]]
    out = generate(model, prompts, 1, 5, eos_id=-1, pad_id=0, sampling=Sampling(temperature=0.0))
    for n, prompt in enumerate(prompts):
        seq = list(prompt)
        for t in range(5):
            logits = nanbeige_forward(cfg, w, torch.tensor([seq]))[0, -1]
            token = int(logits.argmax())
            assert int(out.responses[n, 0, t]) == token
            lp = float(torch.log_softmax(logits, -1)[token])
            assert abs(float(out.logprobs[n, 0, t]) - lp) <= 1e-6 * abs(lp)
            seq.append(token)


# ---- 2. joint replay ------------------------------------------------------------------------


def test_joint_replay_matches_naive(mcore_single, nanbeige_dir):
    R = 2
    model = looped_gpt_from_pretrained(nanbeige_dir, num_loops=R, use_cpu_initialization=True,
                                       max_sequence_length=64).double()
    group = make_group(5, 7, 4, R, seed=73, dtype=torch.float64, kl=True, vocab=VOCAB)
    spec = LossSpec(normalization="seq_mean", loop_weights="uniform", kl_coef=0.05)
    naive = naive_step(model, [group], spec, per_mb=2)[0]
    ref = grads(model)
    model.zero_grad(set_to_none=True)
    out = joint_step(model, [group], spec, wave_size=2)
    assert abs(float(out[0]["loss"]) - float(naive[0])) <= 1e-12 * abs(float(naive[0]))
    errs = rel_errors(grads(model), ref)
    assert {"decoder.final_layernorm.weight", "output_layer.weight",
            "decoder.layers.2.self_attention.linear_qkv.weight"} <= set(errs)
    assert max(errs.values()) <= 1e-12, {n: e for n, e in errs.items() if e > 1e-12}


# ---- 3. bad input -------------------------------------------------------------------------


def _edited(src, dst, config=None, drop=None, add=None):
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(config or {})
    (dst / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(src / "model.safetensors"))
    if drop:
        del tensors[drop]
    if add:
        tensors[add] = torch.ones(8)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


BAD = [
    (dict(config={"loop_share_kv": True}), r"loop_share_kv=True: Nanbeige's loop_share_kv is "
                                           r"not supported \(4.2-3B leaves it off\)"),
    (dict(config={"enable_hyper_connection": True}), r"enable_hyper_connection=True"),
    (dict(config={"enable_mhc": True}), r"enable_mhc=True"),
    (dict(config={"enable_double_loop_split": True}), r"enable_double_loop_split=True"),
    (dict(config={"enable_depth_attention": True}), r"enable_depth_attention=True"),
    (dict(config={"qk_layernorm": True}), r"qk_layernorm=True"),
    (dict(config={"attention_bias": True}), r"attention_bias=True"),
    (dict(config={"loop_loss_weights": [0.5]}),
     r"loop_loss_weights=\[0.5\]: not supported \(4.2-3B leaves it unset\)"),
    (dict(config={"emb_neighbor_num": 2}), r"emb_neighbor_num=2: not supported"),
    (dict(config={"skip_loop_final_norm": True}),
     r"skip_loop_final_norm=True: only the norm closing every loop"),
    (dict(config={"hidden_act": "gelu"}), r"hidden_act='gelu': only 'silu'"),
    (dict(config={"num_loops": 0}), r"num_loops must be a positive integer, got 0"),
    (dict(config={"kv_channels": 16}), r"kv_channels=16 != head_dim=8"),
    (dict(drop="model.layers.2.post_attention_layernorm.weight"),
     r"tensor 'model.layers.2.post_attention_layernorm.weight' is missing"),
    (dict(add="model.layers.0.self_attn.q_layernorm.weight"),
     r"tensor 'model.layers.0.self_attn.q_layernorm.weight' in .* is not part of the Nanbeige "
     r"layout config.json describes"),
]


@pytest.mark.parametrize("edit, message", BAD, ids=[m[:24] for _, m in BAD])
def test_bad_input_is_named(mcore_single, nanbeige_dir, tmp_path, edit, message):
    path = _edited(nanbeige_dir, tmp_path / "bad", **edit)
    with pytest.raises(ValueError, match=message) as err:
        looped_gpt_from_pretrained(path, use_cpu_initialization=True, max_sequence_length=64)
    assert "\n" not in str(err.value)


# ---- 4. export: the source format back, bitwise ---------------------------------------------


def _files(path) -> dict:
    return load_file(str(path / "model.safetensors"))


def _bitwise(a: dict, b: dict) -> bool:
    a, b = ({k: v for k, v in d.items() if not k.endswith("_extra_state")} for d in (a, b))
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_export_round_trip_is_bitwise(mcore_single, nanbeige_dir, tmp_path):
    (nanbeige_dir / "tokenizer.json").write_text("{}")
    (nanbeige_dir / "modeling_nanbeige.py").write_text("# remote code\n")
    first = looped_gpt_from_pretrained(nanbeige_dir, use_cpu_initialization=True)
    out = save_hf(first, tmp_path / "out", source=nanbeige_dir)
    assert _bitwise(_files(out), _files(nanbeige_dir))  # the source's names and bits
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (nanbeige_dir / "config.json").read_text())
    assert (out / "tokenizer.json").is_file() and (out / "modeling_nanbeige.py").is_file()
    second = looped_gpt_from_pretrained(out, use_cpu_initialization=True)
    assert _bitwise(first.state_dict(), second.state_dict())


def test_export_without_source_writes_a_complete_config(mcore_single, nanbeige_dir, tmp_path):
    model = looped_gpt_from_pretrained(nanbeige_dir, num_loops=3, use_cpu_initialization=True)
    out = save_hf(model, tmp_path / "bare")
    written = json.loads((out / "config.json").read_text())
    assert (written["architectures"], written["num_loops"], written["kv_channels"]) == (
        ["NanbeigeForCausalLM"], 3, 8)
    src = read_looped_source(out)
    assert src.num_loops == 3 and src.arch == read_looped_source(nanbeige_dir).arch
    assert _bitwise(_files(out), _files(nanbeige_dir))
