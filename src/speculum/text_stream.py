"""Streaming text: turn the tokens committed so far into text that can be shown at once.

Shared by ``speculum generate`` and the server's server-sent events. Text is released only once
it is final: an incomplete UTF-8 character at the end, or a tail that may be the start of a stop
string, waits for the next tokens; a stop string and what follows it are never released.
"""

from __future__ import annotations

from .stops import cut_at_stop


class StreamingText:
    """Turns a growing token list into text deltas that never need taking back."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.tokens: list[int] = []
        self.sent = ""

    def add(self, tokens: list[int]) -> str:
        self.tokens.extend(tokens)
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        text = text.rstrip("\ufffd")  # an incomplete UTF-8 character
        text = cut_at_stop(text, self.stop)
        hold = max((k for s in self.stop for k in range(len(s) - 1, 0, -1) if text.endswith(s[:k])), default=0)
        ready = text[: len(text) - hold]
        if not ready.startswith(self.sent) or len(ready) <= len(self.sent):
            return ""
        delta, self.sent = ready[len(self.sent):], ready
        return delta

    def finish(self, final: str) -> str:
        if not final.startswith(self.sent):  # a tokenizer that re-spaces decoded text: send what is new
            return ""
        rest, self.sent = final[len(self.sent):], final
        return rest
