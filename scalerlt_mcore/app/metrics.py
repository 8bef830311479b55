"""Run metrics: one JSON line per step in ``metrics.jsonl`` (with wall-clock time), optional
TensorBoard scalars and Weights & Biases run, and a PNG of the reward curve at the end, drawn
from the whole file (a resumed run that continues its run directory plots the whole run)."""

import importlib.util
import json
import time
from pathlib import Path
from typing import Optional

from .config import ConfigError, to_dict

CLOCK_KEYS = ("time", "step_ms")
"""Keys ``MetricsLog`` and the loop add that read the clock."""


class MetricsLog:
    """Appends step records to ``run_dir/metrics.jsonl`` (rank 0 only writes), each with its
    wall-clock ``time`` (seconds since the epoch); with ``tensorboard_dir`` also writes every
    number of a record as a TensorBoard scalar ``<kind>/<key>`` at its step (per-loop
    accuracies as ``eval/loop_<k>``); with ``wandb`` (``wandb.init`` arguments,
    ``wandb_settings``) logs the same scalars to a W&B run. A run starting at step ``start``
    first drops the file's records from ``start`` on (a fresh run: all of them), which a
    resumed run writes again; ``dropped`` counts them."""

    def __init__(self, run_dir, enabled: bool = True, start: int = 0,
                 tensorboard_dir: Optional[str] = None, wandb: Optional[dict] = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.enabled = enabled
        self.records = []
        self.dropped = keep_records_before(self.path, start) if enabled else 0
        self.writer = _summary_writer(tensorboard_dir) if enabled and tensorboard_dir else None
        self.wandb = _wandb_run(wandb, run_dir) if enabled and wandb else None

    def log(self, record: dict) -> None:
        record = {**record, "time": round(time.time(), 3)}
        self.records.append(record)
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for tag, value in scalars(record).items():
                self.writer.add_scalar(tag, value, record["step"])
        if self.wandb is not None:
            self.wandb.log(scalars(record), step=record["step"])

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()


def wandb_settings(cfg) -> Optional[dict]:
    """``wandb.init`` arguments of a run (Megatron-LM's flags: ``--wandb-project``,
    ``--wandb-exp-name``, ``--wandb-save-dir``; the run's config as the W&B config), or None
    without ``--wandb-project``."""
    lg = cfg.logging
    if not lg.wandb_project:
        return None
    return {"project": lg.wandb_project, "name": lg.wandb_exp_name, "dir": lg.wandb_save_dir,
            "config": to_dict(cfg)}


def check_wandb(cfg) -> None:
    """Refuse ``--wandb-project`` when the wandb package is missing (before the run starts)."""
    if cfg.logging.wandb_project and importlib.util.find_spec("wandb") is None:
        raise ConfigError("wandb_project: needs the wandb package (the wandb extra: "
                          "pip install -e '.[wandb]')")


def _wandb_run(settings: dict, run_dir):
    import wandb

    directory = Path(settings["dir"] or run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    return wandb.init(**{**settings, "dir": str(directory)})


def _summary_writer(log_dir: str):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:  # torch's writer needs the tensorboard package
        raise RuntimeError("tensorboard_dir needs the tensorboard package "
                           "(pip install tensorboard)") from e
    return SummaryWriter(log_dir=log_dir)


def scalars(record: dict) -> dict:
    """``{tag: number}`` of a record: ``<kind>/<key>`` for each number (the wall-clock time
    aside), ``eval/loop_<k>`` for each loop's greedy accuracy (k from 1)."""
    kind = record.get("kind", "train")
    out = {f"{kind}/{k}": float(v) for k, v in record.items()
           if k not in ("step", "time") and isinstance(v, (int, float))
           and not isinstance(v, bool)}
    for k, acc in enumerate(record.get("eval_per_loop", []), start=1):
        out[f"{kind}/loop_{k}"] = float(acc)
    return out


def read_records(path) -> list:
    """The records of a ``metrics.jsonl`` file; none when it does not exist."""
    path = Path(path)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _before(record: dict, start: int) -> bool:
    """Whether ``record`` precedes a checkpoint of step ``start``: steps before it, and the
    evaluation after its last step (a run from step 0 evaluates step 0 itself)."""
    if record.get("kind") == "eval":
        return 0 < start and record["step"] <= start
    return record["step"] < start


def keep_records_before(path, start: int) -> int:
    """Rewrite ``path`` keeping the records that precede step ``start``; returns how many
    were dropped."""
    records = read_records(path)
    kept = [r for r in records if _before(r, start)]
    if len(kept) < len(records):
        Path(path).write_text("".join(json.dumps(r) + "\n" for r in kept))
    return len(records) - len(kept)


def plot_rewards(records: list, path) -> Path:
    """Reward curve (sampled rollout reward, held-out greedy reward) and per-loop held-out
    greedy accuracy, over the steps; a dashed line marks the end of the supervised warm-up."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    warmup = [r["step"] for r in records if r.get("kind") == "sft"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot([r["step"] for r in train], [r["reward_mean"] for r in train],
             label="sampled rollouts (training prompts)")
    ax1.plot([r["step"] for r in evals], [r["eval_reward"] for r in evals], "o-",
             label="held-out greedy")
    ax1.set(xlabel="step", ylabel="mean reward", ylim=(-0.05, 1.05), title="reward")
    if evals:
        for loop in range(max(len(r["eval_per_loop"]) for r in evals)):  # grows in a curriculum
            points = [(r["step"], r["eval_per_loop"][loop]) for r in evals
                      if loop < len(r["eval_per_loop"])]
            ax2.plot(*zip(*points), "o-", label=f"loop {loop + 1}")
    ax2.set(xlabel="step", ylabel="greedy accuracy", ylim=(-0.05, 1.05),
            title="per-loop held-out greedy accuracy")
    for ax in (ax1, ax2):
        if warmup:
            ax.axvline(max(warmup) + 1, color="gray", linestyle="--",
                       label=f"end of warm-up (step {max(warmup) + 1})")
        if ax.lines:
            ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
