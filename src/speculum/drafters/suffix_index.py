"""A depth-bounded suffix trie over token sequences, updated one token at a time.

Every substring of length ``<= max_depth`` of every inserted sequence is a path from the root;
each node counts the occurrences of its substring. That is a suffix tree truncated at
``max_depth`` (as SuffixDecoding uses), stored uncompressed because its depth is small.

Appending a token to a sequence extends the ``max_depth`` open suffixes that end at its end:
O(max_depth) dictionary operations, independent of the sequence's length. Removing a sequence
(for a bounded cross-request cache) walks the same paths and decrements.

Shapes and sizes: at most ``len(sequence) * max_depth`` nodes per sequence; node ``0`` is the
root (the empty substring).
"""

from __future__ import annotations


class SuffixIndex:
    def __init__(self, max_depth: int = 40):
        self.max_depth = max_depth
        self.children: list[dict[int, int]] = [{}]  # node -> {token: child node}
        self.count: list[int] = [0]  # node -> occurrences of its substring
        self.free: list[int] = []  # recycled node ids
        self.open: dict[int, list[int]] = {}  # sequence id -> nodes of its suffixes, shortest first
        self.sequences: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self.children) - len(self.free)

    def _new_node(self) -> int:
        if self.free:
            node = self.free.pop()
            self.children[node] = {}
            self.count[node] = 0
            return node
        self.children.append({})
        self.count.append(0)
        return len(self.children) - 1

    def extend(self, seq_id: int, tokens: list[int]) -> None:
        """Append ``tokens`` to sequence ``seq_id`` (created if new)."""
        seq = self.sequences.setdefault(seq_id, [])
        active = self.open.setdefault(seq_id, [])
        children, count, depth_cap = self.children, self.count, self.max_depth
        for tok in tokens:
            seq.append(tok)
            new_active = []
            for node in [0] + active[: depth_cap - 1]:
                nxt = children[node].get(tok)
                if nxt is None:
                    nxt = self._new_node()
                    children[node][tok] = nxt
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
                nxt = self.children[node][tok]
                self.count[nxt] -= 1
                if self.count[nxt] == 0:
                    self._free_subtree(nxt)
                    del self.children[node][tok]
                    break
                node = nxt

    def _free_subtree(self, node: int) -> None:
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(self.children[n].values())
            self.children[n] = {}
            self.free.append(n)

    def walk(self, pattern: list[int]) -> int | None:
        """The node of ``pattern``, or None if it never occurred."""
        node = 0
        for tok in pattern:
            node = self.children[node].get(tok)
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
            if node is not None and self.children[node]:
                lo, best, best_node = mid, mid, node
            else:
                hi = mid - 1
        return best_node, best
