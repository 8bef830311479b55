"""Rollouts with the exit gate: sampling from the exit-weighted mixture, or from the readout of
the first loop whose exit CDF reaches a threshold. The log-probs the rollout records (every
loop's, the exit distribution, and the sampling distribution's) are the quantities a training
forward of the same sequences computes: within 1e-5 (fp32)."""

import pytest
import torch
from helpers.exit_gate import _gated

from scalerlt_mcore.rl.rollout import Sampling, exit_loop_at, generate

PROMPTS = [[3, 9, 4, 7, 1], [5, 2, 8]]
G, STEPS, EOS, PAD = 3, 6, 2, 0
ATOL = 1e-5


def _training_readouts(model, prompt: list, response: list) -> tuple:
    """Per-loop log-probs and exit log-probs [R, n] of the response tokens from a forward of
    the full sequence (as naive training computes them)."""
    seq = torch.tensor(prompt + response)[None]  # [1, P + n]
    labels = torch.cat([seq[:, 1:], seq[:, :1]], dim=1)  # label t = token t + 1
    with torch.no_grad():
        out = model(seq, labels=labels)
    P, n = len(prompt), len(response)
    return out.logprobs[:, 0, P - 1 : P - 1 + n], out.exit_logprobs[:, 0, P - 1 : P - 1 + n]


@pytest.mark.parametrize("mode", ["mixture", "threshold"])
@pytest.mark.parametrize("prompt_once, prompt_kv", [(False, None), (True, "shared"),
                                                    (True, "copied")])
def test_rollout_logprobs_are_the_training_ones(mcore_single, mode, prompt_once, prompt_kv):
    model = _gated(R=3).eval()
    gen = torch.Generator().manual_seed(5)
    ro = generate(model, PROMPTS, G, STEPS, eos_id=EOS, pad_id=PAD, prompt_once=prompt_once,
                  prompt_kv=prompt_kv,
                  sampling=Sampling(temperature=1.0, generator=gen, banned=(PAD,), exit_mode=mode,
                                    exit_threshold=0.6))
    used = set()
    for n, prompt in enumerate(PROMPTS):
        for g in range(G):
            length = int(ro.lengths[n, g])
            response = ro.responses[n, g, :length].tolist()
            lp, exit_lp = _training_readouts(model, prompt, response)  # [R, length]
            assert (ro.loop_logprobs[:, n, g, :length] - lp).abs().max() <= ATOL
            assert (ro.exit_logprobs[:, n, g, :length] - exit_lp).abs().max() <= ATOL
            if mode == "mixture":
                want = torch.logsumexp(exit_lp + lp, dim=0)  # log sum_r p(r) pi_r(y)
            else:
                loops = exit_loop_at(exit_lp, 0.6)  # [length], from 0
                assert torch.equal(ro.exit_loops[n, g, :length], loops + 1)
                want = lp.gather(0, loops[None]).squeeze(0)
                used.update(loops.tolist())
            assert (ro.logprobs[n, g, :length] - want).abs().max() <= ATOL
            assert (ro.logprobs[n, g, length:] == 0).all()
    if mode == "threshold":
        assert len(used) > 1  # tokens exit at different loops


def test_exit_loop_at_is_the_first_loop_past_the_threshold():
    p = torch.tensor([[0.1, 0.3, 0.7], [0.3, 0.3, 0.2], [0.6, 0.4, 0.1]], dtype=torch.float64)
    assert exit_loop_at(p.log(), 0.5).tolist() == [2, 1, 0]  # CDFs .1 .4 1 / .3 .6 1 / .7 .9 1
    assert exit_loop_at(p.log(), 0.95).tolist() == [2, 2, 2]


def test_exit_modes_need_the_gate(mcore_single):
    from helpers.sp import build_model

    with pytest.raises(ValueError, match="exit_mode 'mixture' needs the model's exit gate"):
        generate(build_model(R=2), PROMPTS, 2, 3, eos_id=EOS, pad_id=PAD,
                 sampling=Sampling(exit_mode="mixture"))
    with pytest.raises(ValueError, match="exit_mode must be one of"):
        generate(build_model(R=2), PROMPTS, 2, 3, eos_id=EOS, pad_id=PAD,
                 sampling=Sampling(exit_mode="cdf"))
