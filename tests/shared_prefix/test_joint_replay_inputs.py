"""Replay inputs are explicit and checked (docs/design.md section 4).

- A replay input mutated in place after phase 2 (from the ``phase_callback`` of the last
  non-final wave) is caught before the joint replay: ``ReplayInputError`` naming the tensor
  and the group; the replay never ran and no parameter grad changed after phase 2.
- With checkpointed waves, a mutation made during a wave's backward is caught before that
  wave's recompute.
- A malformed group is rejected before any compute: no phase callback, grads untouched; so
  are an empty group (named), a response without the prompt most rows share (named, also
  response 0), a replay input that still carries an autograd graph (named), and more
  microbatches than the data iterator yields (both counts said).
- Every field the replay reads is guarded: prompt_length, group_id, and an optional tensor
  that was None when fingerprinted and is set later.
- Checked up front against the model and the loss: token ids and labels in the vocabulary,
  labels the tokens shifted by one where the loss reads them (inside responses and at P - 1),
  sequences within the position table, reference log-probs when the KL is on, no dropout.
- A step refused after waves ran says that their gradients remain and must be discarded.
"""

import dataclasses
import math

import pytest
import torch
from helpers.replay_inputs import GID, MUTATIONS, G, P, R, Recorder, S, W, _bump_token, _group
from helpers.sp import VOCAB, LossSpec, build_model, grads, joint_step, make_group

from scalerlt_mcore.rl.objective import rl_forward_step
from scalerlt_mcore.shared_prefix import ReplayInputError, get_shared_prefix_forward_backward_func


@pytest.fixture
def model(mcore_single):
    return build_model(R=R, arch=True).double()


def _mutate_data_only(t: torch.Tensor) -> None:
    """Write through ``.data``: the version counter does not move, only the checksum does."""
    t.data[0, 0, P] += 0.125


@pytest.mark.parametrize("ck", [False, True], ids=["nockpt", "ckpt"])
@pytest.mark.parametrize("name", list(MUTATIONS))
def test_mutation_after_waves_is_caught_before_replay(model, name, ck):
    group = _group()
    rec = Recorder(model, at_wave=2, action=MUTATIONS[name])  # the last non-final wave
    with pytest.raises(ReplayInputError) as info:
        joint_step(model, [group], LossSpec(kl_coef=0.1), W, checkpoint_waves=ck,
                   phase_callback=rec)
    msg = str(info.value)
    assert f"'{name}'" in msg and f"group {GID}" in msg and "joint replay" in msg, msg
    assert rec.calls == ["prompt_producer", "wave", "wave"], rec.calls
    after = grads(model)
    for n, g in rec.grads_at_action.items():
        assert torch.equal(after[n], g), f"{n} changed after phase 2"


def test_mutation_bypassing_version_counter_is_caught(model):
    """The content checksum catches a write the version counter does not see."""
    group = _group()
    version = group.old_logprobs._version
    rec = Recorder(model, at_wave=2, action=lambda g: _mutate_data_only(g.old_logprobs))
    with pytest.raises(ReplayInputError, match=rf"group {GID}: replay input 'old_logprobs'"):
        joint_step(model, [group], LossSpec(kl_coef=0.1), W, phase_callback=rec)
    assert group.old_logprobs._version == version  # the guard did not rely on it
    assert "joint_replay" not in rec.calls


def test_mutation_in_second_group_names_that_group(model):
    groups = [_group(), make_group(4, 5, 3, R, seed=8, kl=True, group_id=GID + 1)]
    rec = Recorder(model, at_wave=3, action=MUTATIONS["advantages"])  # 2 waves of group 0
    with pytest.raises(ReplayInputError, match=rf"group {GID + 1}: replay input 'advantages'"):
        joint_step(model, groups, LossSpec(kl_coef=0.1), W, phase_callback=rec)
    assert rec.calls == ["prompt_producer", "wave", "wave", "joint_replay",
                         "prompt_producer", "wave"], rec.calls


@pytest.mark.parametrize("name", ["tokens", "advantages", "old_logprobs"])
def test_mutation_during_checkpointed_wave_backward_caught_before_recompute(model, name):
    """A hook on the first wave's loss fires at the very start of its backward, before the
    checkpointed wave is recomputed; the recompute must refuse the changed input."""
    group = _group()
    cfg = model.config
    fired = []

    def scale_and_hook(loss):
        if not fired:
            def mutate(grad):
                fired.append(True)
                MUTATIONS[name](group)
                return grad
            loss.register_hook(mutate)
        return loss

    rec = Recorder(model)
    cfg.grad_scale_func = scale_and_hook
    try:
        with pytest.raises(ReplayInputError) as info:
            joint_step(model, [group], LossSpec(kl_coef=0.1), W, checkpoint_waves=True,
                       phase_callback=rec)
    finally:
        cfg.grad_scale_func = None
    msg = str(info.value)
    assert fired and f"'{name}'" in msg and f"group {GID}" in msg, msg
    assert "wave recompute" in msg, msg
    assert rec.calls == ["prompt_producer"], rec.calls  # the first wave never finished
    assert all(p.grad is None for p in model.parameters())  # no parameter grad reached


# ---- malformed groups: rejected before any compute ---------------------------------------


def _reject(model, group, error, pattern, groups_before=(), forward_only=False, wave_size=W,
            **kw):
    """Run a step expected to fail its up-front checks; assert nothing was computed."""
    sentinel = {n: torch.full_like(p, 0.5) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.grad = sentinel[n].clone()
    rec = Recorder(model)
    with pytest.raises(error, match=pattern):
        joint_step(model, [*groups_before, group], LossSpec(kl_coef=0.1), wave_size,
                   phase_callback=rec, forward_only=forward_only, **kw)
    assert rec.calls == [], rec.calls
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, sentinel[n]), f"{n} grad touched"


@pytest.mark.parametrize("forward_only", [False, True])
def test_mismatched_prompts_rejected_before_compute(model, forward_only):
    group = _group()
    group.tokens[3, 2] = group.tokens[0, 2] % (VOCAB - 1) + 1
    _reject(model, group, ReplayInputError, rf"group {GID}: response 3 .*prompt",
            forward_only=forward_only)


def test_first_response_without_the_shared_prompt_is_named(model):
    """Response 0 is the odd one out: it is named, not the responses that share the prompt."""
    group = _group()
    _bump_token(group.tokens, (0, 2))
    _reject(model, group, ReplayInputError,
            rf"group {GID}: response 0 is not preceded by the group's prompt tokens "
            rf"\(tokens\[0, :{P}\] differs from the prompt {G - 1} of the {G} rows share\)")


def test_group_without_a_majority_prompt_is_refused(model):
    two = make_group(2, P, S, R, seed=4, kl=True, group_id=GID)
    _bump_token(two.tokens, (1, 0))
    _reject(model, two, ReplayInputError,
            rf"group {GID}: the responses share no prompt \(tokens\[:, :{P}\] holds 2 "
            rf"different prompts, none in a majority of the 2 rows\)")


def _without_responses(g):
    """The group with its G axis emptied (every tensor keeps its other dimensions)."""
    return dataclasses.replace(
        g, tokens=g.tokens[:0], labels=g.labels[:0], loss_mask=g.loss_mask[:0],
        advantages=g.advantages[:0], old_logprobs=g.old_logprobs[:, :0],
        ref_logprobs=g.ref_logprobs[:, :0])


def test_empty_group_is_refused_naming_it(model):
    """A valid wave size, a group of G = 0: the group is named, not the plan's wave size."""
    empty = _without_responses(_group())
    _reject(model, empty, ValueError, rf"group {GID}: the group has no responses "
                                      rf"\(tokens has shape \(0, {P + S}\)\)",
            groups_before=[make_group(4, 5, 3, R, seed=8, kl=True, group_id=GID + 1)])


def _with_graph(model, name):
    """The group's ``name`` tensor with the policy's autograd graph attached (its values
    unchanged): as if computed by the model without ``no_grad``/``detach``."""
    def corrupt(g):
        weight = next(model.parameters())
        setattr(g, name, getattr(g, name) + 0 * weight.sum().to(getattr(g, name).dtype))
    return corrupt


@pytest.mark.parametrize("wave_size", [G, W], ids=["one_wave", "three_waves"])
@pytest.mark.parametrize("name", ["old_logprobs", "ref_logprobs", "advantages"])
def test_extra_with_autograd_graph_refused_before_compute(model, name, wave_size):
    """One wave would backpropagate through the graph (wrong gradients), several end in an
    autograd error after the first waves wrote gradients: refused up front, naming the field."""
    group = _group()
    _with_graph(model, name)(group)
    _reject(model, group, ValueError,
            rf"group {GID}: {name} carries an autograd graph \(grad_fn AddBackward0\); the "
            rf"schedule's inputs are constants: pass {name}.detach\(\)", wave_size=wave_size)


def test_extra_requiring_grad_refused_before_compute(model):
    group = _group()
    group.old_logprobs.requires_grad_()
    _reject(model, group, ValueError,
            rf"group {GID}: old_logprobs carries an autograd graph \(requires_grad\)")


@pytest.mark.parametrize("num_groups", [0, 2])
def test_more_microbatches_than_groups_refused(model, num_groups):
    """The iterator runs out: how many groups it yielded and how many were asked, before any
    compute (not a bare StopIteration)."""
    groups = [make_group(4, 5, 3, R, seed=8 + n, kl=True, group_id=n) for n in range(num_groups)]
    rec = Recorder(model)
    fb = get_shared_prefix_forward_backward_func(W, phase_callback=rec)
    yielded = f"only {num_groups} groups" if num_groups else "no microbatch"
    with pytest.raises(ValueError, match=rf"num_microbatches = 3, but data_iterator yielded "
                                         rf"{yielded}$"):
        fb(forward_step_func=rl_forward_step(LossSpec().objective()),
           data_iterator=iter(groups), model=model, num_microbatches=3, seq_length=0,
           micro_batch_size=1)
    assert rec.calls == [] and all(p.grad is None for p in model.parameters())


def test_bad_second_group_rejects_the_whole_step(model):
    """The first (valid) group is not trained either: all groups are checked up front."""
    bad = _group()
    bad.group_id = GID + 1
    bad.tokens[1, 0] = bad.tokens[0, 0] % (VOCAB - 1) + 1
    good = make_group(4, 5, 3, R, seed=8, kl=True, group_id=GID)
    _reject(model, bad, ReplayInputError, rf"group {GID + 1}: response 1", groups_before=[good])


def _empty_response(g):
    g.loss_mask[3] = 0


def _wrong(name, shape_fn):
    def f(g):
        t = getattr(g, name)
        setattr(g, name, torch.zeros(shape_fn(t.shape), dtype=t.dtype))
    return f


def _nan_advantage(g):
    g.advantages[2] = math.nan


def _inf_old(g):
    g.old_logprobs[1, 0, P] = -math.inf


def _mask_on_prompt(g):
    g.loss_mask[0, 1] = 1


def _no_advantages(g):
    g.advantages = None


BAD = {
    "empty_response": (_empty_response, r"response 3 has no trained token"),
    "labels_shape": (_wrong("labels", lambda s: (s[0], s[1] - 1)), r"labels has shape"),
    "loss_mask_shape": (_wrong("loss_mask", lambda s: (s[0] - 1, s[1])),
                        r"loss_mask has shape"),
    "advantages_shape": (_wrong("advantages", lambda s: (s[0], 1)), r"advantages has shape"),
    "old_logprobs_shape": (_wrong("old_logprobs", lambda s: (s[0] + 1, s[1], s[2])),
                           r"old_logprobs has shape"),
    "ref_logprobs_shape": (_wrong("ref_logprobs", lambda s: (s[0], s[1], s[2] + 1)),
                           r"ref_logprobs has shape"),
    "nan_advantages": (_nan_advantage, r"advantages contains NaN"),
    "inf_old_logprobs": (_inf_old, r"old_logprobs contains NaN or inf"),
    "mask_on_prompt": (_mask_on_prompt, r"loss_mask is non-zero on prompt positions"),
    "no_advantages": (_no_advantages, r"needs advantages"),
}


def _reject_corrupted(model, corruption, message: str) -> None:
    """A group corrupted by ``corruption`` is refused before compute with ``message``."""
    group = _group()
    corruption(group)
    _reject(model, group, ValueError, message)


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_rejected_with_clear_error(model, case):
    corrupt, pattern = BAD[case]
    _reject_corrupted(model, corrupt, rf"group {GID}: .*{pattern}")


def test_response_longer_than_max_rejected(model):
    group = _group()  # responses padded to S = 4; the first is S long
    _reject(model, group, ValueError,
            rf"group {GID}: response length {S} exceeds the configured maximum {S - 1}",
            max_response_length=S - 1)


def test_response_at_max_length_accepted(model):
    rec = Recorder(model)
    joint_step(model, [_group()], LossSpec(kl_coef=0.1), W, max_response_length=S,
               phase_callback=rec)
    assert rec.calls == ["prompt_producer", "wave", "wave", "joint_replay"]


def test_later_group_changed_while_earlier_group_trains_is_caught(model):
    """Group 2 passes the up-front checks, then its advantages become NaN while group 1
    trains: refused before group 2 contributes anything (no silent NaN gradients)."""
    first = make_group(4, 5, 3, R, seed=8, kl=True, group_id=GID)
    second = _group()
    second.group_id = GID + 1
    calls, after_first = [], {}

    def callback(phase, group):
        calls.append((phase, group.group_id))
        if (phase, group) == ("wave", first):
            second.advantages[0] = math.nan
        if (phase, group) == ("joint_replay", first):
            after_first.update(grads(model))

    with pytest.raises(ReplayInputError, match=rf"group {GID + 1}: replay input 'advantages'"):
        joint_step(model, [first, second], LossSpec(kl_coef=0.1), W, phase_callback=callback)
    assert ("joint_replay", GID) in calls and ("wave", GID + 1) not in calls, calls
    now = grads(model)
    for n, g in after_first.items():
        assert torch.equal(now[n], g), f"{n} changed by the refused group"


# ---- every field the replay reads is guarded ----------------------------------------------


SCALAR_MUTATIONS = {
    "prompt_length": lambda g: setattr(g, "prompt_length", g.prompt_length - 1),
    "group_id": lambda g: setattr(g, "group_id", g.group_id + 1),
}


@pytest.mark.parametrize("name", list(SCALAR_MUTATIONS))
def test_scalar_field_changed_after_waves_is_caught_before_replay(model, name):
    group = _group()
    rec = Recorder(model, at_wave=2, action=SCALAR_MUTATIONS[name])
    with pytest.raises(ReplayInputError) as info:
        joint_step(model, [group], LossSpec(kl_coef=0.1), W, phase_callback=rec)
    msg = str(info.value)
    assert f"group {GID}: replay input '{name}' changed" in msg and "joint replay" in msg, msg
    assert rec.calls == ["prompt_producer", "wave", "wave"], rec.calls


def test_prompt_length_of_later_group_changed_while_earlier_trains_is_caught(model):
    """A later group's prompt_length changed while the first group trains would train it on
    wrong positions (its tokens still pass every check): refused before it runs."""
    first = make_group(4, 5, 3, R, seed=8, kl=True, group_id=GID)
    second = _group()
    second.group_id = GID + 1
    calls = []

    def callback(phase, group):
        calls.append((phase, group.group_id))
        if (phase, group) == ("wave", first):
            second.prompt_length = P - 2

    with pytest.raises(ReplayInputError,
                       match=rf"group {GID + 1}: replay input 'prompt_length' changed .*{P} -> "
                             rf"{P - 2}"):
        joint_step(model, [first, second], LossSpec(kl_coef=0.1), W, phase_callback=callback)
    assert ("joint_replay", GID) in calls and ("prompt_producer", GID + 1) not in calls, calls


def test_optional_field_set_after_first_use_is_caught(model):
    """A field that was None when fingerprinted and is set later is a ReplayInputError naming
    it (the replay would read it), not a bare KeyError."""
    group = make_group(G, P, S, R, seed=4, kl=False, group_id=GID)
    ref = torch.full((R, G, P + S), -3.0, dtype=torch.float64)
    rec = Recorder(model, at_wave=2, action=lambda g: setattr(g, "ref_logprobs", ref))
    with pytest.raises(ReplayInputError,
                       match=rf"group {GID}: replay input 'ref_logprobs' changed .*None -> "):
        joint_step(model, [group], LossSpec(), W, phase_callback=rec)
    assert rec.calls == ["prompt_producer", "wave", "wave"], rec.calls


# ---- inputs checked up front against the model and the loss --------------------------------


def _set(name, index, value):
    def f(g):
        getattr(g, name)[index] = value
    return f


def _bump(name, index):
    def f(g):
        _bump_token(getattr(g, name), index)
    return f


def _no_ref(g):
    g.ref_logprobs = None


LAST = G - 1  # its response has length S // 2 = 2: positions P+1 .. T-2 are padding
BAD_FOR_MODEL = {
    "label_in_response_not_next_token": (
        _bump("labels", (0, P + 1)), rf"labels\[0, {P + 1}\] = \d+ is not the next token "
                                     rf"tokens\[0, {P + 2}\]"),
    "label_at_last_prompt_position_not_next_token": (
        _bump("labels", (2, P - 1)), rf"labels\[2, {P - 1}\] = \d+ is not the next token "
                                     rf"tokens\[2, {P}\]"),
    "response_token_outside_vocab": (
        _set("tokens", (3, P + 1), VOCAB), rf"tokens\[3, {P + 1}\] = {VOCAB} lies outside the "
                                           rf"vocabulary \[0, {VOCAB}\)"),
    "prompt_token_outside_vocab": (
        _set("tokens", (slice(None), 2), VOCAB + 5), rf"tokens\[0, 2\] = {VOCAB + 5} lies "
                                                     rf"outside the vocabulary"),
    "negative_token": (_set("tokens", (0, P + 2), -1), rf"tokens\[0, {P + 2}\] = -1 lies outside"),
    "label_on_padding_outside_vocab": (
        _set("labels", (LAST, P + 2), VOCAB + 1), rf"labels\[{LAST}, {P + 2}\] = {VOCAB + 1} "
                                                  rf"lies outside the vocabulary"),
    "kl_without_ref_logprobs": (_no_ref, r"kl_coef = 0.1 > 0 needs ref_logprobs"),
}


@pytest.mark.parametrize("case", list(BAD_FOR_MODEL))
def test_input_the_model_or_loss_cannot_use_rejected_before_compute(model, case):
    corrupt, pattern = BAD_FOR_MODEL[case]
    _reject_corrupted(model, corrupt, rf"group {GID}: {pattern}")


def test_sequence_longer_than_position_table_rejected_before_compute(model):
    """Learned absolute positions: a sequence past max_sequence_length has no position
    embedding for its last positions (without the check: an IndexError mid-step)."""
    table = model.max_sequence_length
    long_group = make_group(3, table - 2, 3, R, seed=5, kl=True, group_id=GID)  # T = table + 1
    _reject(model, long_group, ValueError,
            rf"group {GID}: sequence length {table + 1} \(prompt {table - 2} \+ response 3\) "
            rf"exceeds the model's position table \(max_sequence_length {table}\)")
    fits = make_group(3, table - 3, 3, R, seed=5, kl=True, group_id=GID)  # T = table
    rec = Recorder(model)
    joint_step(model, [fits], LossSpec(kl_coef=0.1), W, phase_callback=rec)
    assert rec.calls[-1] == "joint_replay"


# ---- dropout is rejected: the replay would draw other masks than the prompt producer ---------


def _config_dropout(name):
    def f(model):
        setattr(model.config, name, 0.1)
    return f


def _extra_dropout(model):
    model.decoder.layers[0].mlp.add_module("noise", torch.nn.Dropout(0.2))


DROPOUT = {
    "hidden_dropout_set_after_build": (_config_dropout("hidden_dropout"),
                                       r"config.hidden_dropout = 0.1 \(flag --hidden-dropout\)"),
    "attention_dropout_set_after_build": (
        _config_dropout("attention_dropout"),
        r"config.attention_dropout = 0.1 \(flag --attention-dropout\)"),
    "dropout_module": (_extra_dropout,
                       r"module 'decoder.layers.0.mlp.noise' \(Dropout\) drops with p = 0.2 "
                       r"in training mode"),
}


@pytest.mark.parametrize("case", list(DROPOUT))
def test_dropout_rejected_before_compute(model, case):
    add_dropout, pattern = DROPOUT[case]
    add_dropout(model)
    _reject(model, _group(), ValueError, rf"joint replay does not support dropout: {pattern}")


def test_model_built_with_hidden_dropout_rejected_before_compute(mcore_single):
    """Layers keep their own copy of hidden_dropout: resetting the config does not help."""
    model = build_model(R=R, arch=True, hidden_dropout=0.1).double()
    model.config.hidden_dropout = 0.0
    _reject(model, _group(), ValueError,
            r"does not support dropout: module '\S+' \(\w+\) (drops with p|applies "
            r"hidden_dropout) = 0.1 in training mode")


def test_dropout_scoring_in_eval_mode_accepted(model):
    """In eval mode dropout is off: forward_only scoring runs; in training mode it is refused."""
    model.config.hidden_dropout = 0.1
    _reject(model, _group(), ValueError, r"config.hidden_dropout = 0.1", forward_only=True)
    model.eval()
    rec = Recorder(model)
    out = joint_step(model, [_group()], LossSpec(kl_coef=0.1), W, forward_only=True,
                     phase_callback=rec)
    assert out[0]["logprobs"].shape == (R, G, P + S)


def test_label_off_the_loss_mask_need_not_be_next_token(model):
    """Labels the loss does not weigh (loss_mask 0, e.g. padding) are only checked against the
    vocabulary: a padding label that is another valid id is accepted."""
    group = _group()
    assert group.loss_mask[LAST, P + 2] == 0
    _bump_token(group.labels, (LAST, P + 2))
    rec = Recorder(model)
    joint_step(model, [group], LossSpec(kl_coef=0.1), W, phase_callback=rec)
    assert rec.calls[-1] == "joint_replay"


# ---- a refused step: the contract ------------------------------------------------------------


def test_refused_step_says_its_partial_grads_must_be_discarded(model):
    """Refused after two waves ran: their gradients stay (the schedule never restores grads),
    and the error tells the caller to discard them and not to step (tests/app/test_refused_step.py:
    the trainer does)."""
    rec = Recorder(model, at_wave=2, action=MUTATIONS["advantages"])
    with pytest.raises(ReplayInputError) as info:
        joint_step(model, [_group()], LossSpec(kl_coef=0.1), W, phase_callback=rec)
    msg = str(info.value)
    assert "refused after compute began" in msg and "discard them" in msg, msg
    assert "do not step the optimizer" in msg, msg
    assert any(p.grad is not None and p.grad.any() for p in model.parameters())


@pytest.mark.parametrize("normalization, rows", [("token_mean", slice(None)),
                                                  ("seq_mean", slice(3, 4))])
def test_naive_step_refuses_rows_with_no_trained_token(model, normalization, rows):
    """The exported naive step runs joint replay's group checks: a group with no trained token
    (token mean: 0 / 0) or a row with none (sequence mean) is refused, not a NaN step."""
    from scalerlt_mcore.shared_prefix import naive_step as library_naive_step

    group = _group()
    group.loss_mask[rows] = 0
    first = 0 if rows.start is None else rows.start
    step = rl_forward_step(LossSpec(normalization=normalization, kl_coef=0.1).objective())
    for p in model.parameters():
        p.grad = None
    with pytest.raises(ValueError, match=rf"^group {GID}: response {first} has no trained "
                                         rf"token \(its loss_mask is 0 everywhere\)$"):
        library_naive_step(model, [group], step, 2)
    assert all(p.grad is None for p in model.parameters())


def test_naive_step_checks_the_loss_needs_up_front(model):
    """The naive schedule asks the loss's check_group too: KL without reference log-probs is
    refused before any compute, not in the middle of the step."""
    group = _group()
    group.ref_logprobs = None
    for p in model.parameters():
        p.grad = None
    from scalerlt_mcore.shared_prefix import naive_step as library_naive_step

    with pytest.raises(ValueError, match=rf"group {GID}: kl_coef = 0.1 > 0 needs ref_logprobs"):
        library_naive_step(model, [group], rl_forward_step(LossSpec(kl_coef=0.1).objective()), 2)
    assert all(p.grad is None for p in model.parameters())
