"""The looped GPT built from Megatron-Core parts."""

from .attention import LoopedCoreAttention, LoopedSelfAttention
from .block import RecurrentTransformerBlock
from .kv import DepthKVCache, PrefixState
from .looped_gpt import LoopedGPTModel, LoopedOutput, token_logprobs
from .specs import get_looped_gpt_layer_local_spec, get_looped_gpt_layer_te_spec

__all__ = [
    "DepthKVCache", "LoopedCoreAttention", "LoopedGPTModel", "LoopedOutput",
    "LoopedSelfAttention", "PrefixState", "RecurrentTransformerBlock",
    "get_looped_gpt_layer_local_spec", "get_looped_gpt_layer_te_spec", "token_logprobs",
]
