"""The looped GPT built from Megatron-Core parts (the library's bottom floor)."""

from .attention import LoopedCoreAttention, LoopedSelfAttention
from .block import LinearConcatInjection, LoopedBlockSubmodules, RecurrentTransformerBlock
from .config import LoopedTransformerConfig
from .kv import DepthKVCache, PrefixState
from .looped_gpt import LoopedGPTModel, LoopedOutput, token_logprobs
from .specs import (
    get_looped_gpt_block_spec,
    get_looped_gpt_layer_local_spec,
    get_looped_gpt_layer_te_spec,
)

__all__ = [
    "DepthKVCache", "LinearConcatInjection", "LoopedBlockSubmodules", "LoopedCoreAttention",
    "LoopedGPTModel", "LoopedOutput", "LoopedSelfAttention", "LoopedTransformerConfig",
    "PrefixState", "RecurrentTransformerBlock", "get_looped_gpt_block_spec",
    "get_looped_gpt_layer_local_spec", "get_looped_gpt_layer_te_spec", "token_logprobs",
]
