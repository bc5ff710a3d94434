"""``PolicyRunner``: a native runner with a KV policy plugged in.

The policy (:mod:`speculum.kv`) decides what the cache stores and what each step reads; this runner
calls it where a runner's work touches the cache:

- the policy is attached to the model (:meth:`~speculum.kv.KVPolicy.attach`: its layout and name);
- prefill runs layer by layer (:func:`~speculum.runners.layerwise.prefill_layerwise`) and hands
  each layer to the policy, which keeps what it wants (and may compute the prompt's attention); ``query_start`` (the query-agnostic
  protocol) compresses ``prompt[:query_start]`` first and appends the rest as decoding steps;
- every forward's attention goes through the policy's ``attend`` (:class:`PolicyStore`);
- :meth:`PolicyRunner.commit` tells the policy what is kept (``before_commit``), commits, and lets
  it evict, quantize or refresh its bounds (``after_commit``).

Forwards run eagerly (no CUDA graphs). The engine sees a runner like any other.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from functools import partial

import torch

from ..attention import Step
from ..errors import SpeculumError
from ..tree import DraftTree
from .base import Forward, RunnerBase
from .layerwise import prefill_layerwise
from .native import NativeRunner

APPEND_CHUNK = 64  # tokens per step when the query-agnostic protocol appends the question


class PolicyRunner(RunnerBase):
    """Runs a model under a KV policy (one policy object serves many requests; state lives in the cache).

    Shares the weights of ``runner`` (a :class:`NativeRunner`: the policies need the native decoder's
    per-layer hooks). Its prefill takes a whole prompt into an empty cache (``chunked_prefill``
    False: a batch prefills such a request at once).
    """

    chunked_prefill = False

    def __init__(self, runner, policy):
        if not isinstance(runner, NativeRunner):
            raise SpeculumError("KV policies run on the native runner (Llama-family and Gemma-3 models); "
                                "this model runs on the Hugging Face runner")
        self.inner, self.policy = runner, policy
        policy.attach(runner.layout, getattr(runner, "target", ""))
        self.decoder, self.layout = runner.decoder, runner.layout
        self.config, self.generation_config = runner.config, runner.generation_config
        self.vocab_size, self.device, self.dtype = runner.vocab_size, runner.device, runner.dtype
        self.num_layers = runner.num_layers
        self.max_positions = runner.max_positions
        self.prefill_chunk = runner.prefill_chunk
        self.variant = f"{runner.variant} kv={policy!r}"

    @property
    def max_length(self) -> int:
        """Rolling positions (StreamingLLM) never pass the cache's size: a sequence may run on."""
        return sys.maxsize if self.policy.rolling else self.max_positions

    def new_cache(self, capacity: int = 1024):
        return self.policy.new_cache(self.layout, self.dtype, self.device, capacity)

    @torch.inference_mode()
    def prefill(self, cache, token_ids: list[int], hidden_layers: Sequence[int] = (),
                query_start: int | None = None) -> dict[int, torch.Tensor]:
        """Layer-by-layer prefill of an empty cache; the policy stores each layer as it completes.

        ``query_start``: the policy compresses ``token_ids[:query_start]`` (the context) before the
        rest (the question) is appended, query-agnostic; by default it sees all of ``token_ids``.
        """
        if hidden_layers:
            raise SpeculumError("hidden states are not returned by a KV policy's layer-by-layer prefill")
        if cache.length or cache.pending:
            raise RuntimeError("a KV policy's prefill needs an empty cache")
        split = len(token_ids) if query_start is None else min(max(1, query_start), len(token_ids))
        first, rest = token_ids[:split], token_ids[split:]
        self.policy.begin_prefill(cache, len(first))
        if first:
            vote = partial(self.policy.prefill_vote, cache) if self.policy.prefill_scores == "logits" else None
            rows = (self.policy.query_rows(len(first)) if self.policy.prefill_scores == "queries"
                    else self.policy.observation_window)
            prefill_layerwise(self.decoder, first, self.prefill_chunk, self.policy.prefill_scores, rows,
                              lambda i, sliding, kv, scores: self.policy.store_prefill(cache, i, sliding, kv, scores),
                              vote,
                              lambda i, sliding, q, kv, a, b, mask: self.policy.prefill_attend(cache, i, sliding, q, kv,
                                                                                               a, b, mask))
        self.policy.end_prefill(cache, len(first))
        for a in range(0, len(rest), APPEND_CHUNK):  # the question, as decoding steps through the policy
            part = rest[a:a + APPEND_CHUNK]
            self.forward(cache, part[0], DraftTree.chain(part[1:]))
            self.commit(cache)
        return {}

    def _run(self, cache, ids: list[int], step: Step, last_only: bool, hidden_layers: Sequence[int]) -> Forward:
        cache.begin(step.positions)
        out = self.decoder.forward_with(torch.tensor(ids, device=self.device), step.positions,
                                        PolicyStore(self.policy, cache, step), last_only, hidden_layers)
        cache.pending = len(ids)
        return out

    @torch.inference_mode()
    def draft_depth(self, cache) -> int | None:
        """The policy's next decision point (:meth:`~speculum.kv.KVPolicy.draft_depth`)."""
        return self.policy.draft_depth(cache)

    @torch.inference_mode()
    def commit(self, cache, keep: list[int] | None = None) -> None:
        self.policy.before_commit(cache, keep)
        cache.commit(keep)
        self.policy.after_commit(cache)


def under_policy(runner, policy):
    """``runner`` under the KV policy ``policy`` (a :class:`PolicyRunner`), or itself where ``policy``
    is None (the whole cache, exact)."""
    return runner if policy is None else PolicyRunner(runner, policy)


class PolicyStore:
    """A forward's :class:`~speculum.cache.store.KVStore` under a KV policy: the policy writes the
    new entries into ``cache`` (a :class:`~speculum.cache.PositionedKVCache` or
    :class:`~speculum.cache.QuantKVCache`, through its ``write``) and attends over what it selects."""

    compiled = None

    def __init__(self, policy, cache, step: Step):
        self.policy, self.cache, self.step = policy, cache, step

    def attend(self, layer: int, sliding: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.policy.attend(self.cache, layer, sliding, q, k, v, self.step)
