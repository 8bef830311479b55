"""Tiny models of every family the planner is held against (the GPT layout, the exit gate and
the public families from random checkpoints), each buildable with a recompute setting, and
MCore's recompute settings by name."""

import tempfile

import torch

from helpers.exit_gate import _gated
from helpers.reference_huginn import write_huginn_checkpoint, write_retrofit_checkpoint
from helpers.reference_nanbeige import write_nanbeige_checkpoint
from helpers.reference_ouro import write_ouro_checkpoint
from helpers.sp import build_model
from scalerlt_mcore.model.looped_import import looped_gpt_from_pretrained

SETTINGS = {
    "full-uniform-1": dict(recompute_granularity="full", recompute_method="uniform",
                           recompute_num_layers=1),
    "full-uniform-2": dict(recompute_granularity="full", recompute_method="uniform",
                           recompute_num_layers=2),
    "full-block-1": dict(recompute_granularity="full", recompute_method="block",
                         recompute_num_layers=1),
    "selective": dict(recompute_granularity="selective"),  # MCore's default: core_attn
}


def _family(write, dtype, **config):
    """A tiny random checkpoint of a public family, imported with ``config``, in ``dtype``."""
    def build():
        with tempfile.TemporaryDirectory() as d:
            write(d)
            return looped_gpt_from_pretrained(d, use_cpu_initialization=True, **config).to(dtype)
    return build


def _gpt(dtype, **kw):
    return lambda **setting: build_model(hidden=32, heads=4, **kw, **setting).to(dtype)


BUILDERS = {
    "arch-f32": _gpt(torch.float32, R=2, arch=True),
    "arch-concat-bf16": _gpt(torch.bfloat16, R=2, arch=True, attn="concat"),
    "rms-gqa-f32": _gpt(torch.float32, R=2, num_query_groups=2, layers=3,
                        normalization="RMSNorm"),
    "truncated-arch-bf16": _gpt(torch.bfloat16, R=3, arch=True, looped_backprop_loops=2),
    "exit-gate-f32": lambda **s: _gated(R=3, hidden=32, heads=4, **s),
    "exit-gate-truncated-bf16": lambda **s: _gated(R=3, hidden=32, heads=4,
                                                   looped_backprop_loops=2, **s).to(
                                                       torch.bfloat16),
    "ouro-f32": lambda **s: _family(write_ouro_checkpoint, torch.float32, **s)(),
    "ouro-bf16": lambda **s: _family(write_ouro_checkpoint, torch.bfloat16, **s)(),
    "huginn-truncated-f32": lambda **s: _family(write_huginn_checkpoint, torch.float32,
                                                looped_backprop_loops=1, **s)(),
    "huginn-bf16": lambda **s: _family(write_huginn_checkpoint, torch.bfloat16, **s)(),
    "retrofit-f32": lambda **s: _family(write_retrofit_checkpoint, torch.float32, **s)(),
    "retrofit-bf16": lambda **s: _family(write_retrofit_checkpoint, torch.bfloat16, **s)(),
    "nanbeige-f32": lambda **s: _family(write_nanbeige_checkpoint, torch.float32, **s)(),
    "nanbeige-bf16": lambda **s: _family(write_nanbeige_checkpoint, torch.bfloat16, **s)(),
}
