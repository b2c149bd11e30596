"""The transformers engine (CPU default): continuous batching of concurrent requests with exact logprobs.

Concurrency model: a background task starts a batch as soon as requests are
pending (waiting at most ``batch_window_ms`` for more) and runs it in ONE
generation thread (:mod:`boltstream.inference.decoding`). While it decodes,
newly arriving requests join it between steps (up to ``max_batch_size``
sequences) and each request is answered the moment its own rows finish, so
closed-loop agents are not held back by each other.

The policy (model reference + version + LoRA slot) is read once at batch
start; the whole batch runs on it and every result is tagged with its
version. After a reload the running batch stops taking new requests, drains
on the old weights, and the next batch starts on the new ones
(:mod:`boltstream.inference.weights`).

With ``prefix_cache_bytes`` > 0 (``serve --prefix-cache-mib``), every new
request's prefill reuses the stored KV of the longest known prefix of its
prompt and finished rows store theirs (:mod:`boltstream.inference.prefix_cache`);
each policy has its own entries, dropped when it is reloaded.

Several named adapters (``adapters=``, :mod:`boltstream.inference.adapters`)
share the one base model; each has its own policy. A batch runs ONE adapter's
policy, so no row is ever decoded with another request's adapter: it starts
with the oldest pending request's adapter, takes that adapter's pending
requests, and stops taking joiners as soon as the oldest waiting request wants
another adapter (which then gets the next batch). The price, measured by
``benchmarks/bench_serving_adapters.py``: interleaved traffic for two
adapters decodes in smaller batches than the same traffic for one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import weakref
from array import array
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from boltstream.inference import decoding, prefix_cache, transformers_internals
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
from boltstream.inference.cpu_share import CpuShare
from boltstream.inference.llama_step import KVBuffer
from boltstream.inference.weights import Policy, WeightSwapping
from boltstream.schemas.packed import I32, as_array
from boltstream.weights.models import stop_token_ids

log = logging.getLogger(__name__)


@dataclass
class _Request:
    prompt_ids: array  # int32: prefill wraps it, the LLM span packs it without a conversion
    params: SamplingParams
    on_token: TokenCallback | None
    future: asyncio.Future[Generation]
    rows_left: int = 0
    adapter: str | None = None  # key of the policy it runs on (None: the worker's one policy)


class TransformersBackend(WeightSwapping):
    """Continuous batching over a Hugging Face causal LM; see the module docstring."""

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
        adapters: tuple[str, ...] = (),
        prefix_cache_bytes: int = 0,
        merge_lora: bool = False,
        threads: int = 0,
    ) -> None:
        self.model_name = model_name
        self.adapters = tuple(adapters)
        self.merge_lora = merge_lora  # the one policy's LoRA checkpoints: merged copies (inference/weights.py)
        self.tokenizer = tokenizer
        self.max_batch_size = max(1, max_batch_size)
        self.batch_window = max(0.0, batch_window_ms) / 1000.0
        limit = getattr(model.config, "max_position_embeddings", None) or 2048
        self.max_context = int(min(max_context or limit, limit))
        self.stop_ids = stop_token_ids(model, tokenizer)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.stop_ids)
        self.batches_run = 0
        self.joined = 0  # requests that joined a running batch
        # What the step timeline reads (inference/metrics.py): seconds the generation thread ran a batch,
        # decode steps run and the rows they decoded (rows / steps = the mean decode batch).
        self.busy_seconds = 0.0
        self.decode_steps = 0
        self.decode_rows = 0
        self._base = model
        self._vocab = model.get_output_embeddings().weight.shape[0]
        self._peft: Any = None
        self._slot_shapes: dict[str, dict[str, Any]] = {}
        self._spare: Any = None
        self._merged: weakref.WeakKeyDictionary[Any, frozenset[str]] = weakref.WeakKeyDictionary()
        # One policy per adapter (all on the base weights until their first checkpoint), or one: key None.
        self._policies: dict[str | None, Policy] = {k: Policy(model, policy_version)
                                                    for k in (self.adapters or (None,))}
        self._lock = threading.Lock()  # _pending: appended on the loop, filtered in the generation thread
        self._batch_policy: Policy | None = None  # policy of the batch being decoded right now
        self._pending: deque[_Request] = deque()  # appended by the loop, popped by loop or generation thread
        self._in_job: list[_Request] = []
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="boltstream-generate")
        self._loop: asyncio.AbstractEventLoop | None = None
        # KV of prompt prefixes, per policy key (inference/prefix_cache.py); 0 bytes: off
        self.prefix_cache = prefix_cache.PrefixCache(prefix_cache_bytes)
        self._kv_reusable = transformers_internals.reusable(model.config)  # not sliding-window or static caches
        import torch

        # torch threads of the generation thread (inference/cpu_share.py); threads > 0 pins them
        self._cpu_share = CpuShare(torch.get_num_threads(), threads)

    def engine_stats(self) -> dict[str, float]:
        """Counters of the generation thread, read at each metrics scrape."""
        return {"busy_seconds": self.busy_seconds, "decode_steps": self.decode_steps,
                "decode_rows": self.decode_rows, "threads": self._cpu_share.current}

    @property
    def policy_version(self) -> int:
        return self.version_of(None)

    def version_of(self, adapter: str | None) -> int:
        return self._policies[self._key(adapter)].version

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
        await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown, True)
        for req in [*self._pending, *self._in_job]:
            if not req.future.done():
                req.future.set_exception(RuntimeError("inference worker is shutting down"))
        self._pending.clear()

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, on_token: TokenCallback | None = None,
        adapter: str | None = None,
    ) -> Generation:
        key = self._key(adapter)
        if self._task is None or self._wakeup is None or self._closing:
            raise RuntimeError("backend not started")
        future: asyncio.Future[Generation] = asyncio.get_running_loop().create_future()
        with self._lock:
            self._pending.append(_Request(as_array(prompt_ids, I32), params, on_token, future, params.n, key))
        self._wakeup.set()
        return await future

    def _take(self, rows: int, key: str | None, joining: bool = False) -> list[_Request]:
        """Pending requests of policy ``key`` (FIFO) that fit next to ``rows`` running sequences; always
        one if none run. ``joining``: none while the oldest pending request wants another adapter."""
        taken: list[_Request] = []
        with self._lock:
            live = [r for r in self._pending if not r.future.done()]  # drop requests whose client left
            if joining and live and live[0].adapter != key:
                self._pending = deque(live)
                return taken
            kept: deque[_Request] = deque()
            full = False
            for req in live:
                if req.adapter == key and not full and (rows == 0 or rows + req.params.n <= self.max_batch_size):
                    taken.append(req)
                    rows += req.params.n
                else:
                    full = full or req.adapter == key  # FIFO within an adapter: none overtakes one that waits
                    kept.append(req)
            self._pending = kept
        return taken

    async def _batch_loop(self) -> None:
        assert self._wakeup is not None and self._loop is not None
        while True:
            while not self._pending:
                self._wakeup.clear()
                await self._wakeup.wait()
            deadline = self._loop.time() + self.batch_window
            while sum(r.params.n for r in self._pending) < self.max_batch_size:  # let a burst arrive
                remaining = deadline - self._loop.time()
                if remaining <= 0:
                    break
                self._wakeup.clear()
                try:
                    await asyncio.wait_for(self._wakeup.wait(), remaining)
                except TimeoutError:
                    break
            with self._lock:
                key = self._pending[0].adapter if self._pending else None
            batch = self._take(0, key)
            if not batch:
                continue
            policy = self._batch_policy = self._policies[key]  # the version this whole batch runs on
            self._in_job = list(batch)
            started = time.perf_counter()
            try:
                await self._loop.run_in_executor(self._executor, self._run_batch, policy, batch, key)
            except Exception as exc:
                log.exception("generation batch failed")
                for req in self._in_job:
                    if not req.future.done():
                        req.future.set_exception(exc)
            finally:
                self._batch_policy = None
                self._in_job = []
                self.busy_seconds += time.perf_counter() - started
            self.batches_run += 1

    # ----------------------------------------------------------- generation thread

    def _resolve(self, req: _Request, generation: Generation) -> None:
        if not req.future.done():
            req.future.set_result(generation)

    def _row_done(self, row: decoding.Row, rows_of: dict[int, list[decoding.Row]], version: int) -> None:
        """Answer a request as soon as all its rows are finished."""
        req = row.request
        req.rows_left -= 1
        if req.rows_left or self._loop is None:
            return
        completions = []
        for r in sorted(rows_of.pop(id(req)), key=lambda r: r.choice):
            text = self.tokenizer.decode(r.ids, skip_special_tokens=True)
            if r.stop_string is not None:
                text, _ = cut_at_stop(text, r.params.stop)
            completions.append(Completion(r.ids, r.logprobs, r.finish or FINISH_LENGTH, text, r.stop_string))
        self._loop.call_soon_threadsafe(self._resolve, req, Generation(req.prompt_ids, completions, version,
                                                                         req.adapter))

    def _run_batch(self, policy: Policy, batch: list[_Request], key: str | None) -> None:
        """Decode ``batch`` (and requests that join it) on ``policy`` until every row has finished."""
        import torch

        ctx: Any = contextlib.nullcontext()
        if policy.adapter is not None:
            self._peft.set_adapter(policy.adapter)
        elif self._peft is not None and policy.model is self._base:
            ctx = self._peft.disable_adapter()  # base weights while adapters are injected
        with torch.inference_mode(), ctx:
            self._decode(policy, batch, key)

    def _serving(self, policy: Policy, key: str | None) -> Callable[[], bool]:
        """Whether ``policy`` is still the one served for ``key`` (the prefix cache only keeps its KV while so)."""
        return lambda: self._policies[key] is policy

    def _prefill(self, policy: Policy, rows: list[decoding.Row], key: str | None) -> decoding.DecodeState:
        """The rows' prefill, through the prefix cache when it is on and the model's caches allow it."""
        cache = self.prefix_cache
        if cache.enabled and self._kv_reusable:
            return prefix_cache.prefill(policy.model, rows, self.device, cache, key,
                                        self._serving(policy, key))
        state = decoding.prefill(policy.model, rows, self.pad_id, self.device)
        cache.count(sum(len(r.request.prompt_ids) for r in rows), 0)
        return state

    def _store_row(self, policy: Policy, state: decoding.DecodeState, j: int, key: str | None) -> None:
        """Keep a finished row's prompt + generated tokens in the prefix cache (the last sampled token
        was never fed, so it has no KV): an agent's next call starts with them."""
        row = state.rows[j]
        if self.prefix_cache.enabled and self._kv_reusable and row.finish != FINISH_ABORT and len(row.ids) > 1:
            self.prefix_cache.insert_row(key, row.request.prompt_ids + row.ids[:-1], decoding.cache_layers(state.cache),
                                         j, self._serving(policy, key))

    def _decode(self, policy: Policy, batch: list[_Request], key: str | None) -> None:
        model = policy.model
        rows = decoding.make_rows(batch)
        rows_of: dict[int, list[decoding.Row]] = {}
        for r in rows:
            rows_of.setdefault(id(r.request), []).append(r)
        self._cpu_share.begin()
        self._set_threads()
        state = self._prefill(policy, rows, key)
        joinable = decoding.can_join(state)
        while True:
            self._set_threads()
            tokens, logprobs = decoding.sample(state)
            keep: list[int] = []
            for j, (row, tok, lp) in enumerate(zip(state.rows, tokens, logprobs, strict=True)):
                if row.finish is not None:  # answered already; rides along until retired
                    continue
                row.ids.append(tok)
                row.logprobs.append(lp)
                if row.request.on_token is not None and self._loop is not None:
                    self._loop.call_soon_threadsafe(row.request.on_token, row.choice, tok, lp)
                self._check_finished(row)
                if row.finish is None and not self._closing:
                    keep.append(j)
                else:
                    row.finish = row.finish or FINISH_ABORT
                    self._row_done(row, rows_of, policy.version)
                    self._store_row(policy, state, j, key)
            if not keep:
                return
            state = decoding.retire(state, keep)
            self.decode_steps += 1
            self.decode_rows += len(keep)
            joiners = self._take(len(keep), key, joining=True) if (
                joinable and self._policies[key] is policy and self._pending and not self._closing) else []
            if not joiners:
                decoding.advance(model, state)
                continue
            self._in_job.extend(joiners)
            self.joined += len(joiners)
            new_rows = decoding.make_rows(joiners)
            for r in new_rows:
                rows_of.setdefault(id(r.request), []).append(r)
            state = self._advance_joining(policy, state, new_rows, key)

    def _set_threads(self) -> None:
        import torch

        n = self._cpu_share.threads()
        if n != torch.get_num_threads():
            torch.set_num_threads(n)

    def _advance_joining(self, policy: Policy, state: decoding.DecodeState, new_rows: list[decoding.Row],
                         key: str | None) -> decoding.DecodeState:
        """Advance the running rows and prefill ``new_rows`` joining them: in one pass over the weights when
        the plain-torch step runs and the joiners' prompts make one block, else in a forward of their own."""
        cache = self.prefix_cache
        finished = [j for j, r in enumerate(state.rows) if r.finish is not None]  # joiners take their rows
        if not isinstance(state.cache, KVBuffer):  # the model's own cache: finished rows leave first
            state = decoding.select(state, [j for j, r in enumerate(state.rows) if r.finish is None])
            finished = []
        if not (cache.enabled and self._kv_reusable and isinstance(state.cache, KVBuffer)):
            decoding.advance(policy.model, state)
            return decoding.join(state, self._prefill(policy, new_rows, key), finished)
        valid = self._serving(policy, key)
        blocks = prefix_cache.plan(new_rows, cache, key, valid)
        if len(blocks) == 1:
            layers, logits = decoding.advance_and_prefill(policy.model, state, blocks[0])
            done: prefix_cache.Done = {}
            prefix_cache.record(blocks[0], layers, logits, cache, key, valid, done)
            joining = prefix_cache.assemble(policy.model, new_rows, done, self.device)
        else:
            decoding.advance(policy.model, state)
            joining = prefix_cache.prefill_blocks(policy.model, new_rows, blocks, self.device, cache, key, valid)
        return decoding.join(state, joining, finished)

    def _check_finished(self, row: decoding.Row) -> None:
        params = row.params
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
