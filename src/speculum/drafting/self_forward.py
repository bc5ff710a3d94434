"""The target drafting for itself over its own KV cache: the draft forward of self-speculation.

A self-draft runs the target's native decoder with something taken away, and reads the keys and
values the *target* computed for the committed tokens:

- a subset of the layers (SWIFT's layer skipping): a skipped layer passes its input through;
- weight-only quantized copies of the linear layers and the LM head (a quantized self-draft);
- a compressed view of the committed entries (long-context drafting, TriForce / MagicDec style):
  StreamingLLM's first ``sink`` and last ``window`` entries instead of all of them, and on
  full-attention layers optionally SnapKV's selection from between them, or Quest's pages picked
  per forward by the draft's own queries; or DuoAttention's split, the retrieval heads reading
  everything (:mod:`.duo_view`); or TidalDecode's entries picked at selection layers for the layers
  after them (:mod:`.tidal_view`); or TokenSelect's head-voted entries per layer
  (:mod:`.tokenselect_view`); or Double Sparsity's entries picked by label channels
  (:mod:`.double_sparsity_view`) (:class:`DraftView`).

Drafted tokens write their keys and values (of the layers that run) into the target cache's free
slots after the committed ones, ``length + used ..``, where the verification forward writes its own
entries next: nothing of the target's state changes, and no second cache or catch-up prefill is
needed. A StreamingLLM or SnapKV view keeps what its full-attention layers read in a small
contiguous buffer of its own instead (:class:`ViewBuffer`): the sinks, the selection and the
recent entries copied once, each step adding only the entries committed since the last, and the
draft's rows writing there; gathering the view from the target's cache in every forward (two
concatenations per layer) cost about as much as the attention over it. Rows see the committed
entries of the view, their ancestors among the pending draft entries (``visible``), and
themselves; sliding-window layers apply their window.

Works on the plain KV caches where slot ``c`` holds position ``c`` (the static cache and a batch
pool's slot), not under a KV policy.

Shapes: ``n`` rows, ``p`` draft entries already pending this step, ``L`` committed entries, ``V``
the vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..attention import attention_probs, fold_queries, grouped, in_window, unfold_rows
from ..cache import KVCache
from ..cache.positioned import PositionedKVCache
from ..cache.static import StaticKVCache
from ..cache.store import FunctionStore, put
from ..errors import SpeculumError
from ..kv.scoring import page_bounds, pool_scores, top_slots
from ..runners.decoder import Layer, NativeDecoder
from .double_sparsity_view import label_top, labels_of
from .duo_view import duo_attend, head_runs
from .tidal_view import select_and_attend, sparse_keys
from .tokenselect_view import SelectionCache


@dataclass(frozen=True)
class DraftView:
    """Which committed entries a draft reads: all (``window=None``), or the first ``sink`` and the
    last ``window`` (StreamingLLM's attention sinks and recent window), and on full-attention layers
    also, from between them, either ``selected`` entries per KV head, those the prompt's last
    ``observe`` tokens attend to most (SnapKV's selection, scores max-pooled over ``kernel``
    neighbours), picked once per request after its prefill; or ``pages`` pages of ``page`` entries
    per KV head, picked at every draft forward and layer by the upper bound of the rows' attention
    scores over each page (Quest: the page's channel-wise key minimum and maximum, taken after the
    prefill).

    Or, with ``retrieval`` (DuoAttention), per layer the KV heads that read every committed entry;
    the other heads of full-attention layers read the sinks and the window. Or, with ``tidal``
    (TidalDecode's selection layers), full-attention layers read everything up to the first
    selection layer and at each one, which picks ``tokens`` entries per KV head from between the
    sinks and the window (scores max-pooled over ``kernel``) for the full-attention layers after it
    to read with the sinks and the window. Or, with ``vote_from`` (TokenSelect), full-attention
    layers from that one on read the sinks, the window and the ``tokens`` entries between them with
    the most head soft votes (a vote reused while the queries' cosine similarity with the one that
    voted stays at least ``threshold``). Or, with ``channels`` (Double Sparsity), full-attention
    layers read the sinks, ``tokens`` entries per KV head picked at every draft forward by the
    approximate attention of the rows' ``channels`` label channels (picked once the prompt is in,
    from its last ``observe`` tokens), and everything committed since the labels were taken."""

    sink: int = 4
    window: int | None = None
    selected: int = 0
    observe: int = 32
    kernel: int = 7
    pages: int = 0
    page: int = 16
    retrieval: tuple[tuple[int, ...], ...] | None = None
    tidal: tuple[int, ...] = ()
    tokens: int = 0
    vote_from: int | None = None
    threshold: float = 0.9
    channels: int = 0

    @property
    def reads_some_whole(self) -> bool:
        """Whether some full-attention reads take every committed entry (DuoAttention's retrieval
        heads, TidalDecode's and TokenSelect's dense layers)."""
        return self.retrieval is not None or bool(self.tidal) or self.vote_from is not None

    @property
    def buffered(self) -> bool:
        """Whether the full-attention layers read a :class:`ViewBuffer` (a window; no Quest pages, no
        DuoAttention, TidalDecode, TokenSelect or Double Sparsity view)."""
        return self.window is not None and not self.pages and not self.channels and not self.reads_some_whole

    def spans(self, length: int) -> list[tuple[int, int]]:
        """Committed slot ranges ``[(lo, hi)]`` read with ``length`` committed entries."""
        if self.window is None or length <= self.sink + self.window:
            return [(0, length)]
        return [(0, self.sink), (length - self.window, length)]


# a StreamingLLM view's buffer keeps the entries committed since its window began until it holds
# this many more than ``window``, then starts again from the last ``window``
REBASE_SLACK = 64
# spare slots a view buffer is first allocated with beyond what the step needs (it doubles after)
BUFFER_SLACK = 128


class ViewBuffer:
    """What a view's full-attention layers read, contiguous, in a :class:`StaticKVCache` of its own
    (``cache.kv [F, 2, H_kv, C, d]`` for the ``F`` full-attention layers, ``layers``: their indices
    in the decoder). Its committed entries are the view's (the target's first ``sink`` entries, the
    selected ones if any, then every committed entry from slot ``recent`` of the target's cache
    on); the draft rows' pending entries follow them. Attention over a slice of it reads no gathered
    copy.

    The target's committed entries are copied in, never recomputed: the buffer reads what the
    target's cache holds, as the view did before."""

    def __init__(self, target_kv: torch.Tensor, layers: list[int], sink: int, middle: torch.Tensor | None,
                 recent: int, capacity: int):
        """``target_kv [layers, 2, H_kv, C, d]`` the target cache's buffer; ``middle [F, 2, H_kv, B, d]``
        the selected entries (or None); ``recent`` the first target slot read in full from here on."""
        shape = target_kv.shape
        self.index = torch.tensor(layers, device=target_kv.device)
        self.cache = StaticKVCache(len(layers), shape[2], shape[4], target_kv.dtype, target_kv.device, capacity)
        self.cache.append(target_kv[self.index, :, :, :sink])
        if middle is not None:
            self.cache.append(middle)
        self.synced = recent  # target slots before this one are in the buffer (from ``recent`` on)

    def sync(self, target_kv: torch.Tensor, length: int, rows: int) -> None:
        """Copy the target's entries committed since the last call (slots ``synced .. length``) and
        make room for ``rows`` pending draft entries after them."""
        c, new = self.cache, length - self.synced
        c.reserve(c.length + max(new, 0) + rows)
        if new > 0:
            c.append(target_kv[self.index, :, :, self.synced:length])
            self.synced = length


def check_plain_cache(cache: KVCache, decoder: NativeDecoder, who: str) -> None:
    """Raise :class:`SpeculumError` unless ``cache`` is a plain native KV cache of ``decoder``'s layout."""
    kv = getattr(cache, "kv", None)
    s = decoder.shape
    if (not isinstance(cache, StaticKVCache) or isinstance(cache, PositionedKVCache) or kv is None
            or tuple(kv.shape[:3]) != (s.layers, 2, s.kv_heads) or kv.shape[4] != s.head_dim):
        raise SpeculumError(f"{who} drafts over the target's own KV cache: it needs the native runner's plain "
                            "cache (no KV policy; for long prompts use a kv-draft view instead)")


class SelfDraft:
    """The target's decoder, with ``layers`` only (default all; indices into ``decoder.layers``),
    optionally other ``weights`` per layer (quantized copies, :mod:`speculum.drafting.quantized_copy`) and
    another ``head`` (``[n, D]`` final-norm output -> ``[n, V]``), reading ``view`` of the committed
    entries.

    Per draft step: :meth:`begin` with the target's cache, then :meth:`run` once per depth.
    """

    def __init__(self, decoder: NativeDecoder, layers: Sequence[int] | None = None,
                 weights: Sequence[Layer] | None = None, head: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 view: DraftView = DraftView()):
        self.decoder = decoder
        self.layers = list(range(decoder.shape.layers)) if layers is None else sorted(layers)
        self.weights = list(decoder.layers) if weights is None else list(weights)
        self.head = head
        self.view = view
        self.cache: KVCache | None = None
        self.used = 0
        self._on_attend = None  # the selection's observation rows: attention output and scores at once
        self.reset()

    def reset(self) -> None:
        """A new request: forget the last one's selection."""
        self.picked: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None  # layer -> k, v [H_kv, B, d]
        self.picked_slots: dict[int, torch.Tensor] = {}  # layer -> their slots [H_kv, B]
        self.bounds: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None  # layer -> key min, max [H_kv, P, d]
        self.recent = 0  # with a selection: committed slots from here on are all read
        self.buffer: ViewBuffer | None = None  # what full-attention layers read (a buffered view)
        self.votes = SelectionCache(self.view.threshold)  # a TokenSelect view's last vote per layer
        self.labels: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None  # layer -> channels [H_kv, r],
        # label cache [H_kv, B, r] (Double Sparsity)

    def prepare(self, cache: KVCache, tokens: list[int]) -> None:
        """After the prompt's prefill (``tokens``: the committed ones, then the root): a selecting view
        picks its entries now, as SnapKV does at prefill, rather than in the first draft step."""
        self.begin(cache, 0, tokens)

    def begin(self, cache: KVCache, rows: int, tokens: list[int] | None = None) -> None:
        """Start a draft step on the target's ``cache`` (committed entries only), with room for
        ``rows`` draft entries in all; ``tokens`` (the committed ones, then the root) let a selecting
        view pick its entries if :meth:`prepare` has not."""
        cache.reserve(cache.length + rows + self.view.observe)  # before any write: a growth keeps only committed entries
        self.cache, self.used = cache, 0
        self.pending_pos = torch.empty(0, dtype=torch.int64, device=self.decoder.device)
        v = self.view
        if self.picked is None and v.selected and v.window is not None and tokens is not None \
                and cache.length > v.sink + v.window + v.selected + v.observe:
            self._select(tokens)
            self.used = 0
            self.pending_pos = self.pending_pos[:0]
        if self.labels is None and v.channels and v.window is not None and tokens is not None \
                and cache.length > v.sink + v.window + v.tokens + v.observe:
            self._label(tokens)
            self.used = 0
            self.pending_pos = self.pending_pos[:0]
        if self.bounds is None and v.pages and v.window is not None \
                and cache.length >= v.sink + v.window + (v.pages + 1) * v.page:
            self._bound()
        if v.buffered:
            self._sync_buffer(rows)

    @torch.inference_mode()
    def _sync_buffer(self, rows: int) -> None:
        """Bring the view's buffer up to the committed entries, with room for ``rows`` draft rows:
        built after a selection (sinks, the selection, everything committed since) or, for a
        StreamingLLM view, from the sinks and the last ``window`` entries, and started again once
        it holds ``REBASE_SLACK`` entries more than that. Short contexts (nothing left out) read
        the target's cache directly."""
        v, cache = self.view, self.cache
        length = cache.length
        buf = self.buffer
        if buf is not None and (length < buf.synced
                                or (self.picked is None and length - self.recent > v.window + REBASE_SLACK)):
            buf = self.buffer = None
        if buf is None:
            if length <= v.sink + v.window or (self.picked is not None and length < self.recent):
                return  # nothing left out (or a cache cut below the selection): the target's cache as it is
            full = [i for i, layer in enumerate(self.decoder.layers) if not layer.sliding]
            if not full:
                return
            middle = None
            if self.picked is not None:
                middle = torch.stack([torch.stack(self.picked[i]) for i in full])  # [F, 2, H_kv, B, d]
            else:
                self.recent = length - v.window
            buf = self.buffer = ViewBuffer(cache.kv, full, v.sink, middle,
                                           self.recent, (middle.shape[3] if middle is not None else 0)
                                           + v.sink + length - self.recent + rows + BUFFER_SLACK)
            self.buffer_slot = {layer: j for j, layer in enumerate(full)}
        buf.sync(cache.kv, length, rows)

    @torch.inference_mode()
    def _bound(self) -> None:
        """Quest's page summaries for the draft: the committed slots from ``sink`` up to the last
        ``window`` (whole pages only) cut into pages of ``page``, each full-attention layer's keys
        reduced to their channel-wise minimum and maximum per page and KV head (called only with more
        than ``pages`` whole pages there)."""
        v, kv = self.view, self.cache.kv
        lo = v.sink
        count = (self.cache.length - v.window - lo) // v.page
        hi = lo + count * v.page
        self.bounds = {}
        for i, layer in enumerate(self.decoder.layers):
            if not layer.sliding:
                keys = kv[i, 0, :, lo:hi].unflatten(1, (count, v.page))  # [H_kv, P, page, d]
                self.bounds[i] = (keys.amin(2), keys.amax(2))  # [H_kv, P, d] each
        self.recent = hi

    def _pages(self, i: int, q: torch.Tensor) -> torch.Tensor:
        """Layer ``i``'s slots to read for rows ``q [n, H, d]``: the ``pages`` pages of highest
        bound (their best over rows and a KV head's query heads), as ``[H_kv, pages * page]``."""
        v = self.view
        bound = page_bounds(fold_queries(q, self.decoder.shape.kv_heads), *self.bounds[i]).amax(1)  # [H_kv, P]
        top = top_slots(bound, v.pages)  # [H_kv, pages]
        first = v.sink + top * v.page  # the pages start after the sinks
        return (first[..., None] + torch.arange(v.page, device=q.device)).flatten(1)

    @torch.inference_mode()
    def _select(self, tokens: list[int]) -> None:
        """SnapKV's selection for the draft: run the last ``observe`` committed tokens (reading every
        committed entry before them), score each full-attention layer's entries by the attention they
        receive (summed over rows and the query heads of a KV head, max-pooled), keep the top
        ``selected`` per KV head among slots ``sink .. length - window``."""
        s, v, cache = self.decoder.shape, self.view, self.cache
        length = cache.length
        lo, hi = v.sink, length - v.window
        scores: dict[int, torch.Tensor] = {}

        def observe(i: int, sliding: bool, q, k, v, mask) -> torch.Tensor | None:
            if sliding:
                return None
            probs = attention_probs(q, k, mask, s.attn_scale, s.attn_softcap)  # [H_kv, g*obs, keys]
            # [H_kv, length]: what each entry receives (the rows' own keys are the pending copies of
            # slots start .. length - 1, after the committed ones)
            scores[i] = probs.sum(1)
            return unfold_rows(torch.matmul(probs.to(v.dtype), v), q.shape[0])

        self._observe(tokens, observe)
        kv = cache.kv
        self.picked, self.picked_slots = {}, {}
        for i, sc in scores.items():
            top = top_slots(pool_scores(sc[:, lo:hi], v.kernel), min(v.selected, hi - lo)) + lo  # [H_kv, B]
            idx = top[..., None].expand(-1, -1, s.head_dim)
            self.picked[i] = (kv[i, 0].gather(1, idx), kv[i, 1].gather(1, idx))
            self.picked_slots[i] = top
        self.recent = hi
        self.buffer = None  # built again around the selection

    def _observe(self, tokens: list[int], hook) -> None:
        """Run the last ``observe`` committed tokens as draft rows reading every committed entry
        before them, ``hook(i, sliding, q, k, v, mask)`` seeing each layer's attention (its output,
        or None for the plain attention)."""
        dec, cache, obs = self.decoder, self.cache, self.view.observe
        start = cache.length - obs
        ids = torch.tensor(tokens[start:cache.length], device=dec.device)
        positions = torch.arange(start, cache.length, device=dec.device)
        causal = torch.ones(obs, obs, dtype=torch.bool, device=dec.device).tril()
        full, self.view = self.view, DraftView()  # the observation rows read everything
        self._on_attend = hook
        try:
            self.run(ids, positions, causal, committed=start)
        finally:
            self.view, self._on_attend = full, None

    @torch.inference_mode()
    def _label(self, tokens: list[int]) -> None:
        """Double Sparsity's label channels for the draft, from the last ``observe`` committed tokens'
        queries and own keys on each full-attention layer, and the label cache of the committed slots
        ``sink .. length - window``."""
        v, cache, obs = self.view, self.cache, self.view.observe
        hi = cache.length - v.window
        self.labels = {}

        def observe(i: int, sliding: bool, q, k, values, mask) -> None:
            if not sliding:
                self.labels[i] = labels_of(q, k[:, -obs:], cache.kv[i, 0, :, v.sink:hi], v.channels)

        self._observe(tokens, observe)
        self.recent = hi

    @torch.inference_mode()
    def run(self, ids: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor,
            committed: int | None = None) -> torch.Tensor:
        """Rows ``ids [n]`` at ``positions [n]``; ``visible [n, p + n]`` bool over this step's pending
        draft entries (the rows' own last). ``committed``: read only the first ``committed`` entries
        (default all; the view then applies). Returns logits ``[n, V]``."""
        dec, s, cache = self.decoder, self.decoder.shape, self.cache
        n = ids.shape[0]
        length = cache.length if committed is None else committed
        at = cache.length + self.used
        cache.reserve(at + n)
        kv = cache.kv
        spans = self.view.spans(length)
        seen = sum(hi - lo for lo, hi in spans)
        contiguous = len(spans) == 1 and spans[0][1] == cache.length
        buffer = self.buffer if committed is None else None
        paged = self.bounds if committed is None else None
        labeled = self.labels if committed is None else None

        def after(count: int) -> torch.Tensor:  # [n, count + p + n]: every committed entry read, then ``visible``
            return torch.cat([torch.ones(n, count, dtype=torch.bool, device=dec.device), visible], dim=1)

        if buffer is not None:  # full-attention layers: the view's own buffer, then the pending entries
            at_buffer = buffer.cache.length + self.used
            buffer.cache.reserve(at_buffer + n)
            full_seen = buffer.cache.length
        elif paged:  # full-attention layers: sinks, the pages, everything committed since the page bounds
            full_seen = self.view.sink + self.view.pages * self.view.page + cache.length - self.recent
        elif labeled:  # full-attention layers: sinks, the labels' choice, everything committed since the labels
            full_seen = self.view.sink + self.view.tokens + cache.length - self.recent
        else:
            full_seen = seen
        masks = {False: grouped(after(full_seen), s.group, dec.dtype), True: None}
        view = self.view
        # a DuoAttention, TidalDecode or TokenSelect view: some full-attention reads take every committed entry
        whole_mask = grouped(after(length), s.group, dec.dtype) if committed is None and view.reads_some_whole else None
        sparse = (whole_mask is not None and view.window is not None
                  and length > view.sink + view.window + view.tokens)  # else every full-attention layer reads all
        tidal, voting = sparse and bool(view.tidal), sparse and view.vote_from is not None
        sparse_mask = grouped(after(view.sink + view.tokens + view.window), s.group, dec.dtype) if sparse else None
        chosen: list[torch.Tensor | None] = [None]  # the last selection layer's entries [H_kv, tokens]
        if s.sliding_window is not None:
            key_pos = torch.cat([torch.arange(lo, hi, device=dec.device) for lo, hi in spans]
                                + [self.pending_pos, positions])
            masks[True] = grouped(after(seen) & in_window(key_pos, positions, s.sliding_window), s.group, dec.dtype)

        def keys(t: torch.Tensor) -> torch.Tensor:  # [H_kv, C, d] -> [H_kv, seen + p + n, d]
            if contiguous:
                return t[:, spans[0][0]:at + n]
            return torch.cat([t[:, lo:hi] for lo, hi in spans] + [t[:, cache.length:at + n]], dim=1)

        def paged_keys(t: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:  # + the pages' entries [H_kv, B, d]
            return torch.cat([t[:, :self.view.sink], chosen, t[:, self.recent:at + n]], dim=1)

        def attend(i: int, sliding: bool, q, k, v):  # the target's free slots, or the view's own buffer
            if buffer is not None and not sliding:
                own = buffer.cache.kv[self.buffer_slot[i]]  # [2, H_kv, C', d]
                put(own, at_buffer, k, v)
                return dec.attend(q, own[0, :, :at_buffer + n], own[1, :, :at_buffer + n], masks[False])
            put(kv[i], at, k, v)
            if self._on_attend is not None:  # the selection's observation rows: attention and scores at once
                out = self._on_attend(i, sliding, q, keys(kv[i, 0]), keys(kv[i, 1]), masks[sliding])
                if out is not None:
                    return out
            if paged and not sliding:
                idx = self._pages(i, q)[..., None].expand(-1, -1, s.head_dim)  # [H_kv, B, d]
                return dec.attend(q, paged_keys(kv[i, 0], kv[i, 0].gather(1, idx)),
                                  paged_keys(kv[i, 1], kv[i, 1].gather(1, idx)), masks[False])
            if labeled and not sliding:
                top = label_top(q, *labeled[i], s.attn_scale, self.view.tokens) + self.view.sink  # [H_kv, tokens]
                idx = top[..., None].expand(-1, -1, s.head_dim)
                return dec.attend(q, paged_keys(kv[i, 0], kv[i, 0].gather(1, idx)),
                                  paged_keys(kv[i, 1], kv[i, 1].gather(1, idx)), masks[False])
            if whole_mask is not None and not sliding:
                if view.retrieval is not None:  # retrieval heads read everything, streaming heads the view
                    everything = (kv[i, 0, :, :at + n], kv[i, 1, :, :at + n], whole_mask)
                    if contiguous:
                        return dec.attend(q, *everything)
                    return duo_attend(dec.attend, q, head_runs(view.retrieval[i], s.kv_heads), s.group, everything,
                                      (keys(kv[i, 0]), keys(kv[i, 1]), masks[False]))
                if tidal and i in view.tidal:  # a selection layer: read everything, pick for the next layers
                    out, chosen[0] = select_and_attend(q, kv[i, 0, :, :at + n], kv[i, 1, :, :at + n], whole_mask,
                                                       s.attn_scale, s.attn_softcap, view.sink,
                                                       length - view.window, view.tokens, view.kernel)
                    return out
                if voting and i >= view.vote_from:  # the layer's own head-voted entries, shared by its heads
                    chosen[0] = self.votes.slots(i, q, kv[i, 0], view.sink, length - view.window,
                                                 view.tokens).expand(s.kv_heads, -1)
                if (tidal or voting) and chosen[0] is not None:  # sinks, the chosen entries, the window
                    recent, picked = length - view.window, chosen[0]
                    return dec.attend(q, sparse_keys(kv[i, 0], view.sink, picked, recent, at + n),
                                      sparse_keys(kv[i, 1], view.sink, picked, recent, at + n), sparse_mask)
                return dec.attend(q, kv[i, 0, :, :at + n], kv[i, 1, :, :at + n], whole_mask)
            return dec.attend(q, keys(kv[i, 0]), keys(kv[i, 1]), masks[sliding])

        h = dec.embed_ids(ids)
        rope = dec.rope(positions)
        store = FunctionStore(attend)
        for i in self.layers:
            h = dec.layer_forward(i, self.weights[i], h, rope, store)
        self.used += n
        self.pending_pos = torch.cat([self.pending_pos, positions])
        if self.head is None:
            return dec.logits(h)
        logits = self.head(dec.final_norm(h))
        if s.final_softcap is not None:
            logits = torch.tanh(logits / s.final_softcap) * s.final_softcap
        return logits
