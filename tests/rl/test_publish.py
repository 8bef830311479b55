"""Weight publication (``rl/publish.py``): the policy as one versioned transaction of
(Hugging Face name, tensor) chunks, vllm-rlt's contract, to a directory an engine in another
process loads.

- Round trip: each looped family's published version loads back through its importer with
  every tensor bitwise equal, in several chunks; a later version after an update; ``LATEST``.
- The transaction is checked (unknown, repeated and misshapen names, a missing one at the
  end, calls outside a transaction, versions that do not increase), one line naming the
  tensor or version; an interrupted transaction leaves no version and the next discards it.
- The vllm-rlt adapter hands the same calls to an engine object (vllm is not importable
  here: a recording stand-in).
- The main job publishes after its start and after every step (``--rl-publish-dir``)."""

import json
import subprocess
import sys

import pytest
import torch
from helpers.h20 import REPO
from helpers.reference_huginn import write_huginn_checkpoint
from helpers.reference_nanbeige import write_nanbeige_checkpoint
from helpers.reference_ouro import write_ouro_checkpoint

from scalerlt_mcore.app.config import ConfigError, parse_args, validate
from scalerlt_mcore.model.hf_export import export_format, hf_state_dict
from scalerlt_mcore.model.looped_import import looped_gpt_from_pretrained
from scalerlt_mcore.rl.publish import (
    DirectoryPublisher,
    PublishError,
    VllmRltPublisher,
    latest_version,
    publish,
    read_version,
)

WRITERS = {"ouro": write_ouro_checkpoint, "huginn": write_huginn_checkpoint,
           "nanbeige": write_nanbeige_checkpoint}


def _model(tmp_path, family):
    src = tmp_path / "src"
    WRITERS[family](src)
    return looped_gpt_from_pretrained(src, use_cpu_initialization=True)


def _same(a: dict, b: dict) -> bool:
    """Same tensors by name, bitwise (MCore's ``_extra_state`` entries left out)."""
    a, b = ({k: v for k, v in d.items() if not k.endswith("_extra_state")} for d in (a, b))
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("family", list(WRITERS))
def test_versions_load_back_bitwise(mcore_single, tmp_path, family):
    model = _model(tmp_path, family)
    root = tmp_path / "published"
    pub = DirectoryPublisher(root, model)
    publish(model, pub, 1, chunk_bytes=4096)  # several chunks
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))  # an update
    publish(model, pub, 2, chunk_bytes=4096)
    assert latest_version(root) == 2 and sorted(p.name for p in root.iterdir()) == [
        "LATEST", "v00000001", "v00000002"]
    index = json.loads((root / "v00000002" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["weight_version"] == 2
    assert len(set(index["weight_map"].values())) > 1
    version, tensors, _ = read_version(root)
    assert version == 2 and _same(tensors, hf_state_dict(model, export_format(model)))
    loaded = looped_gpt_from_pretrained(root / "v00000002", use_cpu_initialization=True)
    assert _same(loaded.state_dict(), model.state_dict())
    first = looped_gpt_from_pretrained(root / "v00000001", use_cpu_initialization=True)
    assert not _same(first.state_dict(), model.state_dict())


def test_the_transaction_is_checked(mcore_single, tmp_path):
    model = _model(tmp_path, "ouro")
    root = tmp_path / "published"
    pub = DirectoryPublisher(root, model)
    tensors = hf_state_dict(model, export_format(model))
    name, t = next(iter(tensors.items()))
    with pytest.raises(PublishError, match="update_weights outside a transaction"):
        pub.update_weights([(name, t)])
    pub.start_weight_update(1)
    with pytest.raises(PublishError, match="weight 'lm_head.bias': not a parameter"):
        pub.update_weights([("lm_head.bias", t)])
    with pytest.raises(PublishError, match=f"weight '{name}': shape"):
        pub.update_weights([(name, t[:1])])
    with pytest.raises(PublishError, match=f"weight '{name}': given twice in version 1"):
        pub.update_weights([(name, t), (name, t)])
    pub.update_weights([(name, t)])
    with pytest.raises(PublishError, match=f"weight '{name}': given twice in version 1"):
        pub.update_weights([(name, t)])
    with pytest.raises(PublishError, match=r"weight version 1 lacks \d+ parameter\(s\)"):
        pub.finish_weight_update()
    # interrupted: no version appears, LATEST stays; the next transaction discards it
    assert latest_version(root) is None and not (root / "v00000001").exists()
    publish(model, pub, 1)
    assert latest_version(root) == 1 and not list(root.glob(".v*.partial"))
    with pytest.raises(PublishError, match="weight version 1 must be an integer above the "
                                           "newest published, 1"):
        pub.start_weight_update(1)


class _Engine:
    """Records the calls a vllm-rlt ``LLM`` would get."""

    def __init__(self):
        self.calls = []

    def start_weight_update(self, version):
        self.calls.append(("start", version))

    def update_weights(self, chunk):
        self.calls.append(("update", [n for n, _ in chunk]))

    def finish_weight_update(self):
        self.calls.append(("finish",))


def test_the_vllm_rlt_adapter_makes_the_contract_calls(mcore_single, tmp_path):
    model = _model(tmp_path, "huginn")
    engine = _Engine()
    publish(model, VllmRltPublisher(engine), 7, chunk_bytes=4096)
    names = [n for c in engine.calls if c[0] == "update" for n in c[1]]
    assert engine.calls[0] == ("start", 7) and engine.calls[-1] == ("finish",)
    assert sorted(names) == sorted(hf_state_dict(model, export_format(model)))  # each once
    assert len(engine.calls) > 3


def test_model_parallel_runs_are_refused_by_name():
    cfg = parse_args(["--rl-publish-dir", "pub", "--tensor-model-parallel-size", "2"])
    with pytest.raises(ConfigError, match="rl_publish_dir and engine rollouts publish the "
                                          "whole model from one rank: they need "
                                          "tensor_model_parallel_size"):
        validate(cfg, world_size=2)


def test_the_main_job_publishes_every_step(mcore_single, tmp_path):
    root = tmp_path / "published"
    proc = subprocess.run(
        [sys.executable, "-m", "scalerlt_mcore.train", "--config",
         str(REPO / "configs" / "ouro_tiny_cpu.yaml"), "--train-iters", "2",
         "--rl-warmup-sft-steps", "1", "--eval-interval", "0", "--eval-iters", "1",
         "--global-batch-size", "8", "--no-plot", "--run-dir", str(tmp_path / "run"),
         "--rl-publish-dir", str(root)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert latest_version(root) == 3  # the start, then each of the 2 steps
    for v, step in ((1, 0), (3, 2)):
        assert f"published weight version {v} (after step {step})" in proc.stdout
    loaded = looped_gpt_from_pretrained(root / "v00000003", use_cpu_initialization=True)
    assert loaded.config.looped_num_loops == 3
