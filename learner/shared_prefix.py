"""A prompt prefix that every sample of a step shares, computed once per step, with its gradient.

Why: an agent's calls all start with the same system prompt (often thousands of tokens). A trie
computes it once per micro-batch (:mod:`.token_trie`), but a step whose trie is split over
several micro-batches would compute it again in each. Here the prefix ``P``
(:func:`.token_trie.shared_prefix_length`: common to all samples, ending before any sample's
first loss token) runs once per step:

1. ``P``'s forward runs through the decoder without gradient, in chunks of at most the
   micro-batch budget (each chunk continuing from the earlier chunks' cache), keeping every
   layer's keys and values. Their detached copies (``leaves``, one set for the whole step,
   ``requires_grad``) are what every micro-batch attends to.
2. Each micro-batch's trie (the samples' tokens after ``P``) runs with a fresh cache built from
   the leaves as ``past_key_values``, a ``[N, P + N]`` mask (every node sees all of ``P``) and
   position ids ``P + depth``. Its backward adds the micro-batch's share of the gradient with
   respect to ``P``'s keys and values into the leaves' ``.grad``.
3. After the last micro-batch, :meth:`SharedPrefix.backward` recomputes ``P``'s chunks with
   gradient, last chunk first (as activation checkpointing does, with the chunk's random state
   replayed), and sends the summed leaf gradients through each chunk's keys and values into the
   weights (LoRA or full) and into the earlier chunks' leaves, whose turn comes next.

Recomputing costs one more forward over ``P``; in exchange ``P``'s activations are never held
while the micro-batches run, and never more than one chunk's at a time, so the step's peak memory
is the micro-batch budget's, however long ``P`` is. A prefix of at most
``StepConfig.shared_prefix_keep_tokens`` tokens skips that: its forward in step 1 runs with
gradient, in one piece, and keeps its activations until step 3, which is then one backward from
its keys and values. The gradient is exact (the loss depends on ``P``'s tokens only through their
keys and values, and a chunk on the earlier chunks only through theirs), so the update equals the
flat step's up to rounding.

Every use of transformers' cache internals goes through :mod:`boltstream.inference.transformers_internals`
(it states what it relies on, and checks it on a real model, gradients included).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from boltstream.inference import transformers_internals

from .token_trie import build_tree
from .tree_forward import causal_model, probe_against_plain, probe_tokens, tree_inputs, tree_problem

logger = logging.getLogger(__name__)



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
    if not transformers_internals.reusable(causal_model(model).config):
        return "the model's KV cache is not a plain growing one (sliding-window or static layers)"
    return None


def _device_rng(device: torch.device) -> list[torch.device]:
    return [device] if device.type == "cuda" else []


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


@dataclasses.dataclass
class SharedPrefix:
    """``P``'s keys/values for one step (``leaves``, whose ``.grad`` collects the micro-batches'
    gradient) and what recomputing its chunks with gradient needs."""

    length: int
    leaves: transformers_internals.KV
    model: torch.nn.Module
    token_ids: torch.Tensor  # [P] long, on the model's device
    chunks: list[tuple[int, int, tuple[torch.Tensor, torch.Tensor | None]]]  # (start, end, RNG state)
    kept: list[torch.Tensor] = dataclasses.field(default_factory=list)  # P's keys/values, in the graph

    @classmethod
    def run(cls, model: torch.nn.Module, token_ids: torch.Tensor, chunk_size: int, keep_tokens: int = 0
            ) -> SharedPrefix:
        """``P``'s forward (``token_ids`` 1-d) on ``model``'s decoder in chunks of at most ``chunk_size``
        tokens; the leaves require grad when grad mode is on. Without gradient, unless grad mode is on
        and ``P`` has at most ``keep_tokens`` tokens: then in one piece, its graph kept for
        :meth:`backward`."""
        decoder = prefix_decoder(model)
        if decoder is None:
            raise ValueError(shared_prefix_problem(model) or "no decoder")
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        device = next(model.parameters()).device
        ids = token_ids.to(device)
        grad = torch.is_grad_enabled()
        keep = grad and ids.shape[0] <= keep_tokens
        size = ids.shape[0] if keep else chunk_size  # kept, every chunk's activations stay: one causal forward
        cache, chunks = None, []
        with torch.set_grad_enabled(keep):
            for start in range(0, ids.shape[0], size):
                end = min(start + size, ids.shape[0])
                chunks.append((start, end, _rng_state(device)))
                cache = _chunk_forward(decoder, ids, start, end, cache)
        layers = transformers_internals.layers_of(cache)
        leaves = [(k.detach().requires_grad_(grad), v.detach().requires_grad_(grad)) for k, v in layers]
        kept = [t for layer in layers for t in layer] if keep else []
        return cls(length=int(ids.shape[0]), leaves=leaves, model=model, token_ids=ids, chunks=chunks, kept=kept)

    def cache(self) -> Any:
        """A fresh cache over the leaves for one forward (the forward appends the trie's own keys)."""
        return transformers_internals.make_cache(self.leaves)

    def backward(self) -> None:
        """Push the gradient the micro-batches left in the leaves through ``P``'s forward into the
        weights (adding to their ``.grad``): each chunk, last first, recomputed with gradient from
        the earlier chunks' leaves, backward from its own keys/values; or, when the forward kept its
        graph, one backward from all of ``P``'s keys/values. Then drops the leaves."""
        if self.kept:
            grads = [g for leaf in self.leaves for g in (leaf[0].grad, leaf[1].grad)]
            pairs = [(t, g) for t, g in zip(self.kept, grads, strict=True) if g is not None and t.requires_grad]
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], grad_tensors=[g for _, g in pairs])
            self.leaves, self.chunks, self.kept = [], [], []
            return
        decoder = prefix_decoder(self.model)
        device = self.token_ids.device
        for start, end, (cpu_state, cuda_state) in reversed(self.chunks):
            grads = [g[..., start:end, :].clone() if g is not None else None
                     for leaf in self.leaves for g in (leaf[0].grad, leaf[1].grad)]
            if all(g is None for g in grads):
                continue
            past = transformers_internals.make_cache([(k[..., :start, :], v[..., :start, :]) for k, v in self.leaves]) \
                if start else None
            with torch.random.fork_rng(devices=_device_rng(device)):
                torch.set_rng_state(cpu_state)
                if cuda_state is not None:
                    torch.cuda.set_rng_state(cuda_state, device)
                cache = _chunk_forward(decoder, self.token_ids, start, end, past)
            outputs = [t[..., start:end, :] for layer in transformers_internals.layers_of(cache) for t in layer]
            pairs = [(t, g) for t, g in zip(outputs, grads, strict=True) if g is not None and t.requires_grad]
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], grad_tensors=[g for _, g in pairs])
        self.leaves, self.chunks = [], []


def _chunk_forward(decoder: torch.nn.Module, ids: torch.Tensor, start: int, end: int, cache: Any) -> Any:
    """The decoder over ``ids[start:end]`` continuing ``cache`` (the keys/values of ``ids[:start]``,
    None for the first chunk), causal; returns the cache, now holding ``ids[:end]``."""
    out = decoder(input_ids=ids[start:end].unsqueeze(0),
                  position_ids=torch.arange(start, end, device=ids.device).unsqueeze(0),
                  past_key_values=cache, use_cache=True)
    return out.past_key_values


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
    a, b, c = probe_tokens(model)
    tree = build_tree([[b], [c]])

    def from_prefix(device: torch.device) -> Any:
        prefix = SharedPrefix.run(model, torch.tensor([a]), chunk_size=1)
        return model(**prefixed_inputs(model, tree, prefix, device), use_cache=False)

    return probe_against_plain(model, from_prefix, int(tree.node_index[1][0]), [a, c],
                               "a forward from a shared prefix's cached keys/values")
