"""The main job from a Nanbeige4.2 checkpoint in its own format, and back out.

The source is a tiny random Nanbeige written by tests/helpers/reference_nanbeige.py, run
through configs/nanbeige_tiny_cpu.yaml with ``--pretrained-checkpoint`` and
``--use-checkpoint-args`` at a smaller batch; built in process exactly as ``train._run`` builds
it (tests/helpers/pretrained_app.py's ``build``); exported by ``python -m
scalerlt_mcore.export``'s ``main``.
"""

import json
from pathlib import Path

import torch
from helpers.pretrained_app import _step, build
from helpers.reference_nanbeige import load_nanbeige, nanbeige_forward, write_nanbeige_checkpoint
from safetensors.torch import load_file

from scalerlt_mcore import export
from scalerlt_mcore.app.checkpoint import save_checkpoint
from scalerlt_mcore.app.config import parse_args, to_dict
from scalerlt_mcore.app.pretrained import resolve_pretrained
from scalerlt_mcore.model.looped_import import looped_gpt_from_pretrained
from scalerlt_mcore.testing import model_parallel_context

CONFIG = str(Path(__file__).resolve().parents[2] / "configs" / "nanbeige_tiny_cpu.yaml")
SMALL = dict(global_batch_size=8, micro_batch_size=4, grpo_group_size=4,
             shared_prefix_wave_size=2, train_iters=3, rl_warmup_sft_steps=1, eval_iters=2,
             lr_warmup_iters=0, seed=3)


def test_nanbeige_through_the_app(tmp_path):
    """--use-checkpoint-args takes Nanbeige's architecture and loop layout (num_loops, the
    maximum positions); the model the app builds is the public function; one warm-up and two
    RL steps (joint replay) move the weights; the command-line export writes them back in the
    source's names and config.json, read back bitwise."""
    path = write_nanbeige_checkpoint(tmp_path / "nanbeige", seed=8)
    ckpt = tmp_path / "ckpt"
    argv = ["--config", CONFIG, "--pretrained-checkpoint", str(path), "--use-checkpoint-args",
            "--save", str(ckpt)]
    for key, value in SMALL.items():
        argv += ["--" + key.replace("_", "-"), str(value)]
    cfg = parse_args(argv)
    notes = resolve_pretrained(cfg)
    m = cfg.model
    assert (m.looped_family, m.num_layers, m.looped_num_loops, m.num_query_groups,
            m.kv_channels, m.hidden_size, m.rotary_base, m.max_position_embeddings) == (
        "nanbeige", 3, 2, 2, 8, 32, 7e7, 64)
    assert notes[-1] == ("loop layout from nanbeige: looped_family nanbeige, looped_num_loops 2, "
                         "max_position_embeddings 64")
    ref_cfg, w = load_nanbeige(path)
    tokens = torch.randint(3, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    want = nanbeige_forward(ref_cfg, w, tokens)
    with model_parallel_context(3):  # a build of its own: fp64 parameters leave the optimizer's
        built = build(argv)[0].model.double()
        with torch.no_grad():
            got = built(tokens).logits[-1]
    with model_parallel_context(3):
        trainer, start, notes = build(argv)
        model = trainer.model
        initial = {k: v.clone() for k, v in model.state_dict().items()
                   if not k.endswith("_extra_state")}
        stats = [_step(trainer, step) for step in range(3)]
        save_checkpoint(ckpt, 3, model, trainer.optimizer, trainer.scheduler,
                        reference=trainer.ref, extra_meta={"config": to_dict(trainer.cfg)})
        trained = {k: v.clone() for k, v in model.state_dict().items()
                   if not k.endswith("_extra_state")}
    assert start == 0 and "(nanbeige, vocabulary 64): 0 prelude, 3 core layers looped 2 " \
        "times (checkpoint: 2), 0 coda" in notes[-1]
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-10
    assert all(s["loss"] == s["loss"] for s in stats), stats  # no NaN
    assert max(float((trained[k] - initial[k]).abs().max()) for k in trained) > 1e-4
    export.main(["--load", str(ckpt), "--format", "hf", str(tmp_path / "out")])
    out = tmp_path / "out"
    assert load_file(str(out / "model.safetensors")).keys() == load_file(
        str(path / "model.safetensors")).keys()
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (path / "config.json").read_text())
    with model_parallel_context(3):
        back = looped_gpt_from_pretrained(out, use_cpu_initialization=True).state_dict()
    assert all(torch.equal(back[k], v) for k, v in trained.items())
