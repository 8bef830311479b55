"""The main job (the app floor): entry, arguments, runtime, checkpoints, metrics, trainer.

It wires the library (``model``, ``shared_prefix``, ``rl``) to MCore DDP, the distributed
optimizer and the process groups. Nothing in the library imports from here.
"""
