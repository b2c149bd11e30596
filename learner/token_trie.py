"""Token tries of a micro-batch's samples, their tree attention mask, and packing by unique tokens.

Why: an agent's samples repeat each other. Every call of the calculator demo starts with the same
system prompt and worked example, the attempts of a task share its question, and a call's prompt
holds the previous call whole. A decoder's hidden state at a position depends only on the tokens
up to it, so two samples that agree on their first ``k`` tokens have the same hidden states there:
computing them once is exact, not an approximation.

The samples become one trie: a node is (parent, token id), so identical ids from position 0 share
nodes. The nodes are numbered in depth-first pre-order (samples inserted in lexicographic order
produce exactly that numbering), which makes the tree attention mask a comparison of intervals:
node ``j`` is an ancestor of (or is) node ``i`` iff ``j <= i < exit[j]``, ``exit[j]`` being the end
of ``j``'s subtree. Each node attends to its ancestors and itself, at position id = its depth, so
a node sees exactly what the same token sees in its own sample's causal attention.

Everything here is pure (lists and CPU tensors in, tensors out); the model side is in
:mod:`.tree_forward`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .collate import Sample, as_tensor


@dataclass(frozen=True)
class PrefixTree:
    """The trie of some token sequences, flattened in depth-first pre-order.

    ``node_index[s][t]`` is the flat index of sequence ``s``'s token ``t``: its hidden state is the
    one at ``node_index[s][t]`` of the tree forward."""

    token_ids: torch.Tensor  # [N] long, the node's token
    position_ids: torch.Tensor  # [N] long, the node's depth (0-based: a sample's own position)
    parents: torch.Tensor  # [N] long, the parent's flat index, -1 for a root
    subtree_end: torch.Tensor  # [N] long, one past the last node of the node's subtree
    node_index: list[torch.Tensor]  # per sequence, in the caller's order: [len_s] long
    total_tokens: int  # sum of the sequences' lengths

    @property
    def unique_tokens(self) -> int:
        """Nodes: the tokens a tree forward computes."""
        return int(self.token_ids.shape[0])

    def attention_mask(self, prefix_length: int = 0) -> torch.Tensor:
        """``[N, prefix_length + N]`` bool: every node sees the ``prefix_length`` tokens of a shared
        prefix computed before the trie (:func:`shared_prefix_length`), then ``[i, P + j]`` is true iff
        node ``j`` is an ancestor of node ``i`` or ``i`` itself."""
        return ancestor_mask(self.subtree_end, prefix_length)


def ancestor_mask(subtree_end: torch.Tensor, prefix_length: int = 0) -> torch.Tensor:
    """The tree attention mask of pre-order numbered nodes from their subtree ends (one comparison
    per element: ``j <= i < subtree_end[j]``), ``[N, prefix_length + N]`` bool, all true over the
    prefix columns."""
    n = subtree_end.shape[0]
    index = torch.arange(n, device=subtree_end.device)
    tree = (index.unsqueeze(0) <= index.unsqueeze(1)) & (index.unsqueeze(1) < subtree_end.unsqueeze(0))
    if not prefix_length:
        return tree
    return torch.cat([torch.ones(n, prefix_length, dtype=torch.bool, device=tree.device), tree], dim=1)


def _ids(sequence: Any) -> torch.Tensor:
    return as_tensor(sequence, torch.long).long()


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the longest common prefix of two 1-d tensors."""
    m = min(a.shape[0], b.shape[0])
    differ = torch.nonzero(a[:m] != b[:m])
    return int(differ[0, 0]) if differ.numel() else m


def first_trained_position(loss_mask: Any) -> int:
    """Index of a sample's first loss token (``loss_mask[t]``, t >= 1: token 0 has nothing before it
    to predict it), or its length when none is trained."""
    mask = as_tensor(loss_mask, torch.bool).bool()
    trained = torch.nonzero(mask[1:])
    return int(trained[0, 0]) + 1 if trained.numel() else int(mask.shape[0])


def shared_prefix_length(samples: Sequence[Sample], min_tokens: int) -> int:
    """Length ``P`` of the token prefix that every sample of ``samples`` starts with and whose hidden
    states no loss needs, or 0 when shorter than ``min_tokens`` (or ``min_tokens`` is 0, or fewer
    than two samples share it).

    The loss on token ``t`` reads the hidden state at ``t - 1``, which the trie after the prefix
    must compute (each sample gathers its log-probs from its own nodes), so ``P`` stops one token
    before every sample's first loss token: ``P <= first_trained_position - 1``. That also leaves
    every sample at least one token after ``P``."""
    if min_tokens <= 0 or len(samples) < 2:
        return 0
    ids = [_ids(s["token_ids"]) for s in samples]
    length = min(first_trained_position(s["loss_mask"]) - 1 for s in samples)
    first = ids[0]
    for other in ids[1:]:
        length = min(length, common_prefix(first, other))
        if length < min_tokens:
            return 0
    return length if length >= min_tokens else 0


def lexicographic_order(sequences: Sequence[Any]) -> list[int]:
    """Indices of ``sequences`` (token id sequences) in lexicographic order, ties by index: samples
    that share a prefix become neighbours, and a sequence comes right before those it prefixes."""
    return sorted(range(len(sequences)), key=lambda i: (list(sequences[i]), i))


def build_tree(sequences: Sequence[Any]) -> PrefixTree:
    """The trie of ``sequences`` (lists, ``array.array`` or 1-d tensors of token ids).

    Inserted in lexicographic order, a sequence shares with all earlier ones exactly its common
    prefix with its predecessor, and its new nodes are numbered after every node so far: that
    numbering is a depth-first pre-order (the subtree of a node is a contiguous run of sorted
    sequences), so no explicit traversal is needed."""
    if not sequences:
        raise ValueError("a prefix tree needs at least one sequence")
    tensors = [_ids(s) for s in sequences]
    order = lexicographic_order([t.tolist() for t in tensors])
    node_index: list[torch.Tensor | None] = [None] * len(tensors)
    new_parts: list[torch.Tensor] = []
    depth_parts: list[torch.Tensor] = []
    parent_parts: list[torch.Tensor] = []
    count = 0
    previous: torch.Tensor | None = None
    previous_index = torch.empty(0, dtype=torch.long)
    for i in order:
        ids = tensors[i]
        shared = common_prefix(previous, ids) if previous is not None else 0
        fresh = ids.shape[0] - shared
        new = torch.arange(count, count + fresh, dtype=torch.long)
        index = torch.cat([previous_index[:shared], new])
        if fresh:
            new_parts.append(ids[shared:])
            depth_parts.append(torch.arange(shared, ids.shape[0], dtype=torch.long))
            first_parent = previous_index[shared - 1 : shared] if shared else torch.tensor([-1])
            parent_parts.append(torch.cat([first_parent, new[:-1]]))
        node_index[i] = index
        count += fresh
        previous, previous_index = ids, index
    token_ids = torch.cat(new_parts) if new_parts else torch.empty(0, dtype=torch.long)
    depths = torch.cat(depth_parts) if depth_parts else torch.empty(0, dtype=torch.long)
    parents = torch.cat(parent_parts) if parent_parts else torch.empty(0, dtype=torch.long)
    return PrefixTree(
        token_ids=token_ids,
        position_ids=depths,
        parents=parents,
        subtree_end=subtree_ends(parents),
        node_index=[ix for ix in node_index if ix is not None],
        total_tokens=sum(int(t.shape[0]) for t in tensors),
    )


def subtree_ends(parents: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """``end[j] = j + size of j's subtree`` for pre-order numbered nodes (children after parents)."""
    parent_list = parents.tolist() if isinstance(parents, torch.Tensor) else list(parents)
    size = [1] * len(parent_list)
    for j in range(len(parent_list) - 1, -1, -1):
        p = parent_list[j]
        if p >= 0:
            size[p] += size[j]
    return torch.arange(len(parent_list), dtype=torch.long) + torch.tensor(size, dtype=torch.long)


def pack_by_unique_tokens(samples: Sequence[Sample], max_unique_tokens: int,
                          max_mask_elements: int | None = None, prefix_length: int = 0) -> list[list[Sample]]:
    """Micro-batches for tree forwards: samples in lexicographic order (sharers side by side), a new
    group whenever adding the next would take the group's trie past ``max_unique_tokens`` nodes or
    its mask past ``max_mask_elements`` (N * (prefix_length + N)). A sample that alone exceeds a
    budget gets a group of its own, as in the flat packing. With ``prefix_length`` the tries are of
    the samples' tokens after that shared prefix (computed once, outside every micro-batch)."""
    if max_unique_tokens <= 0:
        raise ValueError(f"max_unique_tokens must be positive, got {max_unique_tokens}")
    ids = [_ids(s["token_ids"])[prefix_length:] for s in samples]
    order = lexicographic_order([t.tolist() for t in ids])
    groups: list[list[Sample]] = []
    current: list[Sample] = []
    nodes = 0
    previous: torch.Tensor | None = None
    for i in order:
        shared = common_prefix(previous, ids[i]) if current and previous is not None else 0
        grown = nodes + ids[i].shape[0] - shared
        over = grown > max_unique_tokens or (max_mask_elements is not None
                                             and grown * (prefix_length + grown) > max_mask_elements)
        if current and over:
            groups.append(current)
            current, nodes, shared = [], 0, 0
            grown = ids[i].shape[0]
        current.append(samples[i])
        nodes = grown
        previous = ids[i]
    if current:
        groups.append(current)
    return groups
