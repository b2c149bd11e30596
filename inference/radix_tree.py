"""A radix tree keyed by token ids, with LRU eviction under a byte budget (the prefix cache's logic).

Why a radix tree: requests share prefixes of different lengths (a system prompt
shared by every call, a question shared by a group's attempts, a whole first
turn repeated by an agent's second call). Each node holds the payload of its
edge only (the KV of those tokens), so a shared prefix is stored once and a
lookup returns the longest stored prefix of any prompt.

Pure: the payload is opaque. Two functions given at construction handle it:
``nbytes(payload)`` and ``split(payload, k) -> (first k tokens, the rest)``;
the tensors live at the edge (:mod:`boltstream.inference.prefix_cache`).

Several namespaces share the one budget and LRU order: one per policy, so
entries of one set of weights are never returned for another, and one
namespace can be dropped alone (``drop``). Not thread-safe: the caller locks.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

P = TypeVar("P")


@dataclass(eq=False)
class _Node(Generic[P]):
    edge: tuple[int, ...]
    payload: P | None
    nbytes: int
    parent: _Node[P] | None
    children: dict[int, _Node[P]] = field(default_factory=dict)
    last_used: int = 0


class PrefixTree(Generic[P]):
    """Token-id prefixes -> payloads; see the module docstring."""

    def __init__(self, budget_bytes: int, nbytes: Callable[[P], int],
                 split: Callable[[P, int], tuple[P, P]]) -> None:
        self.budget_bytes = budget_bytes
        self._nbytes = nbytes
        self._split = split
        self._roots: dict[Hashable, _Node[P]] = {}
        self._clock = 0
        self.bytes = 0  # payload bytes held
        self.tokens = 0  # tokens held (edge lengths summed)
        self.evictions = 0  # nodes evicted for the budget

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def lookup(self, namespace: Hashable, tokens: Sequence[int], limit: int | None = None
               ) -> list[tuple[P, int]]:
        """The longest stored prefix of ``tokens[:limit]``: ``(payload, tokens used of it)`` along the path.

        Every node on the path counts as used now (LRU). The used counts sum to the matched length;
        only the last payload may be used partly.
        """
        root = self._roots.get(namespace)
        tokens = tokens[:limit] if limit is not None else tokens
        if root is None:
            return []
        now = self._tick()
        root.last_used = now
        path: list[tuple[P, int]] = []
        for child, _, k in _descend(root, tokens):
            child.last_used = now
            assert child.payload is not None
            path.append((child.payload, k))
        return path

    def insert(self, namespace: Hashable, tokens: Sequence[int], make: Callable[[int, int], P]) -> int:
        """Store ``tokens``; ``make(start, end)`` gives the payload of ``tokens[start:end]``, asked only for
        the part not stored yet. Returns how many tokens were added, then evicts down to the budget."""
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = _Node((), None, 0, None)
        now = self._tick()
        root.last_used = now
        node, pos = root, 0
        for child, start, k in _descend(root, tokens):
            if k < len(child.edge):
                child = self._split_node(child, k)  # the walk ends here: nothing below it is visited
            child.last_used = now
            node, pos = child, start + k
        added = len(tokens) - pos
        if added:
            payload = make(pos, len(tokens))
            leaf = _Node(tuple(tokens[pos:]), payload, self._nbytes(payload), node, last_used=now)
            node.children[leaf.edge[0]] = leaf
            self.bytes += leaf.nbytes
            self.tokens += added
        self.evict()
        return added

    def _split_node(self, node: _Node[P], k: int) -> _Node[P]:
        """Cut ``node``'s edge after ``k`` tokens; returns the new upper node (``node`` keeps the rest)."""
        assert node.payload is not None and node.parent is not None and 0 < k < len(node.edge)
        head, tail = self._split(node.payload, k)
        upper = _Node(node.edge[:k], head, self._nbytes(head), node.parent, last_used=node.last_used)
        node.parent.children[upper.edge[0]] = upper
        self.bytes += upper.nbytes - node.nbytes
        node.edge, node.payload, node.parent = node.edge[k:], tail, upper
        node.nbytes = self._nbytes(tail)
        self.bytes += node.nbytes
        upper.children[node.edge[0]] = node
        return upper

    def evict(self) -> None:
        """Remove least recently used leaves until the payloads fit the budget."""
        while self.bytes > self.budget_bytes:
            victim: _Node[P] | None = None
            for leaf in self._leaves():
                if victim is None or leaf.last_used < victim.last_used:
                    victim = leaf
            if victim is None:
                return
            self._remove(victim)
            self.evictions += 1

    def _leaves(self) -> Iterator[_Node[P]]:
        for root in self._roots.values():
            stack = list(root.children.values())
            while stack:
                n = stack.pop()
                if n.children:
                    stack.extend(n.children.values())
                else:
                    yield n

    def _remove(self, leaf: _Node[P]) -> None:
        assert leaf.parent is not None
        del leaf.parent.children[leaf.edge[0]]
        self.bytes -= leaf.nbytes
        self.tokens -= len(leaf.edge)
        leaf.payload = None

    def drop(self, namespace: Hashable) -> None:
        """Forget everything stored under ``namespace`` (not counted as evictions)."""
        root = self._roots.pop(namespace, None)
        if root is None:
            return
        stack = list(root.children.values())
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            self.bytes -= n.nbytes
            self.tokens -= len(n.edge)
            n.payload = None

    def edges(self, namespace: Hashable) -> list[tuple[int, ...]]:
        """Every stored edge under ``namespace``, depth first in token order (the tree's shape, for tests)."""
        root = self._roots.get(namespace)
        out: list[tuple[int, ...]] = []

        def walk(n: _Node[P]) -> None:
            for key in sorted(n.children):
                out.append(n.children[key].edge)
                walk(n.children[key])

        if root is not None:
            walk(root)
        return out


def _descend(root: _Node[P], tokens: Sequence[int]) -> Iterator[tuple[_Node[P], int, int]]:
    """The edges ``tokens`` follows down from ``root``, each as (node, position of the edge's first token
    in ``tokens``, how many of its tokens match); only the last may match in part."""
    node, pos = root, 0
    while pos < len(tokens):
        child = node.children.get(tokens[pos])
        if child is None:
            return
        k = _common(child.edge, tokens, pos)
        partial = k < len(child.edge)  # decided before the caller may split the node
        yield child, pos, k
        if partial:
            return
        node, pos = child, pos + k


def _common(edge: tuple[int, ...], tokens: Sequence[int], pos: int) -> int:
    """How many leading tokens of ``edge`` equal ``tokens[pos:]``."""
    k = 0
    n = min(len(edge), len(tokens) - pos)
    while k < n and edge[k] == tokens[pos + k]:
        k += 1
    return k
