"""DeepSpeed ZeRO (stage 0/1/2) behind the same :class:`~.trainer.Trainer` surface as plain torch.

Topology: rank 0 runs the whole learner (Kafka, S3, metrics); every other rank runs
:func:`run_follower`, which executes the commands rank 0 broadcasts (``step`` with the
step's samples, ``save_state``, ``stop``). Each rank trains on its share of the step's
samples (sorted by length, dealt round-robin so token counts stay balanced), and each
rank's loss is rescaled by ``world_size * n_rank / n_total`` (``n`` = the loss
normaliser: trained tokens or sequences) so that DeepSpeed's gradient *average* equals
the gradient of one big batch, for every loss-aggregation mode.

Gradient accumulation over micro-batches uses DeepSpeed's own boundary flag: only the
last micro-batch's backward is a boundary, so ZeRO reduces gradients once per step.
Weights are saved by rank 0 (stages 0-2 keep full parameters on every rank); optimizer
state is saved collectively with ``engine.save_checkpoint`` into a directory all ranks
see (one machine, or a shared filesystem across machines).

On CPU the process group is gloo. DeepSpeed would JIT-compile a shared-memory allreduce
op on first use (~2 min on 2 cores); it is disabled unless ``ds_shm_comm`` is set.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from boltstream.errors import BoltstreamError
from boltstream.processes import free_port

from .collate import step_normaliser
from .config import LearnerConfig
from .model_setup import (
    RNG_FILE,
    adamw,
    build_model,
    load_weights,
    pad_token_id,
    reference_model,
    rng_state,
    set_rng_state,
    write_backend,
)
from .model_setup import save_weights as save_hf_weights
from .step import StepMetrics, accumulate_gradients, micro_batches, set_lr
from .step_plan import plan_step

logger = logging.getLogger(__name__)

TAG = "state"
SHM_OP = "deepspeed_shm_comm"


def dist_env() -> tuple[int, int, int]:
    """(rank, world size, local rank) from the launcher's environment; (0, 1, 0) without one."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return rank, world, int(os.environ.get("LOCAL_RANK", str(rank)))


def import_deepspeed(cfg: LearnerConfig) -> Any:
    """``import deepspeed`` with a clear error when the extra is missing; CPU accelerator on CPU."""
    if cfg.device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
        import deepspeed.ops
    except ImportError as exc:
        raise BoltstreamError(
            f"--deepspeed needs DeepSpeed ({exc}): pip install --no-build-isolation 'boltstream[deepspeed]' "
            "after torch is installed") from exc
    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    if not cfg.ds_shm_comm:  # the probe result is cached in the module, so this switch sticks
        deepspeed.ops.__compatible_ops__[SHM_OP] = False
    return deepspeed


def init_distributed(cfg: LearnerConfig) -> None:
    """Join (or, alone, create) the process group: gloo on CPU, nccl on GPU; loopback when alone."""
    if dist.is_initialized():
        return
    rank, world, local_rank = dist_env()
    for var, value in (("RANK", rank), ("WORLD_SIZE", world), ("LOCAL_RANK", local_rank)):
        os.environ.setdefault(var, str(value))  # DeepSpeed insists on seeing them
    if world == 1:  # alone: everything on loopback
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise BoltstreamError(f"--deepspeed with WORLD_SIZE={world} needs {', '.join(missing)} (use torchrun)")
    backend = "gloo" if cfg.device == "cpu" else "nccl"
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world,
                            timeout=timedelta(seconds=cfg.dist_timeout_s))
    logger.info("rank %d of %d joined %s group at %s:%s", rank, world, backend, os.environ["MASTER_ADDR"],
                os.environ["MASTER_PORT"])


def merge_metrics(parts: list[dict[str, Any]], scales: list[float], samples: list[dict[str, Any]],
                  seconds: float, grad_norm: float) -> StepMetrics:
    """One StepMetrics from every rank's: token-weighted means, sums, the max ratio."""
    tokens = sum(p["loss_tokens"] for p in parts)

    def mean(key: str) -> float:
        return sum(p[key] * p["loss_tokens"] for p in parts) / tokens if tokens else 0.0

    adv = torch.tensor([float(s["advantage"]) for s in samples], dtype=torch.float64)
    input_tokens = sum(p["input_tokens"] for p in parts)
    return StepMetrics(
        loss=sum(p["loss"] * s for p, s in zip(parts, scales, strict=True)),
        clip_fraction=mean("clip_fraction"), approx_kl=mean("approx_kl"), ref_kl=mean("ref_kl"),
        entropy=mean("entropy"), ratio_mean=mean("ratio_mean"), ratio_max=max(p["ratio_max"] for p in parts),
        is_weight_mean=mean("is_weight_mean"), is_truncated_fraction=mean("is_truncated_fraction"),
        grad_norm=grad_norm, advantage_mean=float(adv.mean()), advantage_std=float(adv.std(unbiased=False)),
        loss_tokens=tokens, input_tokens=input_tokens, samples=len(samples),
        unique_tokens=sum(p.get("unique_tokens", 0) for p in parts),
        micro_batches=sum(p["micro_batches"] for p in parts), seconds=seconds,
        tokens_per_s=input_tokens / seconds if seconds > 0 else 0.0)


class DeepSpeedTrainer:
    """ZeRO data parallelism; construct on every rank (rank 0 passes the resume files, others get them)."""

    backend = "deepspeed"

    def __init__(self, cfg: LearnerConfig, weights_dir: Path | None = None, state_dir: Path | None = None) -> None:
        deepspeed = import_deepspeed(cfg)
        rank, world, local_rank = dist_env()
        if cfg.device == "cuda":
            cfg = dataclasses.replace(cfg, device=f"cuda:{local_rank}")
            torch.cuda.set_device(local_rank)
        init_distributed(cfg)
        self.cfg, self.rank, self.world_size = cfg, dist.get_rank(), dist.get_world_size()
        paths = [str(weights_dir) if weights_dir else None, str(state_dir) if state_dir else None]
        dist.broadcast_object_list(paths, src=0)  # followers learn what rank 0 resumes from
        weights_dir, state_dir = (Path(p) if p else None for p in paths)
        self.model, self.tokenizer = build_model(cfg)
        self.ref_model = reference_model(cfg, self.model)
        if weights_dir is not None:
            load_weights(self.model, weights_dir)  # before ZeRO copies the weights into its partitions
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,  # micro-batches are ours: see the boundary flag in _step
            "zero_optimization": {"stage": cfg.zero_stage},
            "zero_allow_untested_optimizer": True,  # torch AdamW: no compiled fused optimizer needed
            "gradient_clipping": cfg.step.max_grad_norm or 0.0,
            "bf16": {"enabled": cfg.dtype == "bfloat16"},
            "steps_per_print": 10**9,
        }
        self.engine, *_ = deepspeed.initialize(model=self.model, optimizer=adamw(cfg, self.model), config=config,
                                               dist_init_required=False)
        if state_dir is not None:
            self.engine.load_checkpoint(str(state_dir), tag=TAG, load_module_strict=not cfg.lora,
                                        load_optimizer_states=True, load_lr_scheduler_states=False)
            set_rng_state(torch.load(state_dir / RNG_FILE, weights_only=False))
        dist.barrier()  # every rank has read the resume files before rank 0 deletes them
        self.plan = plan_step(self.model, cfg.step_config(pad_token_id(self.tokenizer)), ref_model=self.ref_model,
                              custom_backward=True)
        logger.info("DeepSpeed ZeRO-%d ready on rank %d of %d", cfg.zero_stage, self.rank, self.world_size)

    # ------------------------------------------------------------------ rank 0's commands

    def _command(self, name: str, payload: Any = None) -> None:
        if self.rank == 0 and self.world_size > 1:
            dist.broadcast_object_list([name, payload], src=0)

    def step(self, samples: list[dict[str, Any]], lr: float | None = None) -> StepMetrics:
        self._command("step", (samples, lr))
        return self._step(samples, lr)

    def save_weights(self, directory: Path, dtype: str | None = None) -> None:
        save_hf_weights(self.model, self.tokenizer, directory, dtype)  # rank 0 only: every rank holds all weights

    def save_state(self, directory: Path) -> None:
        self._command("save_state", str(directory))
        self._save_state(directory)

    def close(self) -> None:
        if not dist.is_initialized():
            return
        self._command("stop")
        dist.destroy_process_group()

    # ------------------------------------------------------------------ every rank

    def _step(self, samples: list[dict[str, Any]], lr: float | None = None) -> StepMetrics:
        t0 = time.perf_counter()
        if lr is not None:
            set_lr(self.engine.optimizer, lr)
        self.engine.train()
        ordered = sorted(samples, key=lambda s: -len(s["token_ids"]))
        mine = ordered[self.rank :: self.world_size]
        local = step_normaliser(mine, self.plan.cfg.loss_agg)
        totals = torch.tensor([local], dtype=torch.float64)
        dist.all_reduce(totals)
        total = max(float(totals[0]), 1.0)
        scale = self.world_size * max(local, 1.0) / total  # the step clamps each normaliser at 1 too
        if mine:
            count = len(micro_batches(self.plan, mine)[1])
            calls = [0]

            def backward(loss: torch.Tensor) -> None:
                self.engine.set_gradient_accumulation_boundary(calls[0] == count - 1)
                calls[0] += 1
                self.engine.backward(loss * scale, scale_wrt_gas=False)

            part = accumulate_gradients(self.engine.module, mine, self.plan, ref_model=self.ref_model,
                                        backward_fn=backward).to_dict()
        else:  # fewer samples than ranks: a zero gradient keeps the collectives in step
            zero = sum(p.sum() for p in self.model.parameters() if p.requires_grad) * 0.0
            self.engine.set_gradient_accumulation_boundary(True)
            self.engine.backward(zero, scale_wrt_gas=False)
            part = {f.name: 0 for f in dataclasses.fields(StepMetrics)}
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        parts: list[Any] = [None] * self.world_size
        dist.all_gather_object(parts, (part, scale / self.world_size))
        grad_norm = float(norm) if norm is not None else float("nan")
        return merge_metrics([p for p, _ in parts], [s for _, s in parts], samples, time.perf_counter() - t0,
                             grad_norm)

    def _save_state(self, directory: Path) -> None:
        self.engine.save_checkpoint(str(directory), tag=TAG, exclude_frozen_parameters=self.cfg.lora)
        if self.rank == 0:
            torch.save(rng_state(), directory / RNG_FILE)
            write_backend(directory, self.backend, self.world_size)
        dist.barrier()

    def follow(self) -> None:
        """A non-zero rank's life: execute rank 0's commands until ``stop``."""
        while True:
            message: list[Any] = [None, None]
            dist.broadcast_object_list(message, src=0)
            name, payload = message
            if name == "step":
                self._step(*payload)
            elif name == "save_state":
                self._save_state(Path(payload))
            elif name == "stop":
                break
            else:
                raise RuntimeError(f"unknown command from rank 0: {name!r}")
        dist.destroy_process_group()


def run_follower(cfg: LearnerConfig) -> int:
    """Entry point of ranks > 0 (``boltstream learn --deepspeed`` under a launcher)."""
    trainer = DeepSpeedTrainer(cfg)
    logger.info("rank %d following rank 0", trainer.rank)
    trainer.follow()
    return 0
