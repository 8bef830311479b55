"""Rollout records: what a serving engine returns for each sampled response (vllm-rlt's
output contract), read by the trainer from files.

One JSON object per line and response:

- ``group``: the responses of one prompt share it (a GRPO group);
- ``prompt_ids``, ``response_ids``: token ids (the response as sampled, eos included);
- ``logprobs``: per response token, the behaviour policy's log-prob of the sampled token
  (fp32), in ``logprobs_mode`` ``processed`` (the sampling distribution at the request's
  temperature, before top-p: what the trainer scores) or ``raw`` (unscaled logits: equal to
  it only at temperature 1);
- ``exit_depths``: per response token, the loop (1..R) its decode stopped at;
- ``weight_version``: the published version that decoded it;
- ``sampling_params``: the effective parameters, ``seed`` and ``temperature`` included.

The trainer scores the responses with its own task (the records' groups are the problems it
asked for, in order).

``check_records`` refuses a malformed record with one line naming the record and the field.
"""

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .publish import write_atomic

FIELDS = ("group", "prompt_ids", "response_ids", "logprobs", "exit_depths", "weight_version",
          "sampling_params")
LOGPROBS_MODES = ("processed", "raw")


@dataclass
class RolloutRecord:
    """One sampled response (see the module docstring for the fields)."""

    group: int
    prompt_ids: list
    response_ids: list
    logprobs: list
    exit_depths: list
    weight_version: int
    sampling_params: dict = field(default_factory=dict)
    logprobs_mode: str = "processed"


class RecordError(ValueError):
    """A record the trainer refuses: one line naming the record and its field."""


def write_records(path, records: list) -> None:
    """``records`` as JSON lines at ``path``, written whole or not at all."""
    write_atomic(Path(path), "".join(json.dumps(asdict(r)) + "\n" for r in records))


def read_records(path) -> list:
    """The records of a JSON-lines file; a line that is not one names its line number."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        try:
            raw = json.loads(line)
            missing = [f for f in FIELDS if f not in raw]
            if missing:
                raise RecordError(f"missing field {missing[0]!r}")
            out.append(RolloutRecord(**raw))
        except (ValueError, TypeError) as e:
            raise RecordError(f"{path}: line {n}: not a rollout record ({e})") from None
    return out


def check_records(records: list, vocab_size: int, num_loops: int, version: int,
                  temperature: float) -> None:
    """Every record well formed for a trainer at weight ``version`` with ``num_loops`` loops
    and sampling ``temperature`` (``record_problem``); the first problem raised, naming the
    record and its field."""
    for k, r in enumerate(records):
        problem = record_problem(r, vocab_size, num_loops, version, temperature)
        if problem:
            raise RecordError(f"record {k} (group {r.group}): {problem}")


def record_problem(r: RolloutRecord, vocab_size: int, num_loops: int, version: int,
                   temperature: float) -> str:
    """'' when ``r`` is well formed: ids inside the vocabulary, one log-prob and exit depth
    per response token, depths in 1..R, log-probs finite and <= 0, a version not newer than
    the trainer's, raw log-probs only at temperature 1; else its field and what is wrong."""
    for name in ("prompt_ids", "response_ids"):
        ids = getattr(r, name)
        if not ids or any(not isinstance(t, int) or not 0 <= t < vocab_size for t in ids):
            return f"{name} must be a non-empty list of ids in [0, {vocab_size})"
    for name in ("logprobs", "exit_depths"):
        if len(getattr(r, name)) != len(r.response_ids):
            return (f"{name} has {len(getattr(r, name))} entries for {len(r.response_ids)} "
                    f"response tokens")
    if any(not isinstance(d, int) or not 1 <= d <= num_loops for d in r.exit_depths):
        return f"exit_depths must lie in 1..{num_loops}"
    if any(not math.isfinite(x) or x > 0 for x in r.logprobs):
        return "logprobs must be finite and <= 0"
    if not isinstance(r.weight_version, int) or r.weight_version > version:
        return f"weight_version {r.weight_version!r} is newer than the trainer's {version}"
    if r.logprobs_mode not in LOGPROBS_MODES:
        return f"logprobs_mode must be one of {LOGPROBS_MODES}, got {r.logprobs_mode!r}"
    if r.logprobs_mode == "raw" and temperature != 1.0:
        return (f"logprobs_mode 'raw' (temperature 1) cannot be the behaviour of sampling at "
                f"temperature {temperature}")
    return ""


def stale(records: list, version: int, max_lag: int) -> list:
    """The records decoded more than ``max_lag`` versions before ``version``."""
    return [r for r in records if version - r.weight_version > max_lag]


def by_group(records: list) -> list:
    """The records in groups (first appearance order), each group's in file order."""
    groups: dict = {}
    for r in records:
        groups.setdefault(r.group, []).append(r)
    return list(groups.values())
