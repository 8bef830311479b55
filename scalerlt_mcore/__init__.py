"""ScaleRLT-MCore: I/O-aware end-to-end RL of recurrent looped transformers on Megatron-Core.

Nothing here patches Megatron-Core at import time: call
``scalerlt_mcore.cpu_backend.enable_cpu_backend()`` explicitly to run on CPU.
"""

__version__ = "0.1.0"
