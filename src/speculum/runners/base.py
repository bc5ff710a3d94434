"""The runner protocol: what the engine, drafters and calibration need from a model.

A runner turns token ids into logits against a KV cache. Two calls do the work:

- :meth:`RunnerBase.prefill` commits a run of tokens to the cache (in chunks), optionally
  returning the hidden states of chosen layers for every token;
- :meth:`RunnerBase.forward` scores ``[root] + tree`` in one forward pass: ``n + 1`` rows at
  positions ``cache.position + [0] + depths`` under the tree's ancestor mask, their KV entries left
  pending. It returns a :class:`Forward`: logits for every row and, when asked, the hidden states
  of chosen layers for every row (nothing is collected when nothing is asked).

:meth:`RunnerBase.commit` keeps the root and the accepted path. A runner that runs a KV policy
(:class:`~speculum.runners.policy.PolicyRunner`) lets the policy act there; the engine never calls
a policy itself.

Hidden-state layers are numbered as transformers' ``output_hidden_states``: ``0`` is the embedding
output (the first layer's input), ``i`` the output of the ``i``-th decoder layer, and the last,
``num_layers``, the final norm's output (what the LM head reads).

A subclass provides :meth:`new_cache` and :meth:`_run`, one forward over ids at given positions;
the prefill loop and the forward prologue (positions and the tree mask) are here, once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from ..attention import Step
from ..cache import KVCache
from ..errors import SpeculumError
from ..tree import DraftTree


@dataclass
class Forward:
    """One forward's outputs for its ``n`` rows."""

    logits: torch.Tensor  # [n, V] ([1, V] for a prefill chunk: its last row only)
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [n, D], the layers asked for
    prompt_logits: torch.Tensor | None = None  # [e, V] of the tree's prompt rows, where it had any and they ran


class Runner(Protocol):
    """What the engine needs from a model (implemented by :class:`RunnerBase`)."""

    vocab_size: int  # width of the logits (may exceed the tokenizer's vocabulary)
    device: torch.device
    dtype: torch.dtype
    max_positions: int  # the model's context: a prompt must be shorter
    max_length: int  # the longest sequence (prompt + output) this runner can decode
    # capabilities (RunnerBase's defaults; a runner that has one says so):
    chunked_prefill: bool  # prefill may be called again with the next part of a prompt
    batched_forward: bool  # forward_batch runs its sequences as one forward (else one after another)
    fixed_rows: int | None  # every verification step padded to this many rows (the reproducible mode)
    variant: str  # how its forwards run beyond the model, dtype and device (part of the calibration key)
    inner: Runner | None  # the runner this one wraps (a KV policy's), or None

    def new_cache(self, capacity: int) -> KVCache: ...

    def prefill(self, cache: KVCache, token_ids: list[int], hidden_layers: Sequence[int] = (),
                query_start: int | None = None) -> dict[int, torch.Tensor]: ...

    def forward(self, cache: KVCache, root: int, tree: DraftTree,
                hidden_layers: Sequence[int] = ()) -> Forward: ...

    def commit(self, cache: KVCache, keep: list[int] | None = None) -> None: ...

    def draft_depth(self, cache: KVCache) -> int | None:
        """The most drafted tokens a step may commit before the cache changes what later rows see
        (a KV policy's next eviction or quantization), or None: no limit."""
        ...


def layer_types(config) -> list[str]:
    """``"full_attention"`` or ``"sliding_attention"`` per layer.

    transformers configs list them (``layer_types``) for Gemma-3, Qwen2/3 and others; Mistral
    configs only give ``sliding_window``, which then applies to every layer.
    """
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    if getattr(config, "model_type", "") == "mistral" and getattr(config, "sliding_window", None):
        return ["sliding_attention"] * n
    return ["full_attention"] * n


class RunnerBase:
    """The shared half of every runner. Subclasses set the attributes of :class:`Runner` and
    ``num_layers``, ``prefill_chunk``, and implement :meth:`new_cache` and :meth:`_run`."""

    num_layers: int
    prefill_chunk: int = 256
    chunked_prefill: bool = True  # prefill may be called again with the next part of a prompt
    prompt_rows: bool = False  # whether :meth:`forward` runs a tree's prompt rows (else it leaves them out)
    batched_forward: bool = False  # forward_batch: one call after another here
    fixed_rows: int | None = None
    variant: str = ""
    inner: Runner | None = None
    device: torch.device
    max_positions: int

    @property
    def max_length(self) -> int:
        return self.max_positions

    def draft_depth(self, cache: KVCache) -> int | None:
        return None

    def new_cache(self, capacity: int = 1024) -> KVCache:
        raise NotImplementedError

    def _run(self, cache: KVCache, ids: list[int], step: Step, last_only: bool,
             hidden_layers: Sequence[int], extra_embeds: torch.Tensor | None = None) -> Forward:
        """One forward of ``ids`` at ``step.positions`` after the cache's committed entries (left
        pending); ``extra_embeds [e, D]``: rows input as embeddings after the ids' (``step`` covers them)."""
        raise NotImplementedError

    def _check_layers(self, hidden_layers: Sequence[int]) -> None:
        bad = [i for i in hidden_layers if not 0 <= i <= self.num_layers]
        if bad:
            raise SpeculumError(f"hidden-state layers are 0..{self.num_layers} (0: embeddings, "
                                f"{self.num_layers}: the final norm's output); got {bad}")

    @torch.inference_mode()
    def prefill(self, cache: KVCache, token_ids: list[int], hidden_layers: Sequence[int] = (),
                query_start: int | None = None) -> dict[int, torch.Tensor]:
        """Commit ``token_ids`` to the cache in chunks of ``prefill_chunk`` tokens (chunks bound the
        attention's memory); returns ``{layer: [len(token_ids), D]}`` for ``hidden_layers``.
        ``query_start`` matters only under a KV policy (see :class:`~speculum.runners.policy.PolicyRunner`)."""
        self._check_layers(hidden_layers)
        cache.reserve(cache.length + len(token_ids))
        parts: dict[int, list[torch.Tensor]] = {i: [] for i in hidden_layers}
        for start in range(0, len(token_ids), self.prefill_chunk):
            chunk = token_ids[start:start + self.prefill_chunk]
            step = self.chunk_step(cache, len(chunk))
            out = self._run(cache, chunk, step, True, hidden_layers)
            cache.commit()
            for i, h in out.hidden.items():
                parts[i].append(h)
        return {i: torch.cat(hs) for i, hs in parts.items() if hs}

    def chunk_step(self, cache: KVCache, n: int) -> Step:
        """The prologue of a prefill chunk of ``n`` tokens: the next ``n`` positions, causal."""
        return Step(torch.arange(cache.position, cache.position + n, device=self.device), None)

    def step_for(self, cache: KVCache, tree: DraftTree) -> Step:
        """The prologue of a tree forward: positions ``[n + 1]`` (root first) and the ancestor mask
        (None for a chain: causal); with prompt rows, ``[n + 1 + e]`` (:meth:`DraftTree.forward_mask`)."""
        if tree.prompts is None:
            positions = torch.tensor([0] + tree.depths(), device=self.device) + cache.position
            return Step(positions, None if tree.is_chain else tree.ancestor_mask(self.device))
        positions = torch.tensor(tree.forward_positions(), device=self.device) + cache.position
        return Step(positions, torch.from_numpy(tree.forward_mask()).to(self.device))

    @torch.inference_mode()
    def forward(self, cache: KVCache, root: int, tree: DraftTree, hidden_layers: Sequence[int] = ()) -> Forward:
        """Logits ``[n + 1, V]`` (and hidden states) for ``[root] + tree.tokens``; their KV entries are
        left pending. A tree's prompt rows run after its nodes (their logits in ``prompt_logits``,
        their entries pending after the nodes', never kept)."""
        if hidden_layers:
            self._check_layers(hidden_layers)
        ids = [root] + tree.tokens
        if tree.prompts is not None and not self.prompt_rows:
            tree = replace(tree, prompts=None)
        if tree.prompts is None:
            return self._run(cache, ids, self.step_for(cache, tree), False, hidden_layers)
        out = self._run(cache, ids, self.step_for(cache, tree), False, hidden_layers, tree.prompts.embeds)
        n = len(ids)
        return Forward(out.logits[:n], {i: h[:n] for i, h in out.hidden.items()}, out.logits[n:])

    def forward_batch(self, caches: Sequence[KVCache], roots: Sequence[int], trees: Sequence[DraftTree],
                      prefills: Sequence[tuple[KVCache, list[int]]] = (),
                      hidden_layers: Sequence[int] = ()) -> list[Forward]:
        """:meth:`forward` for several sequences, each with its own cache, root and tree: logits
        ``[n_j + 1, V]`` per sequence. ``prefills``: ``(cache, token_ids)`` prompt chunks to commit
        in the same pass (:meth:`prefill`), each answered after the trees' by a :class:`Forward`
        whose logits are its last row's ``[1, V]`` (none here: ``[0]``) and whose hidden states cover
        the chunk. Here one call after another; the native runner stacks them into one forward
        (:mod:`speculum.runners.batched`)."""
        chunks = [Forward(torch.empty(0), self.prefill(cache, ids, hidden_layers)) for cache, ids in prefills]
        return [self.forward(c, r, t, hidden_layers) for c, r, t in zip(caches, roots, trees)] + chunks

    def new_pool(self, slots: int, capacity: int = 1024):
        """Where :meth:`forward_batch`'s caches come from: an object whose ``acquire()`` returns an
        empty cache and ``release(cache)`` frees it. Here, independent caches."""
        return _Caches(self)

    def forward_tree(self, cache: KVCache, root: int, tree: DraftTree) -> torch.Tensor:
        """:meth:`forward`'s logits ``[n + 1, V]`` alone."""
        return self.forward(cache, root, tree).logits

    def commit(self, cache: KVCache, keep: list[int] | None = None) -> None:
        """Keep the pending entries at indices ``keep`` (root first; None: all of them)."""
        cache.commit(keep)


class _Caches:
    """A runner's independent caches behind the pool interface (:meth:`RunnerBase.new_pool`)."""

    def __init__(self, runner: RunnerBase):
        self.runner = runner

    def acquire(self) -> KVCache:
        return self.runner.new_cache()

    def release(self, cache: KVCache) -> None:
        pass
