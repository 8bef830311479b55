"""Import the weights of a stock MCore ``GPTModel`` distributed checkpoint.

Stock checkpoints stack the layers (``decoder.layers.<name>`` with a leading layer axis) and
use Transformer Engine names for fused norms, unlike the looped model's per-layer keys. So the
loader is stock MCore itself: a ``GPTModel`` of the same layer shapes and the source's N layers
(local spec) loads the checkpoint with ``dist_checkpointing.load`` -- tensor-parallel shards
included -- and its ``state_dict()`` (``decoder.layers.<i>.*``) goes through
``retrofit_state_dict`` into the looped model. A Megatron-LM checkpoint root
(``latest_checkpointed_iteration.txt``) resolves to its latest iteration.
"""

import dataclasses
from pathlib import Path

from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig

LAYER_PROBE = "decoder.layers.self_attention.linear_proj.weight"
"""A stacked per-layer tensor every GPTModel checkpoint has: its first dim is N."""


def is_dist_checkpoint(path) -> bool:
    """True for an MCore distributed checkpoint directory (or a Megatron-LM root of one)."""
    return (resolve_dist_checkpoint(path) / "metadata.json").is_file()


def resolve_dist_checkpoint(path) -> Path:
    """A Megatron-LM root (``latest_checkpointed_iteration.txt``) -> its latest iteration."""
    root = Path(path)
    tracker = root / "latest_checkpointed_iteration.txt"
    if not tracker.is_file():
        return root
    it = tracker.read_text().strip()
    return root / ("release" if it == "release" else f"iter_{int(it):07d}")


def tensor_shapes(path) -> dict:
    """Global shape of every tensor in distributed checkpoint ``path``."""
    meta = dist_checkpointing.load_tensors_metadata(str(resolve_dist_checkpoint(path)))
    return {key: tuple(t.global_shape) for key, t in meta.items()}


def source_layers(path) -> int:
    """N: the layers of the GPTModel saved in ``path``."""
    shapes = tensor_shapes(path)
    if LAYER_PROBE not in shapes:
        raise ValueError(f"{path} is not a stock MCore GPTModel checkpoint: it has no "
                         f"{LAYER_PROBE!r} (stacked layers)")
    return shapes[LAYER_PROBE][0]


def stock_gpt_model(model, num_layers: int) -> GPTModel:
    """A stock ``GPTModel`` with ``model``'s layer shapes and embeddings and ``num_layers``."""
    config = model.config
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(TransformerConfig)
              if f.init}
    stock = TransformerConfig(**{**fields, "num_layers": num_layers})
    return GPTModel(
        stock, get_gpt_layer_local_spec(normalization=config.normalization),
        vocab_size=model.vocab_size, max_sequence_length=model.max_sequence_length,
        position_embedding_type=model.position_embedding_type,
        share_embeddings_and_output_weights=model.share_embeddings_and_output_weights,
    )


def shape_differences(path, gpt: GPTModel) -> list:
    """'<tensor>: checkpoint <shape> != model <shape>' for every differing or missing tensor."""
    saved = {k: v for k, v in tensor_shapes(path).items() if not k.startswith("optimizer.")}
    sharded = gpt.sharded_state_dict()
    apply_factories(sharded)  # e.g. SwiGLU's fc1, saved as two tensors
    mine = {t.key: tuple(t.global_shape) for t in nested_values(sharded)
            if isinstance(t, ShardedTensor)}
    return [f"{k}: checkpoint {saved.get(k, 'absent')} != model {mine.get(k, 'absent')}"
            for k in sorted(saved.keys() | mine.keys()) if saved.get(k) != mine.get(k)]


def load_mcore_gpt_state_dict(path, model) -> dict:
    """The weights of GPTModel checkpoint ``path`` under ``GPTModel`` names (N layers), this
    rank's tensor-parallel shard, for a looped ``model`` with the same layer shapes."""
    ckpt = resolve_dist_checkpoint(path)
    gpt = stock_gpt_model(model, source_layers(ckpt))
    diffs = shape_differences(ckpt, gpt)
    if diffs:
        more = f" (and {len(diffs) - 6} more)" if len(diffs) > 6 else ""
        raise ValueError(f"MCore checkpoint {ckpt} does not fit this model's architecture: "
                         + "; ".join(diffs[:6]) + more)
    sharded = {k: v for k, v in gpt.sharded_state_dict().items()
               if not k.endswith("._extra_state")}
    loaded = dist_checkpointing.load(sharded, str(ckpt))
    gpt.load_state_dict(loaded, strict=False)
    return {k: v for k, v in gpt.state_dict().items() if not k.endswith("._extra_state")}
