"""What both training backends share: building the model, its optimizer, and the files they write.

The plain torch backend (:mod:`.trainer`) and the DeepSpeed one (:mod:`.deepspeed_backend`)
offer the same small surface to the loop (:class:`~.trainer.Trainer`): ``step`` on a list of samples,
and save/load of the weights (HF layout, what inference workers load) and of the training
state (optimizer moments, RNG: what only a resumed learner needs). Keeping the two file
sets apart lets workers download weights without the optimizer state, which is twice the
model's size for AdamW.
"""

from __future__ import annotations

import copy
import json
import logging
import random
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
from safetensors.torch import load_file

from boltstream.weights.models import load_model

from .config import LearnerConfig

logger = logging.getLogger(__name__)

OPTIMIZER_FILE = "optimizer.pt"
RNG_FILE = "rng.pt"
BACKEND_FILE = "backend.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def build_model(cfg: LearnerConfig) -> tuple[torch.nn.Module, Any]:
    """(model in train mode, tokenizer): ``cfg.model`` loaded by :func:`boltstream.weights.models.load_model`,
    wrapped with LoRA adapters when ``cfg.lora`` (only the adapters are then trainable)."""
    torch.manual_seed(cfg.seed)
    model, tokenizer = load_model(cfg.model, dtype=cfg.dtype, device=cfg.device, seed=cfg.seed)
    if cfg.lora:
        lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                          target_modules=list(cfg.lora_targets), task_type="CAUSAL_LM")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)  # LoRA A matrices: the same on every rank and every restart
            model = get_peft_model(model, lora)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    logger.info("model %s (%s): %.1fM parameters, %.2fM trainable", cfg.model, cfg.kind, total / 1e6, trainable / 1e6)
    return model.train(), tokenizer


def reference_model(cfg: LearnerConfig, model: torch.nn.Module) -> torch.nn.Module | None:
    """A frozen copy of the starting weights for the KL penalty of full fine-tuning.

    LoRA needs none (the base with adapters disabled is the reference) and ``kl_coef=0``
    needs none at all. Built from the *initial* weights, so it is the base model also
    after a resume (``model`` is copied before any checkpoint is loaded).
    """
    if cfg.step.kl_coef == 0.0 or cfg.lora:
        return None
    ref = copy.deepcopy(model).eval()
    for p in ref.parameters():
        p.requires_grad_(False)
    return ref


def pad_token_id(tokenizer: Any) -> int:
    pad = getattr(tokenizer, "pad_token_id", None)
    return int(pad) if pad is not None else 0


def vocab_size(model: torch.nn.Module) -> int:
    """Rows of the input embedding: a token id at or above this cannot be trained (vocabulary mismatch)."""
    return int(model.get_input_embeddings().num_embeddings)


def adamw(cfg: LearnerConfig, model: torch.nn.Module) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps,
                             weight_decay=cfg.weight_decay)


def cast_state_dict(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Floating-point tensors cast to ``dtype``; tensors that shared storage (tied embeddings) still
    share it, so ``save_pretrained`` recognises them as tied and writes them once. A weight outside
    the dtype's range (float16: 65504) is an error, never a served inf."""
    cast: dict[tuple[int, tuple[int, ...], tuple[int, ...]], torch.Tensor] = {}
    out = {}
    for name, t in state.items():
        if not t.is_floating_point() or t.dtype == dtype:
            out[name] = t
            continue
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
        if key not in cast:
            cast[key] = t.detach().to(dtype)
            if not bool(torch.isfinite(cast[key]).all()) and bool(torch.isfinite(t).all()):
                raise ValueError(f"{name} does not fit {dtype}: a weight beyond its range became inf")
        out[name] = cast[key]
    return out


def save_weights(model: torch.nn.Module, tokenizer: Any, directory: Path, dtype: str | None = None) -> None:
    """HF layout: a peft model writes adapter_config.json + adapter_model.safetensors, a full model
    config.json + model.safetensors (+ generation config) and the tokenizer files.

    ``dtype`` (full models only) writes the weights cast, e.g. a bfloat16 serving copy of an fp32
    model: half the bytes to upload and download, which is most of a worker's reload time.
    """
    directory.mkdir(parents=True, exist_ok=True)
    if hasattr(model, "peft_config") or dtype is None:
        model.save_pretrained(directory, safe_serialization=True)
    else:
        target = getattr(torch, dtype)
        model.save_pretrained(directory, safe_serialization=True,
                              state_dict=cast_state_dict(model.state_dict(), target))
        config_file = directory / "config.json"
        config = json.loads(config_file.read_text())
        config["dtype"] = dtype  # what a loader asked for dtype="auto" (vLLM's default) builds
        if "torch_dtype" in config:  # older name, still read by older loaders
            config["torch_dtype"] = dtype
        config_file.write_text(json.dumps(config, indent=2) + "\n")
    if not hasattr(model, "peft_config"):
        tokenizer.save_pretrained(directory)


def load_weights(model: torch.nn.Module, directory: Path) -> None:
    """Load a checkpoint written by :func:`save_weights` into ``model`` in place (parameters keep
    their identity, so an optimizer built on them stays valid)."""
    if hasattr(model, "peft_config"):
        result = set_peft_model_state_dict(model, load_file(directory / ADAPTER_WEIGHTS))
        missing = [k for k in result.missing_keys if "lora_" in k]
        if missing:
            raise RuntimeError(f"adapter in {directory} lacks {missing[:3]}...")
        return
    state: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        state.update(load_file(f))
    result = model.load_state_dict(state, strict=False)
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded = {params[k].data_ptr() for k in state if k in params}  # tied weights are saved once
    untied = [k for k in result.missing_keys if k not in params or params[k].data_ptr() not in loaded]
    if untied or result.unexpected_keys:
        raise RuntimeError(f"checkpoint {directory} does not fit the model: missing {untied[:3]}, "
                           f"unexpected {result.unexpected_keys[:3]}")


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])


def write_backend(directory: Path, backend: str, world_size: int) -> None:
    """Which backend wrote a training state: optimizer files of another backend or world size do not load."""
    (directory / BACKEND_FILE).write_text(json.dumps({"backend": backend, "world_size": world_size}))


def state_compatible(state_dir: Path, backend: str, world_size: int) -> bool:
    try:
        saved = json.loads((state_dir / BACKEND_FILE).read_text())
    except (OSError, ValueError):
        return False
    return saved.get("backend") == backend and int(saved.get("world_size", 1)) == world_size
