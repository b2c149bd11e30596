"""Tries, tree masks and packing by unique tokens, on small hand-drawn cases (learner/token_trie.py)."""

from __future__ import annotations

import random
from array import array

import pytest
import torch

from boltstream.learner.token_trie import (
    ancestor_mask,
    build_tree,
    common_prefix,
    first_trained_position,
    pack_by_unique_tokens,
    shared_prefix_length,
    subtree_ends,
)


def rows(mask: torch.Tensor) -> list[str]:
    return ["".join("1" if v else "." for v in row) for row in mask.tolist()]


def test_shared_system_prompt() -> None:
    #   1 - 2 - 3 - 4          nodes: 0:1 1:2 2:3 3:4 4:5 5:6
    #            \- 5 - 6
    tree = build_tree([[1, 2, 3, 4], [1, 2, 3, 5, 6]])
    assert tree.token_ids.tolist() == [1, 2, 3, 4, 5, 6]
    assert tree.position_ids.tolist() == [0, 1, 2, 3, 3, 4]
    assert tree.parents.tolist() == [-1, 0, 1, 2, 2, 4]
    assert tree.subtree_end.tolist() == [6, 6, 6, 4, 6, 6]
    assert [ix.tolist() for ix in tree.node_index] == [[0, 1, 2, 3], [0, 1, 2, 4, 5]]
    assert (tree.unique_tokens, tree.total_tokens) == (6, 9)
    assert rows(tree.attention_mask()) == [
        "1.....",
        "11....",
        "111...",
        "1111..",
        "111.1.",  # the branch sees the shared prompt, not its sibling
        "111.11",
    ]


def test_a_turn_extending_the_previous_one() -> None:
    """The second call's sample holds the first whole: its nodes are the first's plus its own; the
    mask is plain causal. Node indices come back in the caller's order, not the trie's."""
    tree = build_tree([[7, 8, 9, 10, 11], [7, 8, 9]])
    assert tree.token_ids.tolist() == [7, 8, 9, 10, 11]
    assert tree.position_ids.tolist() == [0, 1, 2, 3, 4]
    assert [ix.tolist() for ix in tree.node_index] == [[0, 1, 2, 3, 4], [0, 1, 2]]
    assert (tree.unique_tokens, tree.total_tokens) == (5, 8)
    assert torch.equal(tree.attention_mask(), torch.ones(5, 5, dtype=torch.bool).tril())


def test_identical_responses_share_every_node() -> None:
    tree = build_tree([[4, 5, 6], array("i", [4, 5, 6]), torch.tensor([4, 5, 6])])
    assert tree.token_ids.tolist() == [4, 5, 6]
    assert [ix.tolist() for ix in tree.node_index] == [[0, 1, 2]] * 3
    assert (tree.unique_tokens, tree.total_tokens) == (3, 9)


def test_no_sharing_at_all() -> None:
    """Different first tokens: two roots, a block-diagonal mask, positions restart at 0."""
    tree = build_tree([[3, 1], [2, 2]])
    assert tree.token_ids.tolist() == [2, 2, 3, 1]  # lexicographic: [2, 2] first
    assert tree.position_ids.tolist() == [0, 1, 0, 1]
    assert tree.parents.tolist() == [-1, 0, -1, 2]
    assert [ix.tolist() for ix in tree.node_index] == [[2, 3], [0, 1]]
    assert rows(tree.attention_mask()) == ["1...", "11..", "..1.", "..11"]


def test_a_branch_off_a_shallower_node_after_a_deep_one() -> None:
    #   1 - 2 - 3
    #    \    \- 4
    #     \- 5
    tree = build_tree([[1, 5], [1, 2, 4], [1, 2, 3]])
    assert tree.token_ids.tolist() == [1, 2, 3, 4, 5]
    assert tree.parents.tolist() == [-1, 0, 1, 1, 0]
    assert tree.subtree_end.tolist() == [5, 4, 3, 4, 5]
    assert rows(tree.attention_mask()) == ["1....", "11...", "111..", "11.1.", "1...1"]
    assert [ix.tolist() for ix in tree.node_index] == [[0, 4], [0, 1, 3], [0, 1, 2]]


def test_random_tries_match_a_reference_trie() -> None:
    """Against a dict trie and parent-pointer ancestry: every token's node holds the token at its
    depth, and the mask is exactly ancestors-or-self."""
    rng = random.Random(0)
    for _ in range(30):
        stems = [[rng.randrange(4) for _ in range(rng.randint(0, 5))] for _ in range(3)]
        seqs = [rng.choice(stems) + [rng.randrange(4) for _ in range(rng.randint(1, 6))] for _ in range(6)]
        tree = build_tree(seqs)
        reference: dict[tuple[int, ...], None] = {}
        for s in seqs:
            for t in range(1, len(s) + 1):
                reference[tuple(s[:t])] = None
        assert tree.unique_tokens == len(reference)
        for s, index in zip(seqs, tree.node_index, strict=True):
            assert tree.token_ids[index].tolist() == s
            assert tree.position_ids[index].tolist() == list(range(len(s)))
            assert tree.parents[index].tolist() == [-1, *index[:-1].tolist()]
        parents = tree.parents.tolist()
        expected = torch.zeros(tree.unique_tokens, tree.unique_tokens, dtype=torch.bool)
        for i in range(tree.unique_tokens):
            j = i
            while j >= 0:
                expected[i, j] = True
                j = parents[j]
        assert torch.equal(tree.attention_mask(), expected)


def test_subtree_ends_and_mask_from_parent_pointers() -> None:
    ends = subtree_ends([-1, 0, 0, 2, -1])
    assert ends.tolist() == [4, 2, 4, 4, 5]
    assert rows(ancestor_mask(ends)) == ["1....", "11...", "1.1..", "1.11.", "....1"]


def test_common_prefix() -> None:
    t = torch.tensor
    assert common_prefix(t([1, 2, 3]), t([1, 2, 4])) == 2
    assert common_prefix(t([1, 2]), t([1, 2, 4])) == 2
    assert common_prefix(t([5]), t([1])) == 0


def _sample(ids: list[int], name: str) -> dict:
    return {"token_ids": ids, "sample_id": name}


def test_packing_counts_unique_tokens_and_keeps_sharers_together() -> None:
    system = list(range(10, 20))
    samples = [_sample(system + [1, 2], "a1"), _sample([30, 30, 30], "x"), _sample(system + [3, 4], "b1"),
               _sample(system + [1, 2, 5], "a2")]
    # one trie: 10 + 2 + 1 + 2 + 3 = 18 nodes (25 tokens in all)
    assert [[s["sample_id"] for s in g] for g in pack_by_unique_tokens(samples, 18)] == [["a1", "a2", "b1", "x"]]
    # 17: the unrelated sample opens the second group; 15: b1 too (a1 + a2 are 13 nodes, + b1 = 15)
    assert [[s["sample_id"] for s in g] for g in pack_by_unique_tokens(samples, 17)] == [["a1", "a2", "b1"], ["x"]]
    assert [[s["sample_id"] for s in g] for g in pack_by_unique_tokens(samples, 14)] == [["a1", "a2"], ["b1"], ["x"]]
    # the mask bound: 13 * 13 = 169 fits, 15 * 15 does not (a1 + a2 + b1, and b1 + x: 12 + 3 nodes)
    assert [[s["sample_id"] for s in g] for g in pack_by_unique_tokens(samples, 100, max_mask_elements=200)] == [
        ["a1", "a2"], ["b1"], ["x"]]


def test_a_sample_over_the_budget_gets_a_group_of_its_own() -> None:
    samples = [_sample([1] * 3, "s"), _sample([2] * 50, "long"), _sample([3] * 4, "t")]
    groups = pack_by_unique_tokens(samples, 10)
    assert [[s["sample_id"] for s in g] for g in groups] == [["s"], ["long"], ["t"]]
    with pytest.raises(ValueError, match="max_unique_tokens"):
        pack_by_unique_tokens(samples, 0)


def _trained(ids: list[int], first_loss: int) -> dict:
    return {"token_ids": ids, "loss_mask": [i >= first_loss for i in range(len(ids))]}


def test_first_trained_position_skips_token_zero() -> None:
    assert first_trained_position([False, False, True, True]) == 2
    assert first_trained_position(array("B", [1, 0, 0, 1])) == 3  # token 0 is never a label
    assert first_trained_position([False, False]) == 2


def test_the_shared_prefix_stops_before_the_hidden_state_of_the_first_loss_token() -> None:
    system = [10, 11, 12, 13, 14, 15]
    a = _trained(system + [1, 2, 3], first_loss=8)  # loss on token 8 reads hidden state 7
    b = _trained(system + [1, 4, 5, 6], first_loss=8)
    c = _trained(system + [7, 8], first_loss=7)
    assert shared_prefix_length([a, b], 1) == 7  # 6 system tokens + the shared 1, all before hidden 7
    assert shared_prefix_length([a, b, c], 1) == 6  # c diverges at 6
    assert shared_prefix_length([a, b, c], 6) == 6 and shared_prefix_length([a, b, c], 7) == 0
    early = _trained(system + [1, 2, 3], first_loss=4)  # its loss starts inside the system prompt: P <= 3
    assert shared_prefix_length([a, b, early], 1) == 3 and shared_prefix_length([a, b, early], 4) == 0
    assert shared_prefix_length([a], 1) == 0  # nothing to share with
    assert shared_prefix_length([a, b], 0) == 0  # off
    assert shared_prefix_length([a, _trained([99] + system, first_loss=5)], 1) == 0  # no common prefix


def test_the_mask_after_a_shared_prefix_sees_all_of_it() -> None:
    #  prefix (2 tokens) | 0:4 - 1:5
    #                    |  \- 2:6
    tree = build_tree([[4, 5], [4, 6]])
    assert rows(tree.attention_mask(2)) == [
        "111..",
        "1111.",
        "111.1",
    ]
    assert torch.equal(tree.attention_mask(0), tree.attention_mask())


def test_packing_after_a_shared_prefix_counts_only_the_tokens_after_it() -> None:
    system = list(range(10, 20))
    samples = [_sample(system + [1, 2], "a1"), _sample(system + [3, 4], "b1"), _sample(system + [1, 2, 5], "a2")]
    # after the 10-token prefix: a1 + a2 = 3 nodes, b1 = 2 more
    assert [[s["sample_id"] for s in g] for g in pack_by_unique_tokens(samples, 5, prefix_length=10)] == [
        ["a1", "a2", "b1"]]
    assert [[s["sample_id"] for s in g] for g in pack_by_unique_tokens(samples, 4, prefix_length=10)] == [
        ["a1", "a2"], ["b1"]]
    # the mask is nodes x (prefix + nodes): 3 x 13 = 39 fits, 5 x 15 = 75 does not
    assert [[s["sample_id"] for s in g] for g in pack_by_unique_tokens(samples, 100, max_mask_elements=40,
                                                                       prefix_length=10)] == [["a1", "a2"], ["b1"]]
