"""The replay-input tests' group (R, G, P, S, W: two non-final waves), a ``phase_callback``
that acts at the n-th wave, and the in-place mutations of each guarded field."""

import torch

from helpers.sp import VOCAB, grads, make_group

R, G, P, S, W = 2, 5, 6, 4, 2  # waves [0, 1], [2, 3], [4]: two non-final waves
GID = 17


def _group(**kw):
    return make_group(G, P, S, R, seed=4, kl=True, group_id=GID, **kw)


class Recorder:
    """phase_callback that records the phases and runs ``action`` at the n-th "wave"."""

    def __init__(self, model, at_wave=None, action=None):
        self.model, self.at_wave, self.action = model, at_wave, action
        self.calls, self.waves, self.grads_at_action = [], 0, None

    def __call__(self, phase, group):
        self.calls.append(phase)
        if phase == "wave":
            self.waves += 1
            if self.waves == self.at_wave:
                self.grads_at_action = grads(self.model)
                self.action(group)


def _bump_token(t: torch.Tensor, index) -> None:
    t[index] = t[index] % (VOCAB - 1) + 1  # another valid token id


MUTATIONS = {
    "tokens": lambda g: _bump_token(g.tokens, (G - 1, P)),  # a response token of the last wave
    "labels": lambda g: _bump_token(g.labels, (1, P - 1)),
    "loss_mask": lambda g: g.loss_mask[2, P - 1].mul_(0.5),
    "advantages": lambda g: g.advantages.add_(0.25),
    "old_logprobs": lambda g: g.old_logprobs[1, 3, P].sub_(0.1),
    "ref_logprobs": lambda g: g.ref_logprobs[0, 4, P].add_(0.1),
}
