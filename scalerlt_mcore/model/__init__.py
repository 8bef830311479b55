"""The looped GPT built from Megatron-Core parts (the library's bottom floor)."""

from .attention import LoopedCoreAttention, LoopedSelfAttention
from .block import LinearConcatInjection, LoopedBlockSubmodules, RecurrentTransformerBlock
from .config import LoopedTransformerConfig
from .hf_import import PretrainedArchitecture, looped_gpt_from_hf, read_hf_architecture
from .kv import DepthKVCache, PrefixState
from .looped_gpt import LoopedGPTModel, LoopedOutput
from .retrofit import LayerMapping
from .specs import (
    get_looped_gpt_block_spec,
    get_looped_gpt_layer_local_spec,
    get_looped_gpt_layer_te_spec,
)
from .vocab_parallel import gather_vocab, padded_vocab_size, token_logprobs

__all__ = [
    "DepthKVCache", "LayerMapping", "LinearConcatInjection", "LoopedBlockSubmodules",
    "LoopedCoreAttention", "LoopedGPTModel", "LoopedOutput", "LoopedSelfAttention",
    "LoopedTransformerConfig", "PrefixState", "PretrainedArchitecture",
    "RecurrentTransformerBlock", "gather_vocab", "get_looped_gpt_block_spec",
    "get_looped_gpt_layer_local_spec", "get_looped_gpt_layer_te_spec", "looped_gpt_from_hf",
    "padded_vocab_size", "read_hf_architecture", "token_logprobs",
]
