"""``kv_draft``: lossless long-context decoding that drafts from a compressed view of the cache
(TriForce, Sun et al. 2024; MagicDec, Chen et al. 2024).

The full KV cache is kept and verifies every token; the draft is the same model reading only part
of it (:class:`~speculum.drafting.self_forward.DraftView`):

- ``streaming``: StreamingLLM's first ``sink`` and last ``window`` (512) entries (Xiao et al. 2024);
- ``snapkv``: those (``window`` 256), and on full-attention layers ``selected`` (512) entries per KV
  head from between them, the ones the prompt's last ``observe`` (32) tokens attend to most, picked
  once the prompt is in (SnapKV, Li et al. 2024): where the question's answer lies in the middle of
  a long prompt, the draft still reads it;
- ``quest``: the sinks and the last ``window`` (256), and on full-attention layers ``pages`` (32)
  pages of ``page`` (16) entries per KV head from between them, picked at every draft forward and
  layer by the upper bound of the draft's own attention scores over each page (Quest, Tang et al.
  2024; the pages' key bounds are taken once the prompt is in): the selection follows what the
  draft is writing, at the price of scoring the pages in every forward;
- ``duo``: DuoAttention's head split (Xiao et al. 2024, the gates of :mod:`speculum.kv.duo_attention`,
  ``gates`` a file or those shipped for the model): on full-attention layers the ``retrieval`` percent
  (25) of the gated KV heads with the highest gates read everything, the others the sinks and the
  window (by default the pattern the gates were learned with: 64 + 256 for the shipped ones);
- ``tidal``: TidalDecode's selection (Yang et al. 2024, :mod:`speculum.kv.tidal`'s selection layers,
  placed after ``dense`` (2) layers): full-attention layers read everything up to the first selection
  layer and at each one, which picks ``selected`` (512) entries per KV head from between the sinks and
  the window (256) by the draft rows' attention; the layers after it read those, the sinks and the
  window: the selection follows what the draft is writing, at the price of a few layers reading
  the whole cache;
- ``tokenselect``: TokenSelect's head soft voting (Wu et al. 2024, :mod:`speculum.kv.tokenselect`):
  full-attention layers from ``dense`` (2) on read the sinks, the window (256) and the ``selected``
  (512) entries between them with the most votes from the draft rows' queries, one choice per layer
  for all its heads, a layer's last vote reused while the queries' cosine similarity with the ones
  that cast it stays at least ``threshold`` percent (90; the Selection Cache);
- ``double_sparsity``: Double Sparsity's label channels (Yang et al. 2024,
  :mod:`speculum.kv.double_sparsity`): the sinks, the last ``window`` (256) and on full-attention
  layers ``selected`` (512) entries per KV head from between them, picked at every draft forward by
  the draft rows' attention approximated on ``channels`` (the head size / 8) label channels, which the
  prompt's last ``observe`` (32) tokens choose once the prompt is in.

With a long prompt, a draft step then reads a few hundred entries instead of the whole context (in the
heads and layers a view does not give everything), while the output is exactly full-cache decoding's. The
draft's weights: ``bits=16`` the target's own (the default where those are already quantized, a GGUF model
on speculum's kernels, which stream fewer bytes than a torch copy would), ``bits`` 4 (the default for float
weights) or 8 a weight-only quantized copy (:mod:`speculum.drafters.quant_self`). Drafting is
:class:`~speculum.drafters.self_draft.SelfDrafter`'s: a chain with a confidence stop, or a dynamic
tree with ``top_k > 1``. A chain that has occurred earlier in the text ends with the ``lookup`` (8) tokens
that followed it there (``lookup=0``: none): an answer copied from the prompt, a needle's value,
then costs one draft forward rather than one per token.
"""

from __future__ import annotations

import torch

from ..drafting.quantized_copy import quantized_layers, weights_already_quantized
from ..drafting.self_forward import SelfDraft
from ..drafting.view_choice import VIEWS, draft_view
from ..errors import SpeculumError
from ..options import parse_named
from .self_draft import SelfDrafter

KV_DRAFT_POLICIES = VIEWS
# the integer options a spec may set (and ``gates``, duo's gates file)
KV_DRAFT_OPTIONS = ("sink", "window", "selected", "observe", "pages", "page", "bits", "depth", "top_k", "trim",
                    "lookup", "retrieval", "dense", "threshold", "channels")


def kv_draft_options(spec: str) -> dict:
    """``"streaming:window=256,bits=4"`` -> the drafter's options ``{"policy": "streaming", "window": 256,
    "bits": 4}`` (raises :class:`SpeculumError` on an unknown policy or option)."""
    name, raw = parse_named(spec, "kv-draft")
    if name not in KV_DRAFT_POLICIES:
        raise SpeculumError(f"unknown kv-draft policy {name!r}; choose from {', '.join(KV_DRAFT_POLICIES)}")
    options: dict = {"policy": name}
    for key, value in raw.items():
        if key == "gates":
            if name != "duo":
                raise SpeculumError("kv-draft option gates (a DuoAttention gates file) is the duo view's")
            options[key] = value
            continue
        if key not in KV_DRAFT_OPTIONS:
            raise SpeculumError(f"unknown kv-draft option {key!r}; choose from {', '.join(KV_DRAFT_OPTIONS)}")
        try:
            options[key] = int(value)
        except ValueError:
            raise SpeculumError(f"kv-draft option {key} takes an integer, not {value!r}") from None
    if options.get("bits", 4) not in (4, 8, 16):
        raise SpeculumError("kv-draft option bits is 4 or 8 (a quantized weight copy drafts) or 16 (the target's own)")
    if options.get("trim", 1) not in (0, 1):
        raise SpeculumError("kv-draft option trim is 1 (a quantized head over frequent and prompt tokens) or 0 (all)")
    return options


class KVDraftDrafter(SelfDrafter):
    name = "kv_draft"

    def __init__(self, target: torch.nn.Module, policy: str = "streaming", sink: int | None = None,
                 window: int | None = None, selected: int = 512, observe: int = 32, pages: int = 32, page: int = 16,
                 bits: int | None = None, depth: int = 6, exit_confidence: float = 0.5, gates="auto", retrieval: int = 25,
                 dense: int = 2, layers: tuple[int, ...] | None = None, threshold: int = 90,
                 channels: int | None = None, **options):
        """The view's options as :func:`~speculum.drafting.view_choice.draft_view` takes them (``gates``,
        ``retrieval`` (a percent): ``duo``'s; ``dense``, ``layers``: ``tidal``'s selection layers; ``dense``,
        ``threshold`` (a percent): ``tokenselect``'s; ``channels``: ``double_sparsity``'s); the others
        :class:`~speculum.drafters.self_draft.SelfDrafter`'s."""
        if policy not in KV_DRAFT_POLICIES:
            raise SpeculumError(f"unknown kv-draft policy {policy!r}; choose from {', '.join(KV_DRAFT_POLICIES)}")
        super().__init__(target, depth=depth, exit_confidence=exit_confidence, **options)
        view = draft_view(policy, target, self.decoder, sink, window, selected, observe, pages, page, gates,
                          retrieval, dense, layers, threshold, channels)
        if bits is None:  # a GGUF model's own kernels already stream 4-bit weights, faster than a torch copy
            bits = 16 if weights_already_quantized(self.decoder) else 4
        weights = head = None
        if bits != 16:
            weights, head = quantized_layers(self.decoder, bits), self.draft_head(target, bits)
        self.model = SelfDraft(self.decoder, weights=weights, head=head, view=view)
