"""Where generation ends: an end-of-sequence token, a stop string, the token budget or the context.

A step commits several tokens at once, so a stop may fall inside them: generation then ends exactly
there and the later tokens are discarded, which is what plain decoding, one token at a time, would
have produced.
"""

from __future__ import annotations

from collections.abc import Sequence

from .errors import SpeculumError
from .result import FinishReason


def cut_at_stop(text: str, stop: Sequence[str]) -> str:
    """``text`` up to (not including) the earliest occurrence of any stop string."""
    hits = [text.find(s) for s in stop if s and s in text]
    return text[:min(hits)] if hits else text


class Stops:
    """One request's stop conditions.

    Args:
        tokenizer: decodes the output for stop strings and the final text (may be None without them).
        eos_ids: tokens that end generation (kept in the output).
        stop: stop strings (not included in the final text).
        max_new_tokens: the output's budget.
        max_length: the longest sequence, prompt included (the context, for most runners).
    """

    def __init__(self, tokenizer, eos_ids: set[int], stop: Sequence[str], max_new_tokens: int, max_length: int):
        self.tokenizer, self.eos_ids, self.stop = tokenizer, eos_ids, [s for s in stop if s]
        self.max_new_tokens, self.max_length = max_new_tokens, max_length
        if self.stop and tokenizer is None:
            raise SpeculumError("stop strings need a tokenizer")

    def text(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True) if self.tokenizer else ""

    def extend(self, generated: list[int], tokens: list[int], step: list[int], closed: bool = False
               ) -> tuple[list[int], FinishReason | None]:
        """Append a step's verified tokens to ``generated`` (the output) and ``tokens`` (prompt + output),
        cut where a stop falls. Returns ``(the tokens kept, the finish reason or None)``; ``closed``:
        the budget closer ended the output (an end token then reports ``"closed"``)."""
        before = len(generated)
        generated.extend(step)
        keep, reason = self._check(generated, before)
        if closed and reason == FinishReason.EOS:
            reason = FinishReason.CLOSED
        if keep > self.max_new_tokens:
            keep, reason = self.max_new_tokens, FinishReason.LENGTH
        elif reason is None and keep == self.max_new_tokens:
            reason = FinishReason.LENGTH
        del generated[keep:]
        new = generated[before:]
        tokens.extend(new)
        if reason is None and len(tokens) >= self.max_length:
            reason = FinishReason.CONTEXT
        return new, reason

    def _check(self, generated: list[int], new_from: int) -> tuple[int, FinishReason | None]:
        """``(keep, reason)``: keep ``generated[:keep]``; reason is None when nothing stops."""
        for i in range(new_from, len(generated)):
            if generated[i] in self.eos_ids:
                generated_upto = i + 1
                return self._stop_in(generated[:generated_upto], new_from) or (generated_upto, FinishReason.EOS)
        return self._stop_in(generated, new_from) or (len(generated), None)

    def _stop_in(self, generated: list[int], new_from: int) -> tuple[int, FinishReason] | None:
        if not self.stop or not self._tail_has_stop(generated, new_from):
            return None
        # found: the shortest prefix whose text contains a stop string (it ends inside the new tokens)
        for k in range(max(new_from, 1), len(generated) + 1):
            t = self.text(generated[:k])
            if any(s in t for s in self.stop):
                return k, FinishReason.STOP
        return None

    def _tail_has_stop(self, generated: list[int], new_from: int) -> bool:
        """Whether a stop string ends inside ``generated[new_from:]``'s text, decoding only a tail.

        Decoding the whole output at every step would cost O(n) a step, O(n^2) a request. A stop
        string that ends in the new tokens starts at most ``len(stop)`` characters before them, so
        the tail decoded holds at least that many characters of older text (plus a margin, as a
        slice's first characters can decode differently: a leading space, a split UTF-8 character);
        the window of older tokens doubles until it does, or reaches the start. A hit is then
        confirmed on full decodes by the caller, so the tail can only save work, never invent a stop.
        """
        need = max(len(s) for s in self.stop) + 4
        window = 2 * need
        while True:
            start = max(0, new_from - window)
            if start == 0 or len(self.text(generated[start:new_from])) >= need:
                tail = self.text(generated[start:])
                return any(s in tail for s in self.stop)
            window *= 2

    def final_text(self, generated: list[int], reason: FinishReason | None) -> str:
        text = self.text(generated)
        return cut_at_stop(text, self.stop) if reason == FinishReason.STOP else text
