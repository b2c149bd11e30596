"""A prompt prefix that every sample of a step shares, computed once per step, with its gradient.

Why: an agent's calls all start with the same system prompt (often thousands of tokens). A trie
computes it once per micro-batch (:mod:`.prefix_tree`), but a step whose trie is split over
several micro-batches would compute it again in each. Here the prefix ``P``
(:func:`.prefix_tree.shared_prefix_length`: common to all samples, ending before any sample's
first loss token) runs once per step:

1. ``P``'s forward runs through the decoder with gradient on, keeping every layer's keys and
   values (``outputs``, still in ``P``'s autograd graph).
2. Each micro-batch's trie (the samples' tokens after ``P``) attends to detached copies of them
   (``leaves``, one set for the whole step, ``requires_grad``): a fresh cache built from the
   leaves is the forward's ``past_key_values``, the mask is ``[N, P + N]`` (every node sees all of
   ``P``), position ids are ``P + depth``. Its backward adds the micro-batch's share of the
   gradient with respect to ``P``'s keys and values into the leaves' ``.grad``.
3. After the last micro-batch, :meth:`SharedPrefix.backward` sends the summed leaf gradients
   through ``P``'s forward into the weights (LoRA or full).

The sum of gradients is exact (the loss is a sum over micro-batches, each depending on ``P`` only
through its keys and values), so the update equals the flat step's up to rounding.

Every use of transformers' cache internals goes through :mod:`boltstream.inference.kv_cache`
(it states what it relies on, and checks it on a real model, gradients included).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from boltstream.inference import kv_cache

from .config import StepConfig
from .prefix_tree import build_tree
from .tree_step import causal_model, tree_inputs, tree_problem

logger = logging.getLogger(__name__)

PROBE_TOLERANCE = 1e-3  # as the tree probe: a prefix that is not seen moves the logits by O(1)


def prefix_decoder(model: torch.nn.Module) -> torch.nn.Module | None:
    """The decoder stack of ``model`` (under a peft wrapper: the same modules, adapters in place),
    which runs ``P`` without computing logits for it, or None when the model has no separate one."""
    causal = causal_model(model)
    decoder = causal.get_decoder() if hasattr(causal, "get_decoder") else None
    return decoder if decoder is not None and decoder is not causal else None


def shared_prefix_problem(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot continue a trie from a shared prefix's cached keys/values, or None
    (cheap: from its configuration)."""
    problem = tree_problem(model)
    if problem is not None:
        return problem
    if prefix_decoder(model) is None:
        return f"{type(causal_model(model)).__name__} has no separate decoder to run the prefix on"
    if not kv_cache.reusable(causal_model(model).config):
        return "the model's KV cache is not a plain growing one (sliding-window or static layers)"
    return None


@dataclasses.dataclass
class SharedPrefix:
    """``P``'s keys/values for one step: ``outputs`` in ``P``'s graph, ``leaves`` that the
    micro-batches attend to and whose ``.grad`` collects their gradient."""

    length: int
    outputs: kv_cache.KV
    leaves: kv_cache.KV

    @classmethod
    def run(cls, model: torch.nn.Module, token_ids: torch.Tensor) -> SharedPrefix:
        """``P``'s forward (``token_ids`` 1-d) on ``model``'s decoder; with gradient when grad mode is
        on (then the leaves require grad), else for scoring only."""
        decoder = prefix_decoder(model)
        if decoder is None:
            raise ValueError(shared_prefix_problem(model) or "no decoder")
        device = next(model.parameters()).device
        out = decoder(input_ids=token_ids.to(device).unsqueeze(0), use_cache=True)
        outputs = kv_cache.layers_of(out.past_key_values)
        grad = torch.is_grad_enabled()
        leaves = [(k.detach().requires_grad_(grad), v.detach().requires_grad_(grad)) for k, v in outputs]
        return cls(length=int(token_ids.shape[0]), outputs=outputs, leaves=leaves)

    def cache(self) -> Any:
        """A fresh cache over the leaves for one forward (the forward appends the trie's own keys)."""
        return kv_cache.make_cache(self.leaves)

    def backward(self) -> None:
        """Push the gradient the micro-batches left in the leaves through ``P``'s forward into the
        weights (adding to their ``.grad``), then drop ``P``'s graph."""
        tensors, grads = [], []
        for output, leaf in zip(self.outputs, self.leaves, strict=True):
            for tensor, leaf_tensor in zip(output, leaf, strict=True):
                if leaf_tensor.grad is not None and tensor.requires_grad:
                    tensors.append(tensor)
                    grads.append(leaf_tensor.grad)
        if tensors:
            torch.autograd.backward(tensors, grad_tensors=grads)
        self.outputs, self.leaves = [], []


def prefixed_inputs(model: torch.nn.Module, tree: Any, prefix: SharedPrefix, device: torch.device
                    ) -> dict[str, Any]:
    """A forward's keyword arguments over ``tree`` (the samples' tokens after ``prefix``) continuing
    from ``prefix``'s cached keys/values."""
    return {**tree_inputs(model, tree, device, prefix.length), "past_key_values": prefix.cache()}


@torch.no_grad()
def probe_shared_prefix(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot continue a trie from a shared prefix, or None: :func:`shared_prefix_problem`,
    then the trie ``b, c`` (siblings) after a prefix ``a`` compared with the plain sequence ``a c``."""
    problem = shared_prefix_problem(model)
    if problem is not None:
        return problem
    vocab = int(causal_model(model).get_input_embeddings().num_embeddings)
    a, b, c = (1 % vocab, 2 % vocab, 3 % vocab)
    tree = build_tree([[b], [c]])
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        prefix = SharedPrefix.run(model, torch.tensor([a]))
        tree_logits = model(**prefixed_inputs(model, tree, prefix, device), use_cache=False).logits[0]
        flat_logits = model(input_ids=torch.tensor([[a, c]], device=device), use_cache=False).logits[0]
    except Exception as exc:  # any failure means: no shared prefix
        return f"a forward from a shared prefix's cached keys/values failed: {type(exc).__name__}: {exc}"
    finally:
        model.train(was_training)
    node_c = int(tree.node_index[1][0])
    diff = float((tree_logits[node_c].float() - flat_logits[1].float()).abs().max())
    scale = max(1.0, float(flat_logits[1].float().abs().max()))
    if diff > PROBE_TOLERANCE * scale:
        return f"a forward from a shared prefix's cached keys/values differs from the plain one by {diff:.3g}"
    return None


def resolve_shared_prefix(model: torch.nn.Module, cfg: StepConfig) -> StepConfig:
    """``cfg`` as ``model`` can run it: ``shared_prefix_min_tokens`` 0 (logged once, with the reason)
    when :func:`probe_shared_prefix` finds a problem. Called once when a trainer is built, after
    :func:`.tree_step.resolve_prefix_tree`."""
    if not cfg.prefix_tree or not cfg.shared_prefix_min_tokens:
        return cfg
    problem = probe_shared_prefix(model)
    if problem is None:
        return cfg
    logger.warning("shared-prefix reuse off, each micro-batch computes the shared prefix: %s", problem)
    return dataclasses.replace(cfg, shared_prefix_min_tokens=0)
