"""The 8 x H20 launch configs, checked without a GPU.

Each public checkpoint's config (configs/{ouro_1.4b,huginn_0125,nanbeige_4.2_3b}_h20.yaml) is
read as the trainer reads it beside a directory of that checkpoint's real config.json (no
weights; a small tokenizer.json): its architecture and loop layout are the checkpoint's (what
``--pretrained-checkpoint`` would otherwise refuse) and it validates at 8 ranks. Each of those
and configs/h20_8gpu.yaml (from scratch) is built at full size on ``meta`` (no memory, no FLOPs)
and runs one RL step: a short rollout through the depth-indexed cache (each prompt prefilled
once, two sampled tokens) and a joint-replay step of the run's own schedule, plan and objective,
with the schedule's up-front device check; an op mixing a host tensor into the meta computation
raises. So a config that cannot build, or that puts a tensor on the wrong device, fails here.
"""
import time

import pytest
import torch
from helpers.h20 import CONFIGS, REPO, checkpoint_dir
from helpers.sp import make_group

from scalerlt_mcore.app.config import (
    objective_from,
    parse_args,
    schedule_from,
    validate,
)
from scalerlt_mcore.app.plan import Workload, make_report, meta_model
from scalerlt_mcore.app.pretrained import (
    ARCHITECTURE_KEYS,
    resolve_pretrained,
    run_architecture,
)
from scalerlt_mcore.model import looped_gpt
from scalerlt_mcore.model.looped_import import read_looped_source
from scalerlt_mcore.rl import rollout
from scalerlt_mcore.rl.objective import rl_forward_step
from scalerlt_mcore.rl.rollout import Sampling, generate
from scalerlt_mcore.shared_prefix.group import ReplayGuard, SharedPrefixGroup
from scalerlt_mcore.testing import model_parallel_context

META = torch.device("meta")

META_STEP = {**CONFIGS, "h20_8gpu.yaml": (None, 17.99e6)}
"""The configs run on meta: the public checkpoints' and the from-scratch one."""


def _argv(name: str, source) -> list:
    argv = ["--config", str(REPO / "configs" / name)]
    return argv if source is None else argv + ["--pretrained-checkpoint", str(source)]


@pytest.mark.parametrize("name", CONFIGS)
def test_config_is_the_checkpoints_model(name, tmp_path):
    """The YAML's architecture and loop layout are the checkpoint's config.json's, and the run
    validates at 8 ranks (data parallel 8, bf16, the local spec)."""
    source = checkpoint_dir(tmp_path, CONFIGS[name][0])
    cfg = parse_args(_argv(name, source))
    resolve_pretrained(cfg)
    validate(cfg, 8)
    src, run = read_looped_source(source), run_architecture(cfg)
    keys = [k for k in ARCHITECTURE_KEYS if k != "rope_scaling_factor"]
    assert {k: run[k] for k in keys} == {k: getattr(src.arch, k) for k in keys}
    m = cfg.model
    fixed = {k: v for k, v in src.looped.items() if not k.startswith("looped_initial_state")}
    assert {k: getattr(m, k) for k in fixed} == fixed
    assert m.num_layers == (src.core_layers or src.arch.num_layers)
    assert (m.bf16, m.tensor_model_parallel_size, m.transformer_impl) == (True, 1, "local")
    assert cfg.rl.rl_task.startswith("reasoning_gym:")


H20 = Workload(world_size=8, prompt_length=512, gpu_bytes=96e9)
"""An 8 x H20 node (96 GB each) and the prompt tokens of the memory check (reasoning-gym prompts
under a chat template are shorter)."""


def _memory(cfg, model) -> tuple:
    """(the run's plan for a group of the run's full shape, per-GPU bytes by part): the model
    state, the plan's predicted peak and the rollout cache (``scalerlt_mcore.plan``'s)."""
    report = make_report(cfg, H20, model)
    return report.run_plan, {**report.state, "plan": report.run_memory.peak_bytes,
                             "rollout cache": report.rollout_cache}


@pytest.fixture
def data_checks_off(monkeypatch):
    """Meta tensors hold no data: the checks that read values on the host are switched off (the
    group's value checks, the replay guard's content checksums; test_device_meta.py and the
    CPU tests cover them) and the rollout's final host copies return the device record. The
    device checks stay on (``check_device`` of every group, before any compute)."""
    monkeypatch.setattr(SharedPrefixGroup, "check", lambda self, *args, **kwargs: None)
    monkeypatch.setattr(ReplayGuard, "_verify_contents", lambda self, where: None)
    monkeypatch.setattr(rollout.DecodeRecord, "rollout", lambda self, *args: self)


def _no_host_table(*args):
    raise AssertionError("a model on meta drew its initial-state table on the host")


@pytest.mark.parametrize("name", META_STEP)
def test_full_size_rl_step_on_meta(name, tmp_path, data_checks_off, monkeypatch):
    """(Huginn's random initial state on meta: an empty table on meta, not a host draw of
    every position, 8 s of a 2-core host at Huginn-0125's size.)"""
    monkeypatch.setattr(looped_gpt, "initial_state_table", _no_host_table)
    shape, params = META_STEP[name]
    source = None if shape is None else checkpoint_dir(tmp_path, shape)
    cfg = parse_args(_argv(name, source))
    resolve_pretrained(cfg)
    R = cfg.model.looped_num_loops
    with model_parallel_context(seed=1):
        start = time.perf_counter()
        model = meta_model(cfg)
        built = time.perf_counter() - start
        count = sum(p.numel() for p in model.parameters())
        assert {(p.device, p.dtype) for p in model.parameters()} == {(META, torch.bfloat16)}
        assert abs(count / params - 1) < 0.01, count
        plan, parts = _memory(cfg, model)
        # the rollout cache is freed before the step: the state and the larger of the two
        state = sum(v for k, v in parts.items() if k not in ("plan", "rollout cache"))
        total = state + max(parts["plan"], parts["rollout cache"])
        assert not plan.naive and total <= 0.85 * H20.gpu_bytes, (plan, parts)
        sampling = Sampling(temperature=cfg.rl.rl_temperature, stop_check_interval=4,
                            vocab_size=model.vocab_size, exit_mode=cfg.rl.rl_rollout_exit)
        record = generate(model, [[5, 6, 7, 8], [9, 10, 11]], 2, 2, eos_id=2, pad_id=0,
                          sampling=sampling, prompt_once=True, num_loops=R)
        assert record.out.shape == (4, 2) and record.out.device == META
        assert record.loops.shape == (R, 4, 2) and record.loops.device == META
        group = make_group(4, 6, 3, R, seed=0, dtype=torch.float32, kl=False,
                           vocab=model.vocab_size, device="meta")
        losses = schedule_from(cfg, model)(
            forward_step_func=rl_forward_step(objective_from(cfg)), data_iterator=iter([group]),
            model=model, num_microbatches=1, num_loops=R, seq_length=group.tokens.shape[1],
            micro_batch_size=4)
        assert losses[0]["loss"].device == META
        trained = [p for p in model.parameters() if p.requires_grad]
        assert all(p.grad is not None and p.grad.device == META for p in trained)
        group.tokens = torch.zeros(group.tokens.shape, dtype=torch.long)  # one host tensor
        with pytest.raises(ValueError, match=r"group 0: tokens is on cpu, the model on meta"):
            schedule_from(cfg, model)(
                forward_step_func=rl_forward_step(objective_from(cfg)),
                data_iterator=iter([group]), model=model, num_microbatches=1, num_loops=R,
                seq_length=group.tokens.shape[1], micro_batch_size=4)
    print(f"\n[h20 configs] {name}: {count / 1e9:.2f}B parameters built on meta in {built:.2f} s;"
          f" {plan}; per GPU " + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in parts.items())
          + f"; state + the larger of plan and cache = {total / 1e9:.1f} GB")
