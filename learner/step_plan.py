"""How a training step runs on a given model, decided once: the :class:`StepPlan`.

Why one value: the step has faster paths that only some models can take (a prefix trie instead of
padded rows, a shared prefix computed once per step, log-probs through the LM head at trained
positions only, the reference scoring the same tries). Whether a model can take them is checked
once, with probes on the real model (:func:`.tree_forward.probe_tree_support`,
:func:`.shared_prefix.probe_shared_prefix`), when a trainer is built; every step then runs the
plan as it is. A path the config asks for but the model cannot take is a :class:`Fallback`: the
step stays correct and gets slower, so it is logged as a warning naming the fix, exported as the
learner's ``boltstream_learner_step_mode`` gauge and shown by ``boltstream status``.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from boltstream.inference import transformers_internals

from .config import StepConfig
from .shared_prefix import probe_shared_prefix
from .tree_forward import attention_implementation, causal_model, probe_tree_support

logger = logging.getLogger(__name__)

PATHS = ("prefix_tree", "shared_prefix", "fused_head", "reference_tree")
# What a user can do about a fallback, per path.
_CHECKED = ", ".join(transformers_internals.CHECKED_WITH["transformers"])
FIXES = {
    "prefix_tree": f"load the model with attn_implementation 'sdpa' or 'eager' on transformers {_CHECKED}",
    "shared_prefix": f"a causal LM with a plain growing KV cache on transformers {_CHECKED}, trained by the torch "
                     "backend",
    "fused_head": "no adapter on lm_head and no logit scaling: a plain nn.Linear head",
    "reference_tree": "a reference model that passes the same checks as the policy (or LoRA: its base is the "
                      "reference)",
}


@dataclasses.dataclass(frozen=True)
class Fallback:
    """A path the config asked for that the model cannot take: the step runs the slower one."""

    path: str  # one of PATHS
    reason: str

    @property
    def fix(self) -> str:
        return FIXES[self.path]


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """What every step of one trainer runs: the config and the paths the model takes."""

    cfg: StepConfig
    tree: bool = False  # each micro-batch is one token trie (else padded rows)
    shared_prefix: bool = False  # a prefix every sample shares runs once per step (with ``tree``)
    fused_head: bool = False  # log-probs through the LM head at trained positions only
    reference: str = "none"  # "none", "base" (the peft model, adapters off) or "model" (a separate one)
    reference_tree: bool = False  # the reference scores the same tries (else padded rows)
    reference_fused_head: bool = False
    fallbacks: tuple[Fallback, ...] = ()

    @property
    def mode(self) -> str:
        """``tree+shared-prefix``, ``tree`` or ``flat``: how the policy's decoder runs."""
        return "tree+shared-prefix" if self.shared_prefix else "tree" if self.tree else "flat"

    def paths(self) -> dict[str, str]:
        """Every path the config asks for: ``""`` when it is taken, else why not."""
        asked = {"prefix_tree": self.cfg.prefix_tree, "shared_prefix": self.cfg.prefix_tree and
                 self.cfg.shared_prefix_min_tokens > 0, "fused_head": self.cfg.fused_head,
                 "reference_tree": self.cfg.prefix_tree and self.reference == "model"}
        out = {path: "" for path, on in asked.items() if on}
        out.update({f.path: f.reason for f in self.fallbacks})
        return out


def lm_head_parts(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Linear] | None:
    """(decoder, lm_head) when running them apart computes exactly the model's logits, else None."""
    causal = causal_model(model)
    if not (hasattr(causal, "get_output_embeddings") and hasattr(causal, "get_decoder")):
        return None
    head = causal.get_output_embeddings()
    decoder = causal.get_decoder()
    if type(head) is not torch.nn.Linear or decoder is None or decoder is causal:
        return None
    config = getattr(causal, "config", None)
    for attr in ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale"):
        value = getattr(config, attr, None)
        if value is not None and value != 1:
            return None
    return decoder, head


def _head_problem(model: torch.nn.Module) -> str | None:
    if lm_head_parts(model) is None:
        return f"{type(causal_model(model)).__name__}'s head is not a plain nn.Linear after a separate decoder"
    return None


def plan_step(model: torch.nn.Module, cfg: StepConfig, *, ref_model: torch.nn.Module | None = None,
              custom_backward: bool = False) -> StepPlan:
    """The plan every step of ``model`` under ``cfg`` runs; each fallback logged as a warning with its
    fix. ``custom_backward``: the backend runs each micro-batch's backward itself
    (DeepSpeed), which a shared prefix's gradient cannot wait for. Raises ValueError when ``cfg``
    needs a reference that is not there."""
    reference = "model" if ref_model is not None else "base" if cfg.kl_coef != 0.0 else "none"
    if reference == "base" and not hasattr(model, "disable_adapter"):
        raise ValueError("kl_coef > 0 needs a ref_model (or a peft model, whose base is the reference)")
    fallbacks: list[Fallback] = []

    def check(path: str, asked: bool, problem: str | None) -> bool:
        if asked and problem is not None:
            fallbacks.append(Fallback(path, problem))
        return asked and problem is None

    tree = check("prefix_tree", cfg.prefix_tree, probe_tree_support(model) if cfg.prefix_tree else None)
    shared = tree and cfg.shared_prefix_min_tokens > 0
    shared = check("shared_prefix", shared, None if not shared else (
        "a custom backward (DeepSpeed) runs each micro-batch's backward itself" if custom_backward
        else probe_shared_prefix(model)))
    fused = check("fused_head", cfg.fused_head, _head_problem(model) if cfg.fused_head else None)
    ref_tree, ref_fused = tree, fused
    if ref_model is not None:
        problem = probe_tree_support(ref_model) or (probe_shared_prefix(ref_model) if shared else None)
        ref_tree = check("reference_tree", tree, problem if tree else None)
        ref_fused = cfg.fused_head and lm_head_parts(ref_model) is not None
    plan = StepPlan(cfg, tree, shared, fused, reference, ref_tree, ref_fused, tuple(fallbacks))
    for f in plan.fallbacks:
        logger.warning("learner step: %s off, a slower path runs: %s (fix: %s)", f.path, f.reason, f.fix)
    if tree:
        logger.info("learner step: %s (%s attention)", plan.mode, attention_implementation(model))
    return plan
