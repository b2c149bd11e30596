"""Every use of transformers internals, in one place: the worker's KV caches and the learner's tree mask.

Why any: the decoding loop (:mod:`.decoding`) and the prefix cache (:mod:`.prefix_cache`) read and
build per-layer key/value tensors themselves (left-padding caches to join batches, storing a prompt's
KV, resuming a prefill from stored KV), and the learner's prefix-tree step
(``boltstream.learner.tree_forward``, ``boltstream.learner.shared_prefix``) hands the model a 4-D
attention mask and a cache of tensors that carry gradient. The public ``generate`` and ``forward``
documentation promises neither. ``tests/unit/inference/test_transformers_internals.py`` fails, naming
the versions, when the installed transformers is not one in :data:`CHECKED_WITH` (re-check the
contract below, then add the version).

The contract (transformers, as of the versions in :data:`CHECKED_WITH`):

* ``past_key_values`` of a causal LM's forward is a ``DynamicCache`` whose
  ``layers`` are ``DynamicLayer`` objects with ``keys`` and ``values`` tensors
  of shape ``[batch, kv_heads, seq, head_dim]``;
* ``DynamicCache(ddp_cache_data)`` builds a cache from ``(keys, values)`` per layer, and
  ``DynamicCache(config=...)`` the empty cache of a model, with its layer types;
* ``Cache.batch_select_indices(indices)`` narrows every layer to some rows;
* with gradients on, the ``keys``/``values`` a forward leaves in the cache are the attention's own
  tensors in the autograd graph (not detached copies), and a cache built from tensors that require
  grad passes their gradient back (the next forward's ``DynamicLayer.update`` concatenates onto them);
* ``config._attn_implementation`` names the attention function the model runs
  (:func:`attention_implementation`); ``masking_utils.create_causal_mask`` hands a 4-D
  ``attention_mask`` to every layer as it is given, ``sdpa`` attention passes it to
  ``torch.nn.functional.scaled_dot_product_attention`` (bool: "may attend") and ``eager`` adds it to
  the scores.

:func:`check_api` checks the cache items on a real forward pass and :func:`check_gradient_api` the
gradient one; unit tests call them. The mask items are checked on the real model whenever a trainer
is built (``boltstream.learner.tree_forward.probe_tree_support``): a model that fails runs the slower
flat step, and says so (``boltstream.learner.step_plan``). The worker's own decode step
(:mod:`.llama_step`) uses only the model's public module tree and checks itself against the model's
forward at every load.
"""

from __future__ import annotations

from typing import Any

# distribution -> versions this module's contract was checked against (read by the test).
CHECKED_WITH: dict[str, tuple[str, ...]] = {"transformers": ("5.17.0", "5.19.0")}

KV = list[tuple[Any, Any]]  # (keys, values) per layer, each [batch, kv_heads, seq, head_dim]


def attention_implementation(config: Any) -> str | None:
    """The attention function a model's ``config`` selects ("sdpa", "eager", "flash_attention_2", ...)."""
    return getattr(config, "_attn_implementation", None)


def layers_of(cache: Any) -> KV:
    """The ``(keys, values)`` tensors of every layer of a ``DynamicCache``."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def make_cache(layers: KV) -> Any:
    """A ``DynamicCache`` holding ``layers`` (the model appends to it in the next forward)."""
    from transformers import DynamicCache

    return DynamicCache(layers)


def is_growing(cache: Any) -> bool:
    """Whether every layer is a plain growing one (sliding-window or static layers cannot be re-padded)."""
    from transformers.cache_utils import DynamicLayer

    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def reusable(config: Any) -> bool:
    """Whether the model's caches are plain growing ones (only those can be stored, resumed and re-padded)."""
    from transformers import DynamicCache

    return is_growing(DynamicCache(config=config))


def select_rows(cache: Any, indices: Any) -> None:
    """Keep only the batch rows at ``indices`` (in place)."""
    cache.batch_select_indices(indices)


def _broken(what: str) -> RuntimeError:
    import transformers

    return RuntimeError(f"transformers {transformers.__version__}: {what}; boltstream.inference."
                        f"transformers_internals was checked with {', '.join(CHECKED_WITH['transformers'])}")


def check_api(model: Any) -> None:
    """Raise RuntimeError, naming the installed transformers, unless the internals above behave as relied on."""
    import torch

    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True)
        cache = out.past_key_values
        if not is_growing(cache) or not reusable(model.config):
            raise _broken(f"past_key_values is {type(cache).__name__} without DynamicLayer layers")
        layers = layers_of(cache)
        n_layers = model.config.num_hidden_layers
        if len(layers) != n_layers or any(k.shape[:1] + k.shape[2:3] != (2, 4) or k.shape != v.shape
                                          for k, v in layers):
            raise _broken("cache layers' keys/values are not [batch, kv_heads, seq, head_dim] per layer")
        rebuilt = make_cache([(k[:, :, :3], v[:, :, :3]) for k, v in layers])
        if rebuilt.get_seq_length() != 3:
            raise _broken("DynamicCache(ddp_cache_data) did not rebuild a cache from (keys, values) per layer")
        resumed = model(input_ids=ids[:, 3:], position_ids=torch.tensor([[3], [3]]), past_key_values=rebuilt,
                        use_cache=True)
        if not torch.allclose(resumed.logits[:, -1], out.logits[:, -1], atol=1e-4):
            raise _broken("a forward resumed from a rebuilt cache differs from the full forward")
        select_rows(resumed.past_key_values, torch.tensor([1]))
        if [k.shape[0] for k, _ in layers_of(resumed.past_key_values)] != [1] * n_layers:
            raise _broken("Cache.batch_select_indices did not narrow every layer")


def check_gradient_api(model: Any) -> None:
    """Raise RuntimeError, naming the installed transformers, unless a forward resumed from a cache of
    leaf tensors gives them the gradient that the full forward gives its own keys/values."""
    import torch

    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.enable_grad():
        prefix = model(input_ids=ids[:, :2], use_cache=True)
        kept = layers_of(prefix.past_key_values)
        if not all(k.requires_grad and v.requires_grad for k, v in kept):
            raise _broken("the cache's keys/values are not in the autograd graph of the forward")
        leaves = [(k.detach().requires_grad_(), v.detach().requires_grad_()) for k, v in kept]
        resumed = model(input_ids=ids[:, 2:], position_ids=torch.tensor([[2, 3]]), past_key_values=make_cache(leaves),
                        use_cache=False)
        resumed.logits.sum().backward()
        if any(k.grad is None or v.grad is None or not bool(k.grad.abs().sum() > 0) for k, v in leaves):
            raise _broken("a forward resumed from a cache of leaf tensors gave them no gradient")
