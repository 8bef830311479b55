"""Export a trained checkpoint in its public format:
``python -m scalerlt_mcore.export --load CKPT --format hf DIR``.

The model comes from the run config stored in the checkpoint (``--config`` replaces it) and its
weights from the checkpoint; ``model/hf_export.py`` picks the format (Ouro for a
``looped_family`` ouro model, Llama / Qwen2 for a plain one at R = 1) or refuses saying why.
When the run started from ``--pretrained-checkpoint`` and that directory still exists, its
config.json is the base of the one written (fields the model fixes are written over it) and its
tokenizer and remote-code files are copied; else a HF ``--tokenizer-model`` tokenizer.json is.
An Ouro export's ``early_exit_threshold`` is the run's ``rl_exit_threshold``.

    python -m scalerlt_mcore.export --load runs/ouro/ckpt --format hf /tmp/ouro-trained
"""

import argparse
import shutil
import sys
from pathlib import Path

from scalerlt_mcore.app.checkpoint import CheckpointError, load_model_weights
from scalerlt_mcore.app.config import ConfigError
from scalerlt_mcore.app.pretrained import run_vocab_size
from scalerlt_mcore.app.runtime import (
    build_model,
    init_distributed,
    model_config,
    shutdown_distributed,
)
from scalerlt_mcore.generate import run_config
from scalerlt_mcore.model.hf_export import ExportError, save_hf

FORMATS = ("hf",)
"""``--format`` choices: ``hf`` (config.json + safetensors in the model's source format)."""


def parse(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m scalerlt_mcore.export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True, help="checkpoint directory (as --save wrote it)")
    p.add_argument("--format", choices=FORMATS, default="hf", help="output format")
    p.add_argument("--config", help="run config YAML to use instead of the checkpoint's")
    p.add_argument("out", help="output directory")
    return p.parse_args(argv)


def source_dir(cfg):
    """The run's pretrained Hugging Face-style directory, when it still exists."""
    path = cfg.logging.pretrained_checkpoint
    return path if path and (Path(path) / "config.json").is_file() else None


def export_checkpoint(cfg, load, out, device: str = "cpu") -> Path:
    """Library call: the weights of checkpoint ``load`` (a model built by run config ``cfg``
    on ``device``) written to ``out`` in their public format. Needs the process group and
    model-parallel state (``app.runtime.init_distributed``), as the trainer has them."""
    model = build_model(cfg, model_config(cfg, device), run_vocab_size(cfg), device)
    load_model_weights(load, model)
    threshold = cfg.rl.rl_exit_threshold if cfg.model.looped_exit_gate else None
    written = save_hf(model, out, source=source_dir(cfg), exit_threshold=threshold)
    tokenizer = cfg.tokenizer.tokenizer_model
    if (source_dir(cfg) is None and tokenizer and Path(tokenizer).name == "tokenizer.json"
            and Path(tokenizer).is_file()):
        shutil.copyfile(tokenizer, written / "tokenizer.json")
    return written


def main(argv=None) -> None:
    args = parse(sys.argv[1:] if argv is None else argv)
    try:
        cfg = run_config(args)
        device = init_distributed(cfg)
        try:
            out = export_checkpoint(cfg, args.load, args.out, device)
        finally:
            shutdown_distributed()
    except (ConfigError, ExportError, CheckpointError, FileNotFoundError) as e:
        sys.exit(f"error: {e}")
    print(f"exported {args.load} to {out}: " + ", ".join(sorted(p.name for p in out.iterdir())))


if __name__ == "__main__":
    main()
