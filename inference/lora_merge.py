"""Merge a plain LoRA adapter into a model's weights, in place, as PEFT's ``merge_and_unload`` does.

Why not PEFT itself on every reload: it wraps a fresh copy of the base model
in adapter modules, loads the adapter into them and merges, so each new
policy version costs a deep copy of the model, the wrapping and (for the
plain-torch decode step) a new step with its probe, fused weights and packed
copies. Here a model object that no longer serves (the version before the
current one) takes the next version's weights in place: for every adapted
linear layer ``W = W_base + (B @ A) * scaling``, computed as PEFT computes it
(the factors in float32, the sum rounded once into the weight's dtype), so the
merged weights equal PEFT's bit for bit (a unit test compares them).

Only the adapters the learner writes are merged here: vanilla LoRA on
``nn.Linear`` layers, one rank and alpha for every layer (``use_rslora``
allowed), no DoRA, no bias, no modules to save, no per-layer rank or alpha
patterns. :func:`read_adapter` says why any other adapter is not plain; the
worker then merges it through PEFT.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from boltstream.errors import CheckpointError

# adapter_config.json keys that do not change how a LoRA adapter merges; any other key must hold PEFT's
# default (LoraConfig()), else the adapter is not plain here (DoRA, patterns, biases, PiSSA-style inits...)
_MERGE_NEUTRAL = {"peft_type", "task_type", "peft_version", "auto_mapping", "base_model_name_or_path", "revision",
                  "inference_mode", "r", "lora_alpha", "lora_dropout", "target_modules", "exclude_modules",
                  "layers_to_transform", "layers_pattern", "use_rslora", "megatron_core", "qalora_group_size"}
_PLAIN_INITS = (True, False, "gaussian")
# how PEFT's saved keys start (``PeftModel.save_pretrained`` of a causal LM)
_PREFIX = "base_model.model."


@dataclass(frozen=True)
class PlainAdapter:
    """A plain LoRA adapter: per module name of the base model, its ``(A [r, in], B [out, r])``."""

    scaling: float
    factors: dict[str, tuple[Any, Any]]


def read_adapter(path: Path) -> tuple[PlainAdapter | None, str | None]:
    """``(adapter, None)`` for an adapter directory this module merges, else ``(None, why not)``;
    CheckpointError for files that hold no adapter at all."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        config = json.loads((path / "adapter_config.json").read_text())
    except (OSError, ValueError) as exc:
        return None, f"no readable adapter_config.json: {exc}"
    problem = _not_plain(config)
    if problem is not None:
        return None, problem
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or r < 1 or not isinstance(alpha, (int, float)):
        return None, f"r={r!r}, lora_alpha={alpha!r}"
    scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    try:
        tensors = load_file(path / "adapter_model.safetensors")
    except (OSError, SafetensorError) as exc:
        raise CheckpointError(f"adapter {path}: no readable adapter_model.safetensors: {exc}") from exc
    factors: dict[str, dict[str, Any]] = {}
    for name, t in tensors.items():
        stem, dot, kind = name.removesuffix(".weight").rpartition(".")
        if not (dot and name.endswith(".weight") and kind in ("lora_A", "lora_B") and stem.startswith(_PREFIX)):
            return None, f"tensor {name!r} is not a LoRA factor"
        factors.setdefault(stem.removeprefix(_PREFIX), {})[kind] = t
    pairs = {}
    for module, ab in factors.items():
        a, b = ab.get("lora_A"), ab.get("lora_B")
        if a is None or b is None or a.dim() != 2 or b.dim() != 2 or a.shape[0] != r or b.shape[1] != r:
            raise CheckpointError(f"adapter {path}: module {module} has no rank-{r} pair of lora_A/lora_B")
        pairs[module] = (a, b)
    if not pairs:
        raise CheckpointError(f"adapter {path} holds no LoRA factors")
    return PlainAdapter(scaling, pairs), None


def _not_plain(config: dict[str, Any]) -> str | None:
    """The first setting of ``config`` (adapter_config.json) that makes it more than plain LoRA, or None."""
    from peft import LoraConfig

    defaults = LoraConfig().to_dict()
    if str(config.get("peft_type", "LORA")) != "LORA":
        return f"peft_type={config.get('peft_type')!r}"
    if config.get("init_lora_weights", True) not in _PLAIN_INITS:
        return f"init_lora_weights={config['init_lora_weights']!r}"
    for key, value in config.items():
        if key in _MERGE_NEUTRAL or key == "init_lora_weights":
            continue
        if key not in defaults:
            return f"{key} (unknown to peft {defaults['peft_version']})"
        if value != defaults[key] and not (not value and not defaults[key]):  # None, {} and [] alike
            return f"{key}={value!r}"
    return None


def linear_weights(model: Any, names: Iterable[str]) -> dict[str, Any]:
    """The weight of each named ``nn.Linear`` of ``model``; CheckpointError naming the first that is not one."""
    import torch

    modules = dict(model.named_modules())
    out = {}
    for name in names:
        module = modules.get(name)
        if type(module) is not torch.nn.Linear:
            raise CheckpointError(f"the adapter does not fit the model: it adapts {name!r}, not a linear layer of it")
        out[name] = module.weight
    return out


def merge_into(target: Any, base: Any, adapter: PlainAdapter, previously: frozenset[str] = frozenset()) -> frozenset[str]:
    """Make ``target`` (a copy of ``base``: same modules, own storage) hold ``base`` with ``adapter`` merged.

    ``previously``: the modules an earlier merge changed in ``target``; those the adapter does not
    adapt get ``base``'s weights back. Everything is checked before anything is written. Returns the
    modules merged now (the next call's ``previously``)."""
    import torch

    names, restore = sorted(adapter.factors), sorted(previously - adapter.factors.keys())
    weights, originals = linear_weights(target, names + restore), linear_weights(base, names + restore)
    for name in names:
        a, b = adapter.factors[name]
        out_features, in_features = originals[name].shape
        if a.shape[1] != in_features or b.shape[0] != out_features:
            raise CheckpointError(f"the adapter does not fit the model: factors of {name} ({tuple(b.shape)} @ "
                                  f"{tuple(a.shape)}) against its weight {tuple(originals[name].shape)}")
    with torch.no_grad():
        for name in restore:
            weights[name].copy_(originals[name])
        for name in names:
            a, b = (t.to(weights[name].device, torch.float32) for t in adapter.factors[name])
            # PEFT loads the factors in float32 (its autocast_adapter_dtype); the sum is rounded once
            torch.add(originals[name], (b @ a) * adapter.scaling, out=weights[name])
    return frozenset(names)
