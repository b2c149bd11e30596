"""The prefix cache's radix tree on hand-drawn cases: payloads are token tuples, 10 bytes a token."""

from __future__ import annotations

from boltstream.inference.radix_tree import PrefixTree

NS = "policy"


def _tree(budget: int = 10_000) -> PrefixTree[tuple[int, ...]]:
    return PrefixTree(budget, nbytes=lambda p: 10 * len(p), split=lambda p, k: (p[:k], p[k:]))


def _insert(tree: PrefixTree[tuple[int, ...]], tokens: list[int], ns: str = NS) -> int:
    return tree.insert(ns, tokens, lambda a, b: tuple(tokens[a:b]))


def _matched(tree: PrefixTree[tuple[int, ...]], tokens: list[int], limit: int | None = None,
             ns: str = NS) -> list[int]:
    """The matched tokens, rebuilt from the payloads the lookup returned."""
    return [t for payload, k in tree.lookup(ns, tokens, limit) for t in payload[:k]]


def test_insert_then_lookup_returns_the_longest_stored_prefix() -> None:
    tree = _tree()
    assert _matched(tree, [1, 2, 3]) == []  # empty tree
    assert _insert(tree, [1, 2, 3, 4]) == 4
    assert _matched(tree, [1, 2, 3, 4, 5]) == [1, 2, 3, 4]
    assert _matched(tree, [1, 2, 9]) == [1, 2]  # ends inside the edge: the payload is used partly
    assert tree.lookup(NS, [1, 2, 9]) == [((1, 2, 3, 4), 2)]
    assert _matched(tree, [7, 1, 2]) == []
    assert (tree.bytes, tree.tokens) == (40, 4)


def test_lookup_limit_leaves_the_last_prompt_token_uncached() -> None:
    tree = _tree()
    _insert(tree, [1, 2, 3, 4])
    assert _matched(tree, [1, 2, 3, 4], limit=3) == [1, 2, 3]


def test_a_diverging_insert_splits_the_edge_and_stores_only_the_new_tokens() -> None:
    tree = _tree()
    _insert(tree, [1, 2, 3, 4])
    asked: list[tuple[int, int]] = []
    added = tree.insert(NS, [1, 2, 5], lambda a, b: asked.append((a, b)) or (5,))
    assert added == 1 and asked == [(2, 3)]
    assert tree.edges(NS) == [(1, 2), (3, 4), (5,)]
    assert (tree.bytes, tree.tokens) == (50, 5)  # 2 + 2 + 1 tokens
    assert tree.lookup(NS, [1, 2, 5, 6]) == [((1, 2), 2), ((5,), 1)]
    assert _matched(tree, [1, 2, 3, 4]) == [1, 2, 3, 4]


def test_inserting_a_stored_prefix_adds_nothing_but_may_split() -> None:
    tree = _tree()
    _insert(tree, [1, 2, 3, 4])
    assert _insert(tree, [1, 2, 3, 4]) == 0
    assert _insert(tree, [1, 2]) == 0  # a prefix of an edge: split, no new tokens
    assert tree.edges(NS) == [(1, 2), (3, 4)]
    assert (tree.bytes, tree.tokens) == (40, 4)


def test_lru_eviction_removes_the_least_recently_used_leaf_down_to_the_budget() -> None:
    tree = _tree(budget=60)
    _insert(tree, [1, 2, 3])  # A: 30 bytes
    _insert(tree, [4, 5])  # B: 20 bytes
    _matched(tree, [1, 2, 3])  # A used after B
    _insert(tree, [6, 7])  # C: 70 > 60, B is the least recently used
    assert tree.edges(NS) == [(1, 2, 3), (6, 7)]
    assert (tree.bytes, tree.evictions) == (50, 1)


def test_eviction_takes_leaves_first_and_then_their_parents() -> None:
    tree = _tree(budget=50)
    _insert(tree, [1, 2, 3, 4])  # 40
    _insert(tree, [1, 2, 5])  # split: (1,2) (3,4) (5,) = 50
    _matched(tree, [1, 2, 5])  # (3,4) is now the oldest leaf; its parent (1,2) is newer
    _insert(tree, [9])  # 60 > 50: evict (3,4) -> 40
    assert tree.edges(NS) == [(1, 2), (5,), (9,)]
    assert (tree.bytes, tree.evictions) == (40, 1)
    tree.budget_bytes = 10
    tree.evict()  # (5,) then (1,2) (a leaf once (5,) is gone) go before (9,), the newest
    assert tree.edges(NS) == [(9,)]
    assert (tree.bytes, tree.tokens, tree.evictions) == (10, 1, 3)


def test_an_entry_larger_than_the_budget_is_not_kept() -> None:
    tree = _tree(budget=25)
    _insert(tree, [1, 2, 3])
    assert tree.edges(NS) == [] and tree.bytes == 0 and tree.evictions == 1


def test_namespaces_never_share_entries_and_drop_alone() -> None:
    tree = _tree()
    _insert(tree, [1, 2, 3], ns="a")
    _insert(tree, [1, 2, 3, 4], ns="b")
    assert _matched(tree, [1, 2, 3, 4], ns="a") == [1, 2, 3]
    assert _matched(tree, [1, 2, 3, 4], ns="c") == []
    assert tree.bytes == 70
    tree.drop("b")
    assert _matched(tree, [1, 2, 3, 4], ns="b") == []
    assert _matched(tree, [1, 2, 3], ns="a") == [1, 2, 3]
    assert (tree.bytes, tree.tokens, tree.evictions) == (30, 3, 0)
    tree.drop("missing")  # nothing to drop: no error


def test_a_split_edge_ends_the_walk_even_where_its_tail_has_a_matching_child() -> None:
    """[1..8, 20, ...] splits the edge [1..10] after 8 tokens; the tail [9, 10] has a child starting with 20,
    which the new tokens must not be hung below (they do not follow 9, 10)."""
    tree = _tree()
    _insert(tree, list(range(1, 11)))
    _insert(tree, [*range(1, 11), 20, 21])
    new = [*range(1, 9), 20, 21, 22]
    assert _insert(tree, new) == 3
    assert _matched(tree, new) == new
    assert _matched(tree, [*range(1, 11), 20, 21]) == [*range(1, 11), 20, 21]
    assert (tree.bytes, tree.tokens) == (150, 15)
