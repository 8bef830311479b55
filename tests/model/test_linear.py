"""The direct forwards of forwards that record no graph (``model/linear.py``: MCore's linears
without their autograd functions; ``RotaryAngles``: RoPE's cos/sin once per forward) give
MCore's own tensors, bitwise; with a graph recorded MCore's path runs."""

import pytest
import torch
from helpers.decode import build
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.rotary_pos_embedding import apply_rotary_pos_emb
from megatron.core.transformer import TransformerConfig

from scalerlt_mcore.model.attention import RotaryAngles
from scalerlt_mcore.model.linear import ColumnParallelLinear, RowParallelLinear
from scalerlt_mcore.testing import run_distributed

IN, OUT = 24, 40


def _config():
    return TransformerConfig(num_layers=1, hidden_size=IN, num_attention_heads=4,
                             use_cpu_initialization=True)


def _pair(kind: str, **kwargs) -> tuple:
    """(MCore's linear, the project's subclass) with the same weights."""
    stock_cls, ours_cls = {"column": (tensor_parallel.ColumnParallelLinear, ColumnParallelLinear),
                           "row": (tensor_parallel.RowParallelLinear, RowParallelLinear)}[kind]
    extra = {"gather_output": False} if kind == "column" else {"input_is_parallel": True}
    args = dict(config=_config(), init_method=torch.nn.init.normal_, **extra, **kwargs)
    stock, ours = stock_cls(IN, OUT, **args), ours_cls(IN, OUT, **args)
    with torch.no_grad():
        for p in stock.parameters():
            p.normal_()
    ours.load_state_dict(stock.state_dict())
    return stock, ours


def _same(a: tuple, b: tuple) -> bool:
    return all((x is None and y is None) or torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("bias,skip_bias_add", [(True, False), (True, True), (False, False)])
def test_direct_forward_equals_mcores(mcore_single, kind, bias, skip_bias_add):
    stock, ours = _pair(kind, bias=bias, skip_bias_add=skip_bias_add)
    x = torch.randn(5, 3, IN)
    with torch.no_grad():
        assert _same(ours(x), stock(x))
    got, want = ours(x), stock(x)  # a graph recorded: MCore's own forward
    assert got[0].requires_grad and _same(got, want)


def test_column_with_a_weight_argument(mcore_single):
    """The tied output layer passes the embedding as ``weight``; a wrong shape is MCore's
    error."""
    stock, ours = _pair("column", bias=False, skip_bias_add=False)
    x, weight = torch.randn(5, 3, IN), torch.randn(OUT, IN)
    with torch.no_grad():
        assert torch.equal(ours(x, weight=weight)[0], stock(x, weight=weight)[0])
        with pytest.raises(RuntimeError, match="supplied weight's shape"):
            ours(x, weight=torch.randn(OUT + 1, IN))


def test_direct_path_calls_no_autograd_function(mcore_single, monkeypatch):
    calls = []
    fn = tensor_parallel.layers.LinearWithGradAccumulationAndAsyncCommunication
    original = fn.apply
    monkeypatch.setattr(fn, "apply", lambda *a: calls.append(1) or original(*a))
    stock, ours = _pair("column", bias=True, skip_bias_add=False)
    x = torch.randn(2, 2, IN)
    with torch.no_grad():
        ours(x)
        assert calls == []
        stock(x)
        assert calls == [1]
    ours(x)
    assert calls == [1, 1]


def _tp_worker(rank, world_size) -> bool:
    """Row- and column-parallel linears split over 2 ranks: the direct forward (its own
    all-reduce) equals MCore's on every rank."""
    torch.manual_seed(0)  # the same full weights and input on both ranks
    x = torch.randn(4, 2, IN)
    same = []
    for kind in ("column", "row"):
        stock, ours = _pair(kind, bias=True, skip_bias_add=False)
        part = x if kind == "column" else x[..., rank * IN // 2: (rank + 1) * IN // 2]
        with torch.no_grad():
            same.append(_same(ours(part), stock(part)))
    return all(same)


def test_direct_forward_under_tensor_parallelism():
    assert run_distributed(_tp_worker, 2, tensor_model_parallel_size=2) == [True, True]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rot_dim", [16, 8])  # the whole head / a partial rotary dim
def test_rotary_angles_equal_mcores_rope(mcore_single, dtype, rot_dim):
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4)
    freqs = torch.rand(6, 3, 1, rot_dim) * 50
    t = torch.randn(6, 3, 4, 16).to(dtype)
    want = apply_rotary_pos_emb(t, freqs, config=config)
    assert torch.equal(RotaryAngles.of(freqs).rotate(t), want)


@pytest.mark.parametrize("pe", ["rope", "learned_absolute"])
def test_forward_without_a_graph_equals_with_one(mcore_single, pe):
    """The whole looped model (GQA, prelude, core, coda, injection): per-loop log-probs
    without a recorded graph (direct linears, RoPE once) equal those with one, bitwise."""
    model, _, _ = build(pe, torch.float32)
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        fast = model(tokens[:, :-1], labels=tokens[:, 1:]).logprobs
    slow = model(tokens[:, :-1], labels=tokens[:, 1:]).logprobs
    assert slow.requires_grad and torch.equal(fast, slow.detach())
