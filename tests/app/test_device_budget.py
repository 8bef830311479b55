"""The default shared-prefix memory budget of a run on a GPU (``plan.device_budget``): 90% of
what the device can still allocate, less the state not allocated when the trainer is built
(Adam's moments, the KL reference) and a graphed rollout's kept cache. Off a GPU there is no
default, and ``--shared-prefix-wave-size auto`` needs the flag. The CUDA memory calls are
replaced here (no GPU on this machine): the arithmetic and the wiring are what is checked."""

import pytest
import torch
from helpers.h20 import REPO
from helpers.train_runs import SFT, _flags, _trainer

from scalerlt_mcore.app import plan, trainer
from scalerlt_mcore.app.config import ConfigError, parse_args, validate
from scalerlt_mcore.app.config.rl import task_lengths
from scalerlt_mcore.app.plan import HEADROOM, device_budget, main, meta_model
from scalerlt_mcore.testing import model_parallel_context

MIB = 2**20
TINY = ["--config", str(REPO / "configs" / "ouro_tiny_cpu.yaml")]
CUDA = torch.device("cuda", 0)


@pytest.fixture
def gpu(monkeypatch):
    """A CUDA device with 512 MiB free to the driver, 96 MiB reserved by
    PyTorch's allocator of which 64 are allocated."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (512 * MIB, 1024 * MIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 96 * MIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 64 * MIB)


def _model_and_count(cfg):
    model = meta_model(cfg)
    return model, sum(p.numel() for p in model.parameters())


# 8 ranks, TP 1 (the tiny config)
@pytest.mark.parametrize("extra, kl", [([], False), (["--grpo-kl-beta", "0.1"], True)])
def test_budget_is_what_the_gpu_has_left(gpu, extra, kl):
    cfg = parse_args(TINY + extra)
    with model_parallel_context(seed=1):
        model, count = _model_and_count(cfg)
        got = device_budget(cfg, model, CUDA, 8, 40)
    # fp32: Adam's two fp32 moments sharded over 8 ranks; the KL reference a whole fp32 copy
    pending = 8 * count / 8 + 4 * count * kl
    assert got == pytest.approx(HEADROOM * ((512 + 96 - 64) * MIB - pending), abs=8)


def test_graphed_decoding_keeps_its_cache_out_of_the_budget(gpu):
    cfg = parse_args(TINY)
    graphed = parse_args(TINY + ["--rl-decode-cuda-graph", "true"])
    with model_parallel_context(seed=1):
        model, _ = _model_and_count(cfg)
        c = model.config
        per_row = (c.looped_num_depths * 2 * (c.num_query_groups or c.num_attention_heads)
                   * c.kv_channels * 4 * 40)  # fp32 K and V of every depth, 40 positions
        rows = cfg.rl.grpo_group_size * plan.prompts_per_step(cfg)  # one rank: every prompt
        # two shapes' caches: DecodeGraphs' capacity
        assert (device_budget(cfg, model, CUDA, 1, 40) - device_budget(graphed, model, CUDA, 1, 40)
                == pytest.approx(HEADROOM * 2 * per_row * rows, abs=8))


def test_no_default_off_a_gpu_or_beside_the_flag(gpu):
    cfg, set_budget = parse_args(TINY), parse_args(TINY + ["--shared-prefix-memory-budget", "8"])
    with model_parallel_context(seed=1):
        model, _ = _model_and_count(cfg)
        assert device_budget(cfg, model, torch.device("cpu"), 8, 40) is None
        assert device_budget(set_budget, model, CUDA, 8, 40) is None


def test_a_full_gpu_is_refused_by_name(monkeypatch, gpu):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (0, 1024 * MIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 64 * MIB)  # all in use
    cfg = parse_args(TINY)
    with model_parallel_context(seed=1), pytest.raises(
            ValueError, match=r"^shared_prefix_memory_budget: cuda:0 has 0\.00 MiB free and the "
                              r"model state still takes .* MiB; nothing is left"):
        device_budget(cfg, _model_and_count(cfg)[0], CUDA, 8, 40)


def test_wave_size_auto_needs_the_flag_only_off_a_gpu():
    cfg = parse_args(TINY + ["--shared-prefix-wave-size", "auto"])
    validate(cfg, world_size=1, gpu=True)
    with pytest.raises(ConfigError, match="shared_prefix_memory_budget must be set when the "
                                          "wave size is 'auto'"):
        validate(cfg, world_size=1, gpu=False)


def test_the_trainer_plans_under_the_device_budget(mcore_single, monkeypatch):
    """The trainer hands ``device_budget``'s bytes to its planner: with every ``auto`` and no
    flag, one RL step trains under it."""
    seen = []

    def fake(cfg, model, device, world_size, longest_row):
        seen.append((device, world_size, longest_row))
        return 16 * MIB

    monkeypatch.setattr(trainer, "device_budget", fake)
    tr = _trainer(_flags(shared_prefix_wave_size="auto", shared_prefix_prompt="auto"), gpu=True)
    longest = 1 + task_lengths(tr.task, tr.tok)[0] + tr.cfg.rl.rl_max_response_length
    assert seen == [(torch.device("cpu"), 1, longest)] and tr.schedule.chooser.budget == 16 * MIB
    assert tr.default_budget == 16 * MIB  # train.py prints it
    assert tr.rl_step(SFT)["plan_wave_size"] >= 1


def test_the_plan_command_plans_the_run_under_the_default(capsys):
    """Wave size auto without a budget: the run's plan is chosen under 90% of what the GPU has
    left beside the model state, as the run on it would choose."""
    code = main(TINY + ["--shared-prefix-wave-size", "auto", "--world-size", "2",
                        "--plan-prompt-length", "24"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "wave size auto, default budget " in out and "MiB: 90% of the rest): waves of" in out
