"""llguidance glue: compile a :class:`~speculum.constrain.spec.ConstraintSpec` for a tokenizer and walk
draft trees with the grammar's matcher.

Why llguidance: it is sound (it refuses a schema it cannot enforce rather than approximating it),
it compiles fast, and its masks are cheap next to a forward pass; its matcher copies its state,
which walking a draft tree needs. docs/structured/grammar_engines.md has the comparison with
xgrammar on 100 real schemas.

The bitmask is sized from the *logits' width*, not the tokenizer's vocabulary: models pad their
output layer (SmolLM2: 49152 rows for 49152 tokens, Gemma-3: 262144 rows), and ids the tokenizer
does not know are never allowed.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import SpeculumError
from ..tree import DraftTree, TreeBuilder
from .spec import ConstraintSpec

# tokenizer -> {(width, eos ids): LLTokenizer}; weak keys, so a freed tokenizer's id is never reused
_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _per_tokenizer(store: weakref.WeakKeyDictionary, tokenizer) -> dict:
    """``tokenizer``'s entry in a per-tokenizer cache (a throwaway dict if it is not weak-referenceable)."""
    try:
        return store.setdefault(tokenizer, {})
    except TypeError:  # not weak-referenceable: no cache
        return {}


def _weak(obj):
    """A weak reference to ``obj``, or a strong one where it cannot be weakly referenced."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


def ll_tokenizer(tokenizer, width: int, eos_ids: Sequence[int]):
    """llguidance's view of a Hugging Face fast tokenizer (built once per tokenizer, ~0.3 s)."""
    import llguidance.hf

    if not eos_ids:
        raise SpeculumError("constrained decoding needs an end-of-sequence token id to end the output")
    key = (width, tuple(sorted(eos_ids)))
    cached = _per_tokenizer(_TOKENIZERS, tokenizer)
    if key not in cached:
        try:
            cached[key] = llguidance.hf.from_tokenizer(tokenizer, n_vocab=width, eos_token=sorted(eos_ids))
        except (ValueError, TypeError, AttributeError, RuntimeError) as e:  # slow or unsupported tokenizers
            raise SpeculumError(f"llguidance cannot use this tokenizer: {e}") from None
    return cached[key]


# The budget closer's preferences, best first. Outside a JSON string: tokens that only close objects
# and arrays (longer first), then a comma (a number ends, a required member follows), then the
# shortest value of each type, then opening a string (a key).
# Inside a string: tokens that close it and then only objects and arrays. Anything else: the lowest
# allowed id.
_SHORT_VALUES = [p + v for v in ("0", '""', "[]", "{}", "null", "false", "true", "[", "{", '"') for p in ("", " ")]
_CLOSERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


STUCK_AFTER = 16  # the closer gives up after picking the same fallback token this many times running


@dataclass
class CloserTable:
    """Per tokenizer: each token's text (``[V]``) and the closer's candidate ids, best first, outside /
    inside a JSON string."""

    texts: list[str]
    outside: np.ndarray
    inside: np.ndarray


def closer_table(tokenizer, width: int) -> CloserTable:
    """Built once per tokenizer and logits width."""
    cached = _per_tokenizer(_CLOSERS, tokenizer)
    if width not in cached:
        texts = [""] * width
        for t, i in tokenizer.get_vocab().items():
            if i < width:
                texts[i] = tokenizer.convert_tokens_to_string([t])
        ids = range(width)
        only = lambda t, chars: bool(t) and set(t) <= set(chars)
        by_len = lambda i: (-len(texts[i]), i)
        outside = sorted((i for i in ids if only(texts[i], "}]")), key=by_len)
        first = {}
        for i in ids:
            first.setdefault(texts[i], i)
        outside += [first[v] for v in [",", ", "] + _SHORT_VALUES if v in first]
        inside = sorted((i for i in ids if texts[i][:1] == '"' and (len(texts[i]) == 1 or only(texts[i][1:], "}]"))),
                        key=by_len)
        cached[width] = CloserTable(texts, np.array(outside, dtype=np.int64), np.array(inside, dtype=np.int64))
    return cached[width]


def _string_state(text: str, state: tuple[bool, bool]) -> tuple[bool, bool]:
    """``(inside a JSON string, after a backslash)`` once ``text`` follows ``state``."""
    inside, escaped = state
    for c in text:
        if escaped:
            escaped = False
        elif inside and c == "\\":
            escaped = True
        elif c == '"':
            inside = not inside
    return inside, escaped


SAMPLING_MODES = ("mask", "asap", "awrs")


def check_sampling_mode(mode: str, particles: int) -> None:
    """:class:`SpeculumError` for an unknown constrained-sampling mode or a particle count below 1."""
    if mode not in SAMPLING_MODES:
        raise SpeculumError(f"unknown constraint sampling {mode!r}; choose from {', '.join(SAMPLING_MODES)}")
    if not isinstance(particles, int) or particles < 1:
        raise SpeculumError(f"the number of particles must be an integer >= 1, got {particles}")


class Grammar:
    """A compiled constraint for one tokenizer; :meth:`matcher` starts a request's state.

    Args:
        spec: what the output must match.
        tokenizer: a Hugging Face fast tokenizer.
        width: the model's logits width ``V`` (rows of the output layer).
        eos_ids: tokens that end generation; the grammar allows them once its text is complete.
        close_reserve: 0 (default): an output that reaches ``max_new_tokens`` is cut there, as
            OpenAI's API does. ``N > 0``: the budget closer. Each of the model's tokens among the
            last ``N`` of the budget is kept only if the grammar can still be completed within the
            budget after it (:meth:`TokenMatcher.close_within`); otherwise the grammar's
            shortest-effort completion (:meth:`TokenMatcher._close`) ends the output, valid
            (finish reason ``"closed"``). The rule depends only on the grammar state and the
            model's greedy tokens, so every method closes an output at the same token.
        sampling: how sampled requests meet the constraint: ``"mask"`` (default; each step samples
            the model's distribution restricted to the legal tokens), ``"asap"``
            (:mod:`~speculum.constrain.asap`) or ``"awrs"`` (:mod:`~speculum.constrain.awrs`), which
            sample the model's distribution over whole outputs conditioned on the grammar. Greedy
            requests always mask.
        particles: AWRS's particles per request (importance resampling among them).
    """

    def __init__(self, spec: ConstraintSpec, tokenizer, width: int, eos_ids: Sequence[int], close_reserve: int = 0,
                 sampling: str = "mask", particles: int = 8):
        from llguidance import LLMatcher

        if close_reserve < 0:
            raise SpeculumError("close_reserve must be >= 0")
        check_sampling_mode(sampling, particles)
        if close_reserve and sampling != "mask":
            raise SpeculumError(f"the budget closer replaces the model's tokens, which {sampling} cannot weigh: "
                                "use close_reserve 0 with it")
        self.sampling, self.particles = sampling, particles
        self.lock = threading.Lock()
        self.asap_tries: OrderedDict = OrderedDict()  # ASAp's tries (constrain/asap.py)
        self.spec, self.width = spec, width
        self.tokenizer_ref = _weak(tokenizer)
        self.eos_ids = sorted(eos_ids)
        self.close_reserve = close_reserve
        self.closer = closer_table(tokenizer, width) if close_reserve else None
        self.lltok = ll_tokenizer(tokenizer, width, self.eos_ids)
        self.text = spec.grammar()
        error = LLMatcher.validate_grammar(self.text, self.lltok)
        if error and not error.startswith("WARNING"):
            raise SpeculumError(f"the {spec.kind} constraint cannot be compiled: {error.strip()}")

    def matcher(self) -> TokenMatcher:
        from llguidance import LLMatcher

        m = LLMatcher(self.lltok, self.text, log_level=0)
        if m.is_error():
            raise SpeculumError(f"the {self.spec.kind} constraint cannot be compiled: {m.get_error()}")
        return TokenMatcher(m, self.width, self.eos_ids, self.closer)


GRAMMAR_CACHE = 64  # compiled grammars kept by compile_constraint (least recently used dropped)
_COMPILED: OrderedDict[tuple, Grammar] = OrderedDict()
_COMPILED_LOCK = threading.Lock()


def compile_constraint(spec: ConstraintSpec, tokenizer, width: int, eos_ids: Sequence[int],
                       close_reserve: int = 0, sampling: str = "mask", particles: int = 8) -> Grammar:
    """The :class:`Grammar` for ``spec`` (every caller compiles through here): built once per spec,
    tokenizer, logits width, EOS ids and ``close_reserve``, and kept for the last
    :data:`GRAMMAR_CACHE` distinct ones (a server sees the same schema again and again)."""
    key = (json.dumps([spec.kind, spec.value], sort_keys=True, default=list), id(tokenizer), width,
           tuple(sorted(eos_ids)), close_reserve, sampling, particles)
    with _COMPILED_LOCK:
        grammar = _COMPILED.get(key)
        if grammar is not None and grammar.tokenizer_ref() is tokenizer:
            _COMPILED.move_to_end(key)
            return grammar
    grammar = Grammar(spec, tokenizer, width, eos_ids, close_reserve, sampling, particles)
    with _COMPILED_LOCK:
        _COMPILED[key] = grammar
        while len(_COMPILED) > GRAMMAR_CACHE:
            _COMPILED.popitem(last=False)
    return grammar


class TokenMatcher:
    """One request's grammar state. Only :meth:`commit` changes it; tree walks run on copies.

    The end-of-sequence token is never fed to llguidance: ``validate_tokens`` does not count it and
    rolling back over it undoes one token too many. It is legal exactly when the grammar accepts.
    """

    def __init__(self, matcher, width: int, eos_ids: Sequence[int], closer: CloserTable | None = None):
        self.m, self.width, self.eos_ids = matcher, width, set(eos_ids)
        self.eos = min(eos_ids)
        self._eos_array = np.array(sorted(self.eos_ids), dtype=np.int64)
        self.closer = closer
        self.string_state = (False, False)  # JSON lexical state of the committed text (for the closer)
        self.completion: list[int] | None = None  # the closer's last completion found (see close_within)
        self._mask_bytes = (width + 31) // 32 * 4

    def _bits(self, m=None) -> np.ndarray:
        """``[width/8]`` uint8: the bitmask of tokens allowed in ``m``'s state (default: this request's)."""
        return np.frombuffer((self.m if m is None else m).compute_bitmask(), dtype=np.uint8)[: self._mask_bytes]

    def forced(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens the grammar forces next (its fast-forward tokens), validated."""
        if limit <= 0 or self.m.is_stopped():
            return []
        ff = self.m.compute_ff_tokens()[:limit]
        return ff[: self.m.validate_tokens(ff)] if ff else []

    def _branches(self, m, children: list[int]):
        """``(child, matcher)`` pairs to walk each child on: copies of ``m`` for all but the last
        child, ``m`` itself for the last. Tree walks never roll back: llguidance's ``rollback``
        was seen to leave a different state than before the consumed token (a tree walk with
        rollbacks then masked a legal token on a later step)."""
        last = len(children) - 1
        return [(c, m if i == last else m.deep_copy()) for i, c in enumerate(children)]

    def prune(self, tree: DraftTree) -> DraftTree:
        """``tree`` without the nodes the grammar forbids (and their descendants)."""
        if len(tree) == 0:
            return tree
        kids = tree.children()
        keep: list[int] = []

        def walk(row: int, m) -> None:
            for c, mc in self._branches(m, kids[row]):
                tok = tree.tokens[c]
                if tok in self.eos_ids:  # the end: legal once the grammar accepts; nothing follows it
                    if mc.is_accepting():
                        keep.append(c)
                elif mc.validate_tokens([tok]) == 1:
                    keep.append(c)
                    mc.consume_token(tok)
                    walk(c + 1, mc)

        walk(0, self.m.deep_copy())
        self._check()
        return tree if len(keep) == len(tree) else tree.subtree(sorted(keep))

    def allowed(self, tree: DraftTree) -> torch.Tensor:
        """``[n + 1, V]`` bool: the tokens allowed after the root (row 0) and after each node of a
        legal ``tree`` (row ``i + 1``). Rows after an end-of-sequence node allow everything: they are
        never used, generation stops at that node."""
        kids = tree.children()
        rows: list[np.ndarray | None] = [None] * (len(tree) + 1)

        def walk(row: int, m) -> None:
            rows[row] = self._bits(m)
            for c, mc in self._branches(m, kids[row]):
                tok = tree.tokens[c]
                if tok in self.eos_ids:
                    continue  # generation ends at this node: its row is never used
                if not mc.consume_token(tok):
                    raise _failure(mc, f"token {tok} is not legal here: prune the tree first")
                walk(c + 1, mc)

        walk(0, self.m.deep_copy() if len(tree) else self.m)
        self._check()
        full = np.full(self._mask_bytes, 255, dtype=np.uint8)
        bits = np.stack([r if r is not None else full for r in rows])  # [n + 1, width/8]
        allowed = np.unpackbits(bits, axis=1, bitorder="little")[:, : self.width]
        out = torch.from_numpy(allowed.astype(bool))
        if not out[0].any():
            raise SpeculumError("the constraint allows no token here (the grammar cannot be completed)")
        return out

    def _close(self, m, state: tuple[bool, bool], limit: int) -> tuple[list[int] | None, bool]:
        """The shortest-effort completion from matcher ``m`` (consumed) in JSON string ``state``,
        end-of-sequence token included, within ``limit`` tokens. Deterministic and model-free: forced
        tokens, else the first allowed closer candidate (closing tokens, a comma, short values), else
        the lowest allowed id. Returns ``(path or None, stuck)``: ``stuck`` when the walk gave up
        because its fallback kept picking one token (inside a ``format`` or ``pattern`` string it
        cannot finish), so that no completion was found for a reason other than the budget."""
        path: list[int] = []
        fallback_run = 0
        while len(path) < limit:
            if m.is_accepting():
                return path + [self.eos], False
            ff = m.compute_ff_tokens()
            ff = ff[: min(m.validate_tokens(ff), limit - len(path))] if ff else []
            if ff:  # forced: take them all at once
                for t in ff:
                    m.consume_token(t)
                    state = _string_state(self.closer.texts[t], state)
                path += ff
                fallback_run = 0
                continue
            allowed = np.unpackbits(self._bits(m), bitorder="little")[: self.width]
            prefs = self.closer.inside if state[0] else self.closer.outside
            hit = np.flatnonzero(allowed[prefs])
            if len(hit):
                tok, fallback_run = int(prefs[hit[0]]), 0
            else:
                ids = np.flatnonzero(allowed)
                ids = ids[~np.isin(ids, self._eos_array)]
                if not len(ids):
                    return None, False
                tok = int(ids[0])
                fallback_run = fallback_run + 1 if path and path[-1] == tok else 1
                if fallback_run > STUCK_AFTER:
                    return None, True
            if not m.consume_token(tok):
                return None, False
            path.append(tok)
            state = _string_state(self.closer.texts[tok], state)
        return None, False

    def closing_instead(self, token: int, left: int) -> list[int] | None:
        """The budget closer's rule, with ``left`` tokens of budget and the model's next ``token``:
        None to keep ``token``, else the completion to emit instead (see :meth:`close_within`)."""
        found = self.close_within([token], left, 1)
        return None if found is None else found[1]

    def close_within(self, tokens: Sequence[int], left: int, checked: int) -> tuple[int, list[int]] | None:
        """The budget closer over the model's next ``tokens`` (legal, about to be committed), with
        ``left`` tokens of budget before them; the last ``checked`` of them fall in the closer's zone.

        Returns None to keep them all, or ``(i, path)``: keep ``tokens[:i]`` and emit the completion
        ``path`` instead of ``tokens[i:]``, because after ``tokens[i]`` the grammar could no longer
        be completed within the budget. A token is kept when the last completion found still
        completes the grammar after it (one cheap validation: inside a string it usually does), or
        else when the closer's walk (:meth:`_close`) finds one that fits. A token after which
        the walk gets stuck (in a ``format`` or ``pattern`` string) is kept too: the closer does not
        overrule the model where it cannot do better. The tokens are checked in order, as plain
        decoding checks them one at a time, so every method gives the same output."""
        m, state, known = self.m.deep_copy(), self.string_state, self.completion
        first = len(tokens) - checked
        for i, t in enumerate(tokens):
            if t in self.eos_ids:
                break
            if i >= first:
                after, after_state = m.deep_copy(), _string_state(self.closer.texts[t], state)
                if not after.consume_token(t):
                    break
                if known is None or len(known) > left - i - 1 or not self._completes(after, known):
                    known, stuck = self._close(after, after_state, left - i - 1)
                    if known is None and not stuck:
                        path, _ = self._close(m, state, left - i)
                        return None if path is None else (i, path)
            m.consume_token(t)
            state = _string_state(self.closer.texts[t], state)
        self.completion = known  # the tokens are committed next (or generation ends)
        return None

    @staticmethod
    def _completes(m, path: list[int]) -> bool:
        """Whether ``path`` (ending with the end-of-sequence token) completes the grammar from ``m``."""
        body = path[:-1]
        if m.validate_tokens(body) != len(body):
            return False
        m = m.deep_copy()
        for t in body:
            m.consume_token(t)
        return m.is_accepting()

    def commit(self, tokens: Sequence[int]) -> None:
        """Advance the state over generated ``tokens`` (all legal: they were sampled under the mask)."""
        for t in tokens:
            if t in self.eos_ids:  # generation ends here (and llguidance's rollback skips the end token)
                return
            if not self.m.consume_token(int(t)):
                raise _failure(self.m, f"generated token {t} violates the constraint")
            if self.closer is not None:
                self.string_state = _string_state(self.closer.texts[int(t)], self.string_state)

    def _check(self) -> None:
        if self.m.is_error():
            raise _failure(self.m, "grammar matcher error")


def _failure(m, bug: str) -> Exception:
    """The error for a matcher ``m`` that refused a token its own mask allowed: llguidance stops
    (``is_error``) when a constraint exceeds its limits (lexer size, items per step), which is the
    request's fault (:class:`SpeculumError`: a 400 from the server); anything else is a bug here."""
    if m.is_error():
        return SpeculumError(f"the constraint is too complex to follow: {m.get_error()}")
    return RuntimeError(bug)


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``logits`` ``[n + 1, V]`` with forbidden tokens at ``-inf`` (a new tensor)."""
    return logits.masked_fill(~allowed.to(logits.device), float("-inf"))


def restrict_draft_probs(tree: DraftTree, allowed: torch.Tensor) -> DraftTree:
    """Renormalize each node's draft distribution q over the tokens its parent's state allows.

    Pruning drops drafted tokens the grammar forbids. A sampled draft that survives is then a draw
    from q restricted to the allowed tokens, so verification must use that restricted q to stay
    lossless (the acceptance ratio ``p(x)/q(x)`` and the residual ``p - q``).
    """
    if tree.draft_probs is None or len(tree) == 0:
        return tree
    parent_rows = torch.tensor([p + 1 for p in tree.parents])
    q = tree.draft_probs * allowed[parent_rows].to(tree.draft_probs.device, tree.draft_probs.dtype)
    q = q / q.sum(-1, keepdim=True).clamp_min(1e-30)
    return tree.with_probs(q)


def graft_forced(forced: list[int], tree: DraftTree, budget: int) -> DraftTree:
    """The forced chain with the drafter's ``tree`` merged onto it (jump-forward plus speculation).

    Drafted paths that spell the forced tokens continue below the chain, so one verification
    checks the forced tokens and the drafter's guess of what follows them; drafted nodes that
    leave the chain stay as siblings (the grammar prunes the illegal ones). Forced nodes score
    1.0; drafted nodes keep their scores and tags (1.0 and ``None`` when the drafter gives none).
    A tree with draft probabilities (a sampled draft model) is not merged: its q belongs to its
    own shape, so the forced chain alone is drafted.
    """
    if tree.draft_probs is not None or len(tree) == 0:
        chain = DraftTree.chain(forced)
        chain.scores = [1.0] * len(forced)
        return chain
    b = TreeBuilder()
    b.add_path(forced, [1.0] * len(forced))
    placed: dict[int, int] = {}
    for i, (tok, p) in enumerate(zip(tree.tokens, tree.parents)):
        parent = -1 if p < 0 else placed.get(p)
        if parent is None:
            continue
        if len(b) >= budget and b.child(parent, tok) is None:
            continue
        placed[i] = b.add(parent, tok, tree.scores[i] if tree.scores is not None else 1.0,
                          tree.tags[i] if tree.tags is not None else None)
    return b.build()
