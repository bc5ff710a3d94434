"""``tidal``: TidalDecode (Yang et al., 2024, "TidalDecode: Fast and Accurate LLM Decoding with
Position Persistent Sparse Attention"). The first layers attend fully; a token-selection layer
also attends fully and picks the ``k`` cached tokens with the highest attention (per KV head,
summed over its query heads and the step's rows); every later layer attends only to those
positions, until a re-selection layer picks again (defaults: :func:`default_selection_layers`). The cache is kept whole: what shrinks is the
bytes read per step (``k`` of the context's entries in the sparse layers)."""

from __future__ import annotations

from .scoring import attention_probs, pool_scores, top_slots
from .sparse import SparseReadPolicy


def default_selection_layers(sliding: list[bool], dense_layers: int = 2) -> list[int]:
    """Selection at about 1/5 of the depth and re-selection at about 7/15, among full-attention
    layers (SmolLM2's 30 layers: 6 and 14). The paper selects at layer 2 and re-selects at 13 of
    Llama-3-8B's 32; on SmolLM2 layer 2 does not yet attend to the needle (speculum longctx, 4k
    tokens, 25%: the passkey and multikey samples that 2+12 missed, 6+14 answered like the full
    cache). Models with sliding-window layers (Gemma-3: one global layer in six) select once, at
    the first global layer from 1/5 of the depth on."""
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
    paper's plain top-k). 7 by default: SmolLM2 writes numbers one digit per token, and without
    pooling a 5-digit passkey lost its last digits (4k tokens, 25%: "35." for 35440)."""

    name = "tidal"

    def __init__(self, budget="0.25", layers=None, dense: int = 2, kernel: int = 7):
        super().__init__(budget)
        self.kernel = int(kernel)
        self.dense_layers = int(dense)
        if isinstance(layers, str):
            layers = [int(x) for x in layers.replace("+", " ").split()]
        self.layers = layers

    def begin_prefill(self, cache, n):
        super().begin_prefill(cache, n)
        layers = self.layers if self.layers is not None else default_selection_layers(cache.sliding,
                                                                                       self.dense_layers)
        cache.state["selection_layers"] = set(layers)

    def attend(self, cache, layer, sliding, q, k, v, step):
        st = cache.state
        if self.dense(cache, layer, sliding):
            return cache.attend_all(layer, sliding, q, k, v, step)
        if layer in st["selection_layers"]:
            out = cache.attend_all(layer, sliding, q, k, v, step)
            probs = attention_probs(step.decoder, q, cache.kv[layer, 0, :, : cache.length], None)  # [H_kv, g*n, L]
            later = [i for i in st["selection_layers"] if i > layer]
            upto = min(later) if later else cache.shape.layers
            # one copy of the chosen slots for every full-attention layer up to the next selection layer
            sparse = [i for i in range(layer + 1, upto) if not cache.sliding[i]]
            scores = pool_scores(probs.sum(1), self.kernel)
            block = cache.gather_block(sparse, top_slots(scores, st["read"]), step.n)
            st["blocks"] = dict(zip(sparse, block))
            st["selected_at"] = cache.length
            return out
        if st.get("selected_at") != cache.length or layer not in st["blocks"]:
            return cache.attend_all(layer, sliding, q, k, v, step)  # before this step's first selection
        return cache.attend_block(layer, q, k, v, st["blocks"][layer], step)
