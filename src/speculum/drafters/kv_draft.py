"""``kv_draft``: lossless long-context decoding that drafts from a compressed view of the cache
(TriForce, Sun et al. 2024; MagicDec, Chen et al. 2024).

The full KV cache is kept and verifies every token; the draft is the same model reading only part
of it: StreamingLLM's first ``sink`` and last ``window`` entries (Xiao et al. 2024). With a long
prompt, a draft step then reads ``sink + window`` entries instead of the whole context, while the
output is exactly full-cache decoding's. ``bits`` (4 or 8) also quantizes the draft's weights
(:mod:`speculum.drafters.quant_self`), cheaper still. Drafting is
:class:`~speculum.drafters.self_draft.SelfDrafter`'s: a chain with a confidence stop, or a dynamic
tree with ``top_k > 1``.
"""

from __future__ import annotations

import torch

from ..errors import SpeculumError
from ..runners.quantized import quantized_head, quantized_layers
from ..runners.self_draft import DraftView, SelfDraft
from .self_draft import SelfDrafter

KV_DRAFT_POLICIES = ("streaming",)


class KVDraftDrafter(SelfDrafter):
    name = "kv_draft"

    def __init__(self, target: torch.nn.Module, policy: str = "streaming", sink: int = 4, window: int = 512,
                 bits: int | None = None, depth: int = 6, exit_confidence: float = 0.3, **options):
        if policy not in KV_DRAFT_POLICIES:
            raise SpeculumError(f"unknown kv-draft policy {policy!r}; choose from {', '.join(KV_DRAFT_POLICIES)}")
        if sink < 0 or window < 1:
            raise SpeculumError(f"a kv-draft view needs sink >= 0 and window >= 1 (got {sink}, {window})")
        super().__init__(target, depth=depth, exit_confidence=exit_confidence, **options)
        weights = head = None
        if bits is not None:
            weights, head = quantized_layers(self.decoder, bits), quantized_head(self.decoder, bits)
        self.model = SelfDraft(self.decoder, weights=weights, head=head, view=DraftView(sink, window))
