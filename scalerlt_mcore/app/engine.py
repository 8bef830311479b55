"""Rollouts from a serving engine in another process (``--rl-rollout-source engine``), through
one directory (``--rl-engine-dir``): the trainer publishes weight versions to ``weights/``
(``rl/publish.py``), asks for each RL step's rollouts with a request file
``requests/step{step}-rank{rank}.json`` (the step, the problems' seed and count, G, the oldest
weight version allowed) and reads the answer, rollout records (``rl/records.py``), from
``records/`` under the same name.

``python -m scalerlt_mcore.engine`` with the run's flags is such an engine: the project's own
decoder behind the contract. It waits for a version at least as new as a request allows,
loads it, draws the request's problems and decodes them as the in-process trainer does (the
same code, the requesting rank's generator seeds), so with lag 0 a run gets the in-process
run's rollouts bit for bit; it stops at ``stop`` in the directory. With lag 1 the trainer asks
for step k + 1 before it trains step k: the engine decodes the next batch with the current
weights while the trainer trains.
"""

import json
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from ..model.config import step_seed
from ..rl.publish import latest_version, read_version, write_atomic
from ..rl.records import (
    RecordError,
    RolloutRecord,
    by_group,
    check_records,
    read_records,
    write_records,
)
from ..rl.records import stale as stale_records
from ..rl.rollout import Rollout

POLL_S = 0.05


def _name(step: int, rank: int) -> str:
    return f"step{step:08d}-rank{rank}"


def _wait(what: str, ready, timeout_s: float):
    """``ready()`` once it is not None, polling; a ``TimeoutError`` naming ``what`` after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = ready()
        if value is not None:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout_s:.0f} s for {what}")
        time.sleep(POLL_S)


# ---- the trainer's side -----------------------------------------------------------------------


class EngineClient:
    """A trainer rank's requests and the records that answer them. A run starts from no
    request and no record of an earlier run (a resumed run asks again)."""

    def __init__(self, root, rank: int, timeout_s: float):
        self.root, self.rank, self.timeout_s = Path(root), rank, timeout_s
        for sub in ("requests", "records", "weights"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        for sub in ("requests", "records"):
            for old in (self.root / sub).glob(f"step*-rank{rank}.json*"):
                old.unlink()
        (self.root / "stop").unlink(missing_ok=True)
        self.asked: set = set()

    @property
    def weights(self) -> Path:
        return self.root / "weights"

    def version(self) -> int:
        """The newest published weight version (what the trainer holds)."""
        return latest_version(self.weights) or 0

    def request(self, step: int, seed: int, count: int, group_size: int,
                min_version: int) -> None:
        """Ask for step ``step``'s rollouts (once)."""
        if step in self.asked:
            return
        self.asked.add(step)
        write_atomic(self.root / "requests" / f"{_name(step, self.rank)}.json", json.dumps(
            {"step": step, "rank": self.rank, "seed": seed, "count": count,
             "group_size": group_size, "min_version": min_version}))

    def records(self, step: int) -> list:
        """The records answering step ``step`` (waiting for them)."""
        path = self.root / "records" / f"{_name(step, self.rank)}.jsonl"
        return _wait(f"the engine's rollouts of step {step} ({path})",
                     lambda: read_records(path) if path.is_file() else None, self.timeout_s)

    def stop(self) -> None:
        (self.root / "stop").touch()


def rollout_of(records: list, prompts: list, group_size: int, pad_id: int,
               num_loops: int) -> Rollout:
    """A ``Rollout`` of the records of one step: their groups are the step's problems in
    order (each one's prompt ``prompts[n]``, ``group_size`` responses); the behaviour
    log-probs are its ``logprobs`` and, as one loop, its ``loop_logprobs`` [1, N, G, S]; its
    ``exit_depths`` the records' where a token exited before ``num_loops`` (else None)."""
    groups = by_group(records)
    if len(groups) != len(prompts):
        raise RecordError(f"the engine returned {len(groups)} groups for {len(prompts)} "
                          f"prompts")
    S = max(len(r.response_ids) for r in records)
    N, G = len(prompts), group_size
    host = torch.device("cpu")  # a rollout's tensors are on the host, as generate returns them
    responses = torch.full((N, G, S), pad_id, dtype=torch.long, device=host)
    logprobs = torch.zeros(N, G, S, dtype=torch.float32, device=host)
    lengths = torch.zeros(N, G, dtype=torch.long, device=host)
    depths = torch.zeros(N, G, S, dtype=torch.long, device=host)
    for n, (group, prompt) in enumerate(zip(groups, prompts)):
        if len(group) != G or any(r.prompt_ids != list(prompt) for r in group):
            raise RecordError(f"group {group[0].group}: {len(group)} responses to the prompt "
                              f"of problem {n} expected {G}, every one with its prompt ids")
        for g, r in enumerate(group):
            L = len(r.response_ids)
            responses[n, g, :L] = torch.tensor(r.response_ids, device=host)
            logprobs[n, g, :L] = torch.tensor(r.logprobs, dtype=torch.float32, device=host)
            depths[n, g, :L] = torch.tensor(r.exit_depths, dtype=torch.long, device=host)
            lengths[n, g] = L
    early = bool((depths[depths > 0] < num_loops).any())
    return Rollout(prompts, responses, lengths, logprobs, logprobs[None],
                   exit_depths=depths if early else None)


def usable(records: list, version: int, max_lag: int, policy: str, step: int) -> list:
    """The records within ``max_lag`` versions of ``version``: stale ones refused (one line)
    or, with ``policy`` drop, left out with their whole group (none left: refused)."""
    old = stale_records(records, version, max_lag)
    if not old:
        return records
    worst = min(r.weight_version for r in old)
    if policy == "refuse":
        raise RecordError(f"step {step}: {len(old)} record(s) decoded by weight version "
                          f"{worst}, more than rl_max_policy_lag {max_lag} behind the "
                          f"trainer's {version}")
    dropped = {r.group for r in old}
    kept = [r for r in records if r.group not in dropped]
    if not kept:
        raise RecordError(f"step {step}: every group is older than rl_max_policy_lag "
                          f"{max_lag} (weight version {worst}, the trainer's {version})")
    return kept


# ---- the engine's side ------------------------------------------------------------------------


def records_of(ro: Rollout, version: int, sampling: dict, num_loops: int) -> list:
    """One ``RolloutRecord`` per response of a rollout (each group's ``group`` its index),
    decoded by ``version``: its tokens' exit depths (``Rollout.exit_depths``), or
    ``num_loops`` for every token decoded at full depth."""
    out = []
    N, G = ro.lengths.shape
    for n in range(N):
        for g in range(G):
            L = int(ro.lengths[n, g])
            out.append(RolloutRecord(
                group=n, prompt_ids=[int(t) for t in ro.prompts[n]],
                response_ids=ro.responses[n, g, :L].tolist(),
                logprobs=ro.logprobs[n, g, :L].tolist(),
                exit_depths=([num_loops] * L if ro.exit_depths is None
                             else ro.exit_depths[n, g, :L].tolist()),
                weight_version=version, sampling_params=sampling))
    return out


class Engine:
    """The project's decoder serving requests (``serve``) with published weights."""

    def __init__(self, cfg, worker, root):
        self.cfg, self.worker, self.root = cfg, worker, Path(root)
        self.loaded: Optional[int] = None
        (self.root / "stop").unlink(missing_ok=True)  # a stop left by an earlier run

    def load(self, version: int) -> None:
        """Published ``version`` into the decoder's model (bitwise the trainer's weights)."""
        if version == self.loaded:
            return
        from .pretrained import load_pretrained

        _, tensors, config = read_version(self.root / "weights", version)
        model = self.worker.model
        if config.get("scalerlt_mcore"):
            missing, unexpected = model.load_state_dict(tensors, strict=False)
            missing = [k for k in missing if not k.endswith("_extra_state")]
            if missing or unexpected:
                raise RecordError(f"weight version {version} does not fit the model: "
                                  f"{(missing + unexpected)[0]}")
        else:
            import copy

            cfg = copy.deepcopy(self.cfg)
            cfg.logging.pretrained_checkpoint = str(self.root / "weights" / f"v{version:08d}")
            load_pretrained(cfg, model)
        self.loaded = version

    def serve(self, request: dict) -> Path:
        """Answer one request -> the records file written (then the request is removed)."""
        w = self.worker
        version = _wait(f"weight version {request['min_version']}",
                        lambda: _at_least(self.root / "weights", request["min_version"]),
                        self.timeout_s)
        self.load(version)
        step = request["step"]
        w.rank = request["rank"]  # the requesting rank's generator seeds
        loops = w.start_step(step)
        problems = w.task.sample(request["seed"], request["count"])
        ro = w.rollout(step, problems, request["group_size"], num_loops=loops,
                       exit_kv=self.cfg.rl.rl_rollout_exit == "threshold")
        sampling = {"seed": step_seed(self.cfg.training.seed, step, w.rank, 7),
                    "temperature": self.cfg.rl.rl_temperature, "top_p": self.cfg.rl.rl_top_p,
                    "max_tokens": self.cfg.rl.rl_max_response_length}
        path = self.root / "records" / f"{_name(step, w.rank)}.jsonl"
        write_records(path, records_of(ro, version, sampling, loops))
        return path

    @property
    def timeout_s(self) -> float:
        return timeout_s(self.cfg)

    def run(self) -> int:
        """Serve requests in step order until ``stop`` appears -> requests served."""
        served, idle = 0, time.monotonic()
        while not (self.root / "stop").exists():
            pending = sorted((self.root / "requests").glob("step*.json"))
            if not pending:
                if time.monotonic() - idle > self.timeout_s:
                    raise TimeoutError(f"no request for {self.timeout_s:.0f} s")
                time.sleep(POLL_S)
                continue
            self.serve(json.loads(pending[0].read_text()))
            pending[0].unlink()
            served, idle = served + 1, time.monotonic()
        return served


def timeout_s(cfg) -> float:
    """How long either side waits for the other: the run's distributed timeout."""
    return 60.0 * cfg.training.distributed_timeout_minutes


def _at_least(weights: Path, version: int) -> Optional[int]:
    latest = latest_version(weights)
    return latest if latest is not None and latest >= version else None


def check_engine_records(records: list, worker, version: int, num_loops: int) -> None:
    """``check_records`` at the trainer's vocabulary, loops, version and temperature."""
    check_records(records, worker.tok.vocab_size, num_loops, version,
                  worker.cfg.rl.rl_temperature)
    weights = worker.objective.loop_weights
    early = next((r for r in records if any(d != num_loops for d in r.exit_depths)), None)
    if early is not None and weights != "final":
        raise RecordError(f"record of group {early.group}: exit depths below the loop count "
                          f"({num_loops}) are replayed at each token's own loop: they need "
                          f"rl_loop_weights final, got {weights!r}")


def main(argv=None) -> int:
    """``python -m scalerlt_mcore.engine [training flags]``: serve ``--rl-engine-dir``."""
    from .config import parse_args, validate
    from .pretrained import resolve_pretrained, run_vocab_size
    from .runtime import build_model, init_distributed, model_config, shutdown_distributed
    from .train import USER_ERRORS, exit_with_error, quiet_library_warnings
    from .trainer import RLTrainer

    quiet_library_warnings()
    try:
        cfg = parse_args(sys.argv[1:] if argv is None else argv)
        resolve_pretrained(cfg)
        validate(cfg, 1)
    except USER_ERRORS as e:
        exit_with_error(e)
    if cfg.rl.rl_engine_dir is None:
        exit_with_error(ValueError("the engine serves --rl-engine-dir: give it"))
    device = init_distributed(cfg)
    try:
        model = build_model(cfg, model_config(cfg, device), run_vocab_size(cfg), device)
        worker = RLTrainer(cfg, model, None, None, None, publish=False)
        served = Engine(cfg, worker, cfg.rl.rl_engine_dir).run()
        print(f"engine: served {served} request(s)", flush=True)
    finally:
        shutdown_distributed()
    return 0
