"""A group of responses to one prompt as explicit tensors, its up-front checks, and the
replay-input guard. The group knows no loss: a loss that needs tensors of its own (weights,
behaviour log-probs, ...) declares them in a subclass (``EXTRAS``), and they are checked and
guarded like the group's own."""

import numbers
from dataclasses import dataclass, field
from typing import ClassVar, Optional

import torch
from torch import Tensor

from .tree import PrefixTree, TreeError, build_tree, check_rows, flat_tree, tree_rows

GUARDED = ("tokens", "labels", "loss_mask")
"""The group's own tensor fields the replay reads (a subclass adds its ``EXTRAS``)."""

GUARDED_SCALARS = ("prompt_length", "group_id", "tree")
"""The non-tensor fields the replay reads."""


class ReplayInputError(RuntimeError):
    """A replay input changed after first use, or a group is malformed."""


@dataclass
class SharedPrefixGroup:
    """One prompt with G sampled responses, in MCore's batch layout (T = P + S).

    tokens:       [G, T] long, prompt (identical in every row) then the right-padded response.
    labels:       [G, T] long, labels[:, t] is the token predicted at position t (tokens shifted).
    loss_mask:    [G, T] float/bool, 1 where labels[:, t] is a response token that is trained;
                  0 on prompt positions t < P - 1 and on padding.
    prompt_length: P.
    group_id:     names the group in errors.

    The replay reads ``labels[:, P-1 : T-1]`` (the labels of the response positions,
    ``response_positions``); labels at the prompt positions < P - 1 and at T - 1 are never read.

    A loss's own tensors are the fields of a subclass named in its ``EXTRAS``, each optional
    (None: absent), e.g. the RL loss's group in ``scalerlt_mcore.rl.batch``.

    tree: None for a one-level group; a ``PrefixTree`` when the rows are the root-to-leaf
    sequences of a prefix tree (``from_tree``): the rows are still the naive reference.
    """

    tokens: Tensor
    labels: Tensor
    loss_mask: Tensor
    prompt_length: int
    group_id: int = 0
    tree: Optional[PrefixTree] = None

    EXTRAS: ClassVar[dict] = {}
    """A subclass's loss-owned tensor fields: name -> shape in the symbols ``R`` (the model's
    loops), ``G`` (responses) and ``T`` (positions), e.g. ``("R", "G", "T")``. Each is moved to
    the device by ``from_rollout``, device-, shape- and finiteness-checked by ``check`` and
    fingerprinted by ``ReplayGuard``, like ``tokens``; one that is None stays None."""

    @classmethod
    def from_rollout(cls, prompt, responses: Tensor, lengths, pad_id: int, *, device=None,
                     mask_dtype: torch.dtype = torch.float32, group_id: int = 0,
                     **extras) -> "SharedPrefixGroup":
        """The group of one prompt's sampled responses, every tensor on ``device``.

        prompt:    the P prompt token ids (a list or a [P] tensor).
        responses: [G, S'] right-padded response ids (any device); S = max(lengths) <= S'.
        lengths:   [G] response lengths >= 1 (host values: a list or a CPU tensor).
        extras:    tensors of the class's ``EXTRAS`` (moved to ``device`` as given).
        Builds tokens [G, P + S] (prompt, response, ``pad_id`` padding), labels (tokens
        shifted by one, ``pad_id`` last) and the loss mask (``mask_dtype``, 1 on the positions
        P - 1 .. P - 2 + length that predict a response token).
        """
        _check_extras(cls, extras)
        prompt = torch.as_tensor(prompt, dtype=torch.long, device=device)  # [P]
        lens = _host_lengths(lengths, responses, f"group {group_id}")  # [G] on the host
        P, S, G = prompt.shape[0], int(lens.max()), responses.shape[0]
        if P < 1:
            raise ValueError(f"group {group_id}: the prompt is empty")
        tokens = torch.full((G, P + S), pad_id, dtype=torch.long, device=device)  # [G, T]
        tokens[:, :P] = prompt
        tokens[:, P:] = responses[:, :S].to(device)
        labels = torch.full_like(tokens, pad_id)
        labels[:, :-1] = tokens[:, 1:]
        span = torch.arange(P + S, device=device)[None, :]  # [1, T]
        ends = (P - 1 + lens).to(device)[:, None]  # [G, 1]
        mask = ((span >= P - 1) & (span < ends)).to(mask_dtype)  # [G, T]
        return cls(tokens=tokens, labels=labels, loss_mask=mask, prompt_length=P,
                   group_id=group_id, **_moved(extras, device, group_id))

    @classmethod
    def from_tree(cls, segments: list, pad_id: int, *, device=None,
                  mask_dtype: torch.dtype = torch.float32, group_id: int = 0,
                  **extras) -> "SharedPrefixGroup":
        """The group of a prefix tree's root-to-leaf rows, every tensor on ``device``.

        segments: ``TreeSegment``s, the root (the prompt) first; errors name the node.
        Row g holds the tokens of every node on the path to the g-th leaf (leaves in segment
        order), right-padded with ``pad_id``; labels are the tokens shifted by one; the loss
        mask is 1 where the label (token t + 1) is a trained token of its node. ``extras``
        are per row, as for ``from_rollout``.
        """
        _check_extras(cls, extras)
        try:
            tree, tokens, masks = build_tree(segments)
        except TreeError as e:
            raise TreeError(f"group {group_id}: {e}") from None
        rows, labels, mask = tree_rows(tree, tokens, masks, pad_id)  # [G, T] each
        return cls(tokens=rows.to(device), labels=labels.to(device),
                   loss_mask=mask.to(device=device, dtype=mask_dtype),
                   prompt_length=tree.ends[0], group_id=group_id, tree=tree,
                   **_moved(extras, device, group_id))

    @classmethod
    def guarded_fields(cls) -> tuple:
        """Every tensor field the replay reads: the group's own, then the ``EXTRAS``."""
        return GUARDED + tuple(cls.EXTRAS)

    def check_device(self, device) -> None:
        """Raise if a tensor of the group is not on ``device`` (the model's), naming the field
        and both devices."""
        device = torch.device(device)
        for name in self.guarded_fields():
            t = getattr(self, name)
            if t is not None and not _same_device(t.device, device):
                raise ValueError(f"group {self.group_id}: {name} is on {t.device}, the model on "
                                 f"{device}; build the group on the model's device "
                                 f"({type(self).__name__}.from_rollout(..., device=...))")

    @property
    def group_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def response_length(self) -> int:
        return self.tokens.shape[1] - self.prompt_length

    # ---- the group layout: position t of a [..., T] tensor belongs to labels[:, t] ----------

    @property
    def response_positions(self) -> slice:
        """Positions P-1 .. T-2 of the group layout: those whose label is a response token
        (S = T - P of them), the only positions a loss reads."""
        P = self.prompt_length
        return slice(P - 1, P - 1 + self.response_length)

    def to_layout(self, tail: Tensor) -> Tensor:
        """Values of the response positions [..., S] in the group layout [..., T]: zeros on
        the prompt positions 0 .. P-2 and at the last position T-1."""
        lead = tail.shape[:-1]
        return torch.cat([tail.new_zeros(*lead, self.prompt_length - 1), tail,
                          tail.new_zeros(*lead, 1)], dim=-1)

    def exit_runs(self, num_loops: int) -> Optional[Tensor]:
        """[G, T] the loops each position ran in the engine that sampled the responses, from
        the recorded exit depth of each label (``exit_depths``, a loss's field: the loop the
        token was sampled at, 0 for a token not sampled): a position whose own token was
        sampled ran to its label's depth; one whose token was prefilled (the prompt, an
        environment's reply) or whose label was not sampled ran all R. None without them."""
        reads = getattr(self, "exit_depths", None)
        if reads is None:
            return None
        sampled = torch.zeros_like(reads, dtype=torch.bool)
        sampled[:, 1:] = reads[:, :-1] > 0  # token p is label p - 1
        return torch.where(sampled & (reads > 0), reads, num_loops)

    def as_tree(self) -> PrefixTree:
        """The group's ``tree``; a one-level group's is its depth-1 tree: the prompt (node 0)
        and one leaf per row, each leaf the row's positions P .. T-1 (padding included)."""
        if self.tree is not None:
            return self.tree
        G, T = self.tokens.shape
        return flat_tree(self.prompt_length, T, G)

    def waves(self, wave_size: int) -> list:
        """The group's responses split into waves of ``wave_size``: ``WaveBatch`` objects."""
        rows = torch.arange(self.group_size, device=self.tokens.device)
        return [WaveBatch(self, idx) for idx in rows.split(wave_size)]

    def guarded(self) -> dict:
        return {n: getattr(self, n) for n in self.guarded_fields() if getattr(self, n) is not None}

    def check(self, num_loops: int, max_response_length: Optional[int] = None,
              vocab_size: Optional[int] = None, max_positions: Optional[int] = None) -> None:
        """Reject a malformed group before any compute; errors name the group, the tensor and
        the position. ``vocab_size``: token ids and read labels must lie in [0, vocab_size);
        ``max_positions``: the model's position table (sequences must fit it). Which extra
        tensors a loss needs is the loss's check (``forward_step_func.check_group``)."""
        tag = f"group {self.group_id}"
        self._check_shapes(tag, num_loops)
        self._check_constants(tag)
        self._check_prompt_shared(tag)
        if vocab_size is not None:
            self._check_ids(tag, vocab_size)
        self._check_responses(tag, max_response_length)
        self._check_labels_shifted(tag)
        if self.tree is not None:
            self._check_tree(tag)
        if max_positions is not None and self.tokens.shape[1] > max_positions:
            raise ValueError(
                f"{tag}: sequence length {self.tokens.shape[1]} (prompt {self.prompt_length} + "
                f"response {self.response_length}) exceeds the model's position table "
                f"(max_sequence_length {max_positions}): positions >= {max_positions} have no "
                f"position embedding")
        for name, t in self.guarded().items():
            if t.is_floating_point() and not torch.isfinite(t).all():
                raise ValueError(f"{tag}: {name} contains NaN or inf")

    def check_for(self, model, num_loops: int,
                  max_response_length: Optional[int] = None) -> None:
        """``check_device`` and ``check`` against ``model`` (the bare looped GPT): its device,
        its vocabulary and, with learned absolute positions, its position table -- the checks
        every step (joint replay and ``naive_step``) runs on each group before any compute."""
        learned = getattr(model, "position_embedding_type", None) == "learned_absolute"
        self.check_device(next(model.parameters()).device)
        self.check(num_loops, max_response_length, vocab_size=getattr(model, "vocab_size", None),
                   max_positions=model.max_sequence_length if learned else None)

    def _check_shapes(self, tag: str, num_loops: int) -> None:
        if self.tokens.dim() != 2:
            raise ValueError(f"{tag}: tokens must be [G, T], got {tuple(self.tokens.shape)}")
        G, T = self.tokens.shape
        if G == 0:
            raise ValueError(f"{tag}: the group has no responses (tokens has shape "
                             f"{tuple(self.tokens.shape)}); give each group >= 1 response")
        sizes = {"R": num_loops, "G": G, "T": T}
        expected = {"labels": (G, T), "loss_mask": (G, T)}
        expected.update({n: tuple(sizes[d] for d in dims) for n, dims in self.EXTRAS.items()})
        for name, shape in expected.items():
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != shape:
                raise ValueError(f"{tag}: {name} has shape {tuple(t.shape)}, expected {shape}")
        for name in ("tokens", "labels"):
            t = getattr(self, name)
            if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
                raise ValueError(f"{tag}: {name} must hold integer token ids, got {t.dtype}")
        P = self.prompt_length
        if not isinstance(P, numbers.Integral) or not 1 <= P < T:
            raise ValueError(f"{tag}: prompt_length {P!r} must be an integer in [1, {T - 1}] "
                             f"(T={T})")

    def _check_tree(self, tag: str) -> None:
        if not isinstance(self.tree, PrefixTree):
            raise TypeError(f"{tag}: tree must be a PrefixTree, got {type(self.tree).__name__}")
        check_rows(self.tree, tag, self.tokens, self.loss_mask, self.prompt_length)

    def _check_constants(self, tag: str) -> None:
        """Every field the replay reads is a constant of the step: one that still carries an
        autograd graph would be backpropagated through by a one-wave group and be freed by the
        first wave's backward of a group of several."""
        for name, t in self.guarded().items():
            if t.requires_grad:
                how = f"grad_fn {type(t.grad_fn).__name__}" if t.grad_fn else "requires_grad"
                raise ValueError(f"{tag}: {name} carries an autograd graph ({how}); the "
                                 f"schedule's inputs are constants: pass {name}.detach()")

    def _check_ids(self, tag: str, vocab_size: int) -> None:
        """Token ids (all positions) and the read labels (positions P-1 .. T-2) in the vocab."""
        read = self.response_positions
        for name, ids, offset in (("tokens", self.tokens, 0),
                                  ("labels", self.labels[:, read], read.start)):
            outside = (ids < 0) | (ids >= vocab_size)
            if outside.any():
                i, t = outside.nonzero()[0].tolist()
                raise ValueError(f"{tag}: {name}[{i}, {t + offset}] = {int(ids[i, t])} lies "
                                 f"outside the vocabulary [0, {vocab_size})")

    def _check_labels_shifted(self, tag: str) -> None:
        """Where the loss reads a label (loss_mask != 0, positions P-1 .. T-2), it must be the
        next token: labels[:, t] == tokens[:, t + 1]."""
        read = self.response_positions
        start = read.start
        labels, following = self.labels[:, read], self.tokens[:, start + 1 :]  # [G, S]
        wrong = (labels != following) & (self.loss_mask[:, read] != 0)
        if wrong.any():
            i, t = wrong.nonzero()[0].tolist()
            raise ValueError(
                f"{tag}: labels[{i}, {start + t}] = {int(labels[i, t])} is not the next token "
                f"tokens[{i}, {start + t + 1}] = {int(following[i, t])} (labels must be the "
                f"tokens shifted by one wherever loss_mask is non-zero)")

    def _check_prompt_shared(self, tag: str) -> None:
        """Every row starts with the group's prompt: the first P tokens most rows share. A row
        that differs is named; with no prompt in a majority of the rows, the group is."""
        P = self.prompt_length
        prompts, which, counts = torch.unique(self.tokens[:, :P], dim=0, return_inverse=True,
                                              return_counts=True)  # [U, P], [G], [U]
        if prompts.shape[0] == 1:
            return
        shared = int(counts.argmax())
        if 2 * int(counts[shared]) <= self.group_size:
            raise ReplayInputError(
                f"{tag}: the responses share no prompt (tokens[:, :{P}] holds "
                f"{prompts.shape[0]} different prompts, none in a majority of the "
                f"{self.group_size} rows)")
        i = int((which != shared).nonzero()[0])
        raise ReplayInputError(
            f"{tag}: response {i} is not preceded by the group's prompt tokens "
            f"(tokens[{i}, :{P}] differs from the prompt {int(counts[shared])} of the "
            f"{self.group_size} rows share)")

    def _check_responses(self, tag: str, max_response_length: Optional[int]) -> None:
        P = self.prompt_length
        if (self.loss_mask[:, : P - 1] != 0).any():
            raise ValueError(f"{tag}: loss_mask is non-zero on prompt positions < {P - 1}")
        per_response = (self.loss_mask[:, P - 1 :] != 0).sum(dim=1)
        if (per_response == 0).any():
            i = int((per_response == 0).nonzero()[0])
            raise ValueError(f"{tag}: response {i} has no trained token (its loss_mask is 0 "
                             f"everywhere)")
        if (self.loss_mask[:, -1] != 0).any():
            raise ValueError(f"{tag}: loss_mask is non-zero on the last position (its label "
                             f"lies past the sequence)")
        if max_response_length is not None and self.response_length > max_response_length:
            raise ValueError(f"{tag}: response length {self.response_length} exceeds the "
                             f"configured maximum {max_response_length}")


def _check_extras(cls, extras: dict) -> None:
    unknown = sorted(set(extras) - set(cls.EXTRAS))
    if unknown:
        raise TypeError(f"{cls.__name__} has no extra tensor {unknown[0]!r} (its EXTRAS: "
                        f"{sorted(cls.EXTRAS)})")


def _moved(extras: dict, device, group_id: int) -> dict:
    """The extras on ``device`` (None stays None); one that is not a tensor is refused, naming
    it and its type (its dtype would be a guess)."""
    for name, t in extras.items():
        if t is not None and not isinstance(t, Tensor):
            raise TypeError(f"group {group_id}: {name} must be a tensor (None: absent), got "
                            f"{type(t).__name__}; pass torch.tensor(..., dtype=...)")
    return {n: None if t is None else t.to(device) for n, t in extras.items()}


def _host_lengths(lengths, responses: Tensor, tag: str) -> Tensor:
    """Response lengths [G] as a host tensor, checked against ``responses`` [G, S']."""
    lens = torch.as_tensor(lengths, dtype=torch.long, device="cpu")
    if responses.dim() != 2:
        raise ValueError(f"{tag}: responses must be [G, S'], got {tuple(responses.shape)}")
    G, width = responses.shape
    if tuple(lens.shape) != (G,):
        raise ValueError(f"{tag}: lengths must be [G] = [{G}], got shape {tuple(lens.shape)}")
    if G == 0 or int(lens.min()) < 1 or int(lens.max()) > width:
        raise ValueError(f"{tag}: response lengths must lie in [1, {width}] (the responses' "
                         f"width), got {lens.tolist()}")
    return lens


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Same device type, and the same index where both name one ('cuda' matches 'cuda:0')."""
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


@dataclass
class WaveBatch:
    """What a per-wave ``forward_step_func`` receives from the data iterator: a group and the
    rows (responses) of one wave. Its loss is that wave's share of the *group's* loss, so
    normalisations over the group are computed from ``group`` (all waves), not from the wave.

    group: the SharedPrefixGroup.
    index: [W] long, the group rows of this wave.
    span:  the positions of the group layout the wave's output covers (all of them for a
           one-level group; a tree node's or leaf's positions for a tree group).
    """

    group: SharedPrefixGroup
    index: Tensor
    span: slice = field(default_factory=lambda: slice(None))

    def positions(self, t: Optional[Tensor]) -> Optional[Tensor]:
        """``t`` [..., T] restricted to the wave's positions [..., span] (None stays None)."""
        return None if t is None else t[..., self.span]

    def rows(self, t: Optional[Tensor], dim: int = 0) -> Optional[Tensor]:
        """``t`` restricted to this wave's rows along ``dim`` (None stays None)."""
        return None if t is None else t.index_select(dim, self.index)

    @property
    def whole(self) -> bool:
        """Whether the wave covers every position (a one-level group's wave)."""
        return self.span == slice(None)

    def suffix(self) -> tuple:
        """What the wave's rows run against the prefix state: their response tokens [W, S]
        (positions P .. T-1) and the labels of the response positions [W, S]; for a wave with
        a ``span`` (a tree's), the tokens whose labels the span holds and those labels."""
        g = self.group
        if not self.whole:
            s = self.span
            return g.tokens[self.index, s.start + 1 : s.stop + 1], g.labels[self.index, s]
        return g.tokens[self.index, g.prompt_length :], g.labels[self.index, g.response_positions]


def fingerprint(t: Optional[Tensor]) -> Optional[tuple]:
    """(shape, dtype, version counter, data pointer) of a tensor, read on the host without
    waiting for the device; None for None. An in-place change through torch moves the
    version, a swapped tensor or ``.data`` the pointer; a write that bypasses both (through
    ``.data[...]``) is caught by ``content_checksum``."""
    if t is None:
        return None
    return tuple(t.shape), t.dtype, t._version, t.data_ptr()


CHECKSUM_STRIDE = 2 * 0x9E3779B97F4A7C15 % 2**63
"""Even step of the odd per-byte weights of ``content_checksum``."""


def content_checksum(t: Tensor) -> Tensor:
    """An int64 scalar on ``t``'s device: sum_i byte_i * w_i mod 2^64 with odd weights w_i
    (so any one changed byte changes it), computed there and not read on the host."""
    data = t.detach().contiguous().reshape(-1).view(torch.uint8).long()
    weights = torch.arange(data.numel(), dtype=torch.long, device=data.device)
    return (data * (weights * CHECKSUM_STRIDE + 1)).sum()


class ReplayGuard:
    """Fingerprints every field of a group the replay reads at first use and verifies them
    before replays: the tensors (``guarded_fields``: the group's own and its ``EXTRAS``; one that
    was None must stay None) and ``prompt_length`` and ``group_id``.

    ``verify`` reads only host-side facts (shape, dtype, version counter, data pointer,
    the scalars): it never waits for the device, so it runs before every phase and wave.
    ``verify(..., contents=True)`` also compares the tensors' content checksums, computed on
    the device, in one read on the host: once per group, before the joint replay (or a
    naive plan's last microbatch), whatever the number of waves."""

    def __init__(self, group: SharedPrefixGroup):
        self.group = group
        self.group_id = group.group_id
        self.prints = self._prints()
        self.sums = self._checksums()

    def _prints(self) -> dict:
        prints = {n: getattr(self.group, n) for n in GUARDED_SCALARS}
        prints.update({n: fingerprint(getattr(self.group, n))
                       for n in self.group.guarded_fields()})
        return prints

    def _checksums(self) -> dict:
        return {n: content_checksum(t) for n in self.group.guarded_fields()
                if (t := getattr(self.group, n)) is not None}

    def verify(self, where: str, contents: bool = False) -> None:
        now = self._prints()
        for name, before in self.prints.items():
            if now[name] != before:
                raise ReplayInputError(
                    f"group {self.group_id}: replay input '{name}' changed since first use "
                    f"({_describe(before)} -> {_describe(now[name])}); refusing the {where}"
                )
        if contents:
            self._verify_contents(where)

    def _verify_contents(self, where: str) -> None:
        names = list(self.sums)
        if not names:
            return
        now = torch.stack([content_checksum(getattr(self.group, n)) for n in names])
        changed = now != torch.stack([self.sums[n] for n in names])
        if bool(changed.any()):  # the one read on the host
            name = names[int(changed.nonzero()[0, 0])]
            raise ReplayInputError(
                f"group {self.group_id}: replay input '{name}' changed since first use (its "
                f"content checksum; the version counter did not move); refusing the {where}")


def _describe(value) -> str:
    if isinstance(value, tuple):  # a tensor's fingerprint
        return f"shape/dtype/version/data pointer {value}"
    return repr(value)
