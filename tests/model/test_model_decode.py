"""Decoding with the depth-indexed KV cache.

Prefill of right-padded prompts of different lengths, then token-by-token `decode_step`, must
give every loop's logits of one full forward per sequence. A core layer reused across loops
must own one cache slot per loop: the slots hold the K/V the independent reference computes
at that (loop, layer) application, and corrupting one slot changes only the readouts that
depend on it.
"""

import copy

import pytest
import torch
from helpers.decode import LOOPS, N_CODA, N_CORE, N_PRE, VOCAB, build
from helpers.reference_looped import reference_forward

LENGTHS = torch.tensor([3, 7, 5])  # prompt lengths; prompts are right-padded to 7
STEPS = 4  # decode steps after the prefill


def sequences(seed: int = 0) -> tuple:
    """Full sequences [3, 7 + STEPS] and the right-padded prompts [3, 7] (junk padding)."""
    gen = torch.Generator().manual_seed(seed)
    seqs = torch.randint(0, VOCAB, (3, int(LENGTHS.max()) + STEPS), generator=gen)
    prompts = seqs[:, : int(LENGTHS.max())].clone()
    for b, n in enumerate(LENGTHS.tolist()):
        prompts[b, n:] = torch.randint(0, VOCAB, (prompts.shape[1] - n,), generator=gen)
    return seqs, prompts


def decode(model, seqs, prompts) -> tuple:
    """Prefill then STEPS teacher-forced decode steps -> ([STEPS+1] x [R, B, V], cache)."""
    cache = model.new_kv_cache(3, int(LENGTHS.max()) + STEPS + 1)
    outs = [model.prefill(cache, prompts, LENGTHS)]
    for _ in range(STEPS):
        nxt = seqs[torch.arange(3), cache.lengths]  # [B]
        outs.append(model.decode_step(cache, nxt))
    return outs, cache


def depth(r: int, layer: int, coda: bool = False) -> int:
    """Virtual depth of core (or coda) layer `layer` in loop r: application order."""
    return N_PRE + r * (N_CORE + N_CODA) + (N_CORE if coda else 0) + layer


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)],
                         ids=["fp64", "fp32"])
@pytest.mark.parametrize("pe", ["learned_absolute", "rope"])
def test_decode_matches_full_forward(mcore_single, pe, dtype, tol):
    model, ref, weights = build(pe, dtype)
    seqs, prompts = sequences()
    with torch.no_grad():
        outs, cache = decode(model, seqs, prompts)
        assert cache.lengths.tolist() == (LENGTHS + STEPS).tolist()
        err_model = err_ref = 0.0
        for b, n in enumerate(LENGTHS.tolist()):
            seq = seqs[b : b + 1, : n + STEPS]
            full = model(seq).logits  # R x [1, n+STEPS, V]
            want_ref, _ = reference_forward(weights, ref, seq)
            for r in range(LOOPS):
                got = torch.stack([o[r, b] for o in outs])  # [STEPS+1, V]
                err_model = max(err_model, (got - full[r][0, n - 1 :]).abs().max().item())
                err_ref = max(err_ref, (got - want_ref[r][0, n - 1 :]).abs().max().item())
    assert err_model <= tol
    assert err_ref <= tol


def test_prefill_reads_out_only_the_last_prompt_positions(mcore_single):
    """The readout (final norm + output layer) of a prefill sees one position per row and
    loop, not every prompt position: its logits would be R x B x T x V."""
    model, _, _ = build("learned_absolute")
    _, prompts = sequences()
    rows = []
    hook = model.output_layer.register_forward_hook(lambda m, args, out: rows.append(
        tuple(args[0].shape[:2])))  # input [S, B, H]
    with torch.no_grad():
        logits = model.prefill(model.new_kv_cache(3, 12), prompts, LENGTHS)
    hook.remove()
    assert logits.shape == (LOOPS, 3, VOCAB)
    assert rows == [(1, 3)] * LOOPS


def test_cache_slots_hold_each_loops_kv(mcore_single):
    """Every depth's cache slot holds the reference K/V of that (loop, layer) application;
    a core layer's slots differ between loops."""
    model, ref, weights = build("rope")
    seqs, prompts = sequences(seed=1)
    with torch.no_grad():
        _, cache = decode(model, seqs, prompts)
    assert cache.keys.shape[0] == N_PRE + LOOPS * (N_CORE + N_CODA)
    for b, n in enumerate((LENGTHS + STEPS).tolist()):
        _, kv = reference_forward(weights, ref, seqs[b : b + 1, :n])
        assert len(kv) == cache.keys.shape[0]
        for d, (k, v) in enumerate(kv):
            keys, values = cache.read(d, n, k.dtype)  # [n, B, ng, hn]
            assert (keys[:, b] - k[0]).abs().max().item() <= 1e-10, d
            assert (values[:, b] - v[0]).abs().max().item() <= 1e-10, d
            assert torch.equal(cache.keys[d, b, :, :n].transpose(0, 1), keys[:, b])  # layout
    for layer in range(N_CORE):
        slots = [cache.keys[depth(r, layer)] for r in range(LOOPS)]
        for r in range(1, LOOPS):
            assert (slots[r] - slots[r - 1]).abs().max() > 1e-3, (layer, r)


@pytest.mark.parametrize("slot, changed", [
    pytest.param(depth(1, 0), {1, 2}, id="core-loop1"),
    pytest.param(depth(1, N_CORE - 1), {1, 2}, id="core-last-loop1"),
    pytest.param(depth(2, 0), {2}, id="core-loop2"),
    pytest.param(depth(1, 0, coda=True), {1}, id="coda-loop1"),
    pytest.param(depth(0, 0, coda=True), {0}, id="coda-loop0"),
    pytest.param(0, {0, 1, 2}, id="prelude"),
])
def test_zeroing_one_slot_changes_only_dependent_loops(mcore_single, slot, changed):
    """Loop r reads the core slots of loops <= r and only its own coda slot."""
    model, _, _ = build("learned_absolute")
    seqs, prompts = sequences(seed=2)
    with torch.no_grad():
        cache = model.new_kv_cache(3, 12)
        model.prefill(cache, prompts, LENGTHS)
        corrupted = copy.deepcopy(cache)
        corrupted.keys[slot].zero_()
        corrupted.values[slot].zero_()
        nxt = seqs[torch.arange(3), LENGTHS]
        clean = model.decode_step(cache, nxt)  # [R, B, V]
        dirty = model.decode_step(corrupted, nxt)
    for r in range(LOOPS):
        diff = (clean[r] - dirty[r]).abs().max().item()
        if r in changed:
            assert diff > 1e-6, r
        else:
            assert diff == 0.0, r


def test_prefill_of_equal_rows_shares_one_row_of_rope(mcore_single):
    """A prefill whose rows share their positions gives them as an expand of one row (RoPE's
    angles computed once for all rows), with the same logits as a full-width RoPE; rows at
    other positions, and every decode step, get their own rows."""
    model, _, _ = build("rope")
    prompts = sequences(seed=3)[1]
    with torch.no_grad():
        cache = model.new_kv_cache(3, 12)
        step = cache.plan(prompts.shape[1])
        assert step.positions.stride(0) == 0 and step.positions.shape == (3, 7)
        shared = model.prefill(cache, prompts, LENGTHS)
        assert cache.plan(1).positions.stride(0) != 0  # a decode step: each row its own
        cache.lengths[1] += 1  # rows at different positions
        assert cache.plan(2).positions.stride(0) != 0
        full = model.new_kv_cache(3, 12)
        rope, expanded = model._rope, []
        model._rope = lambda positions, span: (expanded.append(positions.stride(0) == 0)
                                               or rope(positions.contiguous(), span))
        try:
            per_row = model.prefill(full, prompts, LENGTHS)
        finally:
            model._rope = rope
    assert expanded == [True] and torch.equal(shared, per_row)
