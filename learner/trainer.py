"""What the loop trains with: the :class:`Trainer` surface and the plain torch backend.

:class:`Trainer` is all the loop sees of a backend; :class:`TorchTrainer` (one process, one
device, AdamW) and :class:`~.deepspeed_backend.DeepSpeedTrainer` implement it, and
:func:`make_trainer` picks one from the config. What both backends share (model building,
weight and state files) is in :mod:`.model_setup`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

import torch

from .config import LearnerConfig
from .deepspeed_backend import DeepSpeedTrainer
from .model_setup import (
    OPTIMIZER_FILE,
    RNG_FILE,
    adamw,
    build_model,
    load_weights,
    pad_token_id,
    reference_model,
    rng_state,
    save_weights,
    set_rng_state,
    write_backend,
)
from .step import StepMetrics, set_lr, train_step
from .step_plan import StepPlan, plan_step

logger = logging.getLogger(__name__)


class Trainer(Protocol):
    """What the loop needs from a backend."""

    backend: str
    rank: int
    world_size: int
    model: torch.nn.Module  # the unwrapped (peft or HF) model
    tokenizer: Any
    plan: StepPlan  # how every step runs (decided when the trainer was built)

    def step(self, samples: list[dict[str, Any]], lr: float | None = None) -> StepMetrics: ...
    def save_weights(self, directory: Path, dtype: str | None = None) -> None: ...
    def save_state(self, directory: Path) -> None: ...
    def close(self) -> None: ...


class TorchTrainer:
    """One process, one device: :func:`learner.step.train_step` with AdamW.

    ``weights_dir`` / ``state_dir`` (a checkpoint to resume) are loaded at construction,
    weights before the optimizer exists, the same order the DeepSpeed backend needs.
    """

    backend = "torch"
    rank = 0
    world_size = 1

    def __init__(self, cfg: LearnerConfig, weights_dir: Path | None = None, state_dir: Path | None = None,
                 *, model: torch.nn.Module | None = None, tokenizer: Any = None) -> None:
        self.cfg = cfg
        if model is None:
            model, tokenizer = build_model(cfg)
        self.model, self.tokenizer = model, tokenizer
        self.ref_model = reference_model(cfg, model)  # before any checkpoint: the reference is the base
        if weights_dir is not None:
            load_weights(model, weights_dir)
        self.optimizer = adamw(cfg, model)
        if state_dir is not None:
            self.optimizer.load_state_dict(torch.load(state_dir / OPTIMIZER_FILE, map_location=cfg.device,
                                                      weights_only=False))
            set_rng_state(torch.load(state_dir / RNG_FILE, weights_only=False))
        self.plan = plan_step(model, cfg.step_config(pad_token_id(tokenizer)), ref_model=self.ref_model)

    def step(self, samples: list[dict[str, Any]], lr: float | None = None) -> StepMetrics:
        if lr is not None:
            set_lr(self.optimizer, lr)
        return train_step(self.model, self.optimizer, samples, self.plan, ref_model=self.ref_model)

    def save_weights(self, directory: Path, dtype: str | None = None) -> None:
        save_weights(self.model, self.tokenizer, directory, dtype)

    def save_state(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        torch.save(self.optimizer.state_dict(), directory / OPTIMIZER_FILE)
        torch.save(rng_state(), directory / RNG_FILE)
        write_backend(directory, self.backend, self.world_size)

    def close(self) -> None:
        pass


def make_trainer(cfg: LearnerConfig, weights_dir: Path | None = None, state_dir: Path | None = None) -> Trainer:
    """The backend ``cfg`` asks for (DeepSpeed imported only then), resumed from the given files."""
    if cfg.deepspeed:
        return DeepSpeedTrainer(cfg, weights_dir, state_dir)
    return TorchTrainer(cfg, weights_dir, state_dir)
