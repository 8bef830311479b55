"""Run metrics: one JSON line per step, and a PNG of the reward curve at the end."""

import json
from pathlib import Path


class MetricsLog:
    """Appends step records to ``run_dir/metrics.jsonl`` (rank 0 only writes)."""

    def __init__(self, run_dir, enabled: bool = True):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.enabled = enabled
        self.records = []

    def log(self, record: dict) -> None:
        self.records.append(record)
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")


def plot_rewards(records: list, path) -> Path:
    """Reward curve (train mean reward, eval reward) and per-loop eval accuracy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if r.get("kind") == "train"]
    evals = [r for r in records if r.get("kind") == "eval"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot([r["step"] for r in train], [r["reward_mean"] for r in train], label="rollout")
    ax1.plot([r["step"] for r in evals], [r["eval_reward"] for r in evals], "o-", label="eval")
    ax1.set(xlabel="RL step", ylabel="mean reward", ylim=(-0.05, 1.05), title="reward")
    ax1.legend()
    if evals:
        for loop in range(max(len(r["eval_per_loop"]) for r in evals)):  # grows in a curriculum
            points = [(r["step"], r["eval_per_loop"][loop]) for r in evals
                      if loop < len(r["eval_per_loop"])]
            ax2.plot(*zip(*points), "o-", label=f"loop {loop + 1}")
        ax2.legend()
    ax2.set(xlabel="RL step", ylabel="greedy accuracy", ylim=(-0.05, 1.05),
            title="per-loop readout accuracy")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
