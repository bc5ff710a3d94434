"""Shared-prefix reuse: the KV entries of recent prompts, so that a request starting with the same
tokens (a system prompt, a few-shot block, a tool list) copies them instead of recomputing them.

Entries are kept per *tenant* (the server's isolation unit: an API key and cache salt), so the time
to first token never tells one tenant what another sent. A lookup finds the stored prompt that
shares the longest prefix with the new one; matches shorter than ``min_tokens`` are not worth a copy.
The cache holds at most ``max_bytes`` of entries and drops the least recently used first.

Example: stored ``[s1 s2 s3 q1 q2]``, new prompt ``[s1 s2 s3 r1 r2 r3]``: the first 3 entries are
copied into the new request's cache and only ``r1 r2`` are prefilled (the last prompt token is the
root, whose entry the first decoding step writes).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass
class _Entry:
    tokens: list[int]  # the prompt tokens whose entries are stored
    kv: torch.Tensor  # [layers, 2, H_kv, m, d]


def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class PrefixCache:
    """Recent prompts' KV entries, per tenant, bounded in bytes (least recently used dropped first)."""

    def __init__(self, max_bytes: int = 256 << 20, min_tokens: int = 32):
        self.max_bytes, self.min_tokens = max_bytes, min_tokens
        self.entries: OrderedDict[tuple[str, int], _Entry] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.reused_tokens = 0
        self._next = 0

    def lookup(self, tenant: str, prompt: list[int]) -> torch.Tensor | None:
        """The stored entries ``[layers, 2, H_kv, m, d]`` of the longest prefix ``prompt[:m]`` this
        tenant's stored prompts share with ``prompt`` (``m <= len(prompt) - 1``), or None."""
        best, best_key = 0, None
        for key, e in self.entries.items():
            if key[0] == tenant:
                m = common_prefix(e.tokens, prompt)
                if m > best:
                    best, best_key = m, key
        best = min(best, len(prompt) - 1)
        if best_key is None or best < self.min_tokens:
            return None
        self.entries.move_to_end(best_key)
        self.hits += 1
        self.reused_tokens += best
        return self.entries[best_key].kv[:, :, :, :best]

    def store(self, tenant: str, tokens: list[int], kv: torch.Tensor) -> None:
        """Keep a copy of ``kv [layers, 2, H_kv, len(tokens), d]``, the entries of ``tokens``, unless a
        stored prompt of this tenant already covers them."""
        m = len(tokens)
        if m < self.min_tokens:
            return
        for key, e in self.entries.items():
            if key[0] == tenant and len(e.tokens) >= m and common_prefix(e.tokens, tokens) == m:
                self.entries.move_to_end(key)
                return
        size = kv.numel() * kv.element_size()
        if size > self.max_bytes:
            return
        self._next += 1
        self.entries[(tenant, self._next)] = _Entry(list(tokens), kv.clone())
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, old = self.entries.popitem(last=False)
            self.bytes -= old.kv.numel() * old.kv.element_size()
