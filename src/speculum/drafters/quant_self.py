"""``quant_self``: a weight-only quantized copy of the target drafts; the target verifies (QSpec,
Zhao et al. 2024, drafts with low-precision weights of the same model).

The copy's linear layers and LM head are quantized to int4 (groups of 32, the default) or int8
(per channel) (:mod:`speculum.drafting.quantized_copy`); embeddings, norms and the attention itself are
the target's. It drafts over the target's own KV cache (:mod:`speculum.drafting.self_forward`), so the
context it reads is the full-precision one and nothing is prefilled twice. Drafting is
:class:`~speculum.drafters.self_draft.SelfDrafter`'s: a chain with a confidence stop, or a dynamic
tree with ``top_k > 1``; a chain that has occurred earlier in the text ends with the ``lookup`` (8)
tokens that followed it there, without further draft forwards (``lookup=0``: none).
"""

from __future__ import annotations

import warnings

import torch

from ..drafting.quantized_copy import quantized_layers, weights_already_quantized
from ..drafting.self_forward import SelfDraft
from .self_draft import SelfDrafter


class QuantSelfDrafter(SelfDrafter):
    name = "quant_self"

    def __init__(self, target: torch.nn.Module, bits: int = 4, depth: int = 6, **options):
        super().__init__(target, depth=depth, **options)
        if weights_already_quantized(self.decoder):
            warnings.warn("quant_self on a model whose weights are already quantized (a GGUF file): its int"
                          f"{bits} copy runs on torch's kernels, slower than the model's own; it pays with "
                          "--weights float", stacklevel=2)
        self.bits = bits
        self.model = SelfDraft(self.decoder, weights=quantized_layers(self.decoder, bits),
                               head=self.draft_head(target, bits))
