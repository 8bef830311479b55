"""Configuration: precedence, errors that name the key, validation, resolved config, CLI."""

import dataclasses
import inspect
import os
import re
import typing
from importlib import resources
from pathlib import Path
from typing import Literal

import pytest
import torch

from scalerlt_mcore.app.config import (
    CHOICES,
    KEYS,
    OBJECTIVE_FLAGS,
    SAMPLING_FLAGS,
    SCHEDULE_FLAGS,
    ConfigError,
    ModelArgs,
    RunConfig,
    cli_flags,
    demo_config_text,
    field_docs,
    in_key_names,
    looped_kwargs,
    model_config,
    objective_from,
    parse_args,
    sampling_from,
    save_resolved,
    schedule_from,
    task_from,
    to_dict,
    validate,
)
from scalerlt_mcore.app.config.library import library_errors
from scalerlt_mcore.model.config import FieldError, LoopedFields, LoopedTransformerConfig
from scalerlt_mcore.rl.advantages import ADVANTAGE_MODES
from scalerlt_mcore.rl.objective import RLObjective
from scalerlt_mcore.rl.rollout import Sampling

REPO = Path(__file__).resolve().parents[2]


def _yaml(tmp_path, text, name="x.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_precedence_defaults_yaml_cli(tmp_path):
    path = _yaml(tmp_path, "lr: 1e-2\nhidden_size: 32\nrl_task_options: {modulus: 5}\n")
    cfg = parse_args(["--config", path, "--hidden-size", "16", "--bf16", "--seed=7"])
    assert cfg.training.lr == 0.01  # yaml (and "1e-2" read as a float)
    assert cfg.model.hidden_size == 16  # cli beats yaml
    assert cfg.model.bf16 is True and cfg.training.seed == 7  # cli only
    assert cfg.rl.rl_task_options == {"modulus": 5}
    assert cfg.rl.grpo_group_size == RunConfig().rl.grpo_group_size  # default


def test_cli_value_forms(tmp_path):
    cfg = parse_args(["--bf16", "false", "--no-plot", "--num-query-groups", "1",
                      "--grpo-kl-beta", "-0.5", "--rl-task-options", "{max_len: 3}",
                      "--ffn-hidden-size", "none", "--save", "ckpt"])
    assert cfg.model.bf16 is False and cfg.logging.no_plot is True
    assert cfg.model.num_query_groups == 1 and cfg.model.ffn_hidden_size is None
    assert cfg.rl.grpo_kl_beta == -0.5 and cfg.rl.rl_task_options == {"max_len": 3}
    assert cfg.logging.save == "ckpt"


def test_unknown_key_in_yaml_names_key_and_file(tmp_path):
    path = _yaml(tmp_path, "hiden_size: 8\n")
    with pytest.raises(ConfigError, match=f"unknown key 'hiden_size' in {path}.*'hidden_size'"):
        parse_args(["--config", path])


def test_grouped_layout_rejected(tmp_path):
    path = _yaml(tmp_path, "model:\n  num_layers: 2\n")
    with pytest.raises(ConfigError, match="unknown key 'model'.*write flat keys"):
        parse_args(["--config", path])


def test_unknown_key_on_cli():
    with pytest.raises(ConfigError, match="unknown key 'hiden_size' on the command line"):
        parse_args(["--hiden-size", "8"])
    with pytest.raises(ConfigError, match="unexpected command-line argument 'oops'"):
        parse_args(["oops"])
    with pytest.raises(ConfigError, match="key 'lr' expects a value"):
        parse_args(["--lr"])


@pytest.mark.parametrize("argv, message", [
    (["--lr", "abc"], "key 'lr' expects float, got 'abc'"),
    (["--num-layers", "2.5"], "key 'num_layers' expects int, got '2.5'"),
    (["--bf16=maybe"], "key 'bf16' expects bool, got 'maybe'"),
    (["--rl-task-options", "[1, 2]"], "key 'rl_task_options' expects dict"),
])
def test_wrong_type_on_cli(argv, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        parse_args(argv)


def test_wrong_type_in_yaml(tmp_path):
    for text, message in [("num_layers: two\n", "key 'num_layers' expects int, got 'two'"),
                          ("bf16: 1\n", "key 'bf16' expects bool, got 1"),
                          ("rl_task: 3\n", "key 'rl_task' expects str, got 3")]:
        with pytest.raises(ConfigError, match=message):
            parse_args(["--config", _yaml(tmp_path, text)])


def test_missing_or_malformed_file(tmp_path):
    missing = str(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match=f"config file not found: {missing}"):
        parse_args(["--config", missing])
    with pytest.raises(ConfigError, match="must be a mapping"):
        parse_args(["--config", _yaml(tmp_path, "- 1\n- 2\n")])


def test_batch_divisibility_names_both_numbers():
    cfg = parse_args(["--global-batch-size", "24", "--grpo-group-size", "8",
                      "--micro-batch-size", "8"])
    validate(cfg, world_size=1)
    with pytest.raises(ConfigError, match=r"global_batch_size \(24\) must be divisible by "
                       r"data-parallel size x grpo_group_size \(2 x 8 = 16\)"):
        validate(cfg, world_size=2)
    cfg = parse_args(["--micro-batch-size", "3"])
    with pytest.raises(ConfigError, match=r"must be divisible by micro_batch_size \(3\)"):
        validate(cfg, world_size=1)


@pytest.mark.parametrize("argv, message", [
    (["--pipeline-model-parallel-size", "2"], "pipeline_model_parallel_size must be 1"),
    (["--micro-batch-size", "0"], "micro_batch_size must be >= 1"),
    (["--shared-prefix-wave-size", "0"], "shared_prefix_wave_size must be >= 1"),
    (["--rl-loop-weights", "last"], "rl_loop_weights must be one of"),
    (["--grpo-clamp-eps-lower", "0"], "grpo_clamp_eps_lower must be > 0, got 0.0"),
    (["--grpo-clamp-eps-upper", "-0.1"], "grpo_clamp_eps_upper must be > 0, got -0.1"),
    (["--grpo-kl-beta", "-1"], "grpo_kl_beta must be >= 0, got -1.0"),
    (["--bf16", "--fp16"], r"Only one of self.fp16: True and self.bf16 True should be True"),
    (["--looped-num-loops", "0"], "looped_num_loops must be an integer >= 1, got 0"),
    (["--looped-num-coda-layers", "-1"], "looped_num_coda_layers must be an integer >= 0"),
    (["--tensor-model-parallel-size", "3"],
     r"world size \(1\) must be divisible by tensor_model_parallel_size \(3\)"),
    (["--make-vocab-size-divisible-by", "0"], "make_vocab_size_divisible_by must be >= 1"),
    (["--manual-gc-interval", "-1"], "manual_gc_interval must be >= 0"),
    (["--tensor-model-parallel-size", "3"],
     r"num_attention_heads \(2\) must be a multiple of tensor_model_parallel_size \(3\)"),
    (["--rl-task", "revers"],
     "known tasks: kv_retrieval, modular_arithmetic, reverse, sort, mix, reasoning_gym:<dataset>"),
    (["--rl-max-response-length", "1", "--rl-task", "reverse", "--rl-task-options", "{}"],
     r"rl_max_response_length \(1\) is shorter than the task's longest answer \(6\)"),
    (["--max-position-embeddings", "8"], "max_position_embeddings"),
    (["--hidden-size", "63"], r"hidden_size \(63\) must be divisible"),
    (["--rl-old-logprobs", "rollout", "--grpo-iterations", "2"],
     "rl_old_logprobs 'rollout' needs grpo_iterations 1, got 2"),
    (["--rl-stop-check-interval", "0"], r"rl_stop_check_interval must be >= 1 or None, got 0"),
    (["--rl-rollout", "per_prompt"],
     r"rl_rollout must be one of \('prompt_once', 'per_row', 'tree'\)"),
    (["--rl-prompt-kv", "once"], r"rl_prompt_kv must be one of \('shared', 'copied'\)"),
    (["--rl-decode-cuda-graph", "true", "--rl-rollout", "tree", "--grpo-group-size", "16"],
     "rl_decode_cuda_graph decodes rl_rollout prompt_once or per_row; tree rollouts decode"),
    (["--looped-num-loops-sampling", "uniform:3,2"],
     r"looped_num_loops_sampling must be one of .* got 'uniform:3,2'"),
    (["--looped-num-loops-sampling", "poisson"], "looped_num_loops_sampling must be one of"),
    (["--looped-backprop-loops", "-2"], "looped_backprop_loops must be an integer >= 0"),
    (["--looped-readout-tile", "-1"], "looped_readout_tile must be an integer >= 0, got -1"),
    (["--rl-loop-weights", "exit_pdf"], "rl_loop_weights exit_pdf needs looped_exit_gate true"),
    (["--rl-exit-gate-coef", "0.1"], r"rl_exit_gate_coef > 0 needs looped_exit_gate true"),
    (["--rl-loop-weights", "learned"],
     "rl_loop_weights learned needs looped_learned_loop_weights true"),
    (["--looped-learned-loop-weights", "true", "--looped-num-loops", "2",
      "--looped-num-loops-sampling", "uniform:1,3"], "draws up to 3 loops"),
    (["--rl-rollout-exit", "mixture"], "rl_rollout_exit mixture needs looped_exit_gate true"),
    (["--looped-exit-gate", "true"], r"rl_exit_gate_coef must be > 0 with looped_exit_gate"),
    (["--looped-backprop-loops", "1"], "looped_backprop_loops > 0 needs looped_injection"),
    (["--looped-learned-loop-weights", "true"],
     "rl_loop_weights must be learned with looped_learned_loop_weights"),
    (["--rl-exit-threshold", "0"], r"rl_exit_threshold must be in \(0, 1\], got 0"),
    (["--rl-exit-entropy-coef", "-1"], "rl_exit_entropy_coef must be >= 0, got -1.0"),
    (["--rl-top-p", "0"], r"rl_top_p must be in \(0, 1\], got 0.0"),
    (["--grpo-entropy-term-weight", "-0.1"], "grpo_entropy_term_weight must be >= 0, got -0.1"),
    (["--recompute-method", "uniform"],
     "recompute_method 'uniform' .--recompute-method. needs recompute_granularity 'full'"),
    (["--recompute-granularity", "selective", "--recompute-num-layers", "2"],
     "recompute_num_layers"),
])
def test_validate_rejects(argv, message):
    with pytest.raises(ConfigError, match=message):
        validate(parse_args(argv), world_size=1)


def test_recompute_flags_reach_the_transformer_config():
    """Megatron-LM's recompute flags are MCore's TransformerConfig fields of the model."""
    cfg = parse_args(["--recompute-granularity", "full", "--recompute-method", "block",
                      "--recompute-num-layers", "1"])
    validate(cfg, world_size=1)
    config = model_config(cfg, "cpu")
    assert (config.recompute_granularity, config.recompute_method,
            config.recompute_num_layers) == ("full", "block", 1)
    assert model_config(parse_args([]), "cpu").recompute_granularity is None


def test_readout_tile_flag_reaches_the_transformer_config():
    """--looped-readout-tile is the model config's ``looped_readout_tile`` (0 without it)."""
    cfg = parse_args(["--looped-readout-tile", "4096"])
    validate(cfg, world_size=1)
    assert model_config(cfg, "cpu").looped_readout_tile == 4096
    assert model_config(parse_args([]), "cpu").looped_readout_tile == 0


def test_tensor_parallel_sizes_checked_against_data_parallel_size():
    """TP is supported: TP=2 on 2 ranks is one data-parallel rank, whose batch checks use DP
    size 1; an explicit vocab_size (not padded) must split over the TP ranks."""
    cfg = parse_args(["--tensor-model-parallel-size", "2", "--global-batch-size", "8",
                      "--grpo-group-size", "8", "--micro-batch-size", "8"])
    validate(cfg, world_size=2)  # DP 1: the 8 responses on the one data-parallel rank
    with pytest.raises(ConfigError, match=r"global_batch_size \(8\) must be divisible by "
                       r"data-parallel size x grpo_group_size \(2 x 8 = 16\)"):
        validate(cfg, world_size=4)  # DP 2
    cfg = parse_args(["--tensor-model-parallel-size", "2", "--vocab-size", "63"])
    with pytest.raises(ConfigError, match=r"vocab_size \(63\) must be divisible by "
                       r"tensor_model_parallel_size \(2\)"):
        validate(cfg, world_size=2)


def test_embedding_rows_pad_only_the_tokenizer_vocabulary():
    """Megatron's padding (make_vocab_size_divisible_by x TP) applies to the tokenizer's 49
    ids; an explicit vocab_size (a pretrained model's) is the number of rows as set."""
    from scalerlt_mcore.app.pretrained import run_vocab_size

    def rows(*argv):
        return run_vocab_size(parse_args(["--tokenizer-type", "CharTokenizer", *argv]))

    assert rows("--make-vocab-size-divisible-by", "1") == 49
    assert rows("--make-vocab-size-divisible-by", "128") == 128
    assert rows("--make-vocab-size-divisible-by", "128", "--tensor-model-parallel-size", "2") == 256
    assert rows("--make-vocab-size-divisible-by", "4", "--tensor-model-parallel-size", "2") == 56
    assert rows("--vocab-size", "64", "--tensor-model-parallel-size", "2") == 64


def test_long_prompt_config_is_valid_and_long():
    cfg = parse_args(["--config", str(REPO / "configs/long_prompt_cpu.yaml")])
    validate(cfg, world_size=1)
    task = task_from(cfg)
    assert task.name == "kv_retrieval" and 1 + task.max_prompt_chars == 512  # bos + prompt
    assert (cfg.rl.grpo_group_size, cfg.rl.rl_max_response_length) == (16, 16)
    assert cfg.model.max_position_embeddings == 512 + 16


def test_validate_reports_all_problems_at_once():
    with pytest.raises(ConfigError) as e:
        validate(parse_args(["--grpo-clamp-eps-lower", "0", "--rl-top-p", "0"]), world_size=1)
    assert "grpo_clamp_eps_lower" in str(e.value) and "rl_top_p" in str(e.value)


def test_resolved_config_round_trip(tmp_path):
    cfg = parse_args(["--config", str(REPO / "configs/h20_8gpu.yaml"), "--lr", "1e-5",
                      "--run-dir", str(tmp_path)])
    path = save_resolved(cfg, tmp_path)
    assert path == tmp_path / "config.yaml"
    assert parse_args(["--config", str(path)]) == cfg


SHIPPED_CONFIGS = sorted(p for d in ("configs", "scalerlt_mcore/configs", "tests/configs")
                         for p in (REPO / d).glob("*.yaml"))
H20_CHECKPOINT_CONFIGS = ("ouro_1.4b_h20.yaml", "huginn_0125_h20.yaml",
                          "nanbeige_4.2_3b_h20.yaml")
"""Launch configs of public checkpoints: their tokenizer is the checkpoint's (a byte-level one
stands in here; tests/app/test_h20_configs.py validates them beside a checkpoint's shape)."""
CONFIG_WORLD_SIZES = {"cpu_2rank.yaml": 2, "cpu_tp2.yaml": 2, "h20_8gpu.yaml": 8,
                      **dict.fromkeys(H20_CHECKPOINT_CONFIGS, 8)}
"""The world size a shipped config is written for (1 if not listed)."""
CONFIG_NEEDS = {"retrofit_tiny_llama.yaml": ["--pretrained-checkpoint", "tiny-llama"],
                **dict.fromkeys(H20_CHECKPOINT_CONFIGS, ["--tokenizer-type", "ByteLevelTokenizer"])}
"""Flags a config's own header says to add (validation reads no weights)."""


def test_every_shipped_config_is_checked():
    names = {p.name for p in SHIPPED_CONFIGS}
    assert len(SHIPPED_CONFIGS) >= 10 and set(CONFIG_WORLD_SIZES) | set(CONFIG_NEEDS) <= names


@pytest.mark.parametrize("path", SHIPPED_CONFIGS, ids=lambda p: str(p.relative_to(REPO)))
def test_shipped_configs_are_valid(path):
    """Every YAML under configs/, scalerlt_mcore/configs/ and tests/configs/ loads (its keys are
    today's flag names) and validates at the world size it is written for."""
    argv = ["--config", str(path)] + CONFIG_NEEDS.get(path.name, [])
    validate(parse_args(argv), CONFIG_WORLD_SIZES.get(path.name, 1))


def test_repo_demo_config_is_a_link_to_the_packaged_one():
    link = REPO / "configs/demo_cpu.yaml"
    packaged = REPO / "scalerlt_mcore/configs/demo_cpu.yaml"
    assert link.is_symlink() and not os.path.isabs(os.readlink(link))  # relative: git keeps it
    assert link.resolve() == packaged.resolve()
    assert Path(str(resources.files("scalerlt_mcore") / "configs/demo_cpu.yaml")).resolve() \
        == packaged.resolve()
    assert demo_config_text() == packaged.read_text()
    assert parse_args([]) == parse_args(["--config", str(link)])
    validate(parse_args([]), world_size=1)


def test_each_section_has_its_check_beside_it():
    """Each section's module holds its dataclass and its check (``check_<section>``), which
    ``validate`` runs."""
    import importlib
    import inspect

    from scalerlt_mcore.app.config import run

    for section in dataclasses.fields(RunConfig):
        module = importlib.import_module(section.default_factory.__module__)
        check = getattr(module, f"check_{section.name}")
        assert getattr(run, check.__name__) is check, section.name
        assert f"{check.__name__}(cfg" in inspect.getsource(run.validate), section.name


def test_every_field_has_a_docstring():
    for section in dataclasses.fields(RunConfig):
        cls = section.default_factory
        assert list(field_docs(cls)) == [f.name for f in dataclasses.fields(cls)]


# ---- the keys are fields declared in source, with the library's types and defaults ---------


def _library_keys() -> dict:
    """key -> (library class, field), computed from the dataclasses alone."""
    keys = {f.name: (LoopedTransformerConfig, f.name)
            for f in dataclasses.fields(LoopedTransformerConfig) if f.name.startswith("looped_")}
    keys.update({k: (RLObjective, v) for k, v in OBJECTIVE_FLAGS.items()})
    return keys


def test_every_looped_field_and_objective_field_is_a_key():
    looped = {f.name for f in dataclasses.fields(LoopedTransformerConfig)
              if f.name.startswith("looped_")}
    # the app's own loop options (pretrained retrofit, loop curriculum) are not model fields
    app_only = {"looped_retrofit", "looped_loops_warmup_iters", "looped_num_loops_sampling"}
    assert looped == {k for k in KEYS if k.startswith("looped_")} - app_only == {
        f.name for f in dataclasses.fields(LoopedFields)}
    assert "looped_initial_state" in looped  # the field the app had left out
    # every RLObjective field has a key: a new field without one fails here
    assert sorted(OBJECTIVE_FLAGS.values()) == sorted(
        f.name for f in dataclasses.fields(RLObjective))
    assert set(OBJECTIVE_FLAGS) <= set(KEYS)
    assert set(SAMPLING_FLAGS.values()) <= {f.name for f in dataclasses.fields(Sampling)}
    assert set(SAMPLING_FLAGS) <= set(KEYS)
    defaults = {f.name: f.default for f in dataclasses.fields(Sampling)}
    rl = RunConfig().rl
    assert {k: getattr(rl, k) for k in SAMPLING_FLAGS} == {
        k: defaults[name] for k, name in SAMPLING_FLAGS.items()}
    assert KEYS["rl_rollout_exit"][1] == typing.get_type_hints(Sampling)["exit_mode"]


def test_every_key_is_a_field_declared_in_source():
    """An IDE finds every key: each field is annotated in the source of its section or of a
    base class of it (``LoopedFields``), none made at run time."""
    for section in dataclasses.fields(RunConfig):
        cls = section.default_factory
        for f in dataclasses.fields(cls):
            owner = next(k for k in cls.__mro__ if f.name in vars(k).get("__annotations__", {}))
            assert re.search(rf"^\s+{f.name}: ", inspect.getsource(owner), re.M), (
                cls.__name__, f.name)
            assert typing.get_type_hints(cls)[f.name] is not None


def test_library_keys_have_the_library_type_default_and_doc():
    for key, (cls, name) in _library_keys().items():
        if key == "rl_max_response_length":  # the app's own key, fed to constant_length
            continue
        section = getattr(RunConfig(), KEYS[key][0])
        lib_field = next(f for f in dataclasses.fields(cls) if f.name == name)
        assert KEYS[key][1] == typing.get_type_hints(cls)[name], key
        assert getattr(section, key) == lib_field.default, key
        assert field_docs(type(section))[key], key
    rl_docs = field_docs(type(RunConfig().rl))
    assert rl_docs["grpo_clamp_eps_lower"] == (
        "PPO ratio clip below: ratio >= 1 - grpo_clamp_eps_lower.")
    assert field_docs(ModelArgs)["looped_num_loops"].startswith("R: how many times")


def test_one_default_of_the_prompt_mode():
    """The planner's default prompt mode is the schedule's (which declares none) and the
    flag's; the shared-prefix flags' other defaults are the planner's."""
    from scalerlt_mcore.shared_prefix import SharedPrefixSchedule
    from scalerlt_mcore.shared_prefix.planner import Planner

    default = inspect.signature(Planner).parameters["prompt"].default
    assert "prompt" not in inspect.signature(SharedPrefixSchedule).parameters
    assert RunConfig().shared_prefix.shared_prefix_prompt == default
    assert SharedPrefixSchedule(2).chooser.prompt == default
    assert "wave_size" not in vars(SharedPrefixSchedule(2))  # the planner's, read there
    planner = inspect.signature(Planner).parameters
    flat = to_dict(RunConfig())
    for key in ("shared_prefix_schedule", "shared_prefix_checkpoint_waves",
                "shared_prefix_memory_budget"):  # the same defaults where both have one
        assert flat[key] == planner[SCHEDULE_FLAGS[key]].default, key


def test_every_literal_library_field_is_a_choice_key():
    literal = {k: typing.get_args(typing.get_type_hints(cls)[name])
               for k, (cls, name) in _library_keys().items()
               if typing.get_origin(typing.get_type_hints(cls)[name]) is Literal}
    assert set(literal) >= {"looped_injection", "looped_initial_state", "looped_prefix_attention",
                            "rl_loss_normalization", "rl_loop_weights"}
    assert {k: CHOICES[k] for k in literal} == literal
    assert CHOICES["rl_advantage"] == ADVANTAGE_MODES
    assert CHOICES["normalization"] == ("LayerNorm", "RMSNorm")  # MCore's Literal


def test_a_library_error_names_the_key_of_its_field():
    """The library raises a ``FieldError`` naming its field; the app says it in the key's name
    through the key's map, also where the field is one word that is another key's name
    (``normalization``, the model's norm layers)."""
    cfg = parse_args([])
    cfg.rl.rl_loss_normalization = "sum"
    assert library_errors(objective_from, cfg, OBJECTIVE_FLAGS) == [
        "rl_loss_normalization must be one of ('token_mean', 'seq_mean', 'constant', "
        "'step_token_mean'), got 'sum'"]
    with pytest.raises(FieldError) as e:
        RLObjective(clip_high=0.0)
    assert (e.value.field, str(e.value)) == ("clip_high", "clip_high must be > 0, got 0.0")
    assert in_key_names(e.value, OBJECTIVE_FLAGS) == "grpo_clamp_eps_upper must be > 0, got 0.0"
    assert in_key_names(ValueError("clip_high"), OBJECTIVE_FLAGS) == "clip_high"  # not a field's


def test_sampling_from_builds_the_runs_sampling():
    cfg = parse_args(["--rl-temperature", "0.7", "--rl-top-p", "0.9", "--looped-exit-gate",
                      "true", "--rl-exit-gate-coef", "0.1", "--rl-rollout-exit", "threshold",
                      "--rl-exit-threshold", "0.6", "--rl-stop-check-interval", "3"])
    validate(cfg, world_size=1)
    gen = torch.Generator()
    s = sampling_from(cfg, generator=gen, banned=(0, 1), vocab_size=40)
    assert s == Sampling(temperature=0.7, top_p=0.9, generator=gen, banned=(0, 1), vocab_size=40,
                         exit_mode="threshold", exit_threshold=0.6, stop_check_interval=3)
    greedy = sampling_from(cfg, loop=0, temperature=0.0)  # one readout: no exit mode
    assert (greedy.loop, greedy.exit_mode, greedy.temperature) == (0, "none", 0.0)


def test_values_reach_the_library_objects():
    cfg = parse_args(["--config", str(REPO / "configs/h20_8gpu.yaml"), "--grpo-kl-beta", "0.05",
                      "--grpo-entropy-term-weight", "0.01", "--looped-initial-state", "zeros",
                      "--shared-prefix-checkpoint-waves", "--shared-prefix-prompt", "recompute",
                      "--shared-prefix-prompt-segments", "3", "--shared-prefix-state", "inputs",
                      "--ffn-hidden-size", "1000", "--transformer-impl", "local"])
    kwargs, flat = looped_kwargs(cfg), to_dict(cfg)
    assert set(kwargs) == {f.name for f in dataclasses.fields(LoopedFields)} | {
        "num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
        "ffn_hidden_size", "normalization", "bf16", "fp16", "tensor_model_parallel_size",
        "pipeline_model_parallel_size", "transformer_impl", "kv_channels", "add_qkv_bias",
        "sequence_parallel", "context_parallel_size", "recompute_granularity",
        "recompute_method", "recompute_num_layers"}
    config = model_config(cfg, "cpu")
    for key in kwargs:
        if flat[key] is not None:  # None: MCore's default (kv_channels = hidden / heads)
            assert getattr(config, key) == flat[key], key
    assert (config.looped_initial_state, config.num_query_groups) == ("zeros", 4)
    objective = objective_from(cfg)
    for key, name in OBJECTIVE_FLAGS.items():
        assert getattr(objective, name) == flat[key], key
    assert objective.normalization == "constant" and objective.kl_coef == 0.05
    assert objective.entropy_weight == 0.01
    schedule = schedule_from(cfg)
    assert (schedule.chooser.wave_size, schedule.checkpoint_waves,
            schedule.max_response_length) == (8, True, 12)
    assert schedule.chooser.prompt == flat["shared_prefix_prompt"] == "recompute"
    assert schedule.chooser.prompt_segments == flat["shared_prefix_prompt_segments"] == 3
    assert schedule.chooser.state_kind == flat["shared_prefix_state"] == "inputs"
    assert sorted(SCHEDULE_FLAGS) == ["micro_batch_size", "rl_max_response_length",
                                      "shared_prefix_checkpoint_waves",
                                      "shared_prefix_memory_budget", "shared_prefix_prompt",
                                      "shared_prefix_prompt_segments",
                                      "shared_prefix_schedule", "shared_prefix_state",
                                      "shared_prefix_wave_size"]
    assert schedule.chooser.naive_micro_batch_size == flat["micro_batch_size"]
    assert schedule.chooser.schedule == flat["shared_prefix_schedule"]


@pytest.mark.parametrize("argv, message", [
    (["--looped-injection", "add"],
     r"looped_injection must be one of \('none', 'linear_concat'\), got 'add'"),
    (["--rl-loss-normalization", "sum"], "rl_loss_normalization must be one of"),
    (["--rl-advantage", "ppo"], "rl_advantage must be one of"),
    (["--normalization", "L2Norm"], r"normalization must be one of \('LayerNorm', 'RMSNorm'\)"),
])
def test_bad_choice_names_the_key_and_the_choices(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(argv)


def test_values_set_in_python_are_checked_too():
    cfg = parse_args([])
    cfg.rl.rl_advantage, cfg.model.looped_injection, cfg.training.lr = "ppo", "add", "fast"
    with pytest.raises(ConfigError) as e:
        validate(cfg, world_size=1)
    assert "rl_advantage must be one of ('grpo', 'dr_grpo', 'none'), got 'ppo'" in str(e.value)
    assert "looped_injection must be one of" in str(e.value)
    assert "key 'lr' expects float, got 'fast'" in str(e.value)


def test_library_errors_name_the_key_not_the_library_field():
    with pytest.raises(ConfigError) as e:
        validate(parse_args(["--grpo-clamp-eps-upper", "0", "--shared-prefix-wave-size", "0"]), 1)
    lines = str(e.value).splitlines()[1:]
    assert [line.strip() for line in lines] == [
        "grpo_clamp_eps_upper must be > 0, got 0.0",
        "shared_prefix_wave_size must be >= 1, got 0"]


def test_calculate_per_token_loss_reaches_mcore_with_step_token_mean():
    cfg = parse_args(["--calculate-per-token-loss", "--rl-loss-normalization", "step_token_mean"])
    validate(cfg, world_size=1)
    assert model_config(cfg, "cpu").calculate_per_token_loss
    assert objective_from(cfg).normalization == "step_token_mean"
    assert not model_config(parse_args([]), "cpu").calculate_per_token_loss


@pytest.mark.parametrize("argv, message", [
    (["--calculate-per-token-loss"], "calculate_per_token_loss needs rl_loss_normalization "
                                     "step_token_mean (the step-wide token mean), got token_mean"),
    (["--calculate-per-token-loss", "--rl-loss-normalization", "seq_mean"],
     "calculate_per_token_loss needs rl_loss_normalization step_token_mean (the step-wide "
     "token mean), got seq_mean"),
    (["--rl-loss-normalization", "step_token_mean"], "rl_loss_normalization step_token_mean "
                                                     "needs calculate_per_token_loss true"),
])
def test_per_token_loss_and_normalization_come_together(argv, message):
    with pytest.raises(ConfigError) as e:
        validate(parse_args(argv), world_size=1)
    assert message in str(e.value)


def test_help_lists_every_flag(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = capsys.readouterr().out
    assert all(flag in out for flag in cli_flags() if flag not in ("--config", "--help"))


def test_help_shows_the_values_a_run_without_flags_uses(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = capsys.readouterr().out
    assert "Without --config the packaged demo config (demo_cpu.yaml) is applied" in out
    demo, builtin = to_dict(parse_args([])), to_dict(RunConfig())
    assert demo["train_iters"] != builtin["train_iters"]
    assert (f"--train-iters INT (default {demo['train_iters']} (demo; built-in "
            f"{builtin['train_iters']})):") in out
    assert demo["seed"] == builtin["seed"]
    assert f"--seed INT (default {demo['seed']}):" in out
    assert "--grpo-kl-beta FLOAT (default 0.0):" in out  # RLObjective's default, the demo's too


# Adding or renaming a flag is a deliberate change: update this list with it.
FROZEN_CLI_FLAGS = [
    "--adam-beta1", "--adam-beta2", "--adam-eps", "--add-qkv-bias", "--bf16",
    "--calculate-per-token-loss", "--clip-grad",
    "--config", "--context-parallel-size", "--ddp-bucket-size", "--disable-bias-linear",
    "--distributed-timeout-minutes", "--eval-interval", "--eval-iters", "--exit-interval",
    "--ffn-hidden-size", "--finetune", "--fp16", "--global-batch-size", "--grpo-clamp-eps-lower",
    "--grpo-clamp-eps-upper", "--grpo-entropy-term-weight", "--grpo-group-size",
    "--grpo-iterations", "--grpo-kl-beta", "--grpo-prompts-per-step", "--help", "--hidden-size",
    "--inference-max-requests",
    "--kv-channels", "--load", "--log-interval", "--looped-backprop-loops",
    "--looped-cascade-kernel", "--looped-exit-gate", "--looped-family", "--looped-initial-state",
    "--looped-initial-state-std", "--looped-injection", "--looped-learned-loop-weights",
    "--looped-loops-warmup-iters", "--looped-num-coda-layers", "--looped-num-loops",
    "--looped-num-loops-sampling", "--looped-num-prelude-layers", "--looped-prefix-attention",
    "--looped-readout-tile", "--looped-retrofit", "--lr", "--lr-decay-iters",
    "--lr-decay-style", "--lr-warmup-iters",
    "--make-vocab-size-divisible-by", "--manual-gc", "--manual-gc-interval",
    "--max-position-embeddings", "--micro-batch-size", "--min-lr", "--no-load-optim",
    "--no-load-rng", "--no-plot", "--norm-epsilon", "--normalization", "--num-attention-heads",
    "--num-layers", "--num-query-groups", "--overlap-grad-reduce",
    "--override-opt-param-scheduler", "--pipeline-model-parallel-size",
    "--position-embedding-type", "--pretrained-checkpoint", "--recompute-granularity",
    "--recompute-method", "--recompute-num-layers", "--rl-advantage", "--rl-decode-cuda-graph",
    "--rl-engine-dir", "--rl-exit-entropy-coef", "--rl-exit-gate-coef", "--rl-exit-threshold",
    "--rl-importance-sampling-truncation-coef", "--rl-inference-logprobs-is-correction",
    "--rl-loop-weights",
    "--rl-loss-normalization", "--rl-max-policy-lag", "--rl-max-response-length",
    "--rl-old-logprobs",
    "--rl-partial-credit", "--rl-prompt-kv", "--rl-publish-dir", "--rl-reward", "--rl-rollout",
    "--rl-rollout-exit", "--rl-rollout-source", "--rl-stale-records",
    "--rl-stop-check-interval", "--rl-task", "--rl-task-options", "--rl-temperature",
    "--rl-top-p", "--rl-tree-branches", "--rl-warmup-sft-lr", "--rl-warmup-sft-steps",
    "--rope-scaling-factor", "--rotary-base", "--run-dir", "--save", "--save-interval",
    "--save-keep-last", "--seed", "--sequence-parallel", "--shared-prefix-checkpoint-waves",
    "--shared-prefix-memory-budget", "--shared-prefix-prompt", "--shared-prefix-prompt-segments",
    "--shared-prefix-schedule", "--shared-prefix-state",
    "--shared-prefix-wave-size", "--swiglu", "--tensor-model-parallel-size", "--tensorboard-dir",
    "--tokenizer-model", "--tokenizer-type", "--train-iters", "--transformer-impl",
    "--untie-embeddings-and-output-weights", "--use-checkpoint-args",
    "--use-checkpoint-opt-param-scheduler", "--use-distributed-optimizer", "--use-rope-scaling",
    "--vocab-size", "--wandb-exp-name", "--wandb-project", "--wandb-save-dir", "--weight-decay",
]


def test_no_new_cli_options():
    assert cli_flags() == FROZEN_CLI_FLAGS
