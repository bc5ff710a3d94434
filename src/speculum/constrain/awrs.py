"""AWRS: Adaptive Weighted Rejection Sampling, with importance resampling over particles.

Lipkin, LeBrun, Vigly, Loula, MacIver, Du, Eisner, Cotterell, Mansinghka, O'Donnell, Lew,
Vieira (2025), "Fast Controlled Generation from Language Models with Adaptive Weighted Rejection
Sampling", https://arxiv.org/abs/2504.05410

The rule. Instead of computing the grammar's mask over the whole vocabulary, sample a token from the
unmasked ``p``, check only that token against the grammar, and if it is illegal remove it and sample
again from what is left (rejection without replacement). The first legal token is an exact draw
from ``p`` restricted to the legal tokens (what masking samples), after a handful of checks. To
sample from the *sequence-level* constrained distribution ``p(y | y in grammar)`` the sample needs an
importance weight: the legal mass ``Z_t = sum_{x legal} p(x | y_<t)`` of every step. AWRS estimates
it without the mask by continuing the rejection loop a little past the accepted token; the estimate is
unbiased, so ``(y, prod_t w_t)`` is a *properly weighted* sample: for any output ``y``,
``E[W * 1{sample = y}] = prod_t p(y_t | y_<t)`` over complete legal outputs. Properly weighted is not
exact by itself: a single particle follows masking's distribution. Exactness comes from importance
resampling (or SMC) over ``N`` particles: pick a particle with probability proportional to its weight;
the chosen output's distribution converges to the exact one as ``N`` grows, and the weighted particles
give unbiased estimates of expectations under it for every ``N``.

The weight estimator here (:func:`awrs_sample`). Draw the vocabulary in a random order without
replacement (Gumbel-top-k on ``log p``). Phase one walks the order to the first legal token ``x``
(the sample). Phase two walks ``extra`` more draws; the last of them is fixed in advance as the final
one. With ``M`` the mass left in the pool just before the final draw,

    w = p(x) + sum of p(y) over the legal y among the phase-two draws before the final one
        + M * 1{final draw legal}.

Why it is unbiased: given everything drawn before it, the final draw is legal with probability
(legal mass left) / ``M``, so ``M * 1{legal}`` estimates the legal mass left without bias, and the
terms before it are that mass's already-seen part. Conditional on ``x``, ``E[w] = Z``, hence
``E[w * 1{x = a}] = p(a)``. Where the pool empties the sum is exact. The paper builds its estimate
from a second rejection round in the same spirit (recursive and geometric variants); this estimator
is speculum's, with the proof above, not the paper's formula.

Worked example: ``p = (a: 0.5, b: 0.3, c: 0.2)``, ``a`` illegal. The order ``a, b, c``: ``a`` is
rejected, ``b`` accepted (``x = b``), ``extra = 1``: the final draw is ``c`` with ``M = 0.2``, legal,
so ``w = 0.3 + 0.2 = 0.5 = Z`` exactly; with ``c`` illegal, ``w = 0.3``.

In speculum. :class:`AwrsGuide` is an :class:`~speculum.constrain.exact.ExactGuide` (no reweighting)
that keeps each committed token's log weight. On a plain step (an empty tree) it runs
:func:`awrs_sample` with lazy checks instead of the full mask. On a speculative step the drafted tree
needs every node's mask anyway (to prune it and to verify it losslessly), so the root's mask is
computed too and the weight is the exact legal mass of each committed token's row: a zero-variance
properly weighted sample. :func:`generate_particles` runs ``N`` particles of a request one after the
other and resamples one at the end, proportional to its weight (importance resampling; no resampling
mid-way: a particle's KV cache cannot be copied into another's). A particle that does not end in a
complete output (the budget ran out) has weight zero; if all do, the first is returned.
Only :meth:`~speculum.engine.Engine.generate` runs the particles: :meth:`~speculum.engine.Engine.stream`,
batched stepping and the server decode one particle, which follows masking's distribution (its weight
is ``guide.log_weight``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from ..sampling import SamplingParams
from ..tree import DraftTree
from .exact import ExactGuide
from .matcher import Grammar

AWRS_EXTRA = 2  # phase-two draws per weight estimate (more: lower variance, more grammar checks)
AWRS_PARTICLES = 8  # default particles per request


def awrs_sample(p: torch.Tensor, legal: Callable[[int], bool], generator: torch.Generator | None = None,
                extra: int = AWRS_EXTRA) -> tuple[int | None, float]:
    """One AWRS step over ``p`` ``[V]`` (a distribution) with the grammar check ``legal(token)``.

    Returns ``(token, w)``: a draw from ``p`` restricted to the legal tokens and an unbiased estimate
    of their mass (see the module docstring); ``(None, 0.0)`` when no token with ``p > 0`` is legal.
    """
    if extra < 1:
        raise ValueError("AWRS needs at least one draw after the sampled token to weigh it")
    probs = p.double().cpu()
    support = probs.nonzero()[:, 0]
    u = torch.rand(len(support), generator=generator, dtype=torch.float64, device="cpu").clamp_min(1e-300)
    keys = probs[support].log() - (-u.log()).log()  # Gumbel-top-k: a draw without replacement
    order = support[keys.argsort(descending=True)]
    masses = probs[order]
    left = float(masses.sum())  # mass in the pool before the next draw
    token, i = None, 0
    while i < len(order):
        tok = int(order[i])
        left -= float(masses[i])
        i += 1
        if legal(tok):
            token = tok
            break
    if token is None:
        return None, 0.0
    w = float(probs[token])
    for step in range(extra):
        if i >= len(order):
            break  # the pool is empty: w is the exact legal mass
        tok = int(order[i])
        if step == extra - 1:  # the final draw, fixed in advance
            return token, w + max(left, 0.0) * float(legal(tok))
        if legal(tok):
            w += float(masses[i])
        left -= float(masses[i])
        i += 1
    return token, w


class AwrsGuide(ExactGuide):
    """AWRS's guide: lazy rejection on plain steps, exact row masses on speculative ones; ``log_weight``
    is the output's log importance weight so far (see the module docstring)."""

    def __init__(self, grammar: Grammar, width: int, params: SamplingParams, generator: torch.Generator,
                 extra: int = AWRS_EXTRA):
        super().__init__(grammar, width, params)
        self.generator, self.extra = generator, extra
        self.log_weight = 0.0
        self.lazy: float | None = None  # the plain step's weight estimate (None: rows use exact masses)

    def bind(self, tree: DraftTree) -> DraftTree:
        if len(tree):
            self.lazy = None
            return super().bind(tree)
        self.tree, self.allowed, self.lazy = tree, None, 0.0
        return tree

    def legal(self, tok: int) -> bool:
        """Whether the grammar allows ``tok`` next (one check, no mask)."""
        m = self.matcher.m
        if tok in self.matcher.eos_ids:
            return m.is_accepting()
        try:
            return m.validate_tokens([tok]) == 1
        except (ValueError, RuntimeError):  # an id the tokenizer does not know
            return False

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        if self.lazy is None:
            return super().mask(logits)
        p = self.params.probs(logits[:1])[0]  # [V]
        token, w = awrs_sample(p, self.legal, self.generator, self.extra)
        if token is None:  # no legal token has p > 0: plain masking, weight 0
            self.allowed = self.matcher.allowed(self.tree)
            self.lazy = 0.0
            return logits.masked_fill(~self.allowed.to(logits.device), float("-inf"))
        self.lazy = w
        out = torch.full_like(logits, float("-inf"), dtype=torch.float32)
        out[0, token] = 0.0  # the verifier (temperature 1) takes the sampled token
        return out

    def commit(self, tokens: list[int]) -> None:
        if self.lazy is not None:
            self.log_weight += math.log(self.lazy) if self.lazy > 0 else -math.inf
        else:
            for row in self.committed_rows(tokens):
                mass = float(self.mass[row])
                self.log_weight += math.log(mass) if mass > 0 else -math.inf
        super().commit(tokens)


@dataclass
class Particles:
    """What :func:`generate_particles` ran: every particle's result, its log weight and the chosen one."""

    results: list  # [N] GenerationResult
    log_weights: list[float]  # [N]; -inf for outputs the grammar does not accept
    chosen: int

    @property
    def result(self):
        """The chosen particle's output, with the time and forwards of all particles (what it cost)."""
        return replace(self.results[self.chosen], time_s=sum(r.time_s for r in self.results),
                       prefill_s=sum(r.prefill_s for r in self.results),
                       forwards=sum(r.forwards for r in self.results))


def particle_seed(seed: int, i: int) -> int:
    """Particle ``i``'s seed: distinct per particle, fixed by the request's seed."""
    return (seed * 1_000_003 + i * 7_919 + 1) % (1 << 62)


def generate_particles(engine, prompt_ids: Sequence[int], max_new_tokens: int, sampling: SamplingParams,
                       stop: Sequence[str] = (), seed: int | None = None, grammar: Grammar | None = None,
                       particles: int = AWRS_PARTICLES) -> Particles:
    """Importance resampling over ``particles`` AWRS runs of one request (see the module docstring)."""
    base = seed if seed is not None else int(torch.seed() % (1 << 62))
    results, log_weights = [], []
    for i in range(particles):
        d = engine.start(prompt_ids, max_new_tokens, sampling, stop, particle_seed(base, i), grammar)
        while d.reason is None:
            engine.step([d])
        result = d.finish()
        complete = bool(result.tokens) and result.tokens[-1] in engine.eos_ids
        results.append(result)
        log_weights.append(d.guide.log_weight if complete else -math.inf)
    return Particles(results, log_weights, resample(log_weights, base))


def resample(log_weights: list[float], seed: int) -> int:
    """An index drawn with probability proportional to ``exp(log_weights)`` (0 when all are -inf)."""
    lw = torch.tensor(log_weights, dtype=torch.float64)
    if not bool(torch.isfinite(lw).any()):
        return 0
    probs = (lw - lw.max()).exp()
    gen = torch.Generator().manual_seed(seed)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=gen))
