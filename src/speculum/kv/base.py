"""The KV-policy interface and budgets.

A policy decides what the KV cache stores and what each decode step reads. It plugs into the
runner (:class:`~speculum.runners.policy.PolicyRunner`), which calls it at four points:

- **attach**, once, when the policy is plugged into a runner: :meth:`KVPolicy.attach` sees the
  model's attention layout and name (a policy with learned per-model data finds it there);
- **prefill**, layer by layer: :meth:`KVPolicy.store_prefill` receives one layer's full keys and
  values (and, if the policy asks, attention statistics) and stores what it keeps, so the full
  cache of all layers never exists at once (peak memory really falls); a policy whose heads do not
  all attend over the whole prompt computes the prompt's attention itself
  (:meth:`KVPolicy.prefill_attend`);
- **attention**, at every layer of every forward: :meth:`KVPolicy.attend` writes the new entries
  and attends over what the policy chooses to read;
- **commit**: :meth:`KVPolicy.before_commit` sees which pending entries (root and accepted path)
  are about to be kept, while they are still in place (H2O's accepted tokens vote), and
  :meth:`KVPolicy.after_commit` runs once they are (evict, quantize the entries that left the
  full-precision window, refresh page bounds).

A policy object holds only its settings, so one serves many requests; what it keeps for one
request is a typed state object on that request's cache (``cache.state``, a dataclass next to
each policy).

Budgets are a token count (``1024``) or a ratio of the prompt length (``0.25``). Policies are
lossy by design; with a budget that covers the whole context each of them is token-identical to
decoding without a policy (tests/test_kv.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..attention import AttentionLayout, Step
from ..cache import KVCache
from ..errors import SpeculumError


@dataclass(frozen=True)
class Budget:
    """A KV budget: ``tokens`` (an absolute count) or ``ratio`` (a fraction of the prompt)."""

    tokens: int | None = None
    ratio: float | None = None

    @classmethod
    def parse(cls, value) -> Budget:
        """``"0.25"``, ``0.25`` -> ratio; ``"1024"``, ``1024`` -> tokens (an int above 1)."""
        if isinstance(value, Budget):
            return value
        bad = SpeculumError(f"a KV budget is a token count (e.g. 1024) or a ratio in (0, 1] (e.g. 0.25), "
                            f"got {value!r}")
        text = str(value).strip()
        try:
            if isinstance(value, float) or "." in text or "e" in text.lower():
                ratio = float(text)
                if not 0 < ratio <= 1:
                    raise bad
                return cls(ratio=ratio)
            tokens = int(text)
        except ValueError:
            raise bad from None
        if tokens < 1:
            raise bad
        return cls(tokens=tokens)

    def for_length(self, n: int) -> int:
        """The budget in tokens for an ``n``-token prompt (at least 1)."""
        if self.tokens is not None:
            return max(1, self.tokens)
        return max(1, math.ceil(self.ratio * n))

    def __str__(self) -> str:
        return str(self.tokens) if self.tokens is not None else f"{self.ratio:g}"


class KVPolicy:
    """Base class: the hooks a policy implements. See the module docstring for when each runs.

    Class attributes:
        name: the CLI name.
        prefill_scores: attention statistics :meth:`store_prefill` needs: None, ``"window"`` (the
            last ``observation_window`` prompt queries' attention over the prompt, SnapKV),
            ``"window_rows"`` (the same weights per query row, ``[H_kv, g*w, n]``, CAKE),
            ``"all"`` (attention summed over every prompt query, H2O), ``"logits"`` (what
            :meth:`prefill_vote` makes of every prompt query's attention logits, summed: Keyformer)
            or ``"queries"`` (the queries themselves, ``[w, H, d]``, of the prompt rows
            :meth:`query_rows` names, by default the last ``observation_window``: Double Sparsity,
            ThinK, ZipCache).
        rolling: the cache numbers positions by slot (StreamingLLM), so a sequence may run past the
            model's context length.
        uses_budget: whether the budget changes what the policy keeps or reads (False for the
            quantizers, which compress every token: a sweep over budgets runs them once).
    """

    name = "?"
    prefill_scores: str | None = None
    observation_window = 32
    rolling = False
    uses_budget = True

    def __init__(self, budget="0.25"):
        self.budget = Budget.parse(budget)

    def __repr__(self) -> str:
        return f"{self.name}(budget={self.budget})"

    def attach(self, layout: AttentionLayout, model_key: str) -> None:
        """Plugged into a runner for the model named ``model_key`` (``speculum.models.target_key``:
        the GGUF file's stem, a directory's name, a hub id; "" when unknown). Raises
        :class:`~speculum.errors.SpeculumError` where the policy cannot run that model."""

    def new_cache(self, layout: AttentionLayout, dtype: torch.dtype, device, capacity: int) -> KVCache:
        """A fresh cache for one request (``capacity``: prompt + new tokens + draft nodes)."""
        raise NotImplementedError

    def begin_prefill(self, cache, n: int) -> None:
        """Before the layer-by-layer prefill of ``n`` prompt tokens: size the cache, start the state."""

    def end_prefill(self, cache, n: int) -> None:
        """After the last layer is stored."""

    def store_prefill(self, cache, layer: int, sliding: bool, kv: torch.Tensor, scores: torch.Tensor | None) -> None:
        """Keep what the policy wants of one layer's prompt entries ``kv [2, H_kv, n, d]``.

        ``scores [H_kv, n]`` (``[H_kv, g*w, n]`` for ``"window_rows"``) float32 as asked by
        :attr:`prefill_scores` (None otherwise, and on sliding-window layers); for ``"queries"`` the
        queries ``[w, H, d]`` of :meth:`query_rows`, on every layer.
        """
        raise NotImplementedError

    def prefill_vote(self, cache, layer: int, logits: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """With ``prefill_scores = "logits"``: the scores ``[H_kv, b]`` (float32) that prompt query rows
        at ``positions [r]`` give keys ``0 .. b-1`` of a full-attention ``layer``, from their folded
        attention logits ``logits [H_kv, g*r, b]`` (masked with ``-inf``, soft-capped)."""
        raise NotImplementedError

    def query_rows(self, n: int) -> torch.Tensor:
        """The prompt rows ``[w]`` (increasing) whose queries :meth:`store_prefill` receives when
        :attr:`prefill_scores` is ``"queries"``: by default the last ``observation_window``."""
        return torch.arange(max(0, n - self.observation_window), n)

    def prefill_attend(self, cache, layer: int, sliding: bool, q: torch.Tensor, kv: torch.Tensor, a: int, b: int,
                       mask: torch.Tensor | None) -> torch.Tensor | None:
        """The attention of prompt rows ``a .. b-1`` (``q [b-a, H, d]``) over the layer's prompt entries
        ``kv [2, H_kv, n, d]`` (the first ``b`` written), under the prefill's folded ``mask``, or None
        for the layer-by-layer prefill's own (every head over every earlier prompt entry)."""
        return None

    def attend(self, cache, layer: int, sliding: bool, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               step: Step) -> torch.Tensor:
        """Store the new entries ``k, v [n, H_kv, d]`` and attend ``q [n, H, d]`` -> ``[n, H*d]``."""
        return cache.attend_all(layer, sliding, q, k, v, step)

    def draft_depth(self, cache) -> int | None:
        """How many drafted tokens a step may accept before this policy next changes the cache
        (evicts, quantizes) at a commit, or None where its decisions do not depend on how tokens are
        grouped into steps. The engine trims each tree to that depth, so every row of a
        verification reads what a one-token step at its position would: speculation under the
        policy then gives the output of plain decoding under it."""
        return None

    def before_commit(self, cache, keep: list[int] | None) -> None:
        """The pending entries at indices ``keep`` (None: all) are about to be committed."""

    def after_commit(self, cache) -> None:
        """Called after each commit of a decoding step."""
