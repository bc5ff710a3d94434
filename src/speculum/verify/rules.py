"""Verification rules by name: what ``--verify`` chooses (``speculum generate|bench``).

Every rule is exact (the committed text follows the target's distribution) except judge decoding,
which is lossy and opt-in (``--judge``, :mod:`speculum.verify.judge`). The rules differ only for
sampled trees whose nodes have several sampled children (a node with one child is a chain step:
Leviathan/Chen's rule under every rule); greedy and keyed-sampling verification are shared.

=============  ===================================  ====================================================
name           siblings drawn (``Drafter.siblings``)  rule at a node with several sampled children
=============  ===================================  ====================================================
``specinfer``  i.i.d. (each from its own q)          sequential rejection, residual ``max(0, p - q)``
``rsd``        without replacement (Gumbel-top-k)     recursive rejection, residual against ``q_j``
``spectr``     i.i.d. from one q                      K-SEQ selection with its optimal-transport residual
=============  ===================================  ====================================================

The engine tells the drafter how to draw (:attr:`~speculum.drafters.base.Drafter.siblings`, from
the rule's ``siblings``) and the rule checks the tree's :attr:`~speculum.tree.DraftTree.siblings`. A sampled tree must reach the
verifier with each node's siblings intact or cut to a prefix of their draw order (RSD's ``q_j``
removes the siblings before ``j``; SpecTr's ``k`` counts them): a drafter of sampled sibling trees
gives no ``scores``, which keeps the engine's tree sizer off them.
"""

from __future__ import annotations

from ..errors import SpeculumError
from . import Verifier
from .rsd import RSDVerifier
from .spectr import SpecTrVerifier

VERIFY_RULES: dict[str, type[Verifier]] = {cls.name: cls for cls in (Verifier, RSDVerifier, SpecTrVerifier)}
DEFAULT_RULE = Verifier.name


def verifier_class(name: str) -> type[Verifier]:
    """The rule called ``name``; :class:`SpeculumError` for an unknown one."""
    try:
        return VERIFY_RULES[name]
    except KeyError:
        raise SpeculumError(f"unknown verification rule {name!r}; choose one of {', '.join(VERIFY_RULES)}") from None
