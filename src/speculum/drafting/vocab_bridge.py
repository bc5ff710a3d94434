"""Moving token sequences between two tokenizers through text, for drafting across vocabularies.

A draft model with another tokenizer reads the target's context as text re-tokenized in its own
vocabulary, and its drafted tokens reach the target as text re-tokenized in the target's. Three
pieces, each a plain function of token ids:

- :func:`to_other_vocab`: the context ``[n]`` (target ids) as ids of the other tokenizer: the text
  between special tokens is decoded and encoded again; a special token maps to the other
  tokenizer's special token of the same spelling, or is dropped (the text around it is kept). The
  other tokenizer's own prefix (its BOS) is put first. :class:`ContextTranslator` does it for a
  growing context, re-encoding only its recent ids.
- :func:`appended_text`: the text that drafted ids add after a context, decoded beside the
  context's last ids so that a leading space or a multi-byte character comes out right; an
  unfinished UTF-8 character at the end (decoded as U+FFFD) is cut.
- :func:`continuation_ids`: target ids that continue the committed ids with a piece of text. The
  committed ids' last few are decoded and encoded again together with the text; where they come
  back unchanged the ids after them continue the context. Where they do not (the last committed id
  is part of a word the text goes on with, such as ``"hel"`` before ``"lo world"``), the text is
  encoded on its own: ``"lo", " world"`` is how the target itself would go on after ``"hel"``.

Example (target ids written as their strings): committed ``[..., " the", " ca"]``, drafted text
``"t sat"``. ``" the ca" + "t sat"`` encodes as ``[" the", " cat", " sat"]``, which does not begin
with ``[" the", " ca"]``: the text alone is encoded, ``["t", " sat"]``, and verified after ``" ca"``.

:func:`stable_prefix` keeps the ids that do not change when the drafted text grows by its last
draft token: the last word of a draft may be unfinished, and its target ids would then not be the
ones the target picks.

A tokenizer here is anything with Hugging Face's ``encode(text, add_special_tokens=)``,
``decode(ids, skip_special_tokens=)``, ``all_special_ids`` and ``convert_ids_to_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence

# committed ids decoded again beside the drafted text (enough to hold a word's pieces)
TAIL_IDS = 4


def special_ids(tokenizer) -> frozenset[int]:
    """The tokenizer's special token ids (BOS, EOS, chat markers)."""
    return frozenset(int(i) for i in (getattr(tokenizer, "all_special_ids", None) or ()))


def special_map(source, other) -> dict[int, int | None]:
    """``{source special id: other's special id of the same spelling, or None}``."""
    theirs = {other.convert_ids_to_tokens(i): i for i in special_ids(other)}
    return {i: theirs.get(source.convert_ids_to_tokens(i)) for i in special_ids(source)}


def leading_ids(tokenizer) -> list[int]:
    """What the tokenizer puts before any text (its BOS, if it adds one)."""
    return [int(i) for i in tokenizer.encode("", add_special_tokens=True)]


def to_other_vocab(ids: Sequence[int], source, other, specials: dict[int, int | None], first: bool = True) -> list[int]:
    """``ids`` ``[n]`` of ``source`` as ids of ``other`` (``specials``: :func:`special_map`);
    ``first``: ``ids`` begin the sequence (``other``'s BOS is put first)."""
    out = leading_ids(other) if first else []
    start = 0
    for i, tid in enumerate(ids):
        if tid in specials:
            out += _encode_text(ids[start:i], source, other)
            mapped = specials[tid]
            if mapped is not None and not (first and i == 0 and out and out[-1] == mapped):
                out.append(mapped)
            start = i + 1
    return out + _encode_text(ids[start:], source, other)


class ContextTranslator:
    """:func:`to_other_vocab` of a growing sequence, paying only for its recent ids.

    The ids up to a word start at least ``keep`` ids back are translated once and frozen (each
    time ``freeze_at`` ids have piled up after the frozen part); each call translates the ids after
    them. The other tokenizer's ids of the frozen part never change, so a draft model's cache over
    them stays valid. A word cut at a freeze point would be encoded in two parts: the point is put
    where the source's id starts with whitespace (or is special) where there is one.
    """

    def __init__(self, source, other, specials: dict[int, int | None], keep: int = 16, freeze_at: int = 64):
        self.source, self.other, self.specials = source, other, specials
        self.keep, self.freeze_at = keep, freeze_at
        self.reset()

    def reset(self) -> None:
        self.frozen: list[int] = []  # source ids translated once
        self.frozen_out: list[int] = []  # [m] their translation

    def __call__(self, ids: Sequence[int]) -> list[int]:
        ids = list(ids)
        if ids[:len(self.frozen)] != self.frozen:  # another sequence
            self.reset()
        if len(ids) - len(self.frozen) > self.freeze_at:
            self._freeze(ids, self._word_start(ids, len(ids) - self.keep))
        return self.frozen_out + to_other_vocab(ids[len(self.frozen):], self.source, self.other, self.specials,
                                                first=not self.frozen)

    def _freeze(self, ids: list[int], cut: int) -> None:
        self.frozen_out += to_other_vocab(ids[len(self.frozen):cut], self.source, self.other, self.specials,
                                          first=not self.frozen)
        self.frozen = ids[:cut]

    def _word_start(self, ids: list[int], cut: int) -> int:
        """The last position at or before ``cut`` (after the frozen part) whose id starts a word."""
        for i in range(cut, len(self.frozen), -1):
            if ids[i] in self.specials or self.source.decode([ids[i]], skip_special_tokens=False)[:1].isspace():
                return i
        return cut


def _encode_text(ids: Sequence[int], source, other) -> list[int]:
    if not ids:
        return []
    text = source.decode(list(ids), skip_special_tokens=False)
    return [int(i) for i in other.encode(text, add_special_tokens=False)]


def appended_text(tokenizer, context: Sequence[int], drafted: Sequence[int], tail: int = TAIL_IDS) -> str:
    """The text ``drafted`` adds after ``context`` (both ids of ``tokenizer``)."""
    before = list(context[-tail:]) if tail else []
    base = tokenizer.decode(before, skip_special_tokens=False)
    full = tokenizer.decode(before + list(drafted), skip_special_tokens=False)
    text = full[len(base):] if full.startswith(base) else tokenizer.decode(list(drafted), skip_special_tokens=False)
    return text.rstrip("\ufffd")


def continuation_ids(tokenizer, committed: Sequence[int], text: str, specials: frozenset[int] = frozenset(),
                     tail: int = TAIL_IDS) -> list[int]:
    """Target ids that follow ``committed`` with ``text`` (module docstring); ``[]`` for no text."""
    if not text:
        return []
    before: list[int] = []
    for tid in reversed(committed[-tail:] if tail else []):
        if tid in specials:  # text never merges across a special token
            break
        before.insert(0, tid)
    if before:
        joined = tokenizer.decode(before, skip_special_tokens=False) + text
        ids = [int(i) for i in tokenizer.encode(joined, add_special_tokens=False)]
        if ids[:len(before)] == before:
            return ids[len(before):]
    return [int(i) for i in tokenizer.encode(text, add_special_tokens=False)]


def stable_prefix(longer: Sequence[int], shorter: Sequence[int]) -> list[int]:
    """The ids ``longer`` and ``shorter`` begin with alike: those a longer draft would not change."""
    n = 0
    while n < min(len(longer), len(shorter)) and longer[n] == shorter[n]:
        n += 1
    return list(longer[:n])
