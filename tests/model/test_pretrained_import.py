"""Starting from a pretrained model: Hugging Face Llama / Qwen2 directories and stock MCore
``GPTModel`` distributed checkpoints imported into ``LoopedGPTModel``, and retrofitted
recurrence (prelude / core / coda from one plain stack, injection [I | 0]).

References are independent: the Hugging Face forward of tiny random ``LlamaForCausalLM`` /
``Qwen2ForCausalLM`` models built here with ``transformers`` (saved with ``save_pretrained``,
no download), and stock MCore ``GPTModel``'s forward. Logits are compared in fp64 on the
non-padding positions of a right-padded batch run through HF with its ``attention_mask``.

HF's ``LlamaRMSNorm`` / ``Qwen2RMSNorm`` compute in fp32 whatever the input dtype (a
mixed-precision guard for half inputs), which rounds an fp64 reference to fp32; the tests run
the same formula in the input's dtype (tests/helpers/hf.py) so that the reference is a true
fp64 function. HF's RoPE tables are fp32 in both implementations (same arithmetic).
"""

import json

import pytest
import torch
import torch.nn.functional as F
from helpers.hf import BUILDERS, LAYERS, VOCAB, patch_hf_rms_norm, randomize, write_hf_dirs
from helpers.sp import LossSpec, grads, joint_step, make_group, naive_step, rel_errors
from megatron.core import dist_checkpointing
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM, Qwen2ForCausalLM

from scalerlt_mcore.model import LoopedGPTModel, get_looped_gpt_block_spec
from scalerlt_mcore.model.config import LoopedTransformerConfig
from scalerlt_mcore.model.hf_import import (
    load_hf_state_dict,
    looped_gpt_from_hf,
    read_hf_architecture,
)
from scalerlt_mcore.model.mcore_import import load_mcore_gpt_state_dict
from scalerlt_mcore.model.retrofit import (
    LayerMapping,
    load_converted_state_dict,
    retrofit_state_dict,
)
from scalerlt_mcore.rl.rollout import Sampling, generate

TOL = 1e-10


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """name -> directory of a saved tiny random HF model."""
    return write_hf_dirs(tmp_path_factory)


@pytest.fixture
def fp64_hf(monkeypatch):
    """Load a saved HF model in fp64 with its RMSNorm in the input dtype (module docstring)."""
    patch_hf_rms_norm(monkeypatch)
    classes = {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM}
    return lambda name, path: classes[name].from_pretrained(path).double().eval()


def padded_batch(seed: int = 1) -> tuple:
    """tokens [3, 12] right-padded (lengths 12, 8, 5) and the HF attention mask."""
    tokens = torch.randint(1, VOCAB, (3, 12), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, 8:] = mask[2, 5:] = 0
    return tokens.masked_fill(mask == 0, 0), mask


MEASURED = {}  # case -> relative logits error (printed at the end with -s)


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    for case, err in MEASURED.items():
        print(f"\n[pretrained import] {case}: max relative logits error {err:.2e} (fp64)")


def rel_err(got, want, on, case: str) -> float:
    MEASURED[case] = float((got - want)[on].abs().max() / want[on].abs().max())
    return MEASURED[case]


# ---- 1. HF import, R = 1: the same function --------------------------------------------------

CASES = [pytest.param(n, m, id=f"{n}-{m or 'all-core'}") for n in BUILDERS
         for m in (None, "1,2,1")]


@pytest.mark.parametrize("name, mapping", CASES)
def test_hf_import_gives_hf_logits(mcore_single, hf_dirs, fp64_hf, name, mapping):
    """All layers kept, R = 1: in the core alone, or as prelude 1 / core 2 / coda 1 with the
    [I | 0] injection: logits equal the HF forward (fp64, padded batch)."""
    tokens, mask = padded_batch()
    with torch.no_grad():
        want = fp64_hf(name, hf_dirs[name])(input_ids=tokens, attention_mask=mask).logits
        model = looped_gpt_from_hf(hf_dirs[name], mapping=mapping, num_loops=1,
                                   use_cpu_initialization=True).double().eval()
        got = model(tokens).logits
    assert len(got) == 1 and got[0].shape == want.shape == (3, 12, VOCAB)
    assert rel_err(got[0], want, mask.bool(), f"HF {name} {mapping or 'all-core'}") <= TOL


def test_hf_architecture_is_read(hf_dirs):
    llama, qwen = (read_hf_architecture(hf_dirs[n]) for n in ("llama", "qwen2"))
    assert (llama.num_layers, llama.vocab_size, llama.num_query_groups, llama.kv_channels) == (
        LAYERS, VOCAB, 2, 16)
    assert llama.use_rope_scaling and llama.rope_scaling_factor == 8.0
    assert llama.rotary_base == 500000.0 and llama.norm_epsilon == 1e-5
    assert llama.untie_embeddings_and_output_weights and not llama.add_qkv_bias
    assert not qwen.use_rope_scaling and qwen.rotary_base == 1e6
    assert qwen.add_qkv_bias and not qwen.untie_embeddings_and_output_weights


def test_llama3_scaling_is_exercised(mcore_single, hf_dirs):
    """The test model's RoPE frequencies fall in all three llama3 bands: some kept, some
    divided by the factor, some smoothed -- so the parity test checks the scaling."""
    model = looped_gpt_from_hf(hf_dirs["llama"], use_cpu_initialization=True)
    scaled = model.rotary_pos_emb.inv_freq.double()
    plain = 1.0 / 500000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    ratio = plain / scaled
    kept = torch.isclose(ratio, torch.tensor(1.0, dtype=torch.float64), rtol=1e-6)
    divided = torch.isclose(ratio, torch.tensor(8.0, dtype=torch.float64), rtol=1e-6)
    assert kept.any() and divided.any() and (~kept & ~divided).any(), ratio


def test_old_config_layout_is_read(tmp_path, hf_dirs):
    """Configs written before transformers 5 keep rope_theta / rope_scaling at the top."""
    cfg = json.loads((hf_dirs["llama"] / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = {**params, "type": params.pop("rope_type")}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert read_hf_architecture(tmp_path) == read_hf_architecture(hf_dirs["llama"])


# ---- 2. stock MCore GPTModel checkpoint -----------------------------------------------------

GPT_SHAPES = dict(hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48,
                  normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
                  add_bias_linear=False, add_qkv_bias=True, layernorm_epsilon=1e-6,
                  use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0)
GPT_ARGS = dict(vocab_size=VOCAB, max_sequence_length=32, position_embedding_type="rope",
                share_embeddings_and_output_weights=False)


def saved_gpt_model(path, **shapes) -> GPTModel:
    """A stock GPTModel (random weights, norms and biases included), saved to ``path``."""
    gpt = GPTModel(TransformerConfig(num_layers=LAYERS, **{**GPT_SHAPES, **shapes}),
                   get_gpt_layer_local_spec(normalization="RMSNorm"), **GPT_ARGS)
    randomize(gpt, seed=5)
    dist_checkpointing.save(gpt.sharded_state_dict(), str(path))
    return gpt.eval()


def looped_for_gpt(mapping: str, loops: int = 1, **shapes) -> tuple:
    """A looped model with GPT_SHAPES' layers in the mapping's structure, and the mapping."""
    layers = LayerMapping.parse(mapping, LAYERS)
    cfg = LoopedTransformerConfig(
        num_layers=layers.core, looped_num_prelude_layers=layers.prelude,
        looped_num_coda_layers=layers.coda, looped_num_loops=loops,
        looped_injection="linear_concat", **{**GPT_SHAPES, **shapes})
    return LoopedGPTModel(cfg, get_looped_gpt_block_spec(cfg), **GPT_ARGS), layers


@pytest.mark.parametrize("mapping", ["0,4,0", "1,2,1"])
def test_mcore_checkpoint_gives_gpt_model_logits(mcore_single, tmp_path, mapping):
    gpt = saved_gpt_model(tmp_path)
    looped, layers = looped_for_gpt(mapping)
    weights = load_mcore_gpt_state_dict(tmp_path, looped)
    load_converted_state_dict(looped, retrofit_state_dict(weights, layers))
    tokens, mask = padded_batch(seed=2)
    positions = torch.arange(12)[None].expand(3, -1)
    with torch.no_grad():
        want = gpt.double()(tokens, positions, None)
        got = looped.double().eval()(tokens).logits[0]
    assert rel_err(got, want, mask.bool(), f"MCore GPTModel {mapping}") <= TOL


def test_mcore_checkpoint_of_other_shape_names_the_tensors(mcore_single, tmp_path):
    saved_gpt_model(tmp_path)
    looped, _ = looped_for_gpt("0,4,0", ffn_hidden_size=40)
    with pytest.raises(ValueError, match=r"linear_fc1.weight: checkpoint \(4, 96, 32\) != "
                                         r"model \(4, 80, 32\)"):
        load_mcore_gpt_state_dict(tmp_path, looped)


# ---- 3. retrofit, R = 3: rollouts and joint replay -------------------------------------------


@pytest.fixture
def retrofit_r3(mcore_single, hf_dirs):
    """The Llama import as prelude 1 / core 2 / coda 1, looped 3 times (fp64)."""
    model = looped_gpt_from_hf(hf_dirs["llama"], mapping="1,2,1", num_loops=3,
                               use_cpu_initialization=True)
    return model.double()


def test_retrofit_rollouts_are_the_model_policy(retrofit_r3):
    """Sampled tokens' rollout log-probs (KV cache, decode) equal a full forward's."""
    model = retrofit_r3.eval()
    prompts = [[1, 5, 9, 12], [1, 7, 3]]
    gen = torch.Generator().manual_seed(0)
    ro = generate(model, prompts, 3, 5, eos_id=2, pad_id=0,
                  sampling=Sampling(generator=gen, banned=(0, 1)))
    assert ro.responses.shape == (2, 3, 5) and (ro.lengths >= 1).all()
    for n, prompt in enumerate(prompts):
        for i in range(3):
            resp = ro.responses[n, i, : ro.lengths[n, i]].tolist()
            seq = torch.tensor([prompt + resp])
            with torch.no_grad():
                lp = model(seq[:, :-1], labels=seq[:, 1:]).logprobs[-1, 0, len(prompt) - 1:]
            assert torch.allclose(lp.float(), ro.logprobs[n, i, : len(resp)], atol=1e-5)


def test_retrofit_joint_replay_matches_naive(retrofit_r3):
    model, R = retrofit_r3.train(), 3
    group = make_group(5, 8, 4, R, seed=3, kl=True, vocab=VOCAB)
    spec = LossSpec(normalization="seq_mean", kl_coef=0.05, loop_weights="progressive")
    model.zero_grad(set_to_none=True)
    naive_losses, _ = naive_step(model, [group], spec, per_mb=2)
    ref = grads(model)
    model.zero_grad(set_to_none=True)
    out = joint_step(model, [group], spec, wave_size=2)
    errs = rel_errors(grads(model), ref)
    assert float((out[0]["loss"] - naive_losses[0]).abs() / naive_losses[0].abs()) <= 1e-12
    assert max(errs.values()) <= 1e-12, errs
    assert "decoder.injection.weight" in errs and "decoder.coda.0.mlp.linear_fc1.weight" in errs


# ---- 4. mappings and malformed sources ------------------------------------------------------


def test_layer_mapping():
    m = LayerMapping.parse("2,4,2", 10)
    assert m.targets() == {0: "decoder.prelude.0", 1: "decoder.prelude.1",
                           2: "decoder.layers.0", 3: "decoder.layers.1", 4: "decoder.layers.2",
                           5: "decoder.layers.3", 8: "decoder.coda.0", 9: "decoder.coda.1"}
    assert list(m.dropped) == [6, 7]
    assert m.describe() == ("10 source layers: layers 0-1 -> prelude, layers 2-5 -> core "
                            "(looped), layers 8-9 -> coda; dropped: layers 6-7")
    with pytest.raises(ValueError, match="uses 9 layers but the source model has 8"):
        LayerMapping.parse("2,5,2", 8)
    with pytest.raises(ValueError, match="'prelude,core,coda'"):
        LayerMapping.parse("2,4", 8)
    with pytest.raises(ValueError, match="core needs at least 1 layer"):
        LayerMapping.parse("2,0,2", 8)


def test_retrofit_drops_the_layers_between_core_and_coda():
    sd = {f"decoder.layers.{i}.mlp.linear_fc2.weight": torch.full((1,), float(i))
          for i in range(6)}
    sd["embedding.word_embeddings.weight"] = torch.zeros(1)
    out = retrofit_state_dict(sd, LayerMapping.parse("1,2,1", 6))
    assert {k: float(v) for k, v in out.items()} == {
        "decoder.prelude.0.mlp.linear_fc2.weight": 0.0,
        "decoder.layers.0.mlp.linear_fc2.weight": 1.0,
        "decoder.layers.1.mlp.linear_fc2.weight": 2.0,
        "decoder.coda.0.mlp.linear_fc2.weight": 5.0,
        "embedding.word_embeddings.weight": 0.0}


def _copy_dir(src, dst, config_edit=None, drop_prefix=None, extra=None):
    dst.mkdir(exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    if config_edit:
        config_edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    tensors = {**load_file(src / "model.safetensors"), **(extra or {})}
    save_file({k: v for k, v in tensors.items()
               if not (drop_prefix and k.startswith(drop_prefix))}, dst / "model.safetensors")
    return dst


def test_missing_config_json_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json in"):
        read_hf_architecture(tmp_path)


def test_malformed_config_json_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        read_hf_architecture(tmp_path)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(architectures=["MistralForCausalLM"]),
     r"unsupported architecture \['MistralForCausalLM'\]; supported: LlamaForCausalLM, "
     r"Qwen2ForCausalLM"),
    (lambda c: c["rope_parameters"].update(rope_type="yarn"),
     "RoPE scaling type 'yarn' is not supported"),
    (lambda c: c["rope_parameters"].update(high_freq_factor=2.0),
     "llama3 RoPE scaling with high_freq_factor=2.0 is not supported"),
    (lambda c: c.update(hidden_act="gelu"), "hidden_act='gelu': only 'silu'"),
    (lambda c: c.pop("num_hidden_layers"), "num_hidden_layers must be a positive integer"),
    (lambda c: c.update(num_key_value_heads=3),
     r"num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
], ids=["architecture", "rope-type", "llama3-factors", "activation", "no-layers", "kv-heads"])
def test_unsupported_config_is_named(tmp_path, hf_dirs, edit, message):
    path = _copy_dir(hf_dirs["llama"], tmp_path, config_edit=edit)
    with pytest.raises(ValueError, match=message):
        read_hf_architecture(path)


def test_safetensors_without_a_layer_is_named(tmp_path, hf_dirs):
    path = _copy_dir(hf_dirs["qwen2"], tmp_path, drop_prefix="model.layers.2.")
    arch = read_hf_architecture(path)
    with pytest.raises(ValueError, match=r"tensor 'model.layers.2.\S+' is missing from "
                                         r"model.safetensors"):
        load_hf_state_dict(path, arch)


def test_tensor_not_read_is_named(tmp_path, hf_dirs):
    """A weight the Llama mapping has no place for (here OLMo-2's q norm) is refused, not
    dropped; an older checkpoint's RoPE table ``rotary_emb.inv_freq`` is not a weight."""
    table = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}
    kept = _copy_dir(hf_dirs["llama"], tmp_path / "kept", extra=table)
    assert "decoder.layers.0.input_layernorm.weight" in load_hf_state_dict(
        kept, read_hf_architecture(kept))
    extra = {"model.layers.1.self_attn.q_norm.weight": torch.ones(64)}
    path = _copy_dir(hf_dirs["llama"], tmp_path / "bad", extra=extra)
    with pytest.raises(ValueError, match=r"tensor 'model.layers.1.self_attn.q_norm.weight' in "
                                         r"\S+ is not read by the Llama / Qwen2 importer"):
        load_hf_state_dict(path, read_hf_architecture(path))


def test_no_safetensors_is_named(tmp_path, hf_dirs):
    _copy_dir(hf_dirs["qwen2"], tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no \*.safetensors file in"):
        load_hf_state_dict(tmp_path, read_hf_architecture(tmp_path))


def test_weights_of_another_shape_are_named(mcore_single, hf_dirs):
    arch = read_hf_architecture(hf_dirs["qwen2"])
    weights = load_hf_state_dict(hf_dirs["qwen2"], arch)
    model = looped_gpt_from_hf(hf_dirs["qwen2"], use_cpu_initialization=True)
    weights["decoder.layers.1.mlp.linear_fc2.weight"] = torch.zeros(64, 95)
    del weights["decoder.final_layernorm.weight"]
    with pytest.raises(ValueError) as err:
        load_converted_state_dict(model, weights)
    assert "decoder.final_layernorm.weight: missing from the pretrained weights" in str(err.value)
    assert ("decoder.layers.1.mlp.linear_fc2.weight: pretrained (64, 95) != model (64, 96)"
            in str(err.value))

