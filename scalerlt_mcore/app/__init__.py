"""The main job (the app floor): entry, arguments, runtime, checkpoints, metrics, trainer.

It wires the library (``model``, ``shared_prefix``, ``rl``) to MCore DDP, the distributed
optimizer and the process groups. Nothing in the library imports from here.
"""

from scalerlt_mcore.mcore_compat import quiet_fallback_warnings

quiet_fallback_warnings()  # before the app imports MCore: train.py says it once
