"""``ar``: plain autoregressive decoding through the engine (the empty draft tree).

It is the baseline every speculative method is compared with: same runner, same cache, same
sampling code, one token per target forward.
"""

from __future__ import annotations

from ..tree import DraftTree
from .base import Drafter


class AutoregressiveDrafter(Drafter):
    name = "ar"

    def propose(self, tokens: list[int], budget: int) -> DraftTree:
        return DraftTree()
