#!/usr/bin/env bash
# One 8-GPU H20 node: data parallel over 8 ranks (MCore DDP + distributed optimizer), Transformer
# Engine layers in bf16. Needs the gpu extra: pip install -e '.[gpu]' (apex optional, from source).
set -euo pipefail
cd "$(dirname "$0")/.."
torchrun --nproc-per-node 8 -m scalerlt_mcore.train --config configs/h20_8gpu.yaml \
    --save checkpoints/h20 --save-interval 50 "$@"
