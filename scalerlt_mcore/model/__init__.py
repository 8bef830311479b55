"""The looped GPT built from Megatron-Core parts (the library's bottom floor)."""

from .attention import LoopedCoreAttention, LoopedSelfAttention
from .block import LinearConcatInjection, LoopedBlockSubmodules, RecurrentTransformerBlock
from .config import LoopedTransformerConfig
from .kv import DepthKVCache, PrefixState
from .looped_gpt import LoopedGPTModel, LoopedOutput
from .specs import (
    get_looped_gpt_block_spec,
    get_looped_gpt_layer_local_spec,
    get_looped_gpt_layer_te_spec,
)
from .vocab_parallel import gather_vocab, padded_vocab_size, token_logprobs

__all__ = [
    "DepthKVCache", "LinearConcatInjection", "LoopedBlockSubmodules", "LoopedCoreAttention",
    "LoopedGPTModel", "LoopedOutput", "LoopedSelfAttention", "LoopedTransformerConfig",
    "PrefixState", "RecurrentTransformerBlock", "get_looped_gpt_block_spec",
    "gather_vocab", "get_looped_gpt_layer_local_spec", "get_looped_gpt_layer_te_spec",
    "padded_vocab_size", "token_logprobs",
]
