"""Retrofitted recurrence: the weights of an N-layer plain transformer as a looped GPT.

A layer mapping (prelude p, core c, coda d) takes source layers ``[0, p)`` as the prelude,
``[p, p + c)`` as the recurrent core and the last d layers ``[N - d, N)`` as the coda; layers
``[p + c, N - d)`` are dropped. The input injection starts as ``[I | 0]``, so with R = 1 and no
dropped layer the looped model computes the source model's function (Retrofitted Recurrence,
arXiv 2511.07384). Source weights use MCore ``GPTModel`` names (``decoder.layers.<i>.*``).
"""

import re
from dataclasses import dataclass

import torch

from .shards import local_shard

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
INJECTION_KEY = "decoder.injection.weight"


@dataclass(frozen=True)
class LayerMapping:
    """Which source layer becomes which looped-GPT layer."""

    prelude: int
    """Source layers ``[0, prelude)`` run once before the loops."""

    core: int
    """The next ``core`` source layers form the recurrent core."""

    coda: int
    """The last ``coda`` source layers run after every loop."""

    source_layers: int
    """N: layers of the source model."""

    def __post_init__(self):
        for name in ("prelude", "core", "coda", "source_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"layer mapping: {name} must be an integer >= 0, got {value!r}")
        if self.core < 1:
            raise ValueError("layer mapping: the core needs at least 1 layer, got 0")
        used = self.prelude + self.core + self.coda
        if used > self.source_layers:
            raise ValueError(f"layer mapping {self.prelude},{self.core},{self.coda} uses {used} "
                             f"layers but the source model has {self.source_layers}")

    @classmethod
    def parse(cls, text: str, source_layers: int) -> "LayerMapping":
        """``"2,4,2"`` (prelude, core, coda) for an N-layer source."""
        parts = [p.strip() for p in str(text).split(",")]
        if len(parts) != 3 or not all(p.isdigit() for p in parts):
            raise ValueError(f"layer mapping must be 'prelude,core,coda' (three integers, e.g. "
                             f"'2,4,2'), got {text!r}")
        return cls(*(int(p) for p in parts), source_layers=source_layers)

    @classmethod
    def of_config(cls, config, source_layers: int) -> "LayerMapping":
        """The mapping a ``LoopedTransformerConfig``'s prelude / core / coda sizes imply."""
        return cls(config.looped_num_prelude_layers, config.num_layers,
                   config.looped_num_coda_layers, source_layers)

    @property
    def dropped(self) -> range:
        """Source layers left out (between the core and the coda)."""
        return range(self.prelude + self.core, self.source_layers - self.coda)

    def targets(self) -> dict:
        """Source layer index -> looped-GPT module prefix of every kept layer."""
        out = {i: f"decoder.prelude.{i}" for i in range(self.prelude)}
        out.update({self.prelude + j: f"decoder.layers.{j}" for j in range(self.core)})
        first_coda = self.source_layers - self.coda
        out.update({first_coda + j: f"decoder.coda.{j}" for j in range(self.coda)})
        return out

    def describe(self) -> str:
        """One line for the log, e.g. 'layers 0-1 -> prelude, 2-5 -> core, 6-7 -> coda'."""
        parts = [f"{_span(0, self.prelude)} -> prelude" if self.prelude else "",
                 f"{_span(self.prelude, self.core)} -> core (looped)",
                 f"{_span(self.source_layers - self.coda, self.coda)} -> coda" if self.coda else ""]
        dropped = _span(self.dropped.start, len(self.dropped)) if self.dropped else "none"
        return (f"{self.source_layers} source layers: {', '.join(p for p in parts if p)}; "
                f"dropped: {dropped}")


def _span(first: int, count: int) -> str:
    return f"layer {first}" if count == 1 else f"layers {first}-{first + count - 1}"


def retrofit_state_dict(state_dict: dict, mapping: LayerMapping) -> dict:
    """``GPTModel``-named weights of ``mapping.source_layers`` layers -> looped-GPT names.

    Kept layers move to ``decoder.prelude/layers/coda.<j>``; dropped layers are left out;
    every other tensor (embedding, final norm, output layer) keeps its name."""
    targets, out = mapping.targets(), {}
    for name, tensor in state_dict.items():
        match = _LAYER.fullmatch(name)
        if match is None:
            out[name] = tensor
            continue
        index = int(match[1])
        if index >= mapping.source_layers:
            raise ValueError(f"weight {name!r} is layer {index}, but the layer mapping's source "
                             f"has {mapping.source_layers} layers")
        if index in targets:
            out[f"{targets[index]}.{match[2]}"] = tensor
    return out


def identity_injection(hidden_size: int) -> torch.Tensor:
    """[I | 0] of shape [H, 2H]: the loop input starts as the carried state."""
    eye = torch.eye(hidden_size, device="cpu")  # host-side: copied into the model after
    return torch.cat([eye, torch.zeros(hidden_size, hidden_size, device="cpu")], dim=1)


def load_converted_state_dict(model, state_dict: dict) -> None:
    """Copy converted weights (whole tensors) into ``model`` (cast to its dtype; under tensor
    parallelism each rank its shard, ``local_shard``); an injection the weights lack is set to
    [I | 0]. Raises naming every missing, unexpected or misshapen tensor."""
    state_dict = dict(state_dict)
    if INJECTION_KEY not in state_dict and getattr(model.decoder, "injection", None) is not None:
        state_dict[INJECTION_KEY] = identity_injection(model.config.hidden_size)
    params = dict(model.named_parameters())
    state_dict = {k: local_shard(k, params[k], v, model.config) if k in params else v
                  for k, v in state_dict.items()}
    mine = {k: v for k, v in model.state_dict().items() if not k.endswith("._extra_state")}
    problems = [f"{k}: missing from the pretrained weights" for k in mine if k not in state_dict]
    problems += [f"{k}: not in this model" for k in state_dict if k not in mine]
    problems += [f"{k}: pretrained {tuple(v.shape)} != model {tuple(mine[k].shape)}"
                 for k, v in state_dict.items() if k in mine and v.shape != mine[k].shape]
    if problems:
        more = f" (and {len(problems) - 6} more)" if len(problems) > 6 else ""
        raise ValueError("pretrained weights do not fit the model: "
                         + "; ".join(problems[:6]) + more)
    with torch.no_grad():
        model.load_state_dict(state_dict, strict=False)
