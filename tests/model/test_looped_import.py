"""Public looped checkpoints imported in their own format: Ouro (``model_type`` "ouro") and
Huginn-0125 (``huginn_raven``; tests/helpers/reference_huginn.py, the same kind of reference).

The reference is tests/helpers/reference_ouro.py, a plain-PyTorch Ouro written from the public
modeling code that reads the checkpoint's own tensor names (it shares no code with the
importer). The checkpoints are tiny random ones written in Ouro's format (no download).

- per-loop logits and the exit distribution equal the reference on a right-padded batch, fp64,
  R in {1, 2, 4} (relative error <= 1e-10 on the non-padding positions);
- greedy rollouts through the depth-indexed KV cache (Ouro with its threshold exit, Huginn
  with the drawn state) pick the same loops and tokens as the reference recomputed on the
  whole sequence;
- joint replay with ``exit_pdf`` credit and the gate's own term equals naive training through
  stock MCore (fp64 <= 1e-12), the gate's gradient included;
- export writes the source format back: import -> export -> import is bitwise (Ouro, and a
  Llama / Qwen2 kept at R = 1), a retrofitted model is refused saying why;
- bad input: unknown model_type, a missing tensor, a wrong shape, an option that cannot be
  matched -- one-line errors naming it.
"""

import dataclasses
import json
import math

import pytest
import torch
from helpers.hf import write_hf_dirs
from helpers.reference_huginn import (
    documented_initial_state,
    huginn_forward,
    load_huginn,
    retrofit_forward,
    write_huginn_checkpoint,
    write_retrofit_checkpoint,
)
from helpers.reference_ouro import (
    load_ouro,
    ouro_forward,
    threshold_exit_step,
    write_ouro_checkpoint,
)
from helpers.sp import LossSpec, grads, joint_step, make_group, naive_step, rel_errors
from safetensors.torch import load_file, save_file

from scalerlt_mcore.model.hf_export import ExportError, save_hf
from scalerlt_mcore.model.hf_import import looped_gpt_from_hf, read_hf_architecture
from scalerlt_mcore.model.looped_import import looped_gpt_from_pretrained, read_looped_source
from scalerlt_mcore.rl.rollout import Sampling, generate

TOL = 1e-10
VOCAB = 64
MEASURED = {}


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    for case, err in MEASURED.items():
        print(f"\n[looped import] {case}: max relative error {err:.2e} (fp64)")


@pytest.fixture(scope="module")
def ouro_dir(tmp_path_factory):
    return write_ouro_checkpoint(tmp_path_factory.mktemp("ouro"), seed=3)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """Tiny random Llama / Qwen2 directories saved by transformers (test_pretrained_import's)."""
    return write_hf_dirs(tmp_path_factory)


def padded_batch(seed: int = 1) -> tuple:
    """tokens [3, 10] right-padded (lengths 10, 7, 4) and the attention mask (1 = token)."""
    tokens = torch.randint(3, VOCAB, (3, 10), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(3, 10, dtype=torch.long)
    mask[1, 7:] = mask[2, 4:] = 0
    return tokens.masked_fill(mask == 0, 0), mask


def rel(got, want, on, case: str) -> float:
    MEASURED[case] = float((got - want)[..., on].abs().max() / want[..., on].abs().max())
    return MEASURED[case]


def imported(path, loops=None):
    return looped_gpt_from_pretrained(path, num_loops=loops, use_cpu_initialization=True,
                                      max_sequence_length=64).double().eval()


# ---- 1. the same function as the public code ----------------------------------------------


@pytest.mark.parametrize("R", [1, 2, 4])
def test_ouro_per_loop_logits_and_exit_pdf(mcore_single, ouro_dir, R):
    cfg, w = load_ouro(ouro_dir)
    tokens, mask = padded_batch()
    want = ouro_forward(cfg, w, tokens, mask, total_ut_steps=R)
    model = imported(ouro_dir, R)
    with torch.no_grad():
        logits = model(tokens).logits  # R x [B, S, V]
        exit_lp = model(tokens, labels=tokens).exit_logprobs  # [R, B, S]
    on = mask.bool()
    got = torch.stack(logits)  # [R, B, S, V]
    assert got.shape == want["logits"].shape == (R, 3, 10, VOCAB)
    assert rel(got.permute(0, 3, 1, 2), want["logits"].permute(0, 3, 1, 2), on,
               f"ouro R={R} logits") <= TOL
    assert rel(exit_lp.exp(), want["exit_pdf"], on, f"ouro R={R} exit pdf") <= TOL


def test_ouro_config_fields_are_mapped(ouro_dir):
    src = read_looped_source(ouro_dir)
    a = src.arch
    assert (src.model_type, src.num_loops, src.exit_threshold) == ("ouro", 4, 1.0)
    assert src.looped == {"looped_family": "ouro", "looped_exit_gate": True}
    assert (a.num_layers, a.hidden_size, a.ffn_hidden_size, a.num_attention_heads,
            a.num_query_groups, a.kv_channels, a.vocab_size) == (2, 32, 48, 4, 2, 8, VOCAB)
    assert (a.rotary_base, a.norm_epsilon, a.add_qkv_bias) == (1e6, 1e-6, False)
    assert a.untie_embeddings_and_output_weights and not a.use_rope_scaling


def test_tied_ouro_is_imported(mcore_single, tmp_path):
    path = write_ouro_checkpoint(tmp_path, seed=4, tie_word_embeddings=True)
    cfg, w = load_ouro(path)
    assert "lm_head.weight" not in w
    tokens, mask = padded_batch(2)
    want = ouro_forward(cfg, w, tokens, mask, total_ut_steps=2)["logits"]
    with torch.no_grad():
        got = torch.stack(imported(path, 2)(tokens).logits)
    assert rel(got.permute(0, 3, 1, 2), want.permute(0, 3, 1, 2), mask.bool(),
               "ouro tied R=2 logits") <= TOL


# ---- 2. rollouts: the KV cache and the threshold exit -------------------------------------


def test_ouro_threshold_rollout_matches_reference(mcore_single, ouro_dir):
    """Greedy decoding with Ouro's early exit (threshold 0.6): at every step the reference
    recomputes the whole sequence, takes the first UT step whose exit CDF reaches the
    threshold and that step's argmax token."""
    cfg, w = load_ouro(ouro_dir)
    model = imported(ouro_dir, 4)
    prompts = [[5, 9, 11, 3], [7, 8]]
    out = generate(model, prompts, 1, 5, eos_id=-1, pad_id=0,
                   sampling=Sampling(temperature=0.0, exit_mode="threshold", exit_threshold=0.6))
    loops_used = set()
    for n, prompt in enumerate(prompts):
        seq = list(prompt)
        for t in range(5):
            ref = ouro_forward(cfg, w, torch.tensor([seq]))
            step = int(threshold_exit_step(ref["exit_pdf"][:, 0, -1], 0.6))
            token = int(ref["logits"][step, 0, -1].argmax())
            assert int(out.exit_loops[n, 0, t]) == step + 1
            assert int(out.responses[n, 0, t]) == token
            lp = torch.log_softmax(ref["logits"][step, 0, -1], -1)[token]
            assert out.logprobs.dtype == torch.float32  # the rollout stores fp32 log-probs
            assert abs(float(out.logprobs[n, 0, t]) - float(lp)) <= 1e-6 * abs(float(lp))
            loops_used.add(step)
            seq.append(token)
    assert len(loops_used) > 1, loops_used  # the threshold exit is exercised


# ---- 3. joint replay through the imported gate --------------------------------------------


def test_ouro_joint_replay_exit_pdf_matches_naive(mcore_single, ouro_dir):
    from helpers.exit_gate import _joint, _naive

    R = 3
    model = looped_gpt_from_pretrained(ouro_dir, num_loops=R, use_cpu_initialization=True,
                                       max_sequence_length=64).double()
    group = make_group(5, 8, 4, R, seed=71, dtype=torch.float64, kl=True, vocab=VOCAB)
    spec = LossSpec(normalization="seq_mean", kl_coef=0.05)
    naive_loss = _naive(model, [group], spec, "exit_pdf", 0.5, 0.1, per_mb=2)
    ref = grads(model)
    model.zero_grad(set_to_none=True)
    out = _joint(model, [group], spec, "exit_pdf", 0.5, 0.1, 2, False)
    assert abs(float(out[0]["loss"]) - naive_loss) <= 1e-12 * abs(naive_loss)
    errs = rel_errors(grads(model), ref)
    assert {"decoder.exit_gate.linear.weight", "decoder.layers.0.mlp.post_layernorm.weight",
            "decoder.layers.1.self_attention.post_layernorm.weight"} <= set(errs)
    assert max(errs.values()) <= 1e-12, {n: e for n, e in errs.items() if e > 1e-12}


# ---- 4. bad input -------------------------------------------------------------------------


def _edited(src, dst, config=None, drop=None, reshape=None, extra=None):
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(config or {})
    (dst / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(str(src / "model.safetensors"))
    tensors.update(extra or {})
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = tensors[reshape][:-1].contiguous()
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


BAD = [
    (dict(config={"model_type": "gpt_neox"}), r"unknown model_type 'gpt_neox'"),
    (dict(drop="model.layers.1.input_layernorm_2.weight"),
     r"tensor 'model.layers.1.input_layernorm_2.weight' is missing"),
    (dict(reshape="model.layers.0.self_attn.k_proj.weight"),
     r"tensor 'model.layers.0.self_attn.k_proj.weight' .* has shape \(15, 32\), config.json "
     r"implies \(16, 32\)"),
    (dict(config={"use_sliding_window": True}), r"use_sliding_window=True: sliding-window"),
    (dict(config={"hidden_act": "gelu"}), r"hidden_act='gelu': only 'silu'"),
    (dict(config={"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}),
     r"RoPE scaling type 'yarn' is not supported"),
    (dict(config={"early_exit_step": 2}), r"early_exit_step=2: a fixed exit step"),
    (dict(config={"total_ut_steps": 0}), r"total_ut_steps must be a positive integer, got 0"),
    (dict(config={"num_key_value_heads": 3}),
     r"num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
    (dict(extra={"model.layers.0.self_attn.q_norm.weight": torch.ones(32)}),
     r"tensor 'model.layers.0.self_attn.q_norm.weight' in \S+ is not read by the Ouro "
     r"importer"),
]


@pytest.mark.parametrize("edit, message", BAD, ids=[m[:24] for _, m in BAD])
def test_bad_input_is_named(mcore_single, ouro_dir, tmp_path, edit, message):
    path = _edited(ouro_dir, tmp_path / "bad", **edit)
    with pytest.raises(ValueError, match=message) as err:
        looped_gpt_from_pretrained(path, use_cpu_initialization=True, max_sequence_length=64)
    assert "\n" not in str(err.value)


# ---- 5. export: the source format back, bitwise ---------------------------------------------


def _files(path) -> dict:
    return load_file(str(path / "model.safetensors"))


def _bitwise(a: dict, b: dict) -> bool:
    """The same tensors (``_extra_state`` entries of MCore modules skipped), bit for bit."""
    a, b = ({k: v for k, v in d.items() if not k.endswith("_extra_state")} for d in (a, b))
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_ouro_export_round_trip_is_bitwise(mcore_single, ouro_dir, tmp_path):
    (ouro_dir / "tokenizer.json").write_text("{}")
    (ouro_dir / "modeling_ouro.py").write_text("# remote code\n")
    first = looped_gpt_from_pretrained(ouro_dir, use_cpu_initialization=True,
                                       max_sequence_length=64)
    out = save_hf(first, tmp_path / "out", source=ouro_dir, exit_threshold=0.8)
    assert _bitwise(_files(out), _files(ouro_dir))  # the source's names and bits
    written = json.loads((out / "config.json").read_text())
    source = json.loads((ouro_dir / "config.json").read_text())
    assert written == {**source, "early_exit_threshold": 0.8, "max_position_embeddings": 64}
    assert (out / "tokenizer.json").is_file() and (out / "modeling_ouro.py").is_file()
    second = looped_gpt_from_pretrained(out, use_cpu_initialization=True,
                                        max_sequence_length=64)
    assert _bitwise(first.state_dict(), second.state_dict())
    assert read_looped_source(out).exit_threshold == 0.8


def test_export_without_source_writes_a_complete_config(mcore_single, ouro_dir, tmp_path):
    model = looped_gpt_from_pretrained(ouro_dir, num_loops=3, use_cpu_initialization=True,
                                       max_sequence_length=64)
    out = save_hf(model, tmp_path / "bare")
    src = read_looped_source(out)
    assert src.num_loops == 3 and src.arch == read_looped_source(ouro_dir).arch
    assert _bitwise(_files(out), _files(ouro_dir))


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_plain_model_exports_as_itself(mcore_single, hf_dirs, tmp_path, name):
    """Llama (untied, llama3 RoPE) / Qwen2 (tied, QKV biases) at R = 1: the source's tensors
    bit for bit, and transformers reads the directory back to the same logits."""
    from transformers import AutoModelForCausalLM

    src = hf_dirs[name]
    model = looped_gpt_from_hf(src, use_cpu_initialization=True)
    out = save_hf(model, tmp_path / name, source=src)
    assert _bitwise(_files(out), _files(src))
    assert read_hf_architecture(out) == read_hf_architecture(src)
    again = looped_gpt_from_hf(out, use_cpu_initialization=True)
    assert _bitwise(model.state_dict(), again.state_dict())
    tokens = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(src).eval()(input_ids=tokens).logits
        b = AutoModelForCausalLM.from_pretrained(out).eval()(input_ids=tokens).logits
    assert torch.equal(a, b)


def test_retrofitted_model_export_is_refused(mcore_single, hf_dirs, tmp_path):
    """A retrofit with R > 1 and no injection is no public function; one whose recurrent state
    starts at the prelude output has no Retrofitted Recurrence form."""
    plain = looped_gpt_from_hf(hf_dirs["llama"], num_loops=2, use_cpu_initialization=True)
    with pytest.raises(ExportError, match=r"cannot export as plain Llama / Qwen2: "
                       r"looped_num_loops=2 is not the function of any plain transformer"):
        save_hf(plain, tmp_path / "x")
    embed = looped_gpt_from_hf(hf_dirs["llama"], mapping="1,2,1", num_loops=2,
                               use_cpu_initialization=True)
    with pytest.raises(ExportError, match=r"cannot export looped_initial_state 'embed' in the "
                       r"Retrofitted Recurrence huginn_raven layout: its recurrent state starts "
                       r"random"):
        save_hf(embed, tmp_path / "y")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_retrofit_exports_in_the_retrofitted_recurrence_layout(mcore_single, hf_dirs,
                                                               tmp_path):
    """A Llama retrofitted here (prelude 1 / core 2 / coda 1, drawn state) is written as
    Retrofitted Recurrence and read back bitwise, to the same per-loop logits."""
    model = looped_gpt_from_hf(hf_dirs["llama"], mapping="1,2,1", num_loops=3,
                               use_cpu_initialization=True, looped_initial_state="random")
    out = save_hf(model, tmp_path / "retro")
    src = read_looped_source(out)
    assert src.layout == "retrofitted" and src.num_loops == 3 and src.arch.use_rope_scaling
    again = looped_gpt_from_pretrained(out, use_cpu_initialization=True,
                                       max_sequence_length=model.max_sequence_length)
    assert _bitwise(model.state_dict(), again.state_dict())
    tokens = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(model(tokens).logits,
                                                     again(tokens).logits))


def test_retrofitted_recurrence_export_keeps_the_source_block_size(mcore_single, tmp_path):
    """The upstream conversions keep Huginn's ``block_size`` (4096) beside the Llama's
    ``max_position_embeddings``: export writes the source's block_size back, and the model's
    positions as max_position_embeddings."""
    path = _edited(write_retrofit_checkpoint(tmp_path / "retro", seed=9), tmp_path / "src",
                   config={"block_size": 4096})
    model = looped_gpt_from_pretrained(path, use_cpu_initialization=True)
    config = json.loads((save_hf(model, tmp_path / "out", source=path) / "config.json")
                        .read_text())
    assert (config["block_size"], config["max_position_embeddings"]) == (4096, 64)


def _fp64_copy(src, dst):
    """``src`` with every tensor in fp64 carrying bits below fp32's resolution."""
    gen = torch.Generator().manual_seed(4)
    extra = {k: v.double() * (1 + 1e-12 * torch.randn(v.shape, generator=gen, dtype=torch.float64))
             for k, v in load_file(str(src / "model.safetensors")).items()}
    return _edited(src, dst, extra=extra)


@pytest.mark.parametrize("kind", ["ouro", "huginn", "retrofitted", "llama"])
def test_import_and_export_have_one_dtype(mcore_single, ouro_dir, hf_dirs, tmp_path, kind):
    """params_dtype holds for every imported tensor (an fp64 checkpoint's norms stay fp64, bit
    for bit), and an export writes every tensor in the dtype its config.json names, also from
    a model whose norms were left in fp32 beside bf16 weights."""
    src = {"ouro": lambda: ouro_dir, "llama": lambda: hf_dirs["llama"],
           "huginn": lambda: write_huginn_checkpoint(tmp_path / "h", seed=6),
           "retrofitted": lambda: write_retrofit_checkpoint(tmp_path / "r", seed=9)}[kind]()
    path = _fp64_copy(src, tmp_path / "fp64")
    load = looped_gpt_from_hf if kind == "llama" else looped_gpt_from_pretrained
    model = load(path, use_cpu_initialization=True, params_dtype=torch.float64)
    sd = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
    assert {v.dtype for v in sd.values()} == {torch.float64}
    norm = next(k for k in sd if k.endswith("layernorm.weight"))
    assert not torch.equal(sd[norm], sd[norm].float().double())  # fp64 bits kept
    bf16 = load(path, use_cpu_initialization=True, params_dtype=torch.bfloat16)
    for module in bf16.modules():
        if type(module).__name__.endswith("Norm"):
            module.float()  # norms in fp32 beside bf16 weights
    out = save_hf(bf16, tmp_path / "bf16", source=path)
    config = json.loads((out / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    assert {v.dtype for v in _files(out).values()} == {torch.bfloat16}


# ---- 6. Huginn (huginn_raven) ---------------------------------------------------------------


@pytest.fixture(scope="module")
def huginn_dir(tmp_path_factory):
    return write_huginn_checkpoint(tmp_path_factory.mktemp("huginn"), seed=6)


def huginn_model(path, loops, state="random", seed=5, step=3):
    model = looped_gpt_from_pretrained(path, num_loops=loops, use_cpu_initialization=True,
                                       max_sequence_length=64, looped_initial_state=state)
    model.set_initial_state_draw(seed, step)
    return model.double().eval()


@pytest.mark.parametrize("R", [1, 2, 4])
@pytest.mark.parametrize("state", ["random", "zeros"])
def test_huginn_per_loop_logits(mcore_single, huginn_dir, R, state):
    """Loop r's readout is the public model run with num_steps = r from the same initial
    state: the documented (seed, step) draw, or zeros."""
    cfg, w = load_huginn(huginn_dir)
    tokens, mask = padded_batch(4)
    positions = torch.arange(10)[None].expand(3, 10)
    s0 = (documented_initial_state(5, 3, 64, 32, positions) if state == "random"
          else torch.zeros(3, 10, 32, dtype=torch.float64))
    want = torch.stack([huginn_forward(cfg, w, tokens, r + 1, s0) for r in range(R)])
    with torch.no_grad():
        got = torch.stack(huginn_model(huginn_dir, R, state)(tokens).logits)
    assert got.shape == want.shape == (R, 3, 10, VOCAB)
    assert rel(got.permute(0, 3, 1, 2), want.permute(0, 3, 1, 2), mask.bool(),
               f"huginn {state} R={R} logits") <= TOL


def test_huginn_policy_and_reference_draw_one_table_per_step(mcore_single, huginn_dir,
                                                             monkeypatch):
    """Two models with the same (seed, step) draw (the policy and its frozen KL reference)
    draw the host table once between them; the next step's draw is a new table."""
    from scalerlt_mcore.model import looped_gpt

    draws = []
    normal = torch.nn.init.trunc_normal_
    monkeypatch.setattr(torch.nn.init, "trunc_normal_",
                        lambda *a, **k: draws.append(1) or normal(*a, **k))
    looped_gpt.initial_state_table.cache_clear()
    policy, reference = (huginn_model(huginn_dir, 2, seed=811, step=s) for s in (1, 1))
    positions = torch.arange(6)[None]
    first = [m.initial_state(positions) for m in (policy, reference)]
    assert len(draws) == 1 and torch.equal(first[0], first[1])
    for m in (policy, reference):
        m.set_initial_state_draw(811, 2)
    second = [m.initial_state(positions) for m in (policy, reference)]
    assert len(draws) == 2 and torch.equal(second[0], second[1])
    assert not torch.equal(first[0], second[0])


def test_huginn_config_fields_are_mapped(huginn_dir):
    src = read_looped_source(huginn_dir)
    assert (src.model_type, src.num_loops, src.core_layers, src.backprop_loops,
            src.max_sequence_length) == ("huginn_raven", 4, 2, 2, 64)
    assert src.looped == {"looped_family": "huginn", "looped_num_prelude_layers": 1,
                          "looped_num_coda_layers": 1, "looped_injection": "linear_concat",
                          "looped_initial_state": "random"}
    a = src.arch
    assert (a.hidden_size, a.num_attention_heads, a.num_query_groups, a.kv_channels,
            a.ffn_hidden_size, a.rotary_base) == (32, 4, 4, 8, 48, 50000.0)
    assert not a.untie_embeddings_and_output_weights


def test_huginn_joint_replay_matches_naive(mcore_single, huginn_dir):
    """Joint replay with the drawn initial state: the prompt producer and the replay read the
    same rows of the (seed, step) table as the naive full sequences (fp64, 1e-12)."""
    R = 2
    model = looped_gpt_from_pretrained(huginn_dir, num_loops=R, use_cpu_initialization=True,
                                       max_sequence_length=64).double()
    model.set_initial_state_draw(7, 1)
    group = make_group(4, 7, 4, R, seed=72, dtype=torch.float64, vocab=VOCAB)
    spec = LossSpec(normalization="seq_mean", loop_weights="uniform")
    naive = naive_step(model, [group], spec, per_mb=2)[0]
    ref = grads(model)
    model.zero_grad(set_to_none=True)
    out = joint_step(model, [group], spec, wave_size=2)
    assert abs(float(out[0]["loss"]) - float(naive[0])) <= 1e-12 * abs(float(naive[0]))
    errs = rel_errors(grads(model), ref)
    assert {"decoder.injection.weight", "decoder.layers.0.self_attention.qk_bias",
            "decoder.coda.0.post_mlp_residual_layernorm.weight"} <= set(errs)
    assert max(errs.values()) <= 1e-12, {n: e for n, e in errs.items() if e > 1e-12}


HUGINN_BAD = [
    (dict(qk_bias=False), r"qk_bias=False: only True is supported"),
    (dict(test_time_noise=0.1), r"test_time_noise=0.1: only 0 is supported"),
    (dict(n_layers=5), r"n_layers=5 != n_layers_in_prelude \+ n_layers_in_recurrent_block \+ "
                       r"n_layers_in_coda = 4"),
    (dict(init_values={"embed_scale": 2.0}), r"init_values.embed_scale=2.0: only sqrt\(n_embd\)"),
]


@pytest.mark.parametrize("edit, message", HUGINN_BAD, ids=[m[:20] for _, m in HUGINN_BAD])
def test_huginn_bad_input_is_named(mcore_single, huginn_dir, tmp_path, edit, message):
    path = _edited(huginn_dir, tmp_path / "bad", config=edit)
    with pytest.raises(ValueError, match=message) as err:
        looped_gpt_from_pretrained(path, use_cpu_initialization=True, max_sequence_length=64)
    assert "\n" not in str(err.value)


def test_huginn_tensor_not_read_is_named(mcore_single, huginn_dir, tmp_path):
    """A weight outside Huginn's block (here a q norm) is refused, not dropped; the public
    RoPE buffer ``freqs_cis`` is not a weight and may be present."""
    extra = {"transformer.core_block.1.attn.q_norm.weight": torch.ones(32),
             "freqs_cis": torch.zeros(1, 64, 1, 4, 2)}
    path = _edited(huginn_dir, tmp_path / "bad", extra=extra)
    with pytest.raises(ValueError, match=r"tensor 'transformer.core_block.1.attn.q_norm.weight' "
                                         r"in \S+ is not read by the Huginn importer"):
        looped_gpt_from_pretrained(path, use_cpu_initialization=True, max_sequence_length=64)


def test_huginn_export_round_trip_is_bitwise(mcore_single, huginn_dir, tmp_path):
    first = looped_gpt_from_pretrained(huginn_dir, use_cpu_initialization=True,
                                       max_sequence_length=64)
    out = save_hf(first, tmp_path / "out", source=huginn_dir)
    assert _bitwise(_files(out), _files(huginn_dir))  # freqs_cis included
    written = json.loads((out / "config.json").read_text())
    assert written == json.loads((huginn_dir / "config.json").read_text())
    second = looped_gpt_from_pretrained(out, use_cpu_initialization=True,
                                        max_sequence_length=64)
    assert _bitwise(first.state_dict(), second.state_dict())
    bare = read_looped_source(save_hf(first, tmp_path / "bare"))  # no source: a full config
    assert bare.backprop_loops == 4  # mean_backprop_depth: the model's (no truncation) = R
    assert dataclasses.replace(bare, backprop_loops=2) == read_looped_source(huginn_dir)


# ---- 7. Retrofitted Recurrence (huginn_raven with a Llama-style modeling file) ----------------


@pytest.mark.parametrize("R", [1, 2, 4])
def test_retrofitted_recurrence_per_loop_logits(mcore_single, tmp_path, R):
    path = write_retrofit_checkpoint(tmp_path / "retro", seed=9)
    src = read_looped_source(path)
    assert src.layout == "retrofitted" and src.arch.num_query_groups == 2
    cfg, w = load_huginn(path)
    tokens, mask = padded_batch(5)
    assert src.looped["looped_initial_state_std"] == math.sqrt(2 / (5 * 5280))  # init_values
    s0 = documented_initial_state(2, 1, 64, 32, torch.arange(10)[None].expand(3, 10),
                                  std=math.sqrt(2 / (5 * 5280)), scale=1.0)
    want = torch.stack([retrofit_forward(cfg, w, tokens, r + 1, s0) for r in range(R)])
    model = looped_gpt_from_pretrained(path, num_loops=R, use_cpu_initialization=True)
    model.set_initial_state_draw(2, 1)
    with torch.no_grad():
        got = torch.stack(model.double().eval()(tokens).logits)
    assert rel(got.permute(0, 3, 1, 2), want.permute(0, 3, 1, 2), mask.bool(),
               f"retrofitted recurrence R={R} logits") <= TOL


def _olmo2_retrofit(src, dst, modeling):
    """A Retrofitted Recurrence checkpoint as the upstream OLMo-2 converter writes it: the Llama
    layout's names plus per-block ``attn.q_norm`` / ``attn.k_norm`` (full q / k width), with
    ``modeling`` as its modeling file."""
    norms = {f"transformer.{stack}.{i}.attn.{n}_norm.weight": torch.ones(width)
             for stack, count in (("prelude", 1), ("core_block", 2), ("coda", 1))
             for i in range(count) for n, width in (("q", 32), ("k", 16))}
    auto = {"AutoConfig": "raven_config_minimal.RavenConfig",
            "AutoModelForCausalLM": f"{modeling}.RavenForCausalLM"}
    return _edited(src, dst, config={"auto_map": auto}, extra=norms)


def test_retrofitted_recurrence_kv_heads_must_divide_heads(mcore_single, tmp_path):
    path = _edited(write_retrofit_checkpoint(tmp_path / "retro", seed=9), tmp_path / "bad",
                   config={"num_key_value_heads": 3})
    with pytest.raises(ValueError, match=r"n_heads=4 is not a multiple of "
                                         r"num_key_value_heads=3") as err:
        looped_gpt_from_pretrained(path, use_cpu_initialization=True)
    assert "\n" not in str(err.value)


def test_retrofitted_recurrence_olmo2_layout_is_refused(mcore_single, tmp_path):
    """The OLMo-2 layout (post-norm blocks, q/k norms) is refused by its modeling file, and by
    its q/k norm tensors where config.json names the Llama one: never imported as Llama."""
    retro = write_retrofit_checkpoint(tmp_path / "retro", seed=9)
    olmo = _olmo2_retrofit(retro, tmp_path / "olmo", "raven_modeling_minimal_olmo")
    with pytest.raises(ValueError, match=r"auto_map.AutoModelForCausalLM='raven_modeling_minimal_"
                                         r"olmo.RavenForCausalLM': the Retrofitted Recurrence "
                                         r"OLMo-2 layout .* is not supported"):
        looped_gpt_from_pretrained(olmo, use_cpu_initialization=True)
    unnamed = _olmo2_retrofit(retro, tmp_path / "unnamed", "raven_modeling_minimal_llama")
    with pytest.raises(ValueError, match=r"tensor 'transformer.coda.0.attn.k_norm.weight' in "
                                         r"\S+ \(and 7 more\) is not read by the Retrofitted "
                                         r"Recurrence importer"):
        looped_gpt_from_pretrained(unnamed, use_cpu_initialization=True)


def test_huginn_greedy_rollout_matches_reference(mcore_single, huginn_dir):
    """Decoding through the depth-indexed cache (prelude, R loops, per-loop coda) with the
    drawn state: every step's greedy token from the last loop is the reference's, recomputed
    on the whole sequence with the same rows of the state table."""
    cfg, w = load_huginn(huginn_dir)
    model = huginn_model(huginn_dir, 3)
    prompts = [[5, 9, 11, 3], [7, 8]]
    out = generate(model, prompts, 1, 4, eos_id=-1, pad_id=0, sampling=Sampling(temperature=0.0))
    for n, prompt in enumerate(prompts):
        seq = list(prompt)
        for t in range(4):
            positions = torch.arange(len(seq))[None]
            s0 = documented_initial_state(5, 3, 64, 32, positions)
            logits = huginn_forward(cfg, w, torch.tensor([seq]), 3, s0)[0, -1]
            token = int(logits.argmax())
            assert int(out.responses[n, 0, t]) == token
            lp = float(torch.log_softmax(logits, -1)[token])
            assert abs(float(out.logprobs[n, 0, t]) - lp) <= 1e-6 * abs(lp)
            seq.append(token)
