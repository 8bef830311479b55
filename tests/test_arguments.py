"""Configuration: precedence, errors that name the key, validation, resolved config, CLI."""

import dataclasses
from pathlib import Path

import pytest

from scalerlt_mcore.app.arguments import (
    ConfigError,
    RunConfig,
    cli_flags,
    demo_config_text,
    field_docs,
    parse_args,
    save_resolved,
    validate,
)

REPO = Path(__file__).resolve().parents[1]


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
    assert cfg.rl.rl_group_size == RunConfig().rl.rl_group_size  # default


def test_cli_value_forms(tmp_path):
    cfg = parse_args(["--bf16", "false", "--no-plot", "--num-query-groups", "1",
                      "--rl-kl-coef", "-0.5", "--rl-task-options", "{max_len: 3}",
                      "--ffn-hidden-size", "none", "--save", "ckpt"])
    assert cfg.model.bf16 is False and cfg.logging.no_plot is True
    assert cfg.model.num_query_groups == 1 and cfg.model.ffn_hidden_size is None
    assert cfg.rl.rl_kl_coef == -0.5 and cfg.rl.rl_task_options == {"max_len": 3}
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
    cfg = parse_args(["--global-batch-size", "24", "--rl-group-size", "8",
                      "--micro-batch-size", "8"])
    validate(cfg, world_size=1)
    with pytest.raises(ConfigError, match=r"global_batch_size \(24\) must be divisible by "
                       r"data-parallel size x rl_group_size \(2 x 8 = 16\)"):
        validate(cfg, world_size=2)
    cfg = parse_args(["--micro-batch-size", "3"])
    with pytest.raises(ConfigError, match=r"must be divisible by micro_batch_size \(3\)"):
        validate(cfg, world_size=1)


@pytest.mark.parametrize("argv, message", [
    (["--pipeline-model-parallel-size", "2"], "pipeline_model_parallel_size must be 1"),
    (["--micro-batch-size", "0"], "micro_batch_size must be >= 1"),
    (["--shared-prefix-wave-size", "0"], "shared_prefix_wave_size must be >= 1"),
    (["--rl-loop-weights", "last"], "rl_loop_weights must be one of"),
    (["--rl-clip-low", "0"], "rl_clip_low must be > 0"),
    (["--rl-clip-high", "-0.1"], "rl_clip_high must be > 0"),
    (["--bf16", "--fp16"], "bf16 and fp16 are both set"),
    (["--rl-task", "revers"], "known tasks: modular_arithmetic, reverse, sort"),
    (["--rl-max-response-length", "1", "--rl-task", "reverse", "--rl-task-options", "{}"],
     r"rl_max_response_length \(1\) is shorter than the task's longest answer \(6\)"),
    (["--max-position-embeddings", "8"], "max_position_embeddings"),
    (["--hidden-size", "63"], r"hidden_size \(63\) must be divisible"),
])
def test_validate_rejects(argv, message):
    with pytest.raises(ConfigError, match=message):
        validate(parse_args(argv), world_size=1)


def test_validate_reports_all_problems_at_once():
    with pytest.raises(ConfigError) as e:
        validate(parse_args(["--rl-clip-low", "0", "--rl-top-p", "0"]), world_size=1)
    assert "rl_clip_low" in str(e.value) and "rl_top_p" in str(e.value)


def test_resolved_config_round_trip(tmp_path):
    cfg = parse_args(["--config", str(REPO / "configs/h20_8gpu.yaml"), "--lr", "1e-5",
                      "--run-dir", str(tmp_path)])
    path = save_resolved(cfg, tmp_path)
    assert path == tmp_path / "config.yaml"
    assert parse_args(["--config", str(path)]) == cfg


@pytest.mark.parametrize("name, world_size", [
    ("demo_cpu.yaml", 1), ("cpu_2rank.yaml", 2), ("cpu_tp2.yaml", 2), ("h20_8gpu.yaml", 8)])
def test_shipped_configs_are_valid(name, world_size):
    validate(parse_args(["--config", str(REPO / "configs" / name)]), world_size)


def test_embedded_default_is_repo_demo_config():
    assert demo_config_text() == (REPO / "configs/demo_cpu.yaml").read_text()
    assert parse_args([]) == parse_args(["--config", str(REPO / "configs/demo_cpu.yaml")])
    validate(parse_args([]), world_size=1)


def test_every_field_has_a_docstring():
    for section in dataclasses.fields(RunConfig):
        cls = section.default_factory
        assert list(field_docs(cls)) == [f.name for f in dataclasses.fields(cls)]


def test_choices_match_model_config():
    from scalerlt_mcore.app.arguments import CHOICES
    from scalerlt_mcore.model.config import INJECTIONS, PREFIX_ATTENTIONS

    assert set(CHOICES["looped_injection"]) == set(INJECTIONS)
    assert set(CHOICES["looped_prefix_attention"]) == set(PREFIX_ATTENTIONS)


def test_help_lists_every_flag(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    out = capsys.readouterr().out
    assert all(flag in out for flag in cli_flags() if flag not in ("--config", "--help"))


# Adding or renaming a flag is a deliberate change: update this list with it.
FROZEN_CLI_FLAGS = [
    "--adam-beta1", "--adam-beta2", "--adam-eps", "--bf16", "--clip-grad", "--config",
    "--ddp-bucket-size", "--ffn-hidden-size", "--fp16", "--global-batch-size", "--help",
    "--hidden-size", "--load", "--log-interval", "--looped-injection",
    "--looped-num-coda-layers", "--looped-num-loops", "--looped-num-prelude-layers",
    "--looped-prefix-attention", "--lr", "--lr-warmup-iters", "--make-vocab-size-divisible-by",
    "--max-position-embeddings",
    "--micro-batch-size", "--min-lr", "--no-plot", "--normalization",
    "--num-attention-heads", "--num-layers", "--num-query-groups", "--overlap-grad-reduce",
    "--pipeline-model-parallel-size", "--position-embedding-type", "--rl-advantage",
    "--rl-clip-high", "--rl-clip-low", "--rl-eval-every", "--rl-eval-prompts",
    "--rl-group-size", "--rl-kl-coef", "--rl-loop-weights", "--rl-loss-normalization",
    "--rl-max-response-length", "--rl-partial-credit", "--rl-ppo-epochs", "--rl-task",
    "--rl-task-options", "--rl-temperature", "--rl-top-p", "--rl-warmup-sft-steps",
    "--run-dir", "--save", "--save-interval", "--seed", "--shared-prefix-checkpoint-waves",
    "--shared-prefix-schedule", "--shared-prefix-wave-size", "--tensor-model-parallel-size",
    "--train-iters", "--transformer-impl", "--untie-embeddings-and-output-weights",
    "--use-distributed-optimizer", "--weight-decay",
]


def test_no_new_cli_options():
    assert cli_flags() == FROZEN_CLI_FLAGS
