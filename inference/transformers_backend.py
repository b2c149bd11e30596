"""The transformers engine (CPU default): batches concurrent requests, records the sampled tokens' logprobs.

Why a hand-written decode loop instead of ``model.generate``: one batch mixes
requests with different temperatures, top_p, seeds, stop strings and lengths,
and we need the log-probability of every sampled token under exactly the
convention in :mod:`boltstream.inference.backend`; ``generate`` takes one set
of sampling parameters per call and reports processed scores.

Concurrency model: one background task collects pending requests (waiting at
most ``batch_window_ms`` for more once the first arrives), left-pads them and
decodes them together in ONE worker thread. The policy (model reference +
version + LoRA adapter) is read once at batch start, so a reload never changes
the weights under a running batch; its results are tagged with that version.
Full-weight reloads load the new model in another thread and swap the
reference; LoRA adapters are loaded in the generation thread itself, i.e.
between batches.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from boltstream.errors import CheckpointError
from boltstream.inference.backend import (
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_STOP,
    Completion,
    Generation,
    SamplingParams,
    TokenCallback,
    cut_at_stop,
)
from boltstream.models import stop_token_ids

log = logging.getLogger(__name__)

LORA_SLOTS = ("lora-a", "lora-b")
_LORA_SHAPE_KEYS = ("r", "lora_alpha", "target_modules", "rank_pattern", "alpha_pattern", "use_dora",
                    "use_rslora", "bias", "modules_to_save", "layers_to_transform", "fan_in_fan_out")


@dataclass(frozen=True)
class Policy:
    """The weights one batch runs on: a model, its version and (for LoRA) the adapter to activate."""

    model: Any
    version: int
    adapter: str | None = None


@dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    on_token: TokenCallback | None
    future: asyncio.Future[Generation]


@dataclass
class _Row:
    request: _Request
    choice: int
    generator: Any
    ids: list[int]
    logprobs: list[float]
    finish: str | None = None
    stop_string: str | None = None


class TransformersBackend:
    """Dynamic batching over a Hugging Face causal LM; see the module docstring."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        model_name: str,
        policy_version: int = 0,
        max_batch_size: int = 16,
        batch_window_ms: float = 2.0,
        max_context: int | None = None,
    ) -> None:
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.max_batch_size = max(1, max_batch_size)
        self.batch_window = max(0.0, batch_window_ms) / 1000.0
        limit = getattr(model.config, "max_position_embeddings", None) or 2048
        self.max_context = int(min(max_context or limit, limit))
        self.stop_ids = stop_token_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.stop_ids)
        self.batches_run = 0
        self._base = model
        self._vocab = model.get_output_embeddings().weight.shape[0]
        self._peft: Any = None
        self._slot_shapes: dict[str, dict[str, Any]] = {}
        self._batch_policy: Policy | None = None  # policy of the batch being decoded right now
        self._policy = Policy(model, policy_version)
        self._pending: deque[_Request] = deque()
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="boltstream-generate")
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def policy_version(self) -> int:
        return self._policy.version

    @property
    def device(self) -> Any:
        return next(self._base.parameters()).device

    async def start(self) -> None:
        if self._task is None:
            self._loop = asyncio.get_running_loop()
            self._wakeup = asyncio.Event()
            self._task = asyncio.create_task(self._batch_loop(), name="boltstream-batching")

    async def stop(self) -> None:
        self._closing = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        while self._pending:
            req = self._pending.popleft()
            if not req.future.done():
                req.future.set_exception(RuntimeError("inference worker is shutting down"))
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown, True)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, on_token: TokenCallback | None = None
    ) -> Generation:
        if self._task is None or self._wakeup is None:
            raise RuntimeError("backend not started")
        future: asyncio.Future[Generation] = asyncio.get_running_loop().create_future()
        self._pending.append(_Request(list(prompt_ids), params, on_token, future))
        self._wakeup.set()
        return await future

    async def _batch_loop(self) -> None:
        assert self._wakeup is not None and self._loop is not None
        while True:
            while not self._pending:
                self._wakeup.clear()
                await self._wakeup.wait()
            deadline = self._loop.time() + self.batch_window
            while sum(r.params.n for r in self._pending) < self.max_batch_size:
                remaining = deadline - self._loop.time()
                if remaining <= 0:
                    break
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), remaining)
                except TimeoutError:
                    break
            batch = [self._pending.popleft()]
            rows = batch[0].params.n
            while self._pending and rows + self._pending[0].params.n <= self.max_batch_size:
                rows += self._pending[0].params.n
                batch.append(self._pending.popleft())
            batch = [r for r in batch if not r.future.done()]
            if not batch:
                continue
            policy = self._batch_policy = self._policy  # the version this whole batch runs on
            try:
                results = await self._loop.run_in_executor(self._executor, self._run_batch, policy, batch)
            except Exception as exc:
                log.exception("generation batch of %d requests failed", len(batch))
                for req in batch:
                    if not req.future.done():
                        req.future.set_exception(exc)
                continue
            finally:
                self._batch_policy = None
            self.batches_run += 1
            for req, completions in zip(batch, results, strict=True):
                if not req.future.done():
                    req.future.set_result(Generation(req.prompt_ids, completions, policy.version))

    def _emit(self, row: _Row, token: int, logprob: float) -> None:
        cb = row.request.on_token
        if cb is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(cb, row.choice, token, logprob)

    def _run_batch(self, policy: Policy, batch: list[_Request]) -> list[list[Completion]]:
        """Decode a whole batch on ``policy`` (runs in the generation thread)."""
        import torch

        ctx: Any = contextlib.nullcontext()
        if policy.adapter is not None:
            self._peft.set_adapter(policy.adapter)
        elif self._peft is not None and policy.model is self._base:
            ctx = self._peft.disable_adapter()  # base weights while adapters are injected
        rows: list[_Row] = []
        for req in batch:
            for i in range(req.params.n):
                gen = torch.Generator(device="cpu")
                seed = req.params.seed + i if req.params.seed is not None else secrets.randbits(63)
                gen.manual_seed(seed % (2**63))
                rows.append(_Row(req, i, gen, [], []))
        with torch.inference_mode(), ctx:
            self._decode(policy.model, rows)
        out: list[list[Completion]] = [[] for _ in batch]
        index = {id(req): k for k, req in enumerate(batch)}
        for row in rows:
            text = self.tokenizer.decode(row.ids, skip_special_tokens=True)
            if row.stop_string is not None:
                text, _ = cut_at_stop(text, row.request.params.stop)
            out[index[id(row.request)]].append(
                Completion(row.ids, row.logprobs, row.finish or FINISH_LENGTH, text, row.stop_string)
            )
        return out

    def _decode(self, model: Any, rows: list[_Row]) -> None:
        import torch

        device = self.device
        width = max(len(r.request.prompt_ids) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            p = r.request.prompt_ids
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        temps = torch.tensor([r.request.params.temperature or 1.0 for r in rows], device=device)
        active = list(range(len(rows)))  # row indices still decoding, in cache order
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                    logits_to_keep=1)
        cache = out.past_key_values
        while True:
            logits = out.logits[:, -1, :].float()
            logp = torch.log_softmax(logits / temps[active].unsqueeze(-1), dim=-1)
            tokens = self._sample(logits, logp, [rows[i] for i in active])
            keep: list[int] = []
            for j, i in enumerate(active):
                row, tok = rows[i], tokens[j]
                row.ids.append(tok)
                row.logprobs.append(float(logp[j, tok]))
                self._emit(row, tok, row.logprobs[-1])
                self._check_finished(row)
                if row.finish is None:
                    keep.append(j)
            if not keep or self._closing:
                for i in active:
                    rows[i].finish = rows[i].finish or FINISH_ABORT
                return
            if len(keep) < len(active):  # drop finished rows from the batch and the KV cache
                sel = torch.tensor(keep, device=device)
                cache.batch_select_indices(sel)
                mask, positions = mask[sel], positions[sel]
                active = [active[j] for j in keep]
            nxt = torch.tensor([[rows[i].ids[-1]] for i in active], dtype=torch.long, device=device)
            mask = torch.cat([mask, torch.ones_like(nxt)], dim=-1)
            positions = positions[:, -1:] + 1
            out = model(input_ids=nxt, attention_mask=mask, position_ids=positions, past_key_values=cache,
                        use_cache=True)

    @staticmethod
    def _sample(logits: Any, logp: Any, rows: list[_Row]) -> list[int]:
        """Greedy rows take the argmax of the raw logits; others sample from top-p of softmax(logits/T)."""
        import torch

        tokens: list[int] = []
        for j, row in enumerate(rows):
            params = row.request.params
            if params.greedy:
                tokens.append(int(torch.argmax(logits[j])))
                continue
            probs = logp[j].exp()
            if params.top_p < 1.0:
                sorted_p, order = torch.sort(probs, descending=True)
                drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
                sorted_p = sorted_p.masked_fill(drop, 0.0)
                pick = torch.multinomial(sorted_p, 1, generator=row.generator)
                tokens.append(int(order[pick]))
            else:
                tokens.append(int(torch.multinomial(probs, 1, generator=row.generator)))
        return tokens

    def _check_finished(self, row: _Row) -> None:
        params = row.request.params
        if row.request.future.done():  # the client went away
            row.finish = FINISH_ABORT
        elif row.ids[-1] in self.stop_ids:
            row.finish = FINISH_STOP
        elif params.stop:
            text = self.tokenizer.decode(row.ids, skip_special_tokens=True)
            _, row.stop_string = cut_at_stop(text, params.stop)
            if row.stop_string is not None:
                row.finish = FINISH_STOP
        if row.finish is None and (
            len(row.ids) >= params.max_tokens or len(row.request.prompt_ids) + len(row.ids) >= self.max_context
        ):
            row.finish = FINISH_LENGTH

    # ----------------------------------------------------------------- reload

    async def load_weights(self, path: Path, kind: str, version: int) -> None:
        loop = asyncio.get_running_loop()
        path = Path(path)
        if kind == "full":
            model = await loop.run_in_executor(None, self._load_full, path)
            self._policy = Policy(model, version)
        elif kind == "lora":
            slot = LORA_SLOTS[1] if self._policy.adapter == LORA_SLOTS[0] else LORA_SLOTS[0]
            running = self._batch_policy.adapter if self._batch_policy is not None else None
            if self._lora_fits(path, slot) and running != slot:
                # Same shape as the slot's adapter and no running batch uses the slot: copy the tensors
                # now, next to the running batch (its forward only touches its own adapter).
                await loop.run_in_executor(None, self._copy_lora, path, slot)
            else:  # first adapter or a new shape: change modules between batches, in the generation thread
                await loop.run_in_executor(self._executor, self._build_lora, path, slot)
            self._policy = Policy(self._peft, version, slot)
        else:
            raise CheckpointError(f"unknown checkpoint kind {kind!r}")
        log.info("now serving policy version %d (%s)", version, kind)

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
        import json

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

    def _copy_lora(self, path: Path, slot: str) -> None:
        """Copy an adapter's tensors into ``slot`` (~60 ms for SmolLM2 r=16), checking every one fits."""
        import torch
        from peft.utils import set_peft_model_state_dict
        from safetensors.torch import load_file

        weights = load_file(path / "adapter_model.safetensors", device=str(self.device))
        with torch.no_grad():
            result = set_peft_model_state_dict(self._peft, weights, adapter_name=slot)
        missing = [k for k in result.missing_keys if "lora_" in k and f".{slot}" in k]
        if result.unexpected_keys or missing:
            raise CheckpointError(f"adapter {path} does not fit the model: unexpected "
                                  f"{result.unexpected_keys[:3]}, missing {missing[:3]}")

    def _build_lora(self, path: Path, slot: str) -> None:
        """(Re)create ``slot`` from an adapter directory; runs between batches in the generation thread."""
        from peft import PeftModel

        shape = self._lora_shape(path)
        if self._peft is None:
            self._peft = PeftModel.from_pretrained(self._base, path, adapter_name=slot, is_trainable=False)
        else:
            other = LORA_SLOTS[1] if slot == LORA_SLOTS[0] else LORA_SLOTS[0]
            if slot in self._peft.peft_config:
                if other in self._peft.peft_config:
                    self._peft.set_adapter(other)
                self._peft.delete_adapter(slot)
            self._peft.load_adapter(path, adapter_name=slot, is_trainable=False)
        self._slot_shapes[slot] = shape
        self._peft.eval()
