"""``del``: self-speculation by early exit, the exit layer and the chain length chosen per context
(DEL, Zarch et al. 2025, "DEL: Context-Aware Dynamic Exit Layer for Efficient Self-Speculative
Decoding", https://arxiv.org/abs/2504.05598).

The draft is the target's own first ``E`` layers and its LM head (LayerSkip's early exit), run over
the target's KV cache (:class:`~speculum.drafting.self_forward.SelfDraft`: the first ``E`` layers'
entries of the committed tokens are the target's own, so nothing is recomputed or caught up).
Drafting is :class:`~speculum.drafters.self_draft.SelfDrafter`'s (a chain, or EAGLE-2's dynamic
tree with ``top_k > 1``).

**DEL's rule.** For every candidate exit layer ``l`` the drafter tracks the rate ``a_l`` at which a
draft exiting there would have been accepted, from *shadow tokens*: the verification forward's
hidden state of layer ``l`` at each committed token, through the final norm and the LM head, is
the token an exit at ``l`` would have drafted next; it counts as accepted where it equals the
target's own next token there (its final layer's greedy choice: on the prompt and under sampling
the committed token is not the target's choice). (The prompt's last ``prompt_rows`` tokens give the first counts.)
Each step, exit layer and chain length are the pair of highest *tokens per layer*, the
expected tokens committed per step over the work the step costs
(:mod:`speculum.drafting.layer_cost`):

    (E, g) = argmax over l, g of  (1 - a_l^(g+1)) / (1 - a_l)  /  (g c_l + 1)

with ``c_l`` a draft forward's cost in target steps. So a context where shallow layers already
agree with the target drafts long chains cheaply, and one where they do not exits deeper or
drafts less.

Example: 8 layers, ``a_2 = 0.3``, ``a_4 = 0.8``, ``a_6 = 0.9``, costs ``c_l = l / 8``: exit 2 is
worth at best 1.04 (``g = 1``), exit 4 1.22 (``g = 2``), exit 6 1.09 (``g = 1``): DEL drafts 2
tokens from layer 4.

Departures from the paper, and why:

- Candidate exits: ``exits`` (default: at most ``max_exits = 6`` layers evenly spaced from
  ``N / 8`` to ``N - 1``; the paper tracks every layer). A shadow token costs an LM-head product per
  candidate and committed token, which on a CPU is a fair share of a step (the head is about a
  fifth of SmolLM2-135M's weights).
- ``c_l`` is the share of the weights a forward through ``l`` layers and the LM head reads
  (decode on a CPU is bound by the bytes it streams); the paper counts layers.
- Rates are counts decayed by ``decay`` per committed token, so they follow the context.
- ``allow_none`` (default True): where no exit is worth more than plain decoding (speed 1), the step
  drafts nothing; the shadow tokens still come from the verification forward, so drafting resumes
  when the context turns easier. The packaged models are not trained for early exit (LayerSkip's
  recipe), so their shallow layers often are not worth drafting with; the paper always drafts
  (``allow_none=False``).
- ``probe_every`` (default 1, the paper's every step): count shadow tokens only every that many
  steps (the prompt's always), to cut their LM-head products where a step is cheap.
- ``idle_backoff`` (default 16): while the steps draft nothing, the gap between counted steps doubles,
  up to that many steps (1: every step, as the paper); it resets once a step drafts. The shadow tokens'
  LM-head product costs about a quarter of a quantized model's step on a CPU, which a model whose
  exits are never worth drafting with would otherwise pay on every step; an easier context is then
  noticed at most ``idle_backoff`` steps late.
- ``exit_confidence`` (default 0: off): the self-drafters' early stop of a chain at an unsure token.

Shapes: ``m`` committed rows seen at once, ``k`` candidate exits, ``D`` hidden size, ``V`` vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..drafting.layer_cost import best_depth, kept_share
from ..drafting.self_forward import SelfDraft
from ..errors import SpeculumError
from ..tree import DraftTree
from .self_draft import SelfDrafter


def spaced_exits(layers: int, count: int) -> tuple[int, ...]:
    """At most ``count`` exit layers evenly spaced from ``layers // 8`` (at least 1; the very first
    layers are poor exits) to ``layers - 1``, for a model of ``layers`` layers."""
    if layers < 2:
        return ()
    lo, hi = max(1, layers // 8), layers - 1
    if hi - lo + 1 <= count:
        return tuple(range(lo, hi + 1))
    return tuple(sorted({round(lo + i * (hi - lo) / (count - 1)) for i in range(count)}))


class ExitRates:
    """Decayed shadow-token counts per candidate exit layer: ``hits[l] / seen[l]`` is ``a_l``."""

    def __init__(self, exits: Sequence[int], decay: float):
        self.exits, self.decay = tuple(exits), decay
        self.hits = dict.fromkeys(self.exits, 0.0)
        self.seen = dict.fromkeys(self.exits, 0.0)

    def add(self, exit_layer: int, matches: Sequence[bool]) -> None:
        """One layer's shadow tokens, in order (each older count decays once per token)."""
        for hit in matches:
            self.hits[exit_layer] = self.hits[exit_layer] * self.decay + float(hit)
            self.seen[exit_layer] = self.seen[exit_layer] * self.decay + 1.0

    def rate(self, exit_layer: int) -> float:
        """``a_l`` (0 before any shadow token)."""
        seen = self.seen[exit_layer]
        return self.hits[exit_layer] / seen if seen else 0.0


class DelDrafter(SelfDrafter):
    name = "del"

    def __init__(self, target: torch.nn.Module, exits: Sequence[int] | None = None, max_exits: int = 6,
                 depth: int = 8, decay: float = 0.95, prompt_rows: int = 16, allow_none: bool = True,
                 probe_every: int = 1, idle_backoff: int = 16, exit_confidence: float = 0.0, lookup: int = 0,
                 **options):
        super().__init__(target, depth=depth, exit_confidence=exit_confidence, lookup=lookup, **options)
        n = self.decoder.shape.layers
        exits = spaced_exits(n, max_exits) if exits is None else tuple(sorted(set(exits)))
        if not exits or any(not 1 <= e < n for e in exits):
            raise SpeculumError(f"del exits after one of the layers 1..{n - 1}; got {list(exits)}")
        if probe_every < 1 or idle_backoff < 1:
            raise SpeculumError(f"del's probe_every and idle_backoff are at least 1; got {probe_every}, {idle_backoff}")
        if not 0.0 < decay <= 1.0:
            raise SpeculumError(f"del's decay is in (0, 1]; got {decay}")
        self.exits, self.max_depth, self.decay = exits, depth, decay
        self.prompt_rows, self.allow_none, self.probe_every = prompt_rows, allow_none, probe_every
        self.idle_backoff = idle_backoff
        # hidden state l: the output of the first l layers; the last (N): the target's final feature
        self.hidden_layers = (*exits, n)
        self.costs = {e: kept_share(self.decoder, e) for e in exits}
        self.models = {e: SelfDraft(self.decoder, layers=list(range(e))) for e in exits}
        self.model = self.models[exits[-1]]
        self.rates = ExitRates(exits, decay)
        self.choice: tuple[int, int] = (exits[-1], 0)  # (exit layer, chain length) of the last step

    def reset(self, prompt_ids, params, generator) -> None:
        super().reset(prompt_ids, params, generator)
        self.rates = ExitRates(self.exits, self.decay)
        self.hidden_seen = 0  # calls of see_hidden this request (the prompt's first)
        self.idle_gap, self.idle_skip = 1, 0  # while not drafting: the gap between counted steps, steps left

    def fork(self) -> DelDrafter:
        twin = super().fork()
        twin.models = {e: SelfDraft(self.decoder, layers=list(range(e))) for e in self.exits}
        twin.model = twin.models[self.choice[0]]
        return twin

    def see_cache(self, cache) -> None:
        for model in self.models.values():
            model.reset()
        super().see_cache(cache)

    @torch.inference_mode()
    def see_hidden(self, hidden: dict[int, torch.Tensor]) -> None:
        """Hidden states ``{l: [m, D]}`` of the ``m`` tokens just cached (the prompt's after its
        prefill: only its last ``prompt_rows`` count): each candidate exit's shadow token at each
        row is counted against the target's own (its final layer's), in one LM-head product."""
        self.hidden_seen += 1
        if self.hidden_seen > 1:
            if (self.hidden_seen - 1) % self.probe_every:
                return
            idle = self.choice[1] == 0  # the step just verified drafted nothing
            if idle and self.idle_skip:
                self.idle_skip -= 1
                return
            self.idle_gap = min(2 * self.idle_gap, self.idle_backoff) if idle else 1
            self.idle_skip = self.idle_gap - 1 if idle else 0
        final = self.decoder.shape.layers
        keep = max(self.prompt_rows, self.max_depth + 1)
        rows = min(hidden[final].shape[0], keep)
        if rows == 0:
            return
        normed = [self.decoder.norm_final(hidden[e][-rows:]) for e in self.exits] + [hidden[final][-rows:]]
        guess = self.decoder.head_logits(torch.cat(normed)).argmax(-1).view(len(normed), rows)  # [k + 1, m]
        for e, matches in zip(self.exits, (guess[:-1] == guess[-1]).tolist()):
            self.rates.add(e, matches)

    def choose(self) -> tuple[int, int]:
        """DEL's (exit layer, chain length) of highest tokens per layer (module docstring); chain
        length 0 (no draft) where nothing beats plain decoding and ``allow_none``."""
        first = 0 if self.allow_none else 1
        best = (self.exits[-1], first, 1.0 if first == 0 else 0.0)
        for e in self.exits:
            depth, speed = best_depth(self.rates.rate(e), self.costs[e], range(first, self.max_depth + 1))
            if speed > best[2]:
                best = (e, depth, speed)
        return best[0], best[1]

    def model_for(self, tokens: list[int]) -> SelfDraft:
        return self.models[self.choice[0]]

    def propose(self, tokens: list[int], budget: int) -> DraftTree:
        self.choice = self.choose()
        self.depth = self.choice[1]
        self.model = self.models[self.choice[0]]
        if self.depth == 0:
            return DraftTree()
        return super().propose(tokens, budget)
