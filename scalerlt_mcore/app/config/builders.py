"""One builder per library object from the run's config; each key reaches the library
through exactly one of them: ``model_config`` (``looped_*`` and Megatron model keys ->
``LoopedTransformerConfig``), ``objective_from`` (``OBJECTIVE_FLAGS`` -> ``RLObjective``),
``schedule_from`` (``SCHEDULE_FLAGS`` -> the shared-prefix schedule and its ``Planner``),
``sampling_from`` (``SAMPLING_FLAGS`` -> ``Sampling``, how rollouts draw tokens),
``task_from`` and ``tokenizer_from``. The checks (``validate``) build the same objects, so
each library check is written once, in the library."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F

from ...model.config import LoopedTransformerConfig
from ...rl.objective import RLObjective
from ...rl.rollout import Sampling
from ...rl.task_registry import get_task
from ...rl.tokenizer import build_tokenizer
from ...shared_prefix import get_shared_prefix_forward_backward_func
from ...shared_prefix.planner import shared_cost_model
from .library import OBJECTIVE_FLAGS, SAMPLING_FLAGS, SCHEDULE_FLAGS, to_dict

if TYPE_CHECKING:
    from .model import ModelArgs
    from .run import RunConfig


def looped_kwargs(cfg: RunConfig) -> dict:
    """The model section's values that are ``LoopedTransformerConfig`` fields (MCore's and
    the ``looped_*`` ones), by name."""
    names = {f.name for f in dataclasses.fields(LoopedTransformerConfig)}
    return {k: v for k, v in dataclasses.asdict(cfg.model).items() if k in names}


def model_config(cfg: RunConfig, device: str) -> LoopedTransformerConfig:
    """The MCore ``TransformerConfig`` (with ``looped_*`` fields) of a run; needs no process
    group, so ``validate`` builds it too."""
    m = cfg.model
    dtype = torch.bfloat16 if m.bf16 else torch.float16 if m.fp16 else torch.float32
    return LoopedTransformerConfig(**looped_kwargs(cfg), **_megatron_model_kwargs(m),
                                   calculate_per_token_loss=cfg.rl.calculate_per_token_loss,
                                   params_dtype=dtype, pipeline_dtype=dtype,
                                   use_cpu_initialization=device == "cpu",
                                   perform_initialization=True)


def _megatron_model_kwargs(m: ModelArgs) -> dict:
    """Megatron-LM flags whose TransformerConfig field has another name or form."""
    return dict(layernorm_epsilon=m.norm_epsilon, gated_linear_unit=m.swiglu,
                activation_func=F.silu if m.swiglu else F.gelu,
                add_bias_linear=not m.disable_bias_linear)


def library_kwargs(cfg: RunConfig, flags: dict[str, str]) -> dict:
    """``{library name: value of its key}`` for the keys of ``{key: library name}``."""
    flat = to_dict(cfg)
    return {name: flat[key] for key, name in flags.items()}


def objective_from(cfg: RunConfig) -> RLObjective:
    """The run's RL loss (``OBJECTIVE_FLAGS``)."""
    return RLObjective(**library_kwargs(cfg, OBJECTIVE_FLAGS))


def sampling_from(cfg: RunConfig, loop: int = -1, **given) -> Sampling:
    """How the run's rollouts draw tokens (``SAMPLING_FLAGS``); ``given``: the other
    ``Sampling`` fields (the generator, the banned ids, the vocabulary size) and a call's own
    values (e.g. temperature 0: greedy). A readout ``loop`` other than the last (-1) samples
    from that loop alone: no exit mode."""
    kwargs = library_kwargs(cfg, SAMPLING_FLAGS)
    if loop != -1:
        kwargs["exit_mode"] = "none"
    return Sampling(**{**kwargs, **given}, loop=loop)


def schedule_from(cfg: RunConfig, model=None, loss_per_position: Optional[float] = None,
                  max_response_length: Optional[int] = None,
                  default_budget: Optional[float] = None):
    """The run's shared-prefix schedule and its planner (``SCHEDULE_FLAGS``): the memory
    budget in bytes, the loss's saved bytes per position (``loss_per_position``, by default
    the run's ``RLObjective.saved_per_position``) and, with ``shared_prefix_schedule: auto``,
    the cost model measured on ``model`` (on rank 0, shared by every rank; without a model,
    measured at the first plan). ``max_response_length``: the most positions after the prompt
    (default ``rl_max_response_length``; a multi-turn tree's path holds every turn and
    reply); ``default_budget``: the budget in bytes where the run sets none (on a GPU, what
    the device has left beside the model state: ``plan.device_budget``)."""
    kwargs = library_kwargs(cfg, SCHEDULE_FLAGS)
    if max_response_length is not None:
        kwargs["max_response_length"] = max_response_length
    if kwargs["memory_budget"] is not None:
        kwargs["memory_budget"] *= 2**20  # MiB -> bytes
    else:
        kwargs["memory_budget"] = default_budget
    if kwargs["schedule"] == "auto":
        kwargs["cost_model"] = shared_cost_model if model is None else shared_cost_model(model)
    if loss_per_position is None:
        loss_per_position = objective_from(cfg).saved_per_position
    return get_shared_prefix_forward_backward_func(**kwargs, loss_per_position=loss_per_position)


def task_from(cfg: RunConfig):
    """The run's task (a dataset task scored by ``rl_reward``)."""
    return get_task(cfg.rl.rl_task, rl_reward=cfg.rl.rl_reward, **cfg.rl.rl_task_options)


@functools.lru_cache(maxsize=4)
def _tokenizer(tokenizer_type: str, tokenizer_model: Optional[str]):
    return build_tokenizer(tokenizer_type, tokenizer_model)


def tokenizer_from(cfg: RunConfig):
    """The run's tokenizer (built once per process for each type and model)."""
    return _tokenizer(*tokenizer_args(cfg))


def tokenizer_args(cfg: RunConfig) -> tuple[str, Optional[str]]:
    """(tokenizer_type, tokenizer_model) of the run: the flags, and where they are unset the
    tokenizer.json of a Hugging Face ``pretrained_checkpoint`` (else ``CharTokenizer``); a
    ``tokenizer_model`` alone means ``HuggingFaceTokenizer``."""
    kind, model = cfg.tokenizer.tokenizer_type, cfg.tokenizer.tokenizer_model
    pretrained = pretrained_tokenizer_json(cfg.logging.pretrained_checkpoint)
    if kind is None:
        kind = "HuggingFaceTokenizer" if model or pretrained else "CharTokenizer"
    if kind == "HuggingFaceTokenizer" and model is None:
        model = pretrained
    return kind, model


def pretrained_tokenizer_json(path: Optional[str]) -> Optional[str]:
    """The tokenizer.json of a Hugging Face checkpoint directory (config.json beside it), or
    None."""
    root = Path(path) if path else None
    if root is None or not (root / "config.json").is_file():
        return None
    file = root / "tokenizer.json"
    return str(file) if file.is_file() else None


def prompts_per_step(cfg: RunConfig) -> int:
    """Prompts per RL step over all data-parallel ranks."""
    return cfg.rl.grpo_prompts_per_step or cfg.training.global_batch_size // cfg.rl.grpo_group_size


def eval_prompts(cfg: RunConfig) -> int:
    """Held-out prompts per evaluation: ``eval_iters`` batches of ``prompts_per_step``."""
    return cfg.training.eval_iters * prompts_per_step(cfg)
