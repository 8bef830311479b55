"""Runs of the main job in tests: the tiny config (tests/configs/e2e_tiny.yaml) and flags over
it, subprocess runs of ``python -m scalerlt_mcore.train`` and their metrics, and the trainer
built in process as ``train.run`` builds it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import yaml

from scalerlt_mcore.app.config import load_config, parse_args, to_dict, validate
from scalerlt_mcore.app.trainer import TIMED_METRICS

TINY_YAML = Path(__file__).resolve().parents[1] / "configs" / "e2e_tiny.yaml"
TINY = to_dict(load_config(TINY_YAML))
SFT = TINY["rl_warmup_sft_steps"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
TRAIN = [sys.executable, "-m", "scalerlt_mcore.train"]


def _flags(**overrides) -> list:
    """The tiny config file, and ``overrides`` as command-line flags."""
    out = ["--config", str(TINY_YAML)]
    for key, value in overrides.items():
        if isinstance(value, bool):
            value = str(value).lower()
        elif isinstance(value, dict):
            value = yaml.safe_dump(value, default_flow_style=True).strip()
        out += ["--" + key.replace("_", "-"), str(value)]
    return out


def _run(cmd: list, cwd, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=ENV, capture_output=True, text=True,
                          timeout=timeout)


def _untimed(record: dict, *drop: str) -> dict:
    """``record`` without what reads the clock (and the keys ``drop``)."""
    from scalerlt_mcore.app.metrics import CLOCK_KEYS

    return {k: v for k, v in record.items() if k not in TIMED_METRICS + CLOCK_KEYS + drop}


def _records(run_dir) -> list:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _trainer(argv: list, gpu: bool = False):
    """``RLTrainer`` on the current MCore state, built as ``train.run`` builds it (its config
    validated as for a run on GPUs with ``gpu``)."""
    from scalerlt_mcore.app import runtime
    from scalerlt_mcore.app.pretrained import run_vocab_size
    from scalerlt_mcore.app.trainer import RLTrainer

    cfg = parse_args(argv)
    validate(cfg, torch.distributed.get_world_size(), gpu=gpu)
    config = runtime.model_config(cfg, "cpu")
    model = runtime.build_model(cfg, config, run_vocab_size(cfg), "cpu")
    return RLTrainer(cfg, model, *runtime.wrap_for_training(cfg, config, model))


# small steps: 2 prompts x 4 responses, 2 evaluation prompts, no periodic evaluation
FAST = _flags(global_batch_size=8, eval_iters=1, eval_interval=0)

# torchrun's multi-node form on one host: two rendezvous processes, one rank each
TWO_NODES = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d"]
