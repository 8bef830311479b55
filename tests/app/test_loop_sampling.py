"""Sampled loop counts (``looped_num_loops_sampling``, Huginn): one R per training step, drawn
from (seed, step) alone, so every rank and a resumed run draw the same; the step's rollouts,
scoring and training all run with it."""

import pytest
import torch

from scalerlt_mcore.app.config import parse_args
from scalerlt_mcore.app.trainer import RLTrainer
from scalerlt_mcore.model.config import (
    LOOP_COUNT_SALT,
    parse_loop_sampling,
    sample_num_loops,
    step_seed,
)


def test_fixed_is_the_configured_count():
    assert [sample_num_loops("fixed", 3, seed=1, step=s) for s in range(5)] == [3] * 5


def test_draws_repeat_for_the_same_seed_and_step():
    for spec in ("uniform:2,6", "poisson_lognormal"):
        first = [sample_num_loops(spec, 4, seed=7, step=s) for s in range(50)]
        again = [sample_num_loops(spec, 4, seed=7, step=s) for s in range(50)]
        other = [sample_num_loops(spec, 4, seed=8, step=s) for s in range(50)]
        assert first == again and first != other
        assert len(set(first)) > 2


def test_uniform_covers_its_range_only():
    draws = [sample_num_loops("uniform:2,5", 9, seed=3, step=s) for s in range(400)]
    assert set(draws) == {2, 3, 4, 5}


def test_poisson_lognormal_mean_and_clamp():
    """Mean about R (R - 1 for the Poisson part, plus one) before clamping; never above max."""
    draws = torch.tensor([sample_num_loops("poisson_lognormal:1000", 6, seed=0, step=s)
                          for s in range(4000)], dtype=torch.float64)
    assert abs(float(draws.mean()) - 6.0) < 0.25
    assert int(draws.min()) >= 1
    clamped = [sample_num_loops("poisson_lognormal", 6, seed=0, step=s) for s in range(2000)]
    assert max(clamped) == 12  # default max 2R, reached by the tail
    assert parse_loop_sampling("poisson_lognormal", 6) == ("poisson_lognormal", 1, 12)


@pytest.mark.parametrize("spec", ["uniform:0,3", "uniform:4,2", "uniform:2", "fixed:3",
                                  "poisson_lognormal:0", "gauss"])
def test_bad_specs_are_refused(spec):
    with pytest.raises(ValueError, match=f"looped_num_loops_sampling must be one of .* got "
                                         f"'{spec}'"):
        parse_loop_sampling(spec, 4)


class _Trainer(RLTrainer):
    """Only what ``start_step`` reads: the run config, the model's config and its initial
    state draw, no KL reference."""

    def __init__(self, cfg, model_config):
        self.cfg, self.ref = cfg, None
        self.model = type("M", (), {"config": model_config,
                                    "set_initial_state_draw": lambda self, seed, step: None})()


def test_trainer_computes_each_steps_draw_and_the_largest_for_evaluation(mcore_single):
    """The step's count is returned (and passed on by the trainer); the config stays as built."""
    from helpers.sp import build_model

    cfg = parse_args(["--looped-num-loops", "3", "--looped-num-loops-sampling", "uniform:1,4",
                      "--seed", "5"])
    model = build_model(R=3)
    trainer = _Trainer(cfg, model.config)
    for step in range(6):
        assert trainer.start_step(step) == sample_num_loops("uniform:1,4", 3, 5, step)
    assert trainer.start_step(6, evaluation=True) == 4
    assert model.config.looped_num_loops == 3


def test_rl_steps_run_at_each_steps_draw(mcore_single):
    """The main job's RL steps with ``uniform:1,3``: every step's rollouts, old log-probs
    (scoring) and training groups carry that step's R, and the metrics log it."""
    from helpers.train_runs import SFT, _flags, _trainer

    torch.manual_seed(7)
    tr = _trainer(_flags(looped_num_loops_sampling="uniform:1,3", grpo_iterations=1,
                         grpo_kl_beta=0.0))
    seen = []
    optimize = tr.optimize

    def recording(groups, num_loops):
        seen.append({g.old_logprobs.shape[0] for g in groups} | {num_loops})
        return optimize(groups, num_loops)

    tr.optimize = recording
    steps = range(SFT + 5, SFT + 9)  # draws 1, 2, 3, 1 at seed 1234
    metrics = [tr.rl_step(step) for step in steps]
    draws = [sample_num_loops("uniform:1,3", 2, tr.cfg.training.seed, step) for step in steps]
    assert len(set(draws)) > 1  # the steps really differ
    assert [m["loops"] for m in metrics] == draws
    assert seen == [{r} for r in draws]
    assert tr.model.config.looped_num_loops == 2  # the configured count: never changed


def test_one_owner_of_a_steps_loop_count():
    """``step_num_loops``: the curriculum's count, then the spec's draw of the step (the
    largest it can draw for evaluation); the draw's generator seed is ``step_seed``'s."""
    from scalerlt_mcore.model.config import curriculum_loops, step_num_loops

    for step in range(8):
        mean = curriculum_loops(step, 4, 5)
        assert step_num_loops(step, 4, 5, "uniform:1,3", 9) == sample_num_loops(
            "uniform:1,3", mean, 9, step)
        assert step_num_loops(step, 4, 5, "fixed", 9) == mean
        assert step_num_loops(step, 4, 5, "poisson_lognormal", 9, evaluation=True) == 2 * mean
    gen = torch.Generator().manual_seed(step_seed(9, 3, 0, LOOP_COUNT_SALT))
    assert sample_num_loops("uniform:1,6", 2, 9, 3) == int(torch.randint(1, 7, (1,),
                                                                         generator=gen))


def test_each_step_sets_its_initial_state_draw_in_policy_and_reference():
    """A random initial state (Huginn) is redrawn per step from (seed, step), in the policy and
    the KL reference alike, so the step's rollouts, scoring and replay share one s_0."""
    import types

    from scalerlt_mcore.app.trainer import RLTrainer

    class Stub:
        def __init__(self):
            self.config, self.draws = types.SimpleNamespace(looped_num_loops=2), []

        def set_initial_state_draw(self, seed, step=0):
            self.draws.append((seed, step))

    policy, reference = Stub(), Stub()
    cfg = types.SimpleNamespace(
        model=types.SimpleNamespace(looped_num_loops=2, looped_loops_warmup_iters=0,
                                    looped_num_loops_sampling="fixed"),
        training=types.SimpleNamespace(seed=7))
    trainer = types.SimpleNamespace(cfg=cfg, model=policy,
                                    ref=types.SimpleNamespace(module=reference))
    for step in (3, 4):
        assert RLTrainer.start_step(trainer, step) == 2
    assert policy.draws == reference.draws == [(7, 3), (7, 4)]
    trainer.ref = None
    RLTrainer.start_step(trainer, 5)
    assert policy.draws[-1] == (7, 5)
