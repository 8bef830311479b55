"""Rollouts from an engine in another process (``--rl-rollout-source engine``,
``app/engine.py``; ``python -m scalerlt_mcore.engine`` the project's decoder behind the
contract) and the rollout records (``rl/records.py``).

- Lag 0: the run's published weights after every step are bitwise those of the in-process
  run with the same flags, and so are its logged losses and rewards.
- Lag 1: the engine decodes the next step's rollouts while the trainer trains, with the
  weights one version behind (``policy_lag`` 1 after the first RL step).
- Exit depths: with ``--rl-rollout-exit threshold`` the engine's records carry each token's
  exit depth and the trainer replays them (its scored log-probs are the engine's).
- Records are checked on read, one line naming the record and field; stale records are
  refused or dropped with their group; the IS correction's weights from one behaviour
  log-prob per token; bad settings refused by name.
"""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers.train_runs import TINY_YAML

from scalerlt_mcore.app.config import ConfigError, parse_args, validate
from scalerlt_mcore.app.engine import check_engine_records, rollout_of, usable
from scalerlt_mcore.rl.batch import RLGroup, attach_exit_depths, build_groups, inference_layout
from scalerlt_mcore.rl.publish import read_version
from scalerlt_mcore.rl.records import (
    RecordError,
    RolloutRecord,
    check_records,
    read_records,
    write_records,
)

REPO = Path(__file__).resolve().parents[2]


def _train(tmp_path, name: str, *flags, engine_lag=None) -> list:
    """A tiny run (2 warm-up and 3 RL steps); with ``engine_lag`` its rollouts from an engine
    process at that lag -> the run's metrics records."""
    run = tmp_path / name
    args = ["--config", str(TINY_YAML), "--run-dir", str(run), "--no-plot", *flags]
    engine = None
    if engine_lag is not None:
        args += ["--rl-rollout-source", "engine", "--rl-engine-dir", str(run / "engine"),
                 "--rl-max-policy-lag", str(engine_lag)]
        engine = subprocess.Popen([sys.executable, "-m", "scalerlt_mcore.engine", *args],
                                  cwd=tmp_path, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
    proc = subprocess.run([sys.executable, "-m", "scalerlt_mcore.train", *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=500)
    if engine is not None:
        out = engine.communicate(timeout=400)[0]
        assert engine.returncode == 0 and "engine: served 3 request(s)" in out, out[-2000:]
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


KEYS = ("loss", "reward_mean", "kl", "clip_fraction", "response_length", "grad_norm")


def test_lag_0_is_the_in_process_run_bitwise(tmp_path):
    mine = _train(tmp_path, "engine", engine_lag=0)
    ref = _train(tmp_path, "inproc", "--rl-publish-dir", str(tmp_path / "inproc" / "pub"))
    train = [[{k: r[k] for k in KEYS} for r in m if r["kind"] == "train"] for m in (mine, ref)]
    assert train[0] == train[1] and len(train[0]) == 3
    assert {r["policy_lag"] for r in mine if r["kind"] == "train"} == {0.0}
    v1, a, _ = read_version(tmp_path / "engine" / "engine" / "weights")
    v2, b, _ = read_version(tmp_path / "inproc" / "pub")
    assert v1 == v2 == 6 and a.keys() == b.keys()  # the start and 5 steps
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_lag_1_decodes_the_next_step_with_the_current_weights(tmp_path):
    lags = [r["policy_lag"] for r in _train(tmp_path, "lag1", engine_lag=1)
            if r["kind"] == "train"]
    assert lags == [0.0, 1.0, 1.0]


def test_exit_depths_from_the_engine_are_replayed(tmp_path):
    """``--rl-rollout-exit threshold`` from the engine at lag 0: the engine keeps each exited
    position's K/V as vllm-rlt does and records the exit depths (some below R); the trainer
    scores every token at its own depth against those K/V, so the old log-probs it scores
    equal the engine's behaviour log-probs to fp32 rounding (``rollout_logprob_max_diff``,
    measured 4.8e-7 to 7.2e-7; a replay at full depth of the same records: 6.1e-2 and 8.4e-2
    at the steps where tokens exited early)."""
    gate = ["--looped-exit-gate", "true", "--rl-exit-gate-coef", "0.1",
            "--rl-rollout-exit", "threshold", "--rl-exit-threshold", "0.75",
            "--rl-loop-weights", "final"]
    metrics = _train(tmp_path, "exits", *gate, engine_lag=0)
    depths = [d for f in (tmp_path / "exits" / "engine" / "records").glob("*.jsonl")
              for r in read_records(f) for d in r.exit_depths]
    loops = parse_args(["--config", str(TINY_YAML)]).model.looped_num_loops
    assert min(depths) < loops and set(depths) <= set(range(1, loops + 1)), sorted(set(depths))
    diffs = [r["rollout_logprob_max_diff"] for r in metrics if r["kind"] == "train"]
    print(f"\n[engine exits] depths {sorted(set(depths))}, max diffs {diffs}")
    assert len(diffs) == 3 and max(diffs) <= 1e-5, diffs


def _record(**kw) -> RolloutRecord:
    base = dict(group=0, prompt_ids=[1, 2], response_ids=[3, 4, 5], logprobs=[-1.0, -0.5, -2.0],
                exit_depths=[2, 2, 2], weight_version=3, sampling_params={"seed": 1})
    return RolloutRecord(**{**base, **kw})


@pytest.mark.parametrize("change,message", [
    ({"response_ids": [3, 4, 99]}, r"response_ids must be a non-empty list of ids in \[0, 50\)"),
    ({"prompt_ids": []}, r"prompt_ids must be a non-empty list"),
    ({"logprobs": [-1.0]}, "logprobs has 1 entries for 3 response tokens"),
    ({"exit_depths": [2, 3, 2]}, r"exit_depths must lie in 1\.\.2"),
    ({"logprobs": [-1.0, float("nan"), -1.0]}, "logprobs must be finite and <= 0"),
    ({"weight_version": 9}, "weight_version 9 is newer than the trainer's 4"),
    ({"logprobs_mode": "raw"}, "logprobs_mode 'raw' .* at temperature 0.7"),
])
def test_records_are_checked_by_field(change, message):
    with pytest.raises(RecordError, match=f"^record 1 \\(group 0\\): {message}"):
        check_records([_record(), _record(**change)], vocab_size=50, num_loops=2, version=4,
                      temperature=0.7)


def test_records_round_trip_and_bad_lines(tmp_path):
    path = tmp_path / "r.jsonl"
    write_records(path, [_record(), _record(group=1)])
    assert read_records(path) == [_record(), _record(group=1)]
    path.write_text(path.read_text() + '{"group": 2}\n')
    with pytest.raises(RecordError, match="r.jsonl: line 3: not a rollout record \\(missing "
                                          "field 'prompt_ids'\\)"):
        read_records(path)


def test_stale_records_are_refused_or_dropped_with_their_group():
    records = [_record(group=0, weight_version=4), _record(group=0, weight_version=2),
               _record(group=1, weight_version=4)]
    with pytest.raises(RecordError, match="step 7: 1 record\\(s\\) decoded by weight version "
                                          "2, more than rl_max_policy_lag 1 behind"):
        usable(records, 4, 1, "refuse", 7)
    assert usable(records, 4, 1, "drop", 7) == records[2:]
    assert usable(records, 4, 2, "refuse", 7) == records
    with pytest.raises(RecordError, match="every group is older"):
        usable(records[:2], 5, 0, "drop", 7)


def test_the_records_make_the_steps_rollout():
    records = [_record(group=0), _record(group=0, response_ids=[6], logprobs=[-0.1],
                                         exit_depths=[2]), _record(group=1, prompt_ids=[7])]
    with pytest.raises(RecordError, match="group 1: 1 responses to the prompt of problem 1 "
                                          "expected 2"):
        rollout_of(records, [[1, 2], [7]], 2, pad_id=0, num_loops=2)
    ro = rollout_of(records[:2], [[1, 2]], 2, pad_id=0, num_loops=2)
    assert ro.responses.tolist() == [[[3, 4, 5], [6, 0, 0]]] and ro.lengths.tolist() == [[3, 1]]
    assert ro.loop_logprobs.shape == (1, 1, 2, 3)
    assert ro.logprobs[0, 1, 0].item() == pytest.approx(-0.1)
    assert ro.exit_depths is None  # every token at full depth: nothing to replay
    early = [records[0], _record(response_ids=[6], logprobs=[-0.1], exit_depths=[1])]
    ro = rollout_of(early, [[1, 2]], 2, pad_id=0, num_loops=2)
    assert ro.exit_depths.tolist() == [[[2, 2, 2], [1, 0, 0]]]


def test_recorded_exit_depths_reach_the_groups_and_need_final_loop_weights():
    """A step's rollout with exit depths below R: each group holds them at its label
    positions (0 off the responses), its IS weights compare the behaviour log-prob with the
    old one at each token's own loop; with other loop weights than final the records are
    refused, naming the group."""
    records = [_record(), _record(response_ids=[6], logprobs=[-0.1], exit_depths=[1])]
    ro = rollout_of(records, [[1, 2]], 2, pad_id=0, num_loops=2)
    group = attach_exit_depths(build_groups(ro.prompts, ro.responses, ro.lengths, 0, 0),
                               ro.exit_depths)[0]
    assert group.exit_depths.tolist() == [[0, 2, 2, 2, 0], [0, 1, 0, 0, 0]]
    group.old_logprobs = torch.randn(2, 2, 5, dtype=torch.float64)
    behaviour = torch.randn(1, 2, 5, dtype=torch.float64)
    weights = (group.old_logprobs - inference_layout(group, behaviour)).exp()
    own = torch.where(group.exit_depths == 1, group.old_logprobs[0], group.old_logprobs[1])
    want = (own - behaviour[0]).exp()
    assert all(torch.allclose(weights[r], want, rtol=1e-14) for r in range(2))
    worker = SimpleNamespace(tok=SimpleNamespace(vocab_size=50),
                             cfg=SimpleNamespace(rl=SimpleNamespace(rl_temperature=1.0)),
                             objective=SimpleNamespace(loop_weights="uniform"))
    with pytest.raises(RecordError, match=r"^record of group 0: exit depths below the loop "
                                          r"count \(2\) .* need rl_loop_weights final, got "
                                          r"'uniform'$"):
        check_engine_records(records, worker, 3, 2)
    worker.objective.loop_weights = "final"
    check_engine_records(records, worker, 3, 2)


def test_one_behaviour_logprob_weighs_every_loop_alike():
    """An engine's one log-prob per token: every loop's IS weight is exp(old[R-1] - it)."""
    group = RLGroup.from_rollout([1, 2, 3], torch.tensor([[4, 5], [6, 0]]), [2, 1], 0,
                                 mask_dtype=torch.float64)
    group.old_logprobs = torch.randn(3, 2, 5, dtype=torch.float64)
    behaviour = torch.randn(1, 2, 5, dtype=torch.float64)
    weights = (group.old_logprobs - inference_layout(group, behaviour)).exp()
    want = (group.old_logprobs[-1] - behaviour[0]).exp()
    assert all(torch.allclose(weights[r], want, rtol=1e-14) for r in range(3))
    per_loop = torch.randn(3, 2, 5, dtype=torch.float64)
    assert torch.equal(inference_layout(group, per_loop), per_loop)


@pytest.mark.parametrize("flags,message", [
    (["--rl-rollout-source", "engine"], "rl_rollout_source engine needs rl_engine_dir"),
    (["--rl-engine-dir", "e"], "rl_engine_dir is read only with rl_rollout_source engine"),
    (["--rl-rollout-source", "engine", "--rl-engine-dir", "e", "--rl-rollout", "tree"],
     "rl_rollout_source engine needs rl_rollout prompt_once or per_row, got 'tree'"),
    (["--rl-rollout-source", "engine", "--rl-engine-dir", "e", "--rl-old-logprobs", "rollout"],
     "rl_rollout_source engine needs rl_old_logprobs score, got 'rollout'"),
    (["--rl-rollout-source", "engine", "--rl-engine-dir", "e", "--rl-publish-dir", "p"],
     "rl_rollout_source engine publishes to rl_engine_dir/weights"),
    (["--rl-rollout-source", "engine", "--rl-engine-dir", "e", "--rl-max-policy-lag", "-1"],
     "rl_max_policy_lag must be >= 0, got -1"),
])
def test_bad_engine_settings_are_refused_by_name(flags, message):
    with pytest.raises(ConfigError, match=message):
        validate(parse_args(["--config", str(TINY_YAML), *flags]), world_size=1)
