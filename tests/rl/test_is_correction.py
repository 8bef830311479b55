"""The inference-log-prob importance-sampling correction (Megatron-LM's
``--rl-inference-logprobs-is-correction`` and ``--rl-importance-sampling-truncation-coef``):
each token's policy term weighted by min(exp(old - inference), coef) at its loop, a constant;
KL and entropy terms unweighted.

- The loss and its gradient against the independent reference written from Megatron-LM's
  ``calculate_grpo_loss`` (tests/helpers/sp.py ``ref_rl_loss``), fp64, with and without
  truncation, and the logged weight and truncation sums.
- Joint replay with the correction equals naive stock MCore with it (fp64 <= 1e-12).
- Weights of 1 (inference = old) change nothing; other weights change the gradient.
- The main job: the flags reach the loss, the step logs the mean weight and the truncated
  fraction, and bad settings are refused by name.
"""

import pytest
import torch
from helpers.sp import (
    LossSpec,
    build_model,
    grads,
    joint_step,
    make_group,
    naive_step,
    ref_rl_loss,
    ref_token_weights,
    rel_errors,
)
from helpers.train_runs import SFT, _flags, _trainer

from scalerlt_mcore.app.config import ConfigError, parse_args, validate

TOL = 1e-12


def _inputs(R=3, B=4, T=7, seed=0):
    gen = torch.Generator().manual_seed(seed)
    f64 = dict(generator=gen, dtype=torch.float64)
    logprobs = (-2.0 + 0.3 * torch.randn(R, B, T, **f64)).requires_grad_()
    old = logprobs.detach() + 0.2 * torch.randn(R, B, T, **f64)
    inference = old + 0.5 * torch.randn(R, B, T, **f64)  # weights from about 0.2 to 5
    ref = old + 0.1 * torch.randn(R, B, T, **f64)
    adv = torch.randn(B, **f64)
    mask = (torch.rand(B, T, generator=gen) < 0.7).double()
    mask[:, 0] = 1
    return logprobs, old, inference, ref, adv, mask


@pytest.mark.parametrize("coef", [None, 1.2])
def test_loss_and_gradient_match_the_reference(coef):
    logprobs, old, inference, ref, adv, mask = _inputs()
    spec = LossSpec(normalization="seq_mean", kl_coef=0.1, entropy_weight=0.01,
                    loop_weights="progressive", clip_high=0.28, is_correction=True,
                    is_coef=coef)
    weights = ref_token_weights(spec, mask)
    got, stats = spec.objective().loss(logprobs, old, adv, weights, ref, inference=inference)
    (g_got,) = torch.autograd.grad(got, logprobs)
    want = ref_rl_loss(spec, logprobs, old, adv, weights, ref, inference)
    (g_want,) = torch.autograd.grad(want, logprobs)
    assert abs(float(got - want)) <= TOL * abs(float(want))
    assert float((g_got - g_want).abs().max()) <= TOL * float(g_want.abs().max())
    w = (old[-1] - inference[-1]).exp()  # the last loop's, as the stats report
    on = mask != 0
    capped = w if coef is None else w.clamp(max=coef)
    assert torch.isclose(stats["is_weight"], capped[on].sum(), rtol=1e-12)
    truncated = 0 if coef is None else int((w[on] > coef).sum())
    assert int(stats["is_truncated"]) == truncated and (coef is None or truncated > 0)


def test_unit_weights_change_nothing_and_others_do():
    logprobs, old, inference, ref, adv, mask = _inputs(seed=1)
    plain = LossSpec(kl_coef=0.1)
    corrected = LossSpec(kl_coef=0.1, is_correction=True)
    weights = ref_token_weights(plain, mask)
    base, _ = plain.objective().loss(logprobs, old, adv, weights, ref)
    same, _ = corrected.objective().loss(logprobs, old, adv, weights, ref, inference=old)
    other, _ = corrected.objective().loss(logprobs, old, adv, weights, ref, inference=inference)
    (g0,), (g1,), (g2,) = (torch.autograd.grad(x, logprobs) for x in (base, same, other))
    assert torch.equal(g0, g1) and float((g0 - g2).abs().max()) > 1e-3


@pytest.mark.parametrize("W,coef", [(2, None), (3, 1.5)])
def test_joint_replay_matches_naive_mcore(mcore_single, W, coef):
    R = 3
    model = build_model(R=R, arch=True).double()
    group = make_group(5, 9, 4, R, seed=3 + W, kl=True, inference=True)
    spec = LossSpec(normalization="token_mean", kl_coef=0.05, loop_weights="uniform",
                    is_correction=True, is_coef=coef)
    losses, _ = naive_step(model, [group], spec, 2)
    ref = grads(model)
    model.zero_grad(set_to_none=True)
    out = joint_step(model, [group], spec, W)
    assert abs(float(out[0]["loss"]) - float(losses[0])) <= TOL * abs(float(losses[0]))
    assert max(rel_errors(grads(model), ref).values()) <= TOL


def test_a_group_without_inference_logprobs_is_refused(mcore_single):
    model = build_model(R=2).double()
    group = make_group(3, 5, 3, 2, seed=1)
    with pytest.raises(ValueError, match="group 0: inference_is_correction needs "
                                         "inference_logprobs"):
        joint_step(model, [group], LossSpec(is_correction=True), 2)


def test_the_main_job_logs_the_weights(mcore_single):
    """In-process rollouts: the rollout's log-probs are the policy's up to rounding, so the
    mean weight is 1 to rounding and nothing is truncated at 2."""
    tr = _trainer(_flags(rl_inference_logprobs_is_correction=True,
                         rl_importance_sampling_truncation_coef=2.0))
    assert tr.objective.inference_is_correction and tr.objective.is_truncation_coef == 2.0
    m = tr.rl_step(SFT)
    assert abs(m["is_weight"] - 1) < 1e-3 and m["is_truncated"] == 0, m


@pytest.mark.parametrize("flags,message", [
    (["--rl-inference-logprobs-is-correction", "true", "--rl-old-logprobs", "rollout"],
     "rl_inference_logprobs_is_correction needs rl_old_logprobs score"),
    (["--rl-importance-sampling-truncation-coef", "2"],
     "rl_importance_sampling_truncation_coef has nothing to truncate: the inference log-prob "
     "importance-sampling correction is off"),
    (["--rl-inference-logprobs-is-correction", "true",
      "--rl-importance-sampling-truncation-coef", "0"],
     "rl_importance_sampling_truncation_coef must be > 0, got 0"),
])
def test_bad_settings_are_refused_by_name(flags, message):
    with pytest.raises(ConfigError, match=message):
        validate(parse_args(flags), world_size=1)
