"""The main job started from pretrained weights (``--pretrained-checkpoint``, ``--looped-retrofit``,
``--use-checkpoint-args``, ``--finetune``, ``--no-load-optim``, the loop-count curriculum), built
in process exactly as ``train._run`` builds it.

The source is the tiny random Llama of examples/make_tiny_hf_model.py (8 layers, vocabulary 64,
of which the character tokenizer uses 49), run through configs/retrofit_tiny_llama.yaml (prelude
2 / core 4 / coda 2, R = 3, curriculum) at a smaller batch.
"""

import hashlib
import importlib.util
import shutil
from pathlib import Path

import pytest
import torch
from helpers.hf import patch_hf_rms_norm, randomize
from helpers.pretrained_app import _adam_moments, _flat, _step, build
from helpers.reference_huginn import write_huginn_checkpoint
from helpers.tokenizer_files import train_char_bpe
from megatron.core import dist_checkpointing
from megatron.core.models.gpt import GPTModel

from scalerlt_mcore.app.checkpoint import CheckpointError, save_checkpoint
from scalerlt_mcore.app.config import ConfigError, parse_args, task_from, to_dict, validate
from scalerlt_mcore.app.pretrained import (
    resolve_pretrained,
)
from scalerlt_mcore.model.config import curriculum_loops
from scalerlt_mcore.model.mcore_import import stock_gpt_model
from scalerlt_mcore.rl.tokenizer import CharTokenizer
from scalerlt_mcore.testing import model_parallel_context

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "retrofit_tiny_llama.yaml"
SMALL = dict(global_batch_size=8, micro_batch_size=4, grpo_group_size=4, shared_prefix_wave_size=2,
             train_iters=4, rl_warmup_sft_steps=1, grpo_kl_beta=0.05, looped_loops_warmup_iters=3,
             eval_iters=2, lr_warmup_iters=0, seed=3)


def _example():
    spec = importlib.util.spec_from_file_location("make_tiny_hf_model",
                                                  ROOT / "examples" / "make_tiny_hf_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    model = _example().tiny_model("llama", layers=8, seed=0)
    randomize(model, seed=1)  # weights of O(0.1), so that the model is not near-uniform
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_llama_with_tokenizer(tiny_llama, tmp_path_factory):
    """The tiny Llama with a tokenizer.json beside its config.json: a character-level BPE
    trained on the config's task text (24 ids, within the model's 64)."""
    path = tmp_path_factory.mktemp("tiny-llama-tokenizer")
    shutil.copytree(tiny_llama, path, dirs_exist_ok=True)
    cfg = parse_args(["--config", str(CONFIG)])
    texts = [s for p in task_from(cfg).sample(0, 500) for s in (p.prompt, p.answer)]
    train_char_bpe(path / "tokenizer.json", texts, vocab_size=24)
    return path


def _argv(pretrained, **overrides) -> list:
    out = ["--config", str(CONFIG)]
    if pretrained is not None:
        out += ["--pretrained-checkpoint", str(pretrained)]
    for key, value in {**SMALL, **overrides}.items():
        out += ["--" + key.replace("_", "-"), str(value).lower() if isinstance(value, bool)
                else str(value)]
    return out


def _adam_state_empty(optimizer) -> bool:
    (inner,) = getattr(optimizer, "chained_optimizers", [optimizer])
    return not any(inner.optimizer.state[s] for g in inner.shard_fp32_groups for s in g)


# ---- import through the app ----------------------------------------------------------------


def test_retrofit_at_one_loop_is_the_hf_model(tiny_llama, monkeypatch):
    """Through the app's flags (retrofit 2,4,2, all 8 layers kept), R = 1 gives the HF logits
    (fp64; the reference's RMSNorm in fp64, tests/helpers/hf.py)."""
    from transformers import LlamaForCausalLM

    with model_parallel_context(3):
        trainer, start, notes = build(_argv(tiny_llama, looped_num_loops=1))
        model = trainer.model.double().eval()
        assert start == 0
        assert notes == [f"pretrained weights from {tiny_llama} (Hugging Face, vocabulary 64): "
                         "8 source layers: layers 0-1 -> prelude, layers 2-5 -> core (looped), "
                         "layers 6-7 -> coda; dropped: none"]
        tokens = torch.randint(1, 64, (2, 11), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            got = model(tokens).logits[0]
        patch_hf_rms_norm(monkeypatch)
        hf = LlamaForCausalLM.from_pretrained(tiny_llama).double().eval()
        with torch.no_grad():
            want = hf(input_ids=tokens).logits
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-10


def test_use_checkpoint_args_takes_the_architecture(tiny_llama):
    """From the demo's default architecture flags (no config file) the config.json's."""
    cfg = parse_args(["--pretrained-checkpoint", str(tiny_llama), "--use-checkpoint-args",
                      "--looped-retrofit", "3,2,1"])
    resolve_pretrained(cfg)
    m = cfg.model
    assert (m.hidden_size, m.num_attention_heads, m.num_query_groups, m.ffn_hidden_size,
            m.vocab_size, m.normalization, m.swiglu, m.disable_bias_linear,
            m.position_embedding_type, m.untie_embeddings_and_output_weights) == (
        64, 4, 2, 128, 64, "RMSNorm", True, True, "rope", True)
    assert (m.looped_num_prelude_layers, m.num_layers, m.looped_num_coda_layers,
            m.looped_injection) == (3, 2, 1, "linear_concat")


def test_mismatched_architecture_names_what_differs(tiny_llama):
    with model_parallel_context(3), pytest.raises(ConfigError) as err:
        build(_argv(tiny_llama, hidden_size=32, num_attention_heads=2, norm_epsilon=1e-5))
    message = str(err.value)
    for part in ("hidden_size: checkpoint 64 != run 32", "num_attention_heads: checkpoint 4 != "
                 "run 2", "norm_epsilon: checkpoint 1e-06 != run 1e-05", "--use-checkpoint-args"):
        assert part in message, message
    assert "ffn_hidden_size" not in message


def test_use_checkpoint_args_names_the_retrofit_it_conflicts_with(tmp_path):
    """The config file's looped_retrofit with --use-checkpoint-args of a looped checkpoint: the
    refusal says which setting wins and how to drop the other (not "pass
    --use-checkpoint-args"), and the run builds with looped_retrofit null."""
    path = write_huginn_checkpoint(tmp_path / "huginn", seed=6)
    argv = ["--config", str(CONFIG), "--pretrained-checkpoint", str(path),
            "--use-checkpoint-args", "--train-iters", "1"]
    with model_parallel_context(3), pytest.raises(ConfigError) as err:
        build(argv)
    message = str(err.value)
    assert message.startswith("looped_retrofit '2,4,2' conflicts with --use-checkpoint-args: ")
    assert "set looped_retrofit null (--looped-retrofit null)" in message
    assert "pass --use-checkpoint-args" not in message
    with model_parallel_context(3):
        trainer, _, _ = build(argv + ["--looped-retrofit", "null"])
        c = trainer.model.config
        assert (c.looped_num_prelude_layers, c.num_layers, c.looped_num_coda_layers) == (1, 2, 1)


def test_layer_count_mismatch_without_retrofit_is_named(tiny_llama):
    argv = _argv(tiny_llama, num_layers=6) + ["--looped-retrofit", "null"]
    with model_parallel_context(3), pytest.raises(ConfigError, match=(
            r"num_layers: pretrained checkpoint \S+ has 8 layers, this run 6 \(prelude 0 \+ "
            r"core 6 \+ coda 0\)")):
        build(argv)


@pytest.mark.parametrize("flags, message", [
    (["--looped-retrofit", "2,4,2"], "looped_retrofit needs pretrained_checkpoint"),
    (["--finetune"], "finetune needs load"),
    (["--vocab-size", "40", "--tokenizer-type", "CharTokenizer"],
     r"vocab_size \(40\) must be >= the tokenizer's \(49\)"),
    (["--vocab-size", "40"], r"vocab_size \(40\) must be >= the tokenizer's \(259\)"),  # demo's
])
def test_loading_flags_are_validated(flags, message):
    cfg = parse_args(flags)
    with pytest.raises(ConfigError, match=message):
        validate(cfg, 1)


def test_curriculum_loops():
    assert [curriculum_loops(t, 3, 4) for t in range(6)] == [1, 1, 2, 2, 3, 3]
    assert [curriculum_loops(t, 3, 0) for t in range(2)] == [3, 3]


# ---- training from the retrofit ------------------------------------------------------------


def test_rollouts_never_sample_past_the_tokenizer(tiny_llama):
    with model_parallel_context(3):
        trainer, _, _ = build(_argv(tiny_llama))
        assert trainer.model.vocab_size == 64 and CharTokenizer().vocab_size == 49
        problems = trainer.task.sample(0, 4)
        ro = trainer.rollout(0, problems, 8, temperature=1.0)
    assert ro.responses.max() < 49


def test_resume_matches_uninterrupted_run(tmp_path, tiny_llama):
    """4 steps (1 warm-up + 3 RL; loops 1, 1, 2, 3 by the curriculum; KL to the policy at the
    start of RL, saved with the checkpoint) in one go vs 2 steps, a checkpoint, and a resumed
    run: the same parameters and Adam moments, bit for bit."""
    with model_parallel_context(3):
        full, _, _ = build(_argv(tiny_llama, save=str(tmp_path / "ckpt")))
        loops = []
        for step in range(4):
            loops.append(_step(full, step)["loops"])
            if step == 1:  # as train._maybe_save
                save_checkpoint(tmp_path / "ckpt", 2, full.model, full.optimizer, full.scheduler,
                                reference=full.ref)
        want = _flat(full.model), _adam_moments(full.optimizer)
    assert loops == [1, 1, 2, 3]
    with model_parallel_context(3):
        resumed, start, _ = build(_argv(tiny_llama, load=str(tmp_path / "ckpt")))
        assert start == 2
        for step in range(start, 4):
            _step(resumed, step)
        got = _flat(resumed.model), _adam_moments(resumed.optimizer)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert (want[0] - _initial(tiny_llama)).abs().max() > 1e-4, "training must move weights"


def test_tokenizer_json_of_the_pretrained_checkpoint(tmp_path, tiny_llama_with_tokenizer):
    """No tokenizer flags and a Hugging Face --pretrained-checkpoint holding a tokenizer.json:
    the run tokenizes with that file through MCore's HuggingFaceTokenizer (the ids of the
    tokenizers package), records it in its config, trains and samples within its vocabulary; a
    checkpoint saved so is refused under another tokenizer (here through --finetune);
    --tokenizer-type still chooses."""
    from tokenizers import Tokenizer

    path, ckpt = tiny_llama_with_tokenizer, tmp_path / "ckpt"
    file = path / "tokenizer.json"
    with model_parallel_context(3):
        trainer, _, notes = build(_argv(path))
        assert notes[0] == f"tokenizer: HuggingFaceTokenizer {file} (of the pretrained checkpoint)"
        assert (trainer.cfg.tokenizer.tokenizer_type, trainer.cfg.tokenizer.tokenizer_model) == (
            "HuggingFaceTokenizer", str(file))
        assert trainer.tok.identity() == {"type": "HuggingFaceTokenizer", "vocab_size": 24,
                                          "sha256": hashlib.sha256(file.read_bytes()).hexdigest()}
        raw = Tokenizer.from_file(str(file))
        problems = trainer.task.sample(5, 16)
        for p in problems:
            assert trainer.tok.encode(p.prompt) == raw.encode(p.prompt).ids
            assert trainer.tok.decode(raw.encode(p.answer).ids + [trainer.tok.eos_id]) == p.answer
        assert sum(len(trainer.tok.encode(p.prompt)) for p in problems) \
            < sum(len(p.prompt) for p in problems)  # merges: not one id a character
        metrics = [_step(trainer, step) for step in range(2)]  # a warm-up step and an RL step
        assert all(torch.isfinite(torch.tensor(m["loss"])) for m in metrics)
        ro = trainer.rollout(0, trainer.task.sample(0, 4), 8, temperature=1.0)
        assert ro.responses.max() < 24 and trainer.model.vocab_size == 64
        save_checkpoint(ckpt, 2, trainer.model, trainer.optimizer, trainer.scheduler,
                        extra_meta={"tokenizer": trainer.tok.identity(),
                                    "config": to_dict(trainer.cfg)})
    with model_parallel_context(3), pytest.raises(ValueError, match=(
            r"saved with a different tokenizer \(checkpoint != this run\): sha256 .*type "
            r"'HuggingFaceTokenizer' != 'CharTokenizer', vocab_size 24 != 49")):
        build(_argv(path, load=str(ckpt), tokenizer_type="CharTokenizer") + ["--finetune"])
    with model_parallel_context(3):
        trainer, _, notes = build(_argv(path, tokenizer_type="CharTokenizer"))
        assert trainer.tok.identity()["type"] == "CharTokenizer"
        assert not any(line.startswith("tokenizer:") for line in notes)


def _initial(tiny_llama) -> torch.Tensor:
    with model_parallel_context(3):
        trainer, _, _ = build(_argv(tiny_llama))
        return _flat(trainer.model)


def test_finetune_and_no_load_optim(tmp_path, tiny_llama):
    """--finetune: the checkpoint's weights at step 0 with a fresh optimizer; --no-load-optim:
    its weights and step, Adam moments zero. Our checkpoint as --pretrained-checkpoint: its
    weights, at another loop count."""
    ckpt = tmp_path / "ckpt"
    with model_parallel_context(3):
        trainer, _, _ = build(_argv(tiny_llama))
        for step in range(2):
            _step(trainer, step)
        save_checkpoint(ckpt, 2, trainer.model, trainer.optimizer, trainer.scheduler,
                        reference=trainer.ref)
        saved = _flat(trainer.model)
    runs = {"finetune": (["--finetune"], 0), "no_load_optim": (["--no-load-optim"], 2)}
    for name, (flag, step) in runs.items():
        with model_parallel_context(3):
            tr, start, notes = build(_argv(tiny_llama, load=str(ckpt)) + flag)
            assert start == step, name
            assert torch.equal(_flat(tr.model), saved), name
            assert notes[-1] == f"weights from {ckpt / 'iter_0000002'}"
            assert _adam_state_empty(tr.optimizer), name  # a full load would fill it
    with model_parallel_context(3):
        tr, start, _ = build(_argv(ckpt, looped_num_loops=5, looped_retrofit="null",
                                   looped_num_prelude_layers=2, num_layers=4,
                                   looped_num_coda_layers=2, looped_injection="linear_concat"))
        assert start == 0 and torch.equal(_flat(tr.model), saved)
        assert tr.model.config.looped_num_loops == 5


@pytest.mark.parametrize("flag", ["finetune", "no_load_optim"])
def test_load_flags_without_a_checkpoint_are_an_error(tmp_path, flag):
    """Without --pretrained-checkpoint, --load must hold a checkpoint (no silent fresh start)."""
    with model_parallel_context(3), pytest.raises(CheckpointError, match="no checkpoint to load"):
        build(_argv(None, load=str(tmp_path), looped_retrofit="null", **{flag: True}))


def test_own_checkpoint_of_another_model_names_the_tensors(tmp_path, tiny_llama):
    ckpt = tmp_path / "ckpt"
    with model_parallel_context(3):
        trainer, _, _ = build(_argv(tiny_llama))
        _step(trainer, 0)  # MCore's distributed optimizer saves only a stepped Adam
        save_checkpoint(ckpt, 1, trainer.model, trainer.optimizer, trainer.scheduler)
    with model_parallel_context(3), pytest.raises(ValueError, match=(
            r"holds weights of a different model \(checkpoint != this run\): "
            r"decoder.coda.1.\S+ \(\d+,( \d+)?\) != absent")):
        build(_argv(ckpt, looped_retrofit="null", looped_num_prelude_layers=2, num_layers=4,
                    looped_num_coda_layers=1, looped_injection="linear_concat"))


def test_mcore_checkpoint_through_the_app(tmp_path, tiny_llama):
    """A stock GPTModel checkpoint (the tiny Llama's architecture, random weights) retrofitted
    by the app: the looped model holds its layers 0-1 / 2-5 / 6-7; a wrong shape is named."""
    with model_parallel_context(3):
        trainer, _, _ = build(_argv(tiny_llama))
        gpt: GPTModel = stock_gpt_model(trainer.model, num_layers=8)
        randomize(gpt, seed=4)
        (tmp_path / "gpt").mkdir()
        dist_checkpointing.save(gpt.sharded_state_dict(), str(tmp_path / "gpt"))
        want = gpt.state_dict()
    with model_parallel_context(3):
        tr, _, notes = build(_argv(tmp_path / "gpt"))
        got = tr.model.state_dict()
    assert "(MCore, vocabulary 64): 8 source layers" in notes[0]
    for mine, theirs in [("decoder.prelude.1", "decoder.layers.1"),
                         ("decoder.layers.0", "decoder.layers.2"),
                         ("decoder.coda.1", "decoder.layers.7")]:
        key = ".self_attention.linear_qkv.weight"
        assert torch.equal(got[mine + key], want[theirs + key])
    assert torch.equal(got["output_layer.weight"], want["output_layer.weight"])
    with model_parallel_context(3), pytest.raises(ValueError, match=(
            r"does not fit this model's architecture: decoder.layers.mlp.linear_fc1.weight: "
            r"checkpoint \(8, 256, 64\) != model \(8, 192, 64\)")):
        build(_argv(tmp_path / "gpt", ffn_hidden_size=96))


# ---- the LR schedule of a resumed run ---------------------------------------------------------

NO_CURRICULUM = dict(looped_loops_warmup_iters=0)  # every step at R loops: a full load matches

def _schedule(scheduler) -> dict:
    """The state of MCore's OptimizerParamScheduler that the flags and the steps set."""
    return {k: getattr(scheduler, k) for k in (
        "max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style", "start_wd",
        "end_wd", "wd_incr_steps", "wd_incr_style", "num_steps")}


def _after_two_steps(tiny_llama, save=None, **overrides) -> dict:
    """The schedule of a run with these flags after its first two steps, saved to ``save``
    when given (a checkpoint at step 2)."""
    with model_parallel_context(3):
        trainer, _, _ = build(_argv(tiny_llama, **NO_CURRICULUM, **overrides))
        for step in range(2):
            _step(trainer, step)
        if save is not None:
            save_checkpoint(save, 2, trainer.model, trainer.optimizer, trainer.scheduler,
                            reference=trainer.ref)
        return _schedule(trainer.scheduler)


def test_no_load_optim_runs_this_runs_schedule(tmp_path, tiny_llama):
    """Regression: --no-load-optim loaded the checkpoint's LR schedule, so RL started from the
    checkpoint of a warm-up run with other train_iters decayed over that run's steps (to min_lr
    at once) without a word. Now, as Megatron-LM, no schedule is loaded: the run's own, where a
    run with its flags is after the checkpoint's steps (1 warm-up + 1 RL step here)."""
    ckpt = tmp_path / "ckpt"
    saved = _after_two_steps(tiny_llama, save=ckpt, train_iters=2)  # a 2-step schedule
    want = _after_two_steps(tiny_llama, train_iters=40)
    assert want["lr_decay_steps"] != saved["lr_decay_steps"]
    with model_parallel_context(3):
        tr, start, _ = build(_argv(tiny_llama, load=str(ckpt), train_iters=40,
                                   no_load_optim=True, **NO_CURRICULUM))
        assert start == 2
        assert _schedule(tr.scheduler) == want
        assert tr.scheduler.get_lr(tr.optimizer.param_groups[0]) > 2 * tr.cfg.training.min_lr


def test_full_load_refuses_another_schedule_unless_told(tmp_path, tiny_llama):
    """A full --load whose schedule differs from the run's flags is refused, naming the fields
    (Megatron-LM's default); --override-opt-param-scheduler takes the run's shape and the
    checkpoint's position, --use-checkpoint-opt-param-scheduler the checkpoint's shape."""
    ckpt = tmp_path / "ckpt"
    saved = _after_two_steps(tiny_llama, save=ckpt, train_iters=2)
    longer = _after_two_steps(tiny_llama, train_iters=40)
    argv = _argv(tiny_llama, load=str(ckpt), train_iters=40, **NO_CURRICULUM)
    with model_parallel_context(3), pytest.raises(CheckpointError, match=(
            r"another LR schedule \(checkpoint != this run\): lr_decay_steps: "
            rf"{saved['lr_decay_steps']} != {longer['lr_decay_steps']}.*"
            r"--override-opt-param-scheduler true.*--use-checkpoint-opt-param-scheduler true")):
        build(argv)
    with model_parallel_context(3):
        tr, start, _ = build(argv + ["--override-opt-param-scheduler", "true"])
        assert start == 2 and _schedule(tr.scheduler) == longer
    with model_parallel_context(3):
        tr, _, _ = build(argv + ["--use-checkpoint-opt-param-scheduler", "true"])
        assert _schedule(tr.scheduler) == saved
    with model_parallel_context(3):
        tr, _, _ = build(_argv(tiny_llama, load=str(ckpt), train_iters=2, **NO_CURRICULUM))
        assert _schedule(tr.scheduler) == saved


def test_both_schedule_flags_are_an_error(tiny_llama):
    cfg = parse_args(_argv(tiny_llama, override_opt_param_scheduler=True,
                           use_checkpoint_opt_param_scheduler=True))
    with pytest.raises(ConfigError, match="override_opt_param_scheduler and "
                                          "use_checkpoint_opt_param_scheduler exclude each other"):
        validate(cfg, 1)
