"""The model side of prefix-tree training: the decoder's inputs for a trie, and whether a model takes them.

A tree forward runs the decoder once on a micro-batch's trie (:mod:`.token_trie`): ``input_ids``
are the nodes' tokens ``[1, N]``, ``position_ids`` their depths, and ``attention_mask`` the
tree mask as a 4-D ``[1, 1, N, N]`` tensor (after a step's shared prefix of ``P`` tokens,
:mod:`.shared_prefix`: positions ``P + depth`` and a ``[1, 1, N, P + N]`` mask that sees all of it). What it relies on in transformers (checked by
:func:`probe_tree_support` on the real model, and by a unit test on the installed version):

* the mask items of :mod:`boltstream.inference.transformers_internals` (a 4-D ``attention_mask``
  reaches every layer as given; ``sdpa`` takes it as bool "may attend", ``eager`` adds it to the
  scores, so it gets an additive float mask, 0 / the dtype's minimum);
* ``position_ids`` go to the rotary embedding as given.

Other attention implementations (flash-attention-2 takes no dense mask; flex attention wants a
block mask) are not used: :func:`tree_problem` names why, and the step runs flat.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from boltstream.inference import transformers_internals

from .token_trie import PrefixTree, build_tree

TREE_ATTENTION = ("sdpa", "eager")
PROBE_TOLERANCE = 1e-3  # a mask that is ignored moves the probe's logits by O(1), rounding by far less


def causal_model(model: torch.nn.Module) -> torch.nn.Module:
    """The HF model under a peft wrapper (or the model itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def attention_implementation(model: torch.nn.Module) -> str | None:
    return transformers_internals.attention_implementation(getattr(causal_model(model), "config", None))


def tree_problem(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot run a tree forward, from its configuration (cheap), or None."""
    config = getattr(causal_model(model), "config", None)
    if config is None:
        return f"{type(model).__name__} has no transformers config"
    impl = attention_implementation(model)
    if impl not in TREE_ATTENTION:
        return f"attention implementation {impl!r} takes no custom 4-D mask (tree needs one of {TREE_ATTENTION})"
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder models are not supported"
    return None


def _dtype(model: torch.nn.Module) -> torch.dtype:
    return causal_model(model).get_input_embeddings().weight.dtype


def model_mask(model: torch.nn.Module, tree: PrefixTree, device: torch.device, prefix_length: int = 0
               ) -> torch.Tensor:
    """The tree mask as ``model``'s attention takes it: ``[1, 1, N, P + N]`` bool for sdpa (one byte
    per element), additive ``0 / min`` in the model's dtype for eager (it adds the mask to the scores);
    ``P = prefix_length`` columns of a shared prefix's cached keys, seen by every node."""
    mask = tree.attention_mask(prefix_length).to(device)
    if attention_implementation(model) == "eager":
        dtype = _dtype(model)
        additive = torch.zeros(mask.shape, dtype=dtype, device=device)
        mask = additive.masked_fill_(~mask, torch.finfo(dtype).min)
    return mask[None, None]


def tree_inputs(model: torch.nn.Module, tree: PrefixTree, device: torch.device, prefix_length: int = 0
                ) -> dict[str, torch.Tensor]:
    """Keyword arguments of a decoder (or causal LM) forward over ``tree``'s nodes; with
    ``prefix_length`` the trie continues a shared prefix of that many tokens whose keys/values the
    caller passes as ``past_key_values`` (:mod:`.shared_prefix`): positions start after it."""
    return {
        "input_ids": tree.token_ids.to(device).unsqueeze(0),
        "position_ids": (tree.position_ids + prefix_length).to(device).unsqueeze(0),
        "attention_mask": model_mask(model, tree, device, prefix_length),
    }


def label_nodes(tree: PrefixTree, shape: torch.Size | tuple[int, int], prefix_length: int = 0) -> torch.Tensor:
    """``[B, T-1]`` long: at label position ``t`` of sample ``b``, the node whose hidden state predicts
    that label (the node of token ``t``); 0 at padding. Indexing the tree's hidden states with it
    at the loss mask gives the flat path's ``hidden[:, :-1][loss_mask]`` row for row. With
    ``prefix_length`` the trie holds each sample's tokens from ``prefix_length`` on (the label
    positions before it are never trained: :func:`.token_trie.shared_prefix_length`) and they
    point at node 0."""
    index = torch.zeros(shape, dtype=torch.long)
    for b, nodes in enumerate(tree.node_index):
        n = min(nodes.shape[0] - 1, shape[1] - prefix_length)
        index[b, prefix_length : prefix_length + n] = nodes[:n]
    return index


@torch.no_grad()
def probe_tree_support(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot run a tree forward, or None: :func:`tree_problem`, then a forward of
    three nodes ``a -> b, a -> c`` compared with the plain sequence ``a c``. An attention that
    ignores the mask lets ``c`` see ``b`` and fails the comparison; one that rejects it raises."""
    problem = tree_problem(model)
    if problem is not None:
        return problem
    a, b, c = probe_tokens(model)
    tree = build_tree([[a, b], [a, c]])
    try:
        diff = probe_mismatch(model, lambda device: model(**tree_inputs(model, tree, device), use_cache=False),
                              int(tree.node_index[1][1]), [a, c])
    except Exception as exc:  # any failure means: run flat
        return f"a forward with a 4-D tree mask failed: {type(exc).__name__}: {exc}"
    if diff > PROBE_TOLERANCE:
        return f"the model ignores a custom 4-D attention mask (probe logits differ by {diff:.3g}, relative)"
    return None


def probe_tokens(model: torch.nn.Module) -> tuple[int, int, int]:
    """Three distinct token ids every vocabulary has, for the probes."""
    vocab = int(causal_model(model).get_input_embeddings().num_embeddings)
    return 1 % vocab, 2 % vocab, 3 % vocab


@torch.no_grad()
def probe_mismatch(model: torch.nn.Module, tree_forward: Callable[[torch.device], Any], node: int,
                   flat_ids: Sequence[int]) -> float:
    """How far the logits of trie node ``node`` (``tree_forward(device)``'s output, run in eval mode)
    are from the last position of the plain sequence ``flat_ids``: the largest difference over the
    flat logits' scale (at least 1). A probe's forward raises what it raises; the training mode is
    restored either way."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        tree_logits = tree_forward(device).logits[0]
        flat_logits = model(input_ids=torch.tensor([list(flat_ids)], device=device), use_cache=False).logits[0]
    finally:
        model.train(was_training)
    flat = flat_logits[-1].float()
    return float((tree_logits[node].float() - flat).abs().max()) / max(1.0, float(flat.abs().max()))


def probe_against_plain(model: torch.nn.Module, tree_forward: Callable[[torch.device], Any], node: int,
                        flat_ids: Sequence[int], what: str) -> str | None:
    """Why ``what`` (the probe forward ``tree_forward``) cannot be used, or None: it raised, or node
    ``node``'s logits differ from the plain sequence ``flat_ids``'s by more than rounding."""
    try:
        diff = probe_mismatch(model, tree_forward, node, flat_ids)
    except Exception as exc:  # any failure means: not used
        return f"{what} failed: {type(exc).__name__}: {exc}"
    if diff > PROBE_TOLERANCE:
        return f"{what} differs from the plain one by {diff:.3g} (relative)"
    return None
