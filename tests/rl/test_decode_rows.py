"""Rollouts decoded a bounded number of rows at a time (``generate(max_rows=...)``,
``generate_tree(max_rows=...)``, the run's ``--inference-max-requests``).

- Greedy: the rows decoded at a time hold the tokens and per-loop log-probs of decoding every
  row at once (per row and prompt once; fewer rows than a group, and whole groups), in the
  same order; trees likewise, each tree's replies told its own prompt's index.
- Sampled: every row's recorded per-loop log-probs equal the plain-PyTorch reference forward
  of its prompt and response (fp64 model, fp32 records), and no cache holds more rows than
  asked.
- The flag: refused below 1 and, for trees, below a tree's leaves; the plan's rollout cache
  (``rollout_positions``) counts the rows held at once.
"""

import math

import pytest
import torch
from helpers.decode import EOS, PAD, PROMPTS, build, check_segments, reply
from helpers.reference_looped import reference_forward

from scalerlt_mcore.app.config import ConfigError, parse_args, validate
from scalerlt_mcore.app.config.rl import rollout_positions
from scalerlt_mcore.rl.rollout import Sampling, generate
from scalerlt_mcore.rl.tree_rollout import generate_tree

GREEDY = dict(eos_id=EOS, pad_id=PAD)


def _greedy():
    return Sampling(temperature=0.0, banned=(PAD,))


@pytest.mark.parametrize("prompt_once", [False, True])
@pytest.mark.parametrize("max_rows", [1, 3, 4, 9])
def test_rows_at_a_time_decode_what_all_rows_at_once_decode(mcore_single, prompt_once,
                                                            max_rows):
    model, _, _ = build("rope", torch.float64)
    model.eval()
    whole = generate(model, PROMPTS, 4, 5, sampling=_greedy(), prompt_once=prompt_once,
                     **GREEDY)
    parts = generate(model, PROMPTS, 4, 5, sampling=_greedy(), prompt_once=prompt_once,
                     max_rows=max_rows, **GREEDY)
    assert parts.prompts == PROMPTS
    assert torch.equal(parts.responses, whole.responses)
    assert torch.equal(parts.lengths, whole.lengths)
    ulp = torch.finfo(torch.float32).eps * 8
    assert torch.allclose(parts.loop_logprobs, whole.loop_logprobs, atol=ulp, rtol=0)
    assert torch.allclose(parts.logprobs, whole.logprobs, atol=ulp, rtol=0)
    # the prompts' log-probs differ: a row of another prompt would show
    assert len({tuple(r) for r in whole.loop_logprobs[-1, :, 0].tolist()}) == len(PROMPTS)


@pytest.mark.parametrize("prompt_once", [False, True])
def test_sampled_rows_at_a_time_hold_the_reference_logprobs(mcore_single, prompt_once):
    """Three prompts x 4 samples, 3 rows at a time (a group split 3 + 1): every row's per-loop
    log-probs at the sampling temperature are the reference forward's, and every cache made
    holds at most 3 rows."""
    model, ref, weights = build("rope", torch.float64)
    model.eval()
    made, new_cache = [], model.new_kv_cache

    def counting(batch, *args, **kwargs):
        made.append(batch)
        return new_cache(batch, *args, **kwargs)

    model.new_kv_cache = counting
    gen = torch.Generator().manual_seed(5)
    out = generate(model, PROMPTS, 4, 4, prompt_once=prompt_once, max_rows=3, **GREEDY,
                   sampling=Sampling(temperature=0.8, generator=gen, banned=(PAD,)))
    assert made and max(made) <= 3
    assert out.responses.shape == (3, 4, 4) and out.loop_logprobs.shape[1:] == (3, 4, 4)
    err = 0.0
    for n, prompt in enumerate(PROMPTS):
        for g in range(4):
            row = prompt + out.responses[n, g].tolist()
            logits, _ = reference_forward(weights, ref, torch.tensor(row)[None])
            want = torch.stack([(lg[0] / 0.8).log_softmax(-1)[len(prompt) - 1 : -1].gather(
                -1, out.responses[n, g][:, None])[:, 0] for lg in logits])  # [R, S]
            err = max(err, (out.loop_logprobs[:, n, g] - want).abs().max().item())
    assert err <= torch.finfo(torch.float32).eps * 16
    assert len({tuple(r) for r in out.responses[0].tolist()}) > 1  # sampled, not one row


def test_trees_at_a_time_grow_what_all_trees_at_once_grow(mcore_single):
    model, _, _ = build("rope", torch.float64)
    model.eval()
    kwargs = dict(reply_fn=reply, sampling=_greedy(), **GREEDY)
    whole = generate_tree(model, PROMPTS, [2, 3], [4, 3], **kwargs)
    parts = generate_tree(model, PROMPTS, [2, 3], [4, 3], max_rows=6, **kwargs)  # a tree
    assert parts.prompts == PROMPTS and parts.leaves == whole.leaves
    ulp = torch.finfo(torch.float32).eps * 8
    for n in range(len(PROMPTS)):
        check_segments(parts, n, reply)  # each reply told its own tree's prompt index
        assert parts.segments[n] == whole.segments[n]
        for a, b in zip(parts.loop_logprobs[n], whole.loop_logprobs[n]):
            assert torch.allclose(a, b, atol=ulp, rtol=0)
    with pytest.raises(ValueError, match=r"max_rows 5 holds no whole tree: each has 6 leaves"):
        generate_tree(model, PROMPTS, [2, 3], [4, 3], max_rows=5, **kwargs)


@pytest.mark.parametrize("argv, message", [
    (["--inference-max-requests", "0"], "inference_max_requests must be >= 1 or null, got 0"),
    (["--rl-rollout", "tree", "--rl-tree-branches", "2,2", "--grpo-group-size", "4",
      "--global-batch-size", "8", "--micro-batch-size", "4", "--rl-task", "multiturn",
      "--rl-task-options", "{task: reverse, options: {min_len: 2, max_len: 3, alphabet: ab}}",
      "--max-position-embeddings", "32", "--inference-max-requests", "3"],
     r"inference_max_requests 3 holds no whole tree: rl_rollout tree decodes whole trees of 4 "
     r"leaves \(rl_tree_branches 2,2\)"),
])
def test_bad_max_requests_are_refused(argv, message):
    with pytest.raises(ConfigError, match=message):
        validate(parse_args(argv), world_size=1)


@pytest.mark.parametrize("mode, rows, want", [
    ("per_row", None, 3 * 8 * (10 + 6)),   # every prompt's G rows of prompt and response
    ("per_row", 3, 3 * (10 + 6)),          # 3 rows at a time
    ("per_row", 16, 2 * 8 * (10 + 6)),     # two whole groups
    ("prompt_once", None, 3 * (10 + 8 * 6)),
    ("prompt_once", 3, 10 + 3 * 6),        # the prompt once per call, 3 responses
    ("prompt_once", 20, 2 * (10 + 8 * 6)),
])
def test_the_rollout_cache_counts_the_rows_at_once(mode, rows, want):
    cfg = parse_args(["--rl-rollout", mode, "--grpo-group-size", "8",
                      "--rl-max-response-length", "6"])
    cfg.rl.inference_max_requests = rows
    assert rollout_positions(cfg.rl, 10, prompts=3) == want


def test_the_trainer_decodes_at_most_inference_max_requests(mcore_single):
    """The main job's RL step with ``--inference-max-requests 3`` (2 prompts x 4 samples on the
    rank): every cache its rollouts and evaluation make holds at most 3 rows, the rollout has
    every sample, and the step trains."""
    from helpers.train_runs import SFT, _flags, _trainer

    tr = _trainer(_flags(global_batch_size=8, eval_iters=1, eval_interval=0,
                         inference_max_requests=3))
    made, new_cache = [], tr.model.new_kv_cache

    def counting(batch, *args, **kwargs):
        made.append(batch)
        return new_cache(batch, *args, **kwargs)

    tr.model.new_kv_cache = counting
    rollouts, rollout = [], tr.rollout
    tr.rollout = lambda *args, **kwargs: rollouts.append(rollout(*args, **kwargs)) or (
        rollouts[-1])
    for step in range(SFT + 1):
        metrics = tr.rl_step(step) if step >= SFT else tr.sft_step(step)
    tr.evaluate()
    assert made and max(made) <= 3, made
    assert rollouts[0].responses.shape[:2] == (2, 4)
    assert math.isfinite(metrics["loss"]) and metrics["tokens_per_s"] > 0
