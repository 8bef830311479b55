"""The sampling flags reach ``generate`` / ``generate_tree`` as one ``Sampling`` built by
``sampling_from``, in the trainer and in ``python -m scalerlt_mcore.generate`` alike (no
keyword fanned out by hand)."""

import dataclasses
from types import SimpleNamespace

import torch

from scalerlt_mcore.app import trainer as trainer_module
from scalerlt_mcore.app.config import parse_args, sampling_from, tokenizer_from
from scalerlt_mcore.app.trainer import RLTrainer
from scalerlt_mcore.model.config import step_seed
from scalerlt_mcore.rl import rollout
from scalerlt_mcore.rl.rollout import Sampling

FLAGS = ["--rl-temperature", "0.8", "--rl-top-p", "0.9", "--looped-exit-gate", "true",
         "--rl-exit-gate-coef", "0.1", "--rl-rollout-exit", "threshold",
         "--rl-exit-threshold", "0.7", "--rl-stop-check-interval", "3", "--seed", "11"]
SAMPLING_KEYWORDS = {f.name for f in dataclasses.fields(Sampling)}


class _Trainer(RLTrainer):
    """Only what the rollouts read: the run config, its tokenizer and a model on the CPU."""

    def __init__(self, cfg):
        self.cfg, self.tok, self.device, self.rank, self.path_tokens = (
            cfg, tokenizer_from(cfg), torch.device("cpu"), 0, cfg.rl.rl_max_response_length)
        self.banned = (self.tok.pad_id, self.tok.bos_id)
        self.model = torch.nn.Linear(1, 1)
        self.decode_graphs = False


def _recorded(monkeypatch) -> list:
    """The keywords of every ``generate`` / ``generate_tree`` call of the trainer."""
    calls = []

    def record(model, prompts, *args, **kwargs):
        calls.append(kwargs)
        return SimpleNamespace(segments=[None] * len(prompts),
                               loop_logprobs=[None] * len(prompts))

    monkeypatch.setattr(trainer_module, "generate", record)
    monkeypatch.setattr(trainer_module, "generate_tree", record)
    return calls


def test_the_trainers_rollouts_sample_through_sampling_from(monkeypatch):
    calls = _recorded(monkeypatch)
    tr = _Trainer(parse_args(FLAGS))
    problems = [SimpleNamespace(prompt="ab>")]
    tr.rollout(5, problems, 2)
    tr.rollout(0, problems, 1, temperature=0.0, loop=1)  # evaluation: one readout, greedy
    tr.tree_rollout(5, problems)
    assert all(not SAMPLING_KEYWORDS & set(kw) for kw in calls)
    run, greedy, tree = (kw["sampling"] for kw in calls)
    expected = sampling_from(tr.cfg, generator=run.generator, banned=tr.banned,
                             vocab_size=tr.tok.vocab_size)
    assert run == expected and tree == dataclasses.replace(expected, generator=tree.generator)
    assert (run.temperature, run.top_p, run.exit_mode, run.exit_threshold,
            run.stop_check_interval) == (0.8, 0.9, "threshold", 0.7, 3)
    assert run.generator.initial_seed() == step_seed(11, 5, 0, 7)
    assert greedy == dataclasses.replace(expected, generator=greedy.generator, temperature=0.0,
                                         loop=1, exit_mode="none")


def test_the_generate_command_samples_through_sampling_from(monkeypatch):
    from scalerlt_mcore import generate as command

    calls = []

    def record(model, prompts, n, steps, **kwargs):
        calls.append(kwargs)
        return SimpleNamespace(responses=torch.zeros(len(prompts), n, 1, dtype=torch.long))

    monkeypatch.setattr(rollout, "generate", record)
    cfg = parse_args(FLAGS)
    args = SimpleNamespace(num_samples=2, max_new_tokens=None, temperature=0.5, top_p=0.95,
                           seed=3)
    command.sample(torch.nn.Linear(1, 1), cfg, args, ["ab>"], loop=1)
    [kwargs] = calls
    tok = tokenizer_from(cfg)
    assert not SAMPLING_KEYWORDS & set(kwargs)
    assert kwargs["sampling"] == sampling_from(
        cfg, 1, temperature=0.5, top_p=0.95, generator=kwargs["sampling"].generator,
        banned=(tok.pad_id, tok.bos_id), vocab_size=tok.vocab_size)
    assert kwargs["sampling"].exit_mode == "none"  # one readout
