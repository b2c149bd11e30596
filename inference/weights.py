"""Weight swaps for the transformers engine: full checkpoints and LoRA adapters, without dropping requests.

Why a mixin of its own: swapping is where correctness is subtle. The
generation thread reads the policy (model reference, version, LoRA slot) once
per batch, so:

* full weights are loaded into a NEW model object in another thread and the
  reference is swapped; a running batch finishes on the object it holds;
* the one policy's LoRA adapters are merged into a copy of the base weights
  (``merge_lora``, the default of ``boltstream serve``), swapped like full weights;
  the copy that served the version before the current one is recycled: the next
  adapter is merged into it in place (:mod:`.lora_merge`), once no batch runs on it;
* otherwise (several named adapters, or ``--no-merge-lora``) LoRA adapters live
  in two alternating slots: a new adapter goes into the slot the current policy
  does not use. If it has the same shape as that slot's previous adapter (the
  usual case), its tensors are copied in right away, next to a running batch that
  uses the other slot (~60 ms for SmolLM2 r=16); a first adapter or a new shape
  changes modules, which happens in the generation thread, between batches.

Every swap drops the policy's prefix cache (:mod:`boltstream.inference.prefix_cache`):
KV computed by the old weights never serves the new ones.

LoRA adapters apply to the weights the worker started with. With several named
adapters (:mod:`boltstream.inference.adapters`) each has its own two slots
(``<name>-a``, ``<name>-b``) in the one PEFT model over the shared base, and its
own policy: reloading one never touches another's slots or version. Full
checkpoints are refused then: they would replace the base every adapter shares.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from boltstream.errors import CheckpointError

log = logging.getLogger(__name__)

LORA_SLOTS = ("lora-a", "lora-b")
_LORA_SHAPE_KEYS = ("r", "lora_alpha", "target_modules", "rank_pattern", "alpha_pattern", "use_dora",
                    "use_rslora", "bias", "modules_to_save", "layers_to_transform", "fan_in_fan_out")


@dataclass(frozen=True)
class Policy:
    """The weights one batch runs on: a model, its version and (for LoRA) the adapter slot to activate."""

    model: Any
    version: int
    adapter: str | None = None


def lora_slots(adapter: str | None) -> tuple[str, str]:
    """The two PEFT adapter names a policy alternates between (None: the worker's one policy)."""
    return LORA_SLOTS if adapter is None else (f"{adapter}-a", f"{adapter}-b")


class WeightSwapping:
    """Mixed into TransformersBackend; relies on its ``_base``, ``_peft``, ``_policies``, ``_executor``."""

    _base: Any
    _peft: Any
    merge_lora: bool
    _policies: dict[str | None, Policy]
    adapters: tuple[str, ...]
    _batch_policy: Policy | None
    _executor: Any
    _spare: Any  # a merged model object no policy serves any more (recycled by the next merge)
    _merged: Any  # WeakKeyDictionary: merged model object -> the modules its merge changed
    _vocab: int
    _slot_shapes: dict[str, dict[str, Any]]
    prefix_cache: Any
    device: Any

    def _key(self, adapter: str | None) -> str | None:
        """The policy key of ``adapter`` (None: the default one); ValueError naming what is served."""
        if adapter is None:
            return self.adapters[0] if self.adapters else None
        if adapter not in self.adapters:
            served = ", ".join(self.adapters) if self.adapters else "no named adapters"
            raise ValueError(f"adapter {adapter!r} is not served by this worker (it serves {served})")
        return adapter

    async def load_weights(self, path: Path, kind: str, version: int, adapter: str | None = None) -> None:
        loop = asyncio.get_running_loop()
        path = Path(path)
        key = self._key(adapter)
        if kind == "full":
            if key is not None:
                raise CheckpointError(f"adapter {key!r}: a full checkpoint cannot be served as one of several "
                                      "adapters on a shared base model; publish LoRA checkpoints (kind 'lora')")
            model = await loop.run_in_executor(None, self._load_full, path)
            self._policies[key] = Policy(model, version)
        elif kind == "lora" and self.merge_lora and key is None:
            model = await loop.run_in_executor(None, self._merged_lora, path, self._take_spare())
            retired = self._policies[key].model
            self._policies[key] = Policy(model, version)
            self._spare = retired if retired is not self._base else None
        elif kind == "lora":
            slots = lora_slots(key)
            slot = slots[1] if self._policies[key].adapter == slots[0] else slots[0]
            running = self._batch_policy.adapter if self._batch_policy is not None else None
            if self._lora_fits(path, slot) and running != slot:
                # Same shape as the slot's adapter and no running batch uses the slot: copy the tensors
                # now, next to the running batch (its forward only touches its own adapter).
                await loop.run_in_executor(None, self._copy_lora, path, slot)
            else:  # first adapter or a new shape: change modules between batches, in the generation thread
                await loop.run_in_executor(self._executor, self._build_lora, path, slot, slots)
            self._policies[key] = Policy(self._peft, version, slot)
        else:
            raise CheckpointError(f"unknown checkpoint kind {kind!r}")
        # KV belongs to the weights that computed it. After the swap above, so a batch still draining on
        # the old policy can no longer store any (prefix_cache.py checks the policy under the same lock).
        self.prefix_cache.drop(key)
        log.info("now serving policy version %d (%s)%s", version, kind, f" of adapter {key}" if key else "")

    def _load_full(self, path: Path) -> Any:
        """A fresh model object from an HF directory; refused unless every weight loaded."""
        import torch
        from transformers import AutoModelForCausalLM

        kwargs: dict[str, Any] = {"dtype": next(self._base.parameters()).dtype, "output_loading_info": True}
        if not (path / "config.json").is_file():
            kwargs["config"] = self._base.config
        with torch.inference_mode(False):
            model, info = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        problems = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys",
                                                                  "mismatched_keys", "error_msgs")}
        if problems:
            raise CheckpointError(f"checkpoint {path} does not match the model: {problems}")
        if model.get_output_embeddings().weight.shape[0] != self._vocab:
            raise CheckpointError(f"checkpoint {path} has a different vocabulary size than the tokenizer")
        return model.to(self.device).eval()

    @staticmethod
    def _lora_shape(path: Path) -> dict[str, Any]:
        config = json.loads((path / "adapter_config.json").read_text())
        return {k: config.get(k) for k in _LORA_SHAPE_KEYS}

    def _lora_fits(self, path: Path, slot: str) -> bool:
        """Whether ``slot`` holds an adapter of the same shape, so only tensors need copying."""
        if self._peft is None or not (path / "adapter_model.safetensors").is_file():
            return False
        try:
            return self._slot_shapes.get(slot) == self._lora_shape(path)
        except (OSError, ValueError):
            return False

    def _take_spare(self) -> Any:
        """The merged model object of an earlier version, to merge the next one into, unless the running
        batch still decodes on it (runs on the event loop, where batches start)."""
        spare, self._spare = self._spare, None
        running = self._batch_policy.model if self._batch_policy is not None else None
        return spare if spare is not None and spare is not running else None

    def _merged_lora(self, path: Path, into: Any = None) -> Any:
        """A model object with the base weights and the adapter at ``path`` merged: ``into`` (a merged
        model no batch uses any more) rewritten in place, else a new copy of the base model.

        Decoding then runs plain linear layers (on CPU ~1.3x faster than PEFT's unmerged ones, which
        add two small matmuls per layer per token), and a running batch keeps the object it holds,
        as with full checkpoints. A plain LoRA adapter (the learner's) is merged by :mod:`.lora_merge`;
        into a recycled object that skips the copy of the base, and its decode step keeps its probe and
        takes only the new weights. Other adapters go through PEFT into a new copy."""
        import copy

        import torch

        from boltstream.inference import llama_step, lora_merge

        adapter, why_not = lora_merge.read_adapter(path)
        if adapter is None:
            log.info("adapter %s is merged through PEFT (%s)", path, why_not)
            return self._peft_merged(path)
        with torch.inference_mode(False):
            model = into if into is not None else copy.deepcopy(self._base)
            self._merged[model] = lora_merge.merge_into(model, self._base, adapter, self._merged.get(model, frozenset()))
        if into is not None:
            llama_step.refresh(model)
        return model.eval()

    def _peft_merged(self, path: Path) -> Any:
        """A new copy of the base weights with the adapter at ``path`` merged in by PEFT."""
        import copy

        import torch
        from peft import PeftModel

        with torch.inference_mode(False):
            base = copy.deepcopy(self._base)
            try:
                model = PeftModel.from_pretrained(base, path, is_trainable=False).merge_and_unload()
            except (OSError, ValueError, KeyError, RuntimeError) as exc:
                raise CheckpointError(f"adapter {path} does not fit the model: {exc}") from exc
        return model.eval()

    def _copy_lora(self, path: Path, slot: str) -> None:
        """Copy an adapter's tensors into ``slot`` (~60 ms for SmolLM2 r=16), checking every one fits."""
        import torch
        from peft.utils import set_peft_model_state_dict
        from safetensors.torch import load_file

        weights = load_file(path / "adapter_model.safetensors", device=str(self.device))
        with torch.no_grad():
            result = set_peft_model_state_dict(self._peft, weights, adapter_name=slot)
        missing = [k for k in result.missing_keys if "lora_" in k and f".{slot}." in k]
        if result.unexpected_keys or missing:
            raise CheckpointError(f"adapter {path} does not fit the model: unexpected "
                                  f"{result.unexpected_keys[:3]}, missing {missing[:3]}")

    def _build_lora(self, path: Path, slot: str, slots: tuple[str, str]) -> None:
        """(Re)create ``slot`` (one of ``slots``) from an adapter directory; runs between batches in the
        generation thread."""
        from peft import PeftModel

        shape = self._lora_shape(path)
        if self._peft is None:
            self._peft = PeftModel.from_pretrained(self._base, path, adapter_name=slot, is_trainable=False)
        else:
            if slot in self._peft.peft_config:
                others = [s for s in (*slots, *self._peft.peft_config) if s != slot and s in self._peft.peft_config]
                if others:  # PEFT refuses to delete the active adapter
                    self._peft.set_adapter(others[0])
                self._peft.delete_adapter(slot)
            self._peft.load_adapter(path, adapter_name=slot, is_trainable=False)
        self._slot_shapes[slot] = shape
        self._peft.eval()
