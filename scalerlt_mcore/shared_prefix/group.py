"""A GRPO group as explicit tensors, its up-front checks, and the replay-input guard."""

import zlib
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

GUARDED = ("tokens", "labels", "loss_mask", "advantages", "old_logprobs", "ref_logprobs")


class ReplayInputError(RuntimeError):
    """A replay input changed after first use, or a group is malformed."""


@dataclass
class SharedPrefixGroup:
    """One prompt with G sampled responses, in MCore's batch layout (T = P + S).

    tokens:       [G, T] long, prompt (identical in every row) then the right-padded response.
    labels:       [G, T] long, labels[:, t] is the token predicted at position t (tokens shifted).
    loss_mask:    [G, T] float/bool, 1 where labels[:, t] is a response token that is trained;
                  0 on prompt positions t < P - 1 and on padding.
    advantages:   [G] per-response advantage (training only).
    old_logprobs: [R, G, T] per-loop log-probs of labels under the behaviour policy (training).
    ref_logprobs: optional [R, G, T] per-loop log-probs under a frozen reference (KL).
    prompt_length: P.
    """

    tokens: Tensor
    labels: Tensor
    loss_mask: Tensor
    prompt_length: int
    advantages: Optional[Tensor] = None
    old_logprobs: Optional[Tensor] = None
    ref_logprobs: Optional[Tensor] = None
    group_id: int = 0

    @classmethod
    def from_rollout(cls, prompt, responses: Tensor, lengths, pad_id: int, *, device=None,
                     mask_dtype: torch.dtype = torch.float32, group_id: int = 0,
                     advantages: Optional[Tensor] = None, old_logprobs: Optional[Tensor] = None,
                     ref_logprobs: Optional[Tensor] = None) -> "SharedPrefixGroup":
        """The group of one prompt's sampled responses, every tensor on ``device``.

        prompt:    the P prompt token ids (a list or a [P] tensor).
        responses: [G, S'] right-padded response ids (any device); S = max(lengths) <= S'.
        lengths:   [G] response lengths >= 1 (host values: a list or a CPU tensor).
        Builds tokens [G, P + S] (prompt, response, ``pad_id`` padding), labels (tokens
        shifted by one, ``pad_id`` last) and the loss mask (``mask_dtype``, 1 on the positions
        P - 1 .. P - 2 + length that predict a response token); the optional per-response
        tensors are moved to ``device`` as given.
        """
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
        extra = {n: None if t is None else t.to(device) for n, t in (
            ("advantages", advantages), ("old_logprobs", old_logprobs),
            ("ref_logprobs", ref_logprobs))}
        return cls(tokens=tokens, labels=labels, loss_mask=mask, prompt_length=P,
                   group_id=group_id, **extra)

    def check_device(self, device) -> None:
        """Raise if a tensor of the group is not on ``device`` (the model's), naming the field
        and both devices."""
        device = torch.device(device)
        for name in GUARDED:
            t = getattr(self, name)
            if t is not None and not _same_device(t.device, device):
                raise ValueError(f"group {self.group_id}: {name} is on {t.device}, the model on "
                                 f"{device}; build the group on the model's device "
                                 f"(SharedPrefixGroup.from_rollout(..., device=...))")

    @property
    def group_size(self) -> int:
        return self.tokens.shape[0]

    @property
    def response_length(self) -> int:
        return self.tokens.shape[1] - self.prompt_length

    def waves(self, wave_size: int) -> list:
        """The group's responses split into waves of ``wave_size``: ``WaveBatch`` objects."""
        rows = torch.arange(self.group_size, device=self.tokens.device)
        return [WaveBatch(self, idx) for idx in rows.split(wave_size)]

    def guarded(self) -> dict:
        return {n: getattr(self, n) for n in GUARDED if getattr(self, n) is not None}

    def check(self, num_loops: int, max_response_length: Optional[int] = None,
              training: bool = True) -> None:
        """Reject a malformed group before any compute; errors name the tensor and the group."""
        tag = f"group {self.group_id}"
        if training and (self.advantages is None or self.old_logprobs is None):
            raise ValueError(f"{tag}: training needs advantages and old_logprobs")
        G, T = self.tokens.shape if self.tokens.dim() == 2 else (None, None)
        if G is None:
            raise ValueError(f"{tag}: tokens must be [G, T], got {tuple(self.tokens.shape)}")
        expected = {"labels": (G, T), "loss_mask": (G, T), "advantages": (G,),
                    "old_logprobs": (num_loops, G, T), "ref_logprobs": (num_loops, G, T)}
        for name, shape in expected.items():
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != shape:
                raise ValueError(f"{tag}: {name} has shape {tuple(t.shape)}, expected {shape}")
        P = self.prompt_length
        if not 1 <= P < T:
            raise ValueError(f"{tag}: prompt_length {P} must be in [1, {T - 1}] (T={T})")
        self._check_prompt_shared(tag)
        self._check_responses(tag, max_response_length)
        for name, t in self.guarded().items():
            if t.is_floating_point() and not torch.isfinite(t).all():
                raise ValueError(f"{tag}: {name} contains NaN or inf")

    def _check_prompt_shared(self, tag: str) -> None:
        prompt = self.tokens[:, : self.prompt_length]
        differs = (prompt != prompt[:1]).any(dim=1)
        if differs.any():
            i = int(differs.nonzero()[0])
            P = self.prompt_length
            raise ReplayInputError(
                f"{tag}: response {i} is not preceded by the group's prompt tokens "
                f"(tokens[{i}, :{P}] differs from tokens[0, :{P}])"
            )

    def _check_responses(self, tag: str, max_response_length: Optional[int]) -> None:
        P = self.prompt_length
        if (self.loss_mask[:, : P - 1] != 0).any():
            raise ValueError(f"{tag}: loss_mask is non-zero on prompt positions < {P - 1}")
        per_response = (self.loss_mask[:, P - 1 :] != 0).sum(dim=1)
        if (per_response == 0).any():
            i = int((per_response == 0).nonzero()[0])
            raise ValueError(f"{tag}: response {i} is empty (no loss_mask token)")
        if (self.loss_mask[:, -1] != 0).any():
            raise ValueError(f"{tag}: loss_mask is non-zero on the last position (its label "
                             f"lies past the sequence)")
        if max_response_length is not None and self.response_length > max_response_length:
            raise ValueError(f"{tag}: response length {self.response_length} exceeds the "
                             f"configured maximum {max_response_length}")


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
    """

    group: SharedPrefixGroup
    index: Tensor

    def rows(self, t: Optional[Tensor], dim: int = 0) -> Optional[Tensor]:
        """``t`` restricted to this wave's rows along ``dim`` (None stays None)."""
        return None if t is None else t.index_select(dim, self.index)


def fingerprint(t: Tensor) -> tuple:
    """(version counter, CRC32 of the bytes): any in-place change alters one of them."""
    data = t.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes()
    return t._version, zlib.crc32(data)


class ReplayGuard:
    """Fingerprints a group's inputs at first use and verifies them before replays."""

    def __init__(self, group: SharedPrefixGroup):
        self.group = group
        self.prints = {n: fingerprint(t) for n, t in group.guarded().items()}

    def verify(self, where: str) -> None:
        for name, t in self.group.guarded().items():
            now = fingerprint(t)
            if now != self.prints[name]:
                raise ReplayInputError(
                    f"group {self.group.group_id}: replay input '{name}' changed since first use "
                    f"(version/checksum {self.prints[name]} -> {now}); refusing the {where}"
                )
