"""A serving engine's early exit, simulated in plain PyTorch one position at a time (the
reference the exit-depth replay is held to).

As vllm-rlt's ``last_exited`` K/V layout (its docs/kv_layout_computation.md): every (loop,
layer) has a K/V plane; a position runs loops 1 .. e (its exit depth), writing its K/V into
those planes, and at its exit its K/V of loop e is copied into every deeper plane
("finalization"), so a later query at loop d reads loop min(d, e)'s; the prompt runs every
loop. Each loop's readout of a position is computed; the log-prob of its label is read at the
loop the caller names (the depth the engine sampled that token at).

The model: ``reference_looped``'s (pre-LN GPT layers with biases, GELU MLP, RoPE, prelude /
core / coda, ``linear_concat`` injection, initial state ``embed``), one row.
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from helpers.reference_looped import RefConfig, _rope


def _step_layer(x: Tensor, w: dict, t: int, cfg: RefConfig, keys: list,
                values: list) -> Tensor:
    """Position ``t``'s layer application x [1, H] against its plane ``keys``/``values`` (one
    [ng, hd] per position, those < t written): writes position t, attends to 0 .. t."""
    hd, rep = cfg.head_dim, cfg.heads // cfg.groups
    h = F.layer_norm(x, x.shape[-1:], w["ln1_w"], w["ln1_b"], cfg.eps)
    q = (h @ w["wq"].T + w["bq"]).view(1, 1, cfg.heads, hd)
    k = (h @ w["wk"].T + w["bk"]).view(1, 1, cfg.groups, hd)
    v = (h @ w["wv"].T + w["bv"]).view(1, 1, cfg.groups, hd)
    pos = torch.tensor([[t]])
    q, k = _rope(q, pos, cfg), _rope(k, pos, cfg)
    keys[t], values[t] = k[0, 0], v[0, 0]
    kk = torch.stack(keys[: t + 1]).repeat_interleave(rep, dim=1)  # [t+1, nh, hd]
    vv = torch.stack(values[: t + 1]).repeat_interleave(rep, dim=1)
    scores = torch.einsum("hd,khd->hk", q[0, 0], kk) / math.sqrt(hd)  # [nh, t+1]
    out = torch.einsum("hk,khd->hd", scores.softmax(dim=-1), vv).reshape(1, -1)
    x = x + out @ w["wo"].T + w["bo"]
    h = F.layer_norm(x, x.shape[-1:], w["ln2_w"], w["ln2_b"], cfg.eps)
    return x + F.gelu(h @ w["w1"].T + w["b1"]) @ w["w2"].T + w["b2"]


def engine_logprobs(weights: dict, cfg: RefConfig, tokens: list, labels: list,
                    runs: list, reads: list) -> Tensor:
    """One row: position t runs ``runs[t]`` loops (R for the prompt) and the log-prob of
    ``labels[t]`` is read at loop ``reads[t]`` (<= ``runs[t]``) -> [T] (with the autograd
    graph of ``weights``)."""
    T, R = len(tokens), cfg.loops

    def planes(n: int) -> list:
        return [([None] * T, [None] * T) for _ in range(n)]

    prelude = planes(cfg.n_prelude)
    core = [planes(cfg.n_core) for _ in range(R)]  # [loop][layer]
    coda = [planes(cfg.n_coda) for _ in range(R)]
    out = []
    for t in range(T):
        x = weights["tok"][tokens[t]][None]  # [1, H]
        for w, (k, v) in zip(weights["prelude"], prelude):
            x = _step_layer(x, w, t, cfg, k, v)
        embed = state = x
        read = None
        for r in range(runs[t]):
            x = torch.cat([state, embed], dim=-1) @ weights["inject"].T
            for w, (k, v) in zip(weights["core"], core[r]):
                x = _step_layer(x, w, t, cfg, k, v)
            state = y = x
            for w, (k, v) in zip(weights["coda"], coda[r]):
                y = _step_layer(y, w, t, cfg, k, v)
            if r + 1 == reads[t]:
                y = F.layer_norm(y, y.shape[-1:], weights["norm_w"], weights["norm_b"], cfg.eps)
                read = torch.log_softmax(y @ weights["out"].T, dim=-1)[0, labels[t]]
        for deeper in range(runs[t], R):  # finalization: the exit loop's K/V, deeper planes
            for stage in (core, coda):
                for (k, v), (k_exit, v_exit) in zip(stage[deeper], stage[runs[t] - 1]):
                    k[t], v[t] = k_exit[t], v_exit[t]
        out.append(read)
    return torch.stack(out)
