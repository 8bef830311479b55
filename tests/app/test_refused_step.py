"""A step the shared-prefix schedule refuses after compute began leaves nothing behind.

The schedule's contract: a ``ReplayInputError`` raised once waves have run leaves their
gradients in the grad buffers, and says that the caller must discard them. The trainer does:
after a refused step its grad buffers are zero and its parameters, Adam moments and LR schedule
are those from before the step. The trainer is built as ``scalerlt_mcore.train`` builds it
(MCore DDP + distributed Adam), from tests/configs/e2e_tiny.yaml.
"""

import math
from pathlib import Path

import pytest
import torch

from scalerlt_mcore.app.config import parse_args, validate
from scalerlt_mcore.shared_prefix import ReplayInputError, get_shared_prefix_forward_backward_func

TINY_YAML = Path(__file__).resolve().parents[1] / "configs" / "e2e_tiny.yaml"


def _trainer():
    from scalerlt_mcore.app import runtime
    from scalerlt_mcore.app.pretrained import run_vocab_size
    from scalerlt_mcore.app.trainer import RLTrainer

    cfg = parse_args(["--config", str(TINY_YAML)])
    validate(cfg, torch.distributed.get_world_size())
    config = runtime.model_config(cfg, "cpu")
    model = runtime.build_model(cfg, config, run_vocab_size(cfg), "cpu")
    return RLTrainer(cfg, model, *runtime.wrap_for_training(cfg, config, model))


def _state(tr) -> dict:
    """Parameters, reduced grads (world size 1: the grad buffers), Adam state, LR schedule."""
    (inner,) = getattr(tr.optimizer, "chained_optimizers", [tr.optimizer])
    adam = [inner.optimizer.state[s] for group in inner.shard_fp32_groups for s in group]
    params = list(tr.model.parameters())
    return {
        "params": torch.cat([p.detach().reshape(-1) for p in params]).clone(),
        "grads": torch.cat([p.main_grad.reshape(-1) for p in params]).clone(),
        "exp_avg": torch.cat([s["exp_avg"].reshape(-1) for s in adam]).clone(),
        "exp_avg_sq": torch.cat([s["exp_avg_sq"].reshape(-1) for s in adam]).clone(),
        "adam_steps": torch.tensor(sorted({float(s["step"]) for s in adam})),
        "scheduler_steps": torch.tensor(tr.scheduler.num_steps),
        "lr": torch.tensor(tr.optimizer.param_groups[0]["lr"]),
    }


def _poison_after_first_wave(tr, prompt="recompute"):
    """The trainer's schedule, but the first group's advantages change after its first wave
    (so waves have run, and left gradients, when the joint replay refuses the group)."""
    sp = tr.cfg.shared_prefix
    done = []

    def callback(phase, group):
        if phase == "wave" and not done:
            done.append(group.group_id)
            group.advantages.add_(1.0)

    tr.schedule = get_shared_prefix_forward_backward_func(
        sp.shared_prefix_wave_size, sp.shared_prefix_checkpoint_waves,
        tr.cfg.rl.rl_max_response_length, phase_callback=callback, prompt=prompt)
    return done


def _first_training_step(tr, tries: int = 8) -> int:
    """RL steps from the first until one has a non-zero gradient (the untrained model's groups
    can all score 0, and then train nothing); returns that step."""
    first = tr.cfg.rl.rl_warmup_sft_steps
    for step in range(first, first + tries):
        if tr.rl_step(step)["grad_norm"] > 0:
            return step
    raise AssertionError(f"no RL step of {first}..{first + tries - 1} had a gradient")


@pytest.mark.parametrize("prompt", ["recompute", "retain"])
def test_trainer_discards_grads_of_a_refused_step(mcore_single, prompt):
    tr = _trainer()
    assert tr.cfg.rl.grpo_group_size > tr.cfg.shared_prefix.shared_prefix_wave_size  # 2+ waves
    step = _first_training_step(tr)  # Adam state with non-zero moments exists
    before = _state(tr)
    schedule = tr.schedule
    poisoned = _poison_after_first_wave(tr, prompt)
    with pytest.raises(ReplayInputError, match=r"replay input 'advantages' changed.*discard"):
        tr.rl_step(step + 1)
    assert poisoned, "the refusal must come after a wave ran"
    after = _state(tr)
    assert not after["grads"].any(), "grads of the refused step's waves were kept"
    for key in ("params", "exp_avg", "exp_avg_sq", "adam_steps", "scheduler_steps", "lr"):
        assert torch.equal(before[key], after[key]), key
    tr.schedule = schedule  # the trainer is still usable: the same step now trains
    assert math.isfinite(tr.rl_step(step + 1)["grad_norm"])
    trained = _state(tr)
    assert bool((trained["adam_steps"] > before["adam_steps"]).all())  # the optimizer stepped
    assert not torch.equal(trained["params"], before["params"])

