#!/usr/bin/env bash
# One 8-GPU H20 node: data parallel over 8 ranks (MCore DDP + distributed optimizer), bf16, the
# local spec (Transformer Engine layers with --transformer-impl transformer_engine where the gpu
# extra is installed: pip install -e '.[gpu]').
set -euo pipefail
cd "$(dirname "$0")/.."
torchrun --nproc-per-node 8 -m scalerlt_mcore.train --config configs/h20_8gpu.yaml \
    --save checkpoints/h20 --save-interval 50 "$@"
