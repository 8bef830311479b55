"""The public looped checkpoints' real shapes (config.json, no weights) for the 8 x H20 configs."""
import json
from pathlib import Path

from helpers.reference_huginn import HUGINN_CONFIG
from helpers.reference_nanbeige import NANBEIGE_42_3B
from helpers.reference_ouro import OURO_CONFIG
from helpers.tokenizer_files import train_bpe

REPO = Path(__file__).resolve().parents[2]

OURO_1_4B = {**OURO_CONFIG, "vocab_size": 49152, "hidden_size": 2048, "intermediate_size": 5632,
             "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
             "head_dim": 128, "max_position_embeddings": 65536, "rope_theta": 1000000.0,
             "layer_types": ["full_attention"] * 24, "max_window_layers": 24,
             "total_ut_steps": 4, "torch_dtype": "bfloat16"}
"""Ouro-1.4B's config.json (its shape)."""

HUGINN_0125 = {**HUGINN_CONFIG, "n_embd": 5280, "n_heads": 55, "n_layers": 8, "block_size": 4096,
               "vocab_size": 65536, "intermediate_size": 17920, "n_layers_in_recurrent_block": 4,
               "n_layers_in_prelude": 2, "n_layers_in_coda": 2, "mean_recurrence": 32,
               "mean_backprop_depth": 8, "torch_dtype": "bfloat16"}
"""Huginn-0125's config.json (its shape)."""

CONFIGS = {"ouro_1.4b_h20.yaml": (OURO_1_4B, 1.43e9), "huginn_0125_h20.yaml": (HUGINN_0125, 3.56e9),
           "nanbeige_4.2_3b_h20.yaml": (NANBEIGE_42_3B, 4.17e9)}
"""Config -> (the config.json it launches, its parameter count to 1%)."""

def checkpoint_dir(tmp_path, config_json: dict):
    """A checkpoint directory without weights: the config.json and a small tokenizer.json."""
    (tmp_path / "config.json").write_text(json.dumps(config_json))
    train_bpe(tmp_path / "tokenizer.json")
    return tmp_path
