"""The main job on real workloads, in process (``train.run``): a Hugging Face tokenizer.json
through rollouts, training, ``exit_interval`` and checkpoint resume; a refused ``--load`` with
another tokenizer; two reasoning-gym datasets mixed; TensorBoard scalars against
metrics.jsonl; the generation entry on the trained checkpoint."""

import json
import math
from pathlib import Path

import pytest
import torch
from helpers.tokenizer_files import train_bpe

from scalerlt_mcore.app.config import parse_args
from scalerlt_mcore.app.metrics import CLOCK_KEYS
from scalerlt_mcore.app.trainer import TIMED_METRICS
from scalerlt_mcore.testing import model_parallel_context

TINY_YAML = Path(__file__).resolve().parents[1] / "configs" / "e2e_tiny.yaml"
ITERS = 5  # 2 supervised warm-up steps + 3 RL steps


def _argv(tmp: Path, name: str, *extra: str) -> list:
    return ["--config", str(TINY_YAML), "--train-iters", str(ITERS), "--no-plot",
            "--run-dir", str(tmp / f"run_{name}"), *extra]


def _run(argv: list) -> dict:
    from scalerlt_mcore.app.train import run

    return run(parse_args(argv))


def _records(tmp: Path, *names: str) -> list:
    """The untimed metrics records of the runs ``names``, in order."""
    out = []
    for name in names:
        for line in (tmp / f"run_{name}" / "metrics.jsonl").read_text().splitlines():
            record = json.loads(line)
            assert record["time"] > 1.7e9 and ("step_ms" in record) == (record["kind"] != "eval")
            out.append({k: v for k, v in record.items() if k not in TIMED_METRICS + CLOCK_KEYS})
    return out


def _named_params(argv: list, ckpt: Path) -> dict:
    """Parameters by name of checkpoint ``ckpt`` loaded into the model of ``argv``."""
    from scalerlt_mcore.generate import load_model

    cfg = parse_args(argv)
    try:
        model = load_model(cfg, str(ckpt))
        return {n: p.detach().clone() for n, p in model.named_parameters()}
    finally:
        from scalerlt_mcore.app.runtime import shutdown_distributed

        shutdown_distributed()


def _params(argv: list, ckpt: Path) -> torch.Tensor:
    """Flat parameters of checkpoint ``ckpt`` loaded into the model of ``argv``."""
    return torch.cat([p.reshape(-1) for p in _named_params(argv, ckpt).values()])


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> str:
    return str(train_bpe(tmp_path_factory.mktemp("tok") / "tokenizer.json"))


def test_huggingface_tokenizer_trains_exits_and_resumes_bitwise(tmp_path, bpe):
    hf = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", bpe]
    full = _run(_argv(tmp_path, "a", *hf, "--save", str(tmp_path / "a")))
    cut = _run(_argv(tmp_path, "b1", *hf, "--save", str(tmp_path / "b"), "--exit-interval", "3"))
    assert cut == {} and (tmp_path / "b" / "latest").read_text() == "iter_0000003"
    resumed = _run(_argv(tmp_path, "b2", *hf, "--load", str(tmp_path / "b"),
                         "--save", str(tmp_path / "b")))
    assert resumed == full
    a, b = _records(tmp_path, "a"), _records(tmp_path, "b1", "b2")
    assert a == b
    train = [r for r in a if r["kind"] == "train"]
    assert len(train) == ITERS - 2 and all(r["response_length"] >= 1 for r in train)
    assert any(r["reward_std"] > 0 and r["grad_norm"] > 0 for r in train)
    pa, pb = _params(_argv(tmp_path, "x", *hf), tmp_path / "a"), \
        _params(_argv(tmp_path, "x", *hf), tmp_path / "b")
    assert torch.equal(pa, pb)


def test_load_with_another_tokenizer_is_refused(tmp_path, bpe):
    hf = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", bpe]
    ckpt = str(tmp_path / "ckpt")
    _run(_argv(tmp_path, "a", *hf, "--train-iters", "1", "--save", ckpt))
    with pytest.raises(ValueError, match=r"saved with a different tokenizer.*type "
                       r"'HuggingFaceTokenizer' != 'ByteLevelTokenizer'.*--tokenizer-type"):
        _run(_argv(tmp_path, "b", "--tokenizer-type", "ByteLevelTokenizer", "--load", ckpt))
    other = str(train_bpe(tmp_path / "other" / "tokenizer.json", seed=1))
    with pytest.raises(ValueError, match=r"saved with a different tokenizer.*sha256 '"):
        _run(_argv(tmp_path, "c", "--tokenizer-type", "HuggingFaceTokenizer",
                   "--tokenizer-model", other, "--load", ckpt))


MIX = ("{tasks: [{task: 'reasoning_gym:chain_sum', options: {max_terms: 2, max_digits: 1}}, "
       "{task: 'reasoning_gym:spell_backward', options: {min_word_len: 3, max_word_len: 4}}]}")


def test_two_reasoning_gym_datasets_train(tmp_path):
    """A few steps on a mix of two reasoning-gym datasets with MCore's byte-level tokenizer:
    both datasets' prompts reach the rollouts, rewards come from their score_answer, and the
    parameters move."""
    from scalerlt_mcore.app import runtime
    from scalerlt_mcore.app.config import tokenizer_from, validate
    from scalerlt_mcore.app.trainer import RLTrainer

    argv = _argv(tmp_path, "rg", "--rl-task", "mix", "--rl-task-options", MIX,
                 "--tokenizer-type", "ByteLevelTokenizer", "--max-position-embeddings", "80",
                 "--rl-max-response-length", "5", "--train-iters", "4")
    cfg = parse_args(argv)
    validate(cfg, world_size=1)
    with model_parallel_context(cfg.training.seed):
        config = runtime.model_config(cfg, "cpu")
        model = runtime.build_model(cfg, config, tokenizer_from(cfg).vocab_size, "cpu")
        tr = RLTrainer(cfg, model, *runtime.wrap_for_training(cfg, config, model))
        init = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
        seen, rewards = [], tr.rewards
        tr.rewards = lambda problems, ro, *a, **k: seen.append(problems) or rewards(
            problems, ro, *a, **k)
        metrics = [tr.sft_step(s) if s < 2 else tr.rl_step(s) for s in range(4)]
        after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    prompts = [p.prompt for batch in seen for p in batch]
    assert any("arithmetic problem" in p for p in prompts)
    assert any(p.startswith("Spell this word backward") for p in prompts)
    for m in metrics:
        assert all(math.isfinite(v) for v in m.values() if isinstance(v, float)), m
    assert all(0 <= m["reward_mean"] <= 1 for m in metrics[2:])
    assert (after - init).abs().max() > 1e-4


def test_tensorboard_scalars_and_generation_from_the_checkpoint(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from scalerlt_mcore.generate import main as generate

    tb, ckpt = tmp_path / "tb", tmp_path / "ckpt"
    _run(_argv(tmp_path, "t", "--tensorboard-dir", str(tb), "--save", str(ckpt)))
    events = EventAccumulator(str(tb))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    for tag in ("train/reward_mean", "train/reward_std", "train/response_length", "train/loss",
                "train/kl", "train/clip_fraction", "train/tokens_per_s", "train/time_rollout_s",
                "train/time_score_s", "train/time_train_s", "train/step_ms", "sft/loss",
                "eval/eval_reward", "eval/loop_1", "eval/loop_2"):
        assert tag in tags, (tag, sorted(tags))
    records = [json.loads(x) for x in (tmp_path / "run_t/metrics.jsonl").read_text().splitlines()]
    kl = [(r["step"], r["kl"]) for r in records if r["kind"] == "train"]
    assert [(e.step, pytest.approx(e.value)) for e in events.Scalars("train/kl")] == kl
    loop1 = [(r["step"], r["eval_per_loop"][0]) for r in records if r["kind"] == "eval"]
    assert [(e.step, pytest.approx(e.value)) for e in events.Scalars("eval/loop_1")] == loop1

    capsys.readouterr()
    generate(["--load", str(ckpt), "--prompt", "ab>", "--loop", "all", "--task-prompts", "2"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(" | ")[0] for line in lines] == ["loop 1"] * 3 + ["loop 2"] * 3
    assert all(" | 'ab>' -> " in lines[i] for i in (0, 3))
    assert all(" | reward " in line for line in lines[1:3] + lines[4:])
    generate(["--load", str(ckpt), "--prompt", "ab>", "--loop", "all", "--task-prompts", "2"])
    assert capsys.readouterr().out.strip().splitlines() == lines  # greedy: deterministic


def test_exit_gate_trains_exits_and_resumes_bitwise(tmp_path):
    """The exit gate's weights travel with the checkpoint: with the gate on (exit_pdf loop credit
    and the gate's own loss term), a run cut by ``exit_interval`` and resumed with ``--load``
    ends with the uninterrupted run's metrics and parameters, the gate's included, and the gate
    has moved from its initial weights."""
    gate = ["--looped-exit-gate", "true", "--rl-loop-weights", "exit_pdf",
            "--rl-exit-gate-coef", "0.1", "--rl-exit-entropy-coef", "0.01"]
    full = _run(_argv(tmp_path, "a", *gate, "--save", str(tmp_path / "a")))
    cut = _run(_argv(tmp_path, "b1", *gate, "--save", str(tmp_path / "b"), "--exit-interval", "3"))
    assert cut == {}
    resumed = _run(_argv(tmp_path, "b2", *gate, "--load", str(tmp_path / "b"),
                         "--save", str(tmp_path / "b")))
    assert resumed == full
    assert _records(tmp_path, "a") == _records(tmp_path, "b1", "b2")
    x = _argv(tmp_path, "x", *gate)
    pa, pb = _named_params(x, tmp_path / "a"), _named_params(x, tmp_path / "b")
    p0 = _named_params(x, tmp_path / "b" / "iter_0000003")
    gates = [n for n in pa if "exit_gate" in n]
    assert gates, list(pa)
    assert pa.keys() == pb.keys()
    assert [n for n in pa if not torch.equal(pa[n], pb[n])] == []
    assert all(not torch.equal(pa[n], p0[n]) for n in gates)
