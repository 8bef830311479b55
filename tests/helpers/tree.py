"""Random prefix trees for the tree tests: segments of a given shape with random tokens and
per-token loss masks, and the GRPO group of their root-to-leaf rows (the naive reference)."""

import math

import torch

from scalerlt_mcore.rl.batch import RLGroup
from scalerlt_mcore.shared_prefix import TreeSegment

from .sp import VOCAB


def tree_segments(shape: list, seed: int, vocab: int = VOCAB, masks: str = "mixed") -> list:
    """``shape``: per node (root first) (parent index or None, length). ``masks``: "mixed"
    (an internal node's tokens trained on a random half, some nodes not at all), "none" (no
    internal token trained), or "leaves" (the default masks)."""
    gen = torch.Generator().manual_seed(seed)
    parents = [p for p, _ in shape]
    segments = []
    for n, (parent, length) in enumerate(shape):
        tokens = torch.randint(1, vocab, (length,), generator=gen)
        mask = None
        internal = n > 0 and n in parents
        if masks == "mixed" and internal:
            mask = (torch.rand(length, generator=gen) < 0.5).double() if n % 3 else None
        elif masks == "mixed" and n > 0:
            mask = torch.ones(length, dtype=torch.float64)
            mask[torch.rand(length, generator=gen) < 0.2] = 0  # some leaf tokens untrained
            mask[0] = 1
        segments.append(TreeSegment(tokens, parent, mask))
    return segments


def tree_group(shape: list, R: int, seed: int, dtype=torch.float64, kl: bool = False,
               group_id: int = 0, masks: str = "mixed", device=None) -> RLGroup:
    """The RLGroup of a random tree of ``shape`` (``tree_segments``) with random advantages
    and behaviour / reference log-probs near the tiny model's (as ``helpers.sp.make_group``)."""
    segments = tree_segments(shape, seed, masks=masks)
    probe = RLGroup.from_tree(segments, 0)
    G, T = probe.tokens.shape
    gen = torch.Generator().manual_seed(seed + 1)
    adv = torch.randn(G, generator=gen, dtype=dtype)
    base = -math.log(VOCAB)
    old = base + 0.25 * torch.randn(R, G, T, generator=gen, dtype=dtype)
    ref = base + 0.25 * torch.randn(R, G, T, generator=gen, dtype=dtype) if kl else None
    return RLGroup.from_tree(segments, 0, device=device, mask_dtype=dtype, group_id=group_id,
                             advantages=adv, old_logprobs=old, ref_logprobs=ref)


# Shapes: (parent, length) per node, root first.
DEPTH2 = [(None, 6), (0, 3), (0, 4), (1, 2), (1, 3), (1, 1), (2, 4), (2, 2)]
"""Root, two internal nodes of uneven lengths, 3 + 2 leaves."""

DEPTH3 = [(None, 5), (0, 2), (0, 3), (1, 2), (1, 3), (3, 2), (3, 1), (3, 3), (4, 2), (2, 3),
          (0, 2)]
"""Uneven: an internal node with an internal and a leaf child, depth-3 leaves under node 3,
a leaf child of the root beside internal ones."""
