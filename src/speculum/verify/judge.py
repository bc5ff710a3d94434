"""Judge decoding (LOSSY, opt-in): a linear judge accepts drafted tokens the target would not pick.

Bachmann, Anagnostidis, Pumarola, Georgopoulos, Sanakoyeu, Du, Schönfeld, Thabet, Kohler (2025),
"Judge Decoding: Faster Speculative Sampling Requires Going Beyond Model Alignment",
https://arxiv.org/abs/2501.19309.

The rule. Exact verification rejects a drafted token that is correct but not the target's own
choice (a synonym, another valid ordering). Judge decoding reads the target's hidden state at the
drafted token's row of the verification forward (the token as input, having seen its context)
and a linear head ``sigmoid(w . h + b)`` judges it: a drafted token is accepted where the target's
argmax equals it (greedy verification) *or* where the judge's score exceeds ``threshold``. The
walk goes down the tree as the greedy walk does (a matching child first, else the child the judge
scores highest above the threshold) and the bonus token is the target's argmax after the accepted
path. The output is therefore NOT plain greedy decoding's: it is off by default, labelled
(``"lossy": true`` and ``"verify": "judge"`` in results, a warning on stderr when it is built)
and applies to greedy requests only (sampled ones verify exactly, by SpecInfer's rule).

Worked example: root "The", draft "big dog"; the target's argmax after "The" is "large". Greedy
rejects "big". The judge's score on the row of "big" is 0.93 > 0.5: "big" is accepted; the
target's argmax after "The big" is "dog": accepted too, and the bonus is the argmax after it.

The head: the paper trains it on a few thousand tokens labelled by people (or a strong model) as
"correct but different". speculum's trainer (:mod:`speculum.train.judge`) uses a cheap proxy
instead, said plainly: a token is labelled acceptable when the target's own probability of it is
at least ``ratio`` times its top probability at that position, on text the target sampled itself.
That proxy measures "the target nearly chose it", not "it is correct".

Shapes: ``hidden[layer]`` is ``[n + 1, D]`` (row ``i + 1`` is node ``i``); ``weight`` ``[D]``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import SpeculumError
from ..tree import DraftTree
from . import Acceptance, Verifier, greedy_tokens

JUDGE_WARNING = ("speculum: judge decoding is LOSSY: greedy output may differ from plain decoding's "
                 "(a linear judge accepts drafted tokens the target did not choose)")


@dataclass
class JudgeHead:
    """A linear judge on one hidden-state layer of the target.

    Attributes:
        weight: ``[D]`` float32; bias: a scalar; ``score(h) = sigmoid(h @ weight + bias)``.
        layer: the target's hidden-state layer it reads (numbered as :mod:`speculum.runners.base`:
            ``num_layers`` is the last layer's output).
        threshold: accept a drafted token whose score exceeds this.
        ratio: the proxy-label ratio the head was trained with (for the record).
        model: the target it was trained for (its :func:`~speculum.models.target_key`, or "").
    """

    weight: torch.Tensor
    bias: float
    layer: int
    threshold: float = 0.5
    ratio: float = 0.5
    model: str = ""

    def scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[m]`` judge scores in (0, 1) of hidden states ``[m, D]``."""
        return torch.sigmoid(hidden.float() @ self.weight.to(hidden.device) + self.bias)

    def save(self, path: str | Path) -> None:
        torch.save({"weight": self.weight.float().cpu(), "bias": float(self.bias), "layer": self.layer,
                    "threshold": self.threshold, "ratio": self.ratio, "model": self.model}, str(path))

    @classmethod
    def load(cls, path: str | Path) -> JudgeHead:
        if not Path(path).is_file():
            raise SpeculumError(f"judge head {path} is not a file (make one with speculum.train.judge)")
        try:
            d = torch.load(str(path), map_location="cpu", weights_only=True)
            return cls(d["weight"], float(d["bias"]), int(d["layer"]), float(d["threshold"]), float(d["ratio"]),
                       str(d.get("model", "")))
        except (KeyError, TypeError, RuntimeError, ValueError) as e:
            raise SpeculumError(f"{path} is not a judge head: {e}") from None


class JudgeVerifier(Verifier):
    """Greedy verification that also accepts tokens the judge accepts (see the module). Made per
    head by :func:`judge_rule`."""

    name = "judge"
    lossy = True
    head: JudgeHead

    def accept(self, tree: DraftTree, logits: torch.Tensor, position: int | None = None,
               hidden: dict[int, torch.Tensor] | None = None) -> Acceptance:
        if not self.params.greedy or len(tree) == 0:
            return super().accept(tree, logits, position, hidden)
        if hidden is None or self.head.layer not in hidden:
            raise RuntimeError(f"judge decoding needs the target's hidden states of layer {self.head.layer}")
        return self.accept_judged(tree, logits, hidden[self.head.layer])

    def accept_judged(self, tree: DraftTree, logits: torch.Tensor, hidden: torch.Tensor) -> Acceptance:
        """``logits`` ``[n + 1, V]``, ``hidden`` ``[n + 1, D]``: the greedy walk, widened by the judge."""
        target = greedy_tokens(logits)  # [n + 1]
        scores = self.head.scores(hidden[1:]).tolist()  # [n] one per node
        approved = [s > self.head.threshold for s in scores]
        kids = tree.children()
        path, row = [], 0
        while True:
            match = next((c for c in kids[row] if tree.tokens[c] == target[row]), None)
            if match is None:
                judged = [c for c in kids[row] if approved[c]]
                match = max(judged, key=scores.__getitem__) if judged else None
            if match is None:
                return Acceptance(path, [tree.tokens[i] for i in path] + [target[row]], target)
            path.append(match)
            row = match + 1


def judge_rule(judge: JudgeHead | str | Path, threshold: float | None = None, warn: bool = True) -> type[JudgeVerifier]:
    """The verification rule of one judge head (or its file); ``threshold`` overrides the head's.
    Says on stderr that the rule is lossy (``warn``)."""
    head = judge if isinstance(judge, JudgeHead) else JudgeHead.load(judge)
    if threshold is not None:
        if not 0.0 < threshold < 1.0:
            raise SpeculumError(f"the judge's threshold is a probability in (0, 1), got {threshold}")
        head = JudgeHead(head.weight, head.bias, head.layer, threshold, head.ratio, head.model)
    if warn:
        print(JUDGE_WARNING, file=sys.stderr)
    return type("JudgeVerifierWithHead", (JudgeVerifier,), {"head": head, "hidden_layers": (head.layer,)})
