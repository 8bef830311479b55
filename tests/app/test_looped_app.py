"""The main job from a looped checkpoint in its own format (Ouro, Huginn), and back out.

The source is a tiny random Ouro written by tests/helpers/reference_ouro.py in Ouro's format, run
through configs/ouro_tiny_cpu.yaml (exit_pdf credit, the gate's own term, threshold-exit
rollouts) with ``--use-checkpoint-args`` at a smaller batch; built in process exactly as
``train._run`` builds it (tests/app/test_pretrained_app.py's ``build``).
"""

import json
from pathlib import Path

import pytest
import torch
from helpers.pretrained_app import _adam_moments, _flat, _step, build
from helpers.reference_ouro import load_ouro, ouro_forward, write_ouro_checkpoint
from safetensors.torch import load_file

from scalerlt_mcore import export
from scalerlt_mcore.app.checkpoint import save_checkpoint
from scalerlt_mcore.app.config import ConfigError, parse_args, to_dict
from scalerlt_mcore.app.pretrained import resolve_pretrained
from scalerlt_mcore.model.looped_import import looped_gpt_from_pretrained
from scalerlt_mcore.testing import model_parallel_context

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "ouro_tiny_cpu.yaml")
HUGINN_CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "huginn_tiny_cpu.yaml")
SMALL = dict(global_batch_size=8, micro_batch_size=4, grpo_group_size=4,
             shared_prefix_wave_size=2, train_iters=4, rl_warmup_sft_steps=1, eval_iters=2,
             lr_warmup_iters=0, seed=3)


@pytest.fixture(scope="module")
def ouro_dir(tmp_path_factory):
    return write_ouro_checkpoint(tmp_path_factory.mktemp("ouro-app"), seed=5,
                                 early_exit_threshold=0.7)


def _argv(path, **overrides) -> list:
    out = ["--config", CONFIG, "--pretrained-checkpoint", str(path), "--use-checkpoint-args"]
    for key, value in {**SMALL, **overrides}.items():
        out += ["--" + key.replace("_", "-"), str(value)]
    return out


def test_use_checkpoint_args_takes_the_loop_layout(ouro_dir):
    cfg = parse_args(["--pretrained-checkpoint", str(ouro_dir), "--use-checkpoint-args"])
    notes = resolve_pretrained(cfg)
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.kv_channels, m.num_query_groups, m.rotary_base) == (
        2, 32, 8, 2, 1e6)
    assert (m.looped_family, m.looped_exit_gate, m.looped_num_loops) == ("ouro", True, 4)
    assert cfg.rl.rl_exit_threshold == 0.7
    assert notes[-1] == ("loop layout from ouro: looped_family ouro, looped_exit_gate True, "
                         "looped_num_loops 4, max_position_embeddings 64, rl_exit_threshold 0.7")
    assert m.max_position_embeddings == 64  # config.json's max_position_embeddings


def test_more_positions_than_the_checkpoint_are_kept(ouro_dir):
    """A run's ``--max-position-embeddings`` above the source's stays (Megatron-LM keeps a
    given one; rotary positions have no table to match), named in the log; below it, the
    source's."""
    cfg = parse_args(["--pretrained-checkpoint", str(ouro_dir), "--use-checkpoint-args",
                      "--max-position-embeddings", "96"])
    notes = resolve_pretrained(cfg)
    assert cfg.model.max_position_embeddings == 96
    assert notes[-1].endswith("rl_exit_threshold 0.7; the run's max_position_embeddings 96 "
                              "kept (the source's 64: longer rows are beyond its training)")
    cfg = parse_args(["--pretrained-checkpoint", str(ouro_dir), "--use-checkpoint-args",
                      "--max-position-embeddings", "48"])
    resolve_pretrained(cfg)
    assert cfg.model.max_position_embeddings == 64


def test_app_model_is_the_public_function(ouro_dir):
    cfg, w = load_ouro(ouro_dir)
    tokens = torch.randint(3, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    want = ouro_forward(cfg, w, tokens)["logits"]  # [R, B, S, V]
    with model_parallel_context(3):
        trainer, start, notes = build(_argv(ouro_dir))
        model = trainer.model.double().eval()
        with torch.no_grad():
            got = torch.stack(model(tokens).logits)
    assert start == 0 and ("(ouro, vocabulary 64): 0 prelude, 2 core layers looped 4 times "
                           "(checkpoint: 4), 0 coda") in notes[-1]
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-10


def test_another_loop_layout_is_named(ouro_dir):
    argv = ["--config", CONFIG, "--pretrained-checkpoint", str(ouro_dir), "--num-layers", "2",
            "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "48",
            "--kv-channels", "8", "--rotary-base", "1000000.0", "--looped-family", "gpt",
            "--looped-exit-gate", "false", "--rl-loop-weights", "final",
            "--rl-rollout-exit", "none", "--rl-exit-gate-coef", "0"]
    with model_parallel_context(3), pytest.raises(ConfigError, match=(
            r"\(ouro\) has another model than this run \(looped_family: checkpoint 'ouro' != "
            r"run 'gpt'; looped_exit_gate: checkpoint True != run False\)")):
        build(argv)


def test_resume_and_export(tmp_path, ouro_dir):
    """4 steps (1 warm-up + 3 RL with exit_pdf credit) in one go vs 2, a checkpoint and a
    resumed run: the same parameters and Adam moments bit for bit. The checkpoint exported
    (library call and the command line) is the trained model in Ouro's format, bitwise."""
    ckpt = tmp_path / "ckpt"
    with model_parallel_context(3):
        full, _, _ = build(_argv(ouro_dir, save=str(ckpt)))
        initial = _flat(full.model)
        stats = [_step(full, step) for step in range(2)]
        save_checkpoint(ckpt, 2, full.model, full.optimizer, full.scheduler, reference=full.ref,
                        extra_meta={"config": to_dict(full.cfg)})  # as train._maybe_save
        at_two = {k: v.clone() for k, v in full.model.state_dict().items()
                  if not k.endswith("_extra_state")}
        stats += [_step(full, step) for step in range(2, 4)]
        want = _flat(full.model), _adam_moments(full.optimizer)
    assert all(1.0 <= s["exit_loop"] <= 4.0 for s in stats[1:]), stats
    with model_parallel_context(3):
        resumed, start, _ = build(_argv(ouro_dir, load=str(ckpt)))
        assert start == 2
        for step in range(start, 4):
            _step(resumed, step)
        got = _flat(resumed.model), _adam_moments(resumed.optimizer)
        cfg = resumed.cfg
        out = export.export_checkpoint(cfg, ckpt, tmp_path / "lib")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert (want[0] - initial).abs().max() > 1e-4, "training must move weights"
    export.main(["--load", str(ckpt), "--format", "hf", str(tmp_path / "cli")])
    for path in (out, tmp_path / "cli"):
        assert json.loads((path / "config.json").read_text())["early_exit_threshold"] == 0.7
        assert load_file(str(path / "model.safetensors")).keys() == load_file(
            str(ouro_dir / "model.safetensors")).keys()
        with model_parallel_context(3):
            back = looped_gpt_from_pretrained(path, use_cpu_initialization=True,
                                              max_sequence_length=64).state_dict()
        for name, value in at_two.items():
            assert torch.equal(back[name], value), name


# ---- Huginn ---------------------------------------------------------------------------------


def test_huginn_through_the_app(tmp_path):
    """--use-checkpoint-args takes Huginn's layout (prelude / core / coda, adapter, drawn
    initial state, R = mean_recurrence, its loop sampling and backprop depth); the model the
    app builds is the public function at num_steps = R; a short run trains and exports back
    to the source's tensor names."""
    from helpers.reference_huginn import (
        documented_initial_state,
        huginn_forward,
        load_huginn,
        write_huginn_checkpoint,
    )

    path = write_huginn_checkpoint(tmp_path / "huginn", seed=8)
    argv = ["--config", HUGINN_CONFIG, "--pretrained-checkpoint", str(path),
            "--use-checkpoint-args", "--save", str(tmp_path / "ckpt")]
    for key, value in {**SMALL, "train_iters": 3}.items():
        argv += ["--" + key.replace("_", "-"), str(value)]
    cfg = parse_args(argv)
    notes = resolve_pretrained(cfg)
    m = cfg.model
    assert (m.looped_family, m.looped_num_prelude_layers, m.num_layers, m.looped_num_coda_layers,
            m.looped_num_loops, m.looped_backprop_loops, m.looped_num_loops_sampling) == (
        "huginn", 1, 2, 1, 4, 2, "poisson_lognormal")
    assert "looped_initial_state random" in notes[-1]
    ref_cfg, w = load_huginn(path)
    tokens = torch.randint(3, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    s0 = documented_initial_state(0, 0, 64, 32, torch.arange(9)[None].expand(2, 9))
    want = huginn_forward(ref_cfg, w, tokens, 4, s0)
    with model_parallel_context(3):
        trainer, _, _ = build(argv)
        model = trainer.model
        with torch.no_grad():
            got = model.double()(tokens).logits[-1]
        model.float()
        for step in range(3):
            _step(trainer, step)
        save_checkpoint(tmp_path / "ckpt", 3, model, trainer.optimizer, trainer.scheduler,
                        reference=trainer.ref, extra_meta={"config": to_dict(trainer.cfg)})
        out = export.export_checkpoint(trainer.cfg, tmp_path / "ckpt", tmp_path / "out")
        trained = {k: v.clone() for k, v in model.state_dict().items()
                   if not k.endswith("_extra_state")}
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-10
    assert load_file(str(out / "model.safetensors")).keys() == load_file(
        str(path / "model.safetensors")).keys()
    with model_parallel_context(3):
        back = looped_gpt_from_pretrained(out, use_cpu_initialization=True).state_dict()
    assert all(torch.equal(back[k], v) for k, v in trained.items())
