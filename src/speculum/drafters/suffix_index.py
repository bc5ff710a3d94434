"""A depth-bounded suffix trie over token sequences, updated one token at a time.

Every substring of length ``<= max_depth`` of every inserted sequence is a path from the root;
each node counts the occurrences of its substring. That is a suffix tree truncated at
``max_depth`` (as SuffixDecoding uses), stored uncompressed because its depth is small.

Appending a token to a sequence extends the ``max_depth`` open suffixes that end at its end:
O(max_depth) dictionary operations, independent of the sequence's length. Removing a sequence
(for a bounded cross-request cache) walks the same paths and decrements.

Storage: flat lists indexed by node id (count, first child, next sibling, token) plus one dict
from ``node * 2**SHIFT + token`` to the child, rather than a Python dict per node: a trie over a
few thousand tokens has ~10^5 nodes, and this keeps it to a handful of Python objects. Node ``0``
is the root (the empty substring).
"""

from __future__ import annotations

SHIFT = 24  # token ids below 2**24
NONE = -1


class SuffixIndex:
    def __init__(self, max_depth: int = 40):
        self.max_depth = max_depth
        self.edge: dict[int, int] = {}  # node << SHIFT | token -> child
        self.count: list[int] = [0]  # node -> occurrences of its substring
        self.first: list[int] = [NONE]  # node -> first child
        self.sibling: list[int] = [NONE]  # node -> next sibling
        self.token: list[int] = [NONE]  # node -> its last token
        self.free: list[int] = []  # recycled node ids
        self.open: dict[int, list[int]] = {}  # sequence id -> nodes of its suffixes, shortest first
        self.sequences: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.count) - len(self.free)

    def _new_child(self, parent: int, tok: int) -> int:
        if self.free:
            node = self.free.pop()
            self.count[node] = 0
            self.first[node] = NONE
            self.token[node] = tok
        else:
            node = len(self.count)
            self.count.append(0)
            self.first.append(NONE)
            self.sibling.append(NONE)
            self.token.append(tok)
        self.sibling[node] = self.first[parent]
        self.first[parent] = node
        self.edge[parent << SHIFT | tok] = node
        return node

    def children(self, node: int) -> list[int]:
        """Child node ids of ``node``."""
        out, c = [], self.first[node]
        while c != NONE:
            out.append(c)
            c = self.sibling[c]
        return out

    def child(self, node: int, tok: int) -> int | None:
        return self.edge.get(node << SHIFT | tok)

    def extend(self, seq_id: int, tokens: list[int]) -> None:
        """Append ``tokens`` to sequence ``seq_id`` (created if new)."""
        seq = self.sequences.setdefault(seq_id, [])
        active = self.open.setdefault(seq_id, [])
        edge, count, depth_cap = self.edge, self.count, self.max_depth
        for tok in tokens:
            if not 0 <= tok < (1 << SHIFT):
                raise ValueError(f"token id {tok} out of range")
            seq.append(tok)
            new_active = []
            for node in [0] + active[: depth_cap - 1]:
                nxt = edge.get(node << SHIFT | tok)
                if nxt is None:
                    nxt = self._new_child(node, tok)
                count[nxt] += 1
                new_active.append(nxt)
            active[:] = new_active

    def remove(self, seq_id: int) -> None:
        """Forget sequence ``seq_id``: decrement every substring it added, free emptied nodes."""
        seq = self.sequences.pop(seq_id, None)
        self.open.pop(seq_id, None)
        if not seq:
            return
        for start in range(len(seq)):
            node = 0
            for tok in seq[start:start + self.max_depth]:
                nxt = self.edge[node << SHIFT | tok]
                self.count[nxt] -= 1
                if self.count[nxt] == 0:
                    self._unlink(node, nxt)
                    self._free_subtree(nxt)
                    break
                node = nxt

    def _unlink(self, parent: int, node: int) -> None:
        del self.edge[parent << SHIFT | self.token[node]]
        if self.first[parent] == node:
            self.first[parent] = self.sibling[node]
            return
        c = self.first[parent]
        while self.sibling[c] != node:
            c = self.sibling[c]
        self.sibling[c] = self.sibling[node]

    def _free_subtree(self, node: int) -> None:
        stack = [node]
        while stack:
            n = stack.pop()
            for c in self.children(n):
                del self.edge[n << SHIFT | self.token[c]]
                stack.append(c)
            self.first[n] = NONE
            self.free.append(n)

    def walk(self, pattern: list[int]) -> int | None:
        """The node of ``pattern``, or None if it never occurred."""
        node, edge = 0, self.edge
        for tok in pattern:
            node = edge.get(node << SHIFT | tok)
            if node is None:
                return None
        return node

    def longest_match(self, context: list[int], max_len: int) -> tuple[int, int]:
        """``(node, m)`` for the longest suffix of ``context`` (``m <= max_len``) with a continuation.

        A suffix "has a continuation" when some occurrence of it is followed by a token. This is
        monotone in ``m`` (a continued occurrence of a suffix contains one of every shorter
        suffix), so the length is found by binary search. ``m = 0`` (the root) when nothing matches.
        """
        lo, hi, best = 0, min(max_len, len(context), self.max_depth - 1), 0
        best_node = 0
        while lo < hi:
            mid = (lo + hi + 1) // 2
            node = self.walk(context[len(context) - mid:])
            if node is not None and self.first[node] != NONE:
                lo, best, best_node = mid, mid, node
            else:
                hi = mid - 1
        return best_node, best
