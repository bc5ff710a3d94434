"""``tidal``: TidalDecode (Yang et al., 2024, "TidalDecode: Fast and Accurate LLM Decoding with
Position Persistent Sparse Attention"). The first layers attend fully; a token-selection layer
also attends fully and picks the ``k`` cached tokens with the highest attention (per KV head,
summed over its query heads and the step's rows); every later layer attends only to those
positions, until a re-selection layer picks again (defaults: :func:`default_selection_layers`). The
cache is kept whole: what shrinks is the bytes read per step (``k`` of the context's entries in the
sparse layers, read in place through :meth:`~speculum.cache.PositionedKVCache.attend_slots`, so
nothing is copied and memory stays at the full cache's)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .scoring import pool_scores, top_slots
from .sparse import SparseReadPolicy, SparseState


@dataclass
class TidalState(SparseState):
    """One request's token selection."""

    selection_layers: frozenset[int] = frozenset()
    slots: torch.Tensor | None = None  # [H_kv, read] the chosen slots, increasing
    sparse: frozenset[int] = frozenset()  # the layers that read them (up to the next selection layer)
    selected_at: int = -1  # cache length when ``slots`` were chosen (this step's, or stale)


def default_selection_layers(sliding: list[bool], dense_layers: int = 2) -> list[int]:
    """Selection at about 1/5 of the depth and re-selection at about 7/15, among full-attention
    layers (SmolLM2's 30 layers: 6 and 14; Llama-3-8B's 32: 6 and 15). The paper chose layers per
    model (2 and 13 for Llama-3-8B); this rule is speculum's, for models the paper did not cover
    (BENCHMARKS.md, "Why the defaults", has what it was chosen on). Models with sliding-window
    layers (Gemma-3: one global layer in six) select once, at the first global layer from 1/5 of
    the depth on."""
    layers = len(sliding)
    full = [i for i, s in enumerate(sliding) if not s and i >= max(dense_layers, round(layers / 5))]
    if not full:
        return []
    first = full[0]
    if any(sliding):
        return [first]
    again = min(full, key=lambda i: abs(i - round(layers * 7 / 15)))
    return [first] if again <= first else [first, again]


class TidalPolicy(SparseReadPolicy):
    """Position-persistent sparse attention; ``layers``: the selection layers (``"6+14"`` on the CLI);
    ``kernel``: max-pool the selection scores over that many neighbours before the top-k (1: the
    paper's plain top-k; speculum's default 7 keeps runs of digit tokens together: BENCHMARKS.md,
    "Why the defaults")."""

    name = "tidal"

    def __init__(self, budget="0.25", layers=None, dense: int = 2, kernel: int = 7):
        super().__init__(budget)
        self.kernel = int(kernel)
        self.dense_layers = int(dense)
        if isinstance(layers, str):
            layers = [int(x) for x in layers.replace("+", " ").split()]
        self.layers = layers

    def new_state(self, cache, read):
        layers = self.layers if self.layers is not None else default_selection_layers(
            [cache.layout.is_sliding(i) for i in range(cache.layout.layers)], self.dense_layers)
        return TidalState(read, frozenset(layers))

    def attend(self, cache, layer, sliding, q, k, v, step):
        st = cache.state
        if self.dense(cache, layer, sliding):
            return cache.attend_all(layer, sliding, q, k, v, step)
        if layer in st.selection_layers:
            out = cache.attend_all(layer, sliding, q, k, v, step)
            s = cache.layout
            probs = cache.committed_probs(layer, q)  # [H_kv, g*n, L], the keys read in place
            later = [i for i in st.selection_layers if i > layer]
            upto = min(later) if later else s.layers
            # the full-attention layers up to the next selection layer read the chosen slots
            st.sparse = frozenset(i for i in range(layer + 1, upto) if not s.is_sliding(i))
            st.slots = top_slots(pool_scores(probs.sum(1), self.kernel), st.read)
            st.selected_at = cache.length
            return out
        if st.selected_at != cache.length or layer not in st.sparse:
            return cache.attend_all(layer, sliding, q, k, v, step)  # before this step's first selection
        return cache.attend_slots(layer, q, k, v, st.slots, step)
