"""Weight publication to a serving engine: the policy in the engine's physical Hugging Face
names (each looped family's export, ``model/hf_export.py``) as one versioned transaction of
``(name, tensor)`` chunks, vllm-rlt's contract (docs/training_contract.md there):
``start_weight_update(version)``, ``update_weights(chunks)``, ``finish_weight_update()``,
every parameter exactly once.

``DirectoryPublisher`` writes versions an engine in another process loads, each a Hugging
Face checkpoint directory (config.json, sharded safetensors and their index: what the
importers, transformers and vLLM read): a version appears whole or not at all (written under
a hidden name, then renamed), ``LATEST`` names the newest. ``VllmRltPublisher`` hands the
same transaction to a vllm-rlt ``LLM`` / ``LLMEngine`` (``vllm_rlt_available``: only where
that package imports).
"""

import importlib.util
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Optional, Protocol

from ..model.hf_export import ExportError, export_format, hf_config, hf_state_dict

LATEST = "LATEST"
INDEX = "model.safetensors.index.json"


class PublishError(ValueError):
    """A transaction the publisher refuses: one line naming the tensor or version."""


class Publisher(Protocol):
    """What a trainer publishes through (vllm-rlt's three calls)."""

    def start_weight_update(self, version: int) -> None: ...

    def update_weights(self, chunk: Iterable) -> None: ...

    def finish_weight_update(self) -> None: ...


def weight_chunks(tensors: dict, chunk_bytes: int) -> Iterator[list]:
    """``{name: tensor}`` as lists of ``(name, tensor)`` of at most ``chunk_bytes`` each (a
    larger tensor alone)."""
    chunk, size = [], 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if chunk and size + nbytes > chunk_bytes:
            yield chunk
            chunk, size = [], 0
        chunk.append((name, t))
        size += nbytes
    if chunk:
        yield chunk


def published_tensors(model) -> tuple:
    """(``{name: tensor}`` on the host, config dict) as a version holds them: the model's
    export format (Hugging Face names and config.json), or, for a model no public format
    holds (a looped GPT layout of this project's own), its own state-dict names with
    ``{"scalerlt_mcore": true}`` as the config: this project's engine loads either."""
    try:
        kind = export_format(model)
    except ExportError:
        own = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()
               if not k.endswith("_extra_state")}
        return own, {"scalerlt_mcore": True}
    return hf_state_dict(model, kind), hf_config(model, kind)


def publish(model, publisher: Publisher, version: int, chunk_bytes: int = 2**30) -> None:
    """One transaction: ``model`` as ``published_tensors`` names it, in chunks of at most
    ``chunk_bytes``."""
    tensors = published_tensors(model)[0]
    publisher.start_weight_update(version)
    for chunk in weight_chunks(tensors, chunk_bytes):
        publisher.update_weights(chunk)
    publisher.finish_weight_update()


class DirectoryPublisher:
    """Versions ``v{version:08d}/`` under ``root``: config.json (the export's), one
    safetensors file per chunk and ``model.safetensors.index.json`` (name -> file, the
    version in its metadata); ``LATEST`` the newest version. ``model`` fixes the names and
    shapes a transaction must give, each once."""

    def __init__(self, root, model):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        tensors, self.config = published_tensors(model)
        self.expected = {n: tuple(t.shape) for n, t in tensors.items()}
        self.version: Optional[int] = None
        self.files: dict = {}

    @property
    def _partial(self) -> Path:
        return self.root / f".v{self.version:08d}.partial"

    def start_weight_update(self, version: int) -> None:
        """A new transaction (an unfinished one is discarded); ``version`` above the
        newest."""
        latest = latest_version(self.root)
        if not isinstance(version, int) or (latest is not None and version <= latest):
            raise PublishError(f"weight version {version!r} must be an integer above the "
                               f"newest published, {latest}")
        self._discard()
        self.version, self.files = version, {}
        self._partial.mkdir()

    def update_weights(self, chunk: Iterable) -> None:
        """Check the chunk (names known, not given before, shapes), then write it."""
        if self.version is None:
            raise PublishError("update_weights outside a transaction (start_weight_update "
                               "first)")
        chunk = list(chunk)
        names = [n for n, _ in chunk]
        for name, t in chunk:
            if name not in self.expected:
                raise PublishError(f"weight {name!r}: not a parameter of the published model")
            if name in self.files or names.count(name) > 1:
                raise PublishError(f"weight {name!r}: given twice in version {self.version}")
            if tuple(t.shape) != self.expected[name]:
                raise PublishError(f"weight {name!r}: shape {tuple(t.shape)}, the model's is "
                                   f"{self.expected[name]}")
        from safetensors.torch import save_file

        file = f"model-{len(set(self.files.values())) + 1:05d}.safetensors"
        save_file({n: t.detach().to("cpu").contiguous() for n, t in chunk},
                  str(self._partial / file), metadata={"format": "pt"})
        self.files.update(dict.fromkeys(names, file))

    def finish_weight_update(self) -> None:
        """Every parameter given: the version appears (renamed whole), then ``LATEST``."""
        if self.version is None:
            raise PublishError("finish_weight_update outside a transaction")
        missing = sorted(set(self.expected) - set(self.files))
        if missing:
            raise PublishError(f"weight version {self.version} lacks {len(missing)} "
                               f"parameter(s), e.g. {missing[0]!r}")
        (self._partial / INDEX).write_text(json.dumps(
            {"metadata": {"weight_version": self.version}, "weight_map": self.files}, indent=1))
        (self._partial / "config.json").write_text(json.dumps(self.config, indent=2) + "\n")
        os.replace(self._partial, self.root / f"v{self.version:08d}")
        write_atomic(self.root / LATEST, f"{self.version}\n")
        self.version, self.files = None, {}

    def _discard(self) -> None:
        for old in self.root.glob(".v*.partial"):
            shutil.rmtree(old)


def write_atomic(path: Path, text: str) -> None:
    """``text`` at ``path``, whole or not at all for a reader polling it (a hidden file
    renamed)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def latest_version(root) -> Optional[int]:
    """The newest version published under ``root`` (None: none yet)."""
    path = Path(root) / LATEST
    return int(path.read_text()) if path.is_file() else None


def read_version(root, version: Optional[int] = None) -> tuple:
    """(version, ``{name: tensor}``, config dict) of a published version (default the
    newest): what an engine loads."""
    from safetensors.torch import load_file

    version = latest_version(root) if version is None else version
    if version is None:
        raise PublishError(f"{root}: no weight version published yet")
    where = Path(root) / f"v{version:08d}"
    index = json.loads((where / INDEX).read_text())
    tensors = {}
    for file in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(str(where / file)))
    return version, tensors, json.loads((where / "config.json").read_text())


def vllm_rlt_available() -> bool:
    """Whether the vllm-rlt engine (the ``vllm`` package) imports here."""
    return importlib.util.find_spec("vllm") is not None


class VllmRltPublisher:
    """The transaction handed to a vllm-rlt ``LLM`` or ``LLMEngine`` (``llm``), which checks
    names, shapes and completeness itself."""

    def __init__(self, llm):
        self.llm = llm

    def start_weight_update(self, version: int) -> None:
        self.llm.start_weight_update(version=version)

    def update_weights(self, chunk: Iterable) -> None:
        self.llm.update_weights(list(chunk))

    def finish_weight_update(self) -> None:
        self.llm.finish_weight_update()
