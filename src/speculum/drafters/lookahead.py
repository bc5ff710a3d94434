"""``lookahead``: Lookahead decoding (Fu et al. 2024, "Break the Sequential Dependency of LLM
Inference Using Lookahead Decoding"). Training-free and model-free: the target itself, run on a
window of guessed future tokens in the verification forward, fills an n-gram pool; the pool's
n-grams that start at the root are verified in that same forward.

**The lookahead branch** is a 2D window of Jacobi iterates, ``window`` (W) columns by ``ngram - 1``
(N - 1) levels, carried as :class:`~speculum.tree.PromptRows` anchored at the root (never verified,
never cached). Block 0 is the root and level 0's ``W - 1`` tokens at offsets ``1..W-1``; level
``l >= 1`` holds ``W`` tokens at offsets ``l..l+W-1``. Column ``j`` of level ``l`` sees block 0's
columns ``0..j`` and column ``j`` of levels ``1..l``: one chain of consecutive positions, so every
row is a Jacobi update of the token one position on. The outputs of the top level are the next
iterate: each column then spells an n-gram (block 0's token, the column's tokens of levels
``1..N-2``, the new output), which goes into the pool keyed by its first token; the window moves up
one level (level 0 drops its first column, the new iterate becomes the top level). Until the
window has ``N - 1`` levels (the first steps), each step's outputs add a level. Level 0 starts as
tokens drawn from the prompt, as in the reference implementation.

**The pool** keeps, per first token, the ``guesses`` (G) latest distinct n-grams (a repeated one
moves to the back, the oldest goes first). With ``from_text`` (the reference implementation's
``POOL_FROM_PROMPT``) the prompt's and the output's n-grams join it too.

**The verification branch** is the pool's n-grams keyed by the root, newest first, merged into one
tree (shared prefixes once). Each node's score is the product of hit rates learnt online by depth
and by where the n-gram came from (Jacobi or text), so the engine's tree sizer keeps what pays.

**The window switch** (``adaptive``): the window's rows are not free. On a 2-core CPU every row of
a 135M model's forward costs about as much as a drafted node (BENCHMARKS.md, "Self-speculation"),
where on a GPU a few dozen rows cost next to nothing. Each step a bandit
(:mod:`~speculum.drafters.rate_bandit`) chooses whether the window rides along, by the tokens per
second measured with and without it (each step timed from its draft to its update); without it the step drafts from the pool as it stands.

Departures from the paper: the verification branch is a tree (the paper verifies G independent
chains), and the engine commits the bonus token after a fully accepted n-gram. Where the runner
leaves prompt rows out (batched steps, the reproducible mode, KV policies) the window does not
move and the pool grows from text only. Greedy and sampled requests alike draft deterministic
trees (the target's own verification keeps the output exact); the window is always updated with
the argmax.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict

import numpy as np
import torch

from ..errors import SpeculumError
from ..tree import DraftTree, PromptRows, TreeBuilder
from ..verify import Acceptance
from ..weights import embedder, model_device
from .base import Drafter
from .hit_rates import HitRates, record_tree
from .rate_bandit import ArmRates, StepClock

JACOBI, TEXT = "jacobi", "text"  # where a pool n-gram came from
WINDOW, NO_WINDOW = "window", "no_window"  # the window switch's arms


class LookaheadDrafter(Drafter):
    name = "lookahead"

    def __init__(self, target: torch.nn.Module, draft_head=None, window: int = 5, ngram: int = 4,
                 guesses: int = 8, from_text: bool = True, max_nodes: int = 24, adaptive: bool = True,
                 gamma: float = 0.99, explore: float = 0.25, clock=time.perf_counter, seed: int = 0):
        if window < 2 or ngram < 3 or guesses < 1:
            raise SpeculumError(f"lookahead needs window >= 2, ngram >= 3 and guesses >= 1; got window={window}, "
                                f"ngram={ngram}, guesses={guesses}")
        # draft_head: the learned drafters' head files, passed to every method that reads the target; unused here
        self.embedding = embedder(target)  # Gemma's scale included
        self.device = model_device(target)
        self.window, self.ngram, self.guesses = window, ngram, guesses
        self.from_text, self.max_nodes, self.seed = from_text, max_nodes, seed
        # P(depth-d node of an n-gram from `origin` hits | its parent did), shared across requests
        self.rates = HitRates(prior=lambda key: 0.4 if key[1] == 1 else 0.6)
        self._mask = self._window_mask()
        # whether the window rides along: measured tokens per second with and without it, shared by forks
        self.adaptive, self.clock = adaptive, clock
        self.switch = ArmRates((WINDOW, NO_WINDOW), gamma, explore)
        self.with_window: list[bool] = []  # per step of the current request (for reports)

    def reset(self, prompt_ids, params, generator):
        super().reset(prompt_ids, params, generator)
        rng = random.Random(self.seed)
        self.levels: list[list[int]] = [[rng.choice(prompt_ids) for _ in range(self.window - 1)]]
        self.pool: dict[int, OrderedDict[tuple[int, ...], str]] = {}
        self.indexed = 0  # text n-grams starting before this index are in the pool
        if self.from_text:
            self._index_text(list(prompt_ids))
        self.steps = StepClock(self.switch, self.clock)
        self.switch.halve()
        self.with_window = []

    # -- the pool --------------------------------------------------------------------------------

    def _add(self, key: int, gram: tuple[int, ...], origin: str) -> None:
        slot = self.pool.setdefault(key, OrderedDict())
        if gram in slot:
            slot.move_to_end(gram)
            if origin == JACOBI:
                slot[gram] = JACOBI  # the target wrote it here too
            return
        slot[gram] = origin
        if len(slot) > self.guesses:
            slot.popitem(last=False)

    def _index_text(self, tokens: list[int]) -> None:
        """Every n-gram of ``tokens`` that starts at or after :attr:`indexed` and is complete."""
        n = self.ngram
        for i in range(self.indexed, len(tokens) - n + 1):
            self._add(tokens[i], tuple(tokens[i + 1:i + n]), TEXT)
        self.indexed = max(self.indexed, len(tokens) - n + 1)

    # -- drafting --------------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, tokens: list[int], budget: int) -> DraftTree:
        if self.from_text:  # the text committed since (inside auto, other arms' steps too)
            self._index_text(tokens)
        builder = TreeBuilder()
        limit = min(budget, self.max_nodes)
        for gram, origin in reversed(self.pool.get(tokens[-1], {}).items()):
            parent, score = -1, 1.0
            for depth, tok in enumerate(gram, 1):
                node = builder.child(parent, tok)
                if node is None and len(builder) >= limit:
                    break
                score *= self.rates.p((origin, depth))
                parent = builder.add(parent, tok, score, ("la", (origin, depth)))
        tree = builder.build()
        # a step is timed from its propose to its update (not to the next propose: inside auto the
        # next step may be another arm's)
        window = self.steps.begin(len(tokens)) == WINDOW if self.adaptive else True
        self.with_window.append(window)
        if window:
            tree.prompts = self._window_rows()
        self.root = tokens[-1]
        return tree

    def _window_rows(self) -> PromptRows:
        """The lookahead branch as prompt rows after the root: level 0's ``W - 1`` tokens, then each
        higher level's ``W`` (as many levels as are filled), masks as in the module docstring."""
        w, levels = self.window, self.levels
        ids = [t for level in levels for t in level]
        offsets = list(range(1, w)) + [l + j for l in range(1, len(levels)) for j in range(w)]
        with torch.inference_mode():
            embeds = self.embedding(torch.tensor(ids, device=self.device))
        e = len(ids)
        return PromptRows([-1] * e, offsets, embeds, self._mask[:e, :e])

    def _window_mask(self) -> np.ndarray:
        """``[R, R]`` visibility among a full window's rows (``R = (W - 1) + (N - 2) W``, row order as
        :meth:`_window_rows`): block-0 row ``j`` sees block-0 rows ``1..j``; level ``l``'s column
        ``j`` sees block-0 rows ``1..j`` and column ``j`` of levels ``1..l`` (the root is the anchor)."""
        w, n = self.window, self.ngram

        def row(level: int, col: int) -> int:  # level 0 has columns 1..W-1
            return col - 1 if level == 0 else (w - 1) + (level - 1) * w + col

        size = (w - 1) + (n - 2) * w
        mask = np.zeros((size, size), dtype=bool)
        for level in range(n - 1):
            for col in range(1 if level == 0 else 0, w):
                r = row(level, col)
                mask[r, [row(0, c) for c in range(1, col + 1)]] = True
                mask[r, [row(up, col) for up in range(1, level + 1)]] = True
        return mask

    # -- learning --------------------------------------------------------------------------------

    def see_prompt_logits(self, tree: DraftTree, acceptance: Acceptance, logits: torch.Tensor | None) -> None:
        """The window's outputs ``[e, V]``: the next Jacobi iterate, its n-grams, the window moved up."""
        if logits is None or tree.prompts is None or logits.shape[0] != len(tree.prompts):
            return
        w, levels = self.window, self.levels
        top = logits[-w:] if len(levels) > 1 else logits[:w - 1]
        new = top.max(-1).indices.tolist()
        if len(levels) == 1:  # the root's own output (the step's first committed token) heads level 1
            new = [acceptance.tokens[0]] + new
        if len(levels) < self.ngram - 1:
            levels.append(new)
            return
        block0 = [self.root] + levels[0]
        for j in range(w):
            self._add(block0[j], tuple(level[j] for level in levels[1:]) + (new[j],), JACOBI)
        self.levels = [levels[1][1:], *levels[2:], new]

    def update(self, tokens: list[int], tree: DraftTree, acceptance: Acceptance, logits: torch.Tensor) -> None:
        self.steps.close(len(tokens))
        record_tree(self.rates, "la", tree, logits, acceptance)

    def finish(self, tokens: list[int]) -> None:
        self.steps.close(len(tokens))
