"""``bild``: Big Little Decoder (Kim, Mangalam, Moon, Malik, Mahoney, Gholami, Keutzer 2023,
"Speculative Decoding with Big Little Decoder", https://arxiv.org/abs/2302.07863).

A small model with the target's tokenizer drafts; the big (target) model takes over by two policies:

- **fallback**: the small model drafts a token only while it is confident, its largest next-token
  probability at least ``fallback`` (the paper's alpha_FB). At the first position where it is not,
  drafting stops and the big model runs over the drafted chain; its prediction at that position is
  the step's bonus token (so a small model that is unsure at once gives a plain decoding step).
- **rollback**: the big model's run checks every drafted token. The paper rolls back from the
  first token whose cross-entropy distance to the big model's prediction, ``-log p_big(token)``,
  exceeds ``rollback`` (alpha_RB), and keeps the others even where the big model would have chosen
  differently: that is lossy. speculum's default is the lossless form, ``rollback=0``: exact
  verification (the greedy walk or speculative sampling of :mod:`speculum.verify`), so the output
  is the target's own. ``rollback > 0`` is the paper's rule, opt-in and labelled lossy (a warning
  says so): a drafted token is then also kept where ``-log p_big(token) <= rollback``.

Example (``fallback=0.5``): the small model's top probabilities after the root are .9 ("the"),
.8 ("cat"), .3: it drafts "the cat" and falls back; the target accepts "the", prefers "a dog"
to "cat": greedy keeps "the" + bonus "a". With ``rollback=2`` and ``p_big(cat) = .2``
(``-log .2 = 1.6 <= 2``) "cat" is kept too, and the bonus is the big model's token after it.

Defaults: ``fallback=0.5``, in the range of the paper's sweeps (0..1 it says, the best value
depends on the pair of models); ``max_draft=10`` caps a chain (the paper's small model runs until
it falls back; a cap bounds a step's cost where a small model is confident for long).
"""

from __future__ import annotations

import math
import warnings
from functools import partial

import torch

from ..errors import SpeculumError
from ..tree import DraftTree
from ..verify import Acceptance, Verifier
from .draft_model import DraftModelDrafter


class RollbackVerifier(Verifier):
    """BiLD's lossy rollback rule on chains: drafted tokens whose ``-log p(token) <= rollback`` are
    kept without verification (``p``: the target's distribution, softmax of its logits under greedy
    requests, the request's sampling distribution otherwise); from the first other token on, the
    exact rule. Trees (which BiLD does not draft) are verified exactly."""

    name = "bild_rollback"

    def __init__(self, params, generator=None, key=None, rollback: float = 0.0):
        super().__init__(params, generator, key)
        self.rollback = rollback
        self.lossy = rollback > 0  # results say so (GenerationResult.lossy)

    def tolerated(self, tree: DraftTree, logits: torch.Tensor) -> int:
        """How many leading drafted tokens the rule keeps unverified (``logits`` ``[n + 1, V]``)."""
        probs = torch.softmax(logits.float(), -1) if self.params.greedy else self.params.probs(logits)
        floor = math.exp(-self.rollback)
        kept = 0
        for i, tok in enumerate(tree.tokens):
            if float(probs[i, tok]) < floor:
                break
            kept += 1
        return kept

    def accept(self, tree: DraftTree, logits: torch.Tensor, position: int | None = None,
               hidden: dict[int, torch.Tensor] | None = None) -> Acceptance:
        if self.rollback <= 0 or not tree.is_chain or len(tree) == 0:
            return super().accept(tree, logits, position, hidden)
        kept = self.tolerated(tree, logits)
        rest = DraftTree.chain(tree.tokens[kept:], None if tree.draft_probs is None else tree.draft_probs[kept:])
        tail = super().accept(rest, logits[kept:], None if position is None else position + kept)
        return Acceptance(list(range(kept)) + [kept + i for i in tail.path], tree.tokens[:kept] + tail.tokens)


class BiLDDrafter(DraftModelDrafter):
    """Chains from the small model until its confidence falls below ``fallback``; ``rollback > 0``
    turns on the paper's lossy rollback rule (see the module docstring)."""

    name = "bild"

    def __init__(self, draft_model: torch.nn.Module, fallback: float = 0.5, rollback: float = 0.0,
                 max_draft: int = 10):
        fallback, rollback = float(fallback), float(rollback)
        if not 0.0 <= fallback <= 1.0:
            raise SpeculumError(f"bild's fallback threshold is a probability in [0, 1]; got {fallback}")
        if not rollback >= 0.0:
            raise SpeculumError(f"bild's rollback threshold is a distance >= 0 (0: lossless); got {rollback}")
        super().__init__(draft_model, num_draft=int(max_draft), adaptive=False)
        self.fallback, self.rollback = fallback, rollback
        if rollback > 0:
            warnings.warn(f"bild with rollback={rollback} is LOSSY: it keeps drafted tokens the target would not "
                          "have produced (BiLD's rollback rule); rollback=0 gives the target's exact output",
                          stacklevel=2)
            self.verifier_cls = partial(RollbackVerifier, rollback=rollback)

    def _falls_back(self, probs: torch.Tensor) -> bool:
        return float(probs.max()) < self.fallback
