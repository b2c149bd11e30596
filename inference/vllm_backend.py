"""The vLLM engine (GPU): vLLM's ``AsyncLLM`` in-process behind the same small Backend interface.

Optional: needs ``pip install 'boltstream[vllm]'`` on a Linux machine with a
CUDA GPU; imported only when ``boltstream serve --backend vllm`` asks for it.
Written against vLLM's V1 API (``vllm.v1.engine.async_llm.AsyncLLM``,
``SamplingParams(logprobs=0, output_kind=DELTA)``, ``LoRARequest``,
``collective_rpc`` with a worker extension class).

* Token ids and logprobs come from the engine (never re-tokenised).
  ``logprobs_mode="processed_logprobs"`` makes vLLM report log-probabilities
  after temperature scaling, i.e. the convention in
  :mod:`boltstream.inference.backend`; unlike the transformers engine, vLLM
  also renormalises over the top-p nucleus when ``top_p < 1`` (identical at
  the RL default ``top_p = 1``).
* LoRA reload: the adapter is registered with ``add_lora``; requests started
  before keep their old ``LoRARequest`` (so they finish on, and are tagged
  with, the old version); new requests get the new one.
* Full reload: new requests wait at a gate, in-flight ones drain, every
  worker loads the safetensors through :class:`CheckpointLoader` (below),
  the prefix cache is reset (its KV entries belong to the old weights), and the gate opens.
* Prefix caching is on (``enable_prefix_caching=True``). vLLM puts a request's
  LoRA adapter (its ``lora_name``, ``lora_int_id`` in older versions) into its KV
  block hashes, and every LoRA version here has its own (``v<N>``, ``N``), so KV of
  one adapter version never serves another.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from boltstream.errors import BoltstreamError, CheckpointError
from boltstream.inference.backend import FINISH_LENGTH, Completion, Generation, SamplingParams, TokenCallback

log = logging.getLogger(__name__)

WORKER_EXTENSION = "boltstream.inference.vllm_backend.CheckpointLoader"
MAX_LORAS = 4


def _import_vllm() -> Any:
    try:
        import vllm
    except ImportError as exc:
        raise BoltstreamError(
            "the vLLM backend needs vLLM: pip install 'boltstream[vllm]' (Linux, CUDA GPU); "
            "on CPU use --backend transformers"
        ) from exc
    return vllm


class VllmBackend:
    """See the module docstring."""

    def __init__(self, engine_args: Any, tokenizer: Any, *, model_name: str, model_path: Path,
                 policy_version: int, max_context: int, lora: bool) -> None:
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.max_context = max_context
        self.lora_enabled = lora
        self._args = engine_args
        self._engine: Any = None
        self._version = policy_version
        self._lora: Any = None
        self._loras: list[Any] = []
        self._full_path = model_path
        self._open = asyncio.Event()
        self._inflight = 0
        self._drained = asyncio.Condition()

    @classmethod
    def create(cls, cfg: Any) -> VllmBackend:
        """Engine arguments from a ServeConfig; the engine itself starts in :meth:`start`."""
        vllm = _import_vllm()
        from transformers import AutoTokenizer

        from boltstream.weights.models import model_dir

        path = model_dir(cfg.model, cfg.seed)
        kwargs: dict[str, Any] = dict(
            model=str(path), tokenizer=str(path), served_model_name=cfg.name, seed=cfg.seed,
            dtype=cfg.dtype or "auto", gpu_memory_utilization=cfg.gpu_memory_utilization,
            logprobs_mode="processed_logprobs", worker_extension_cls=WORKER_EXTENSION,
            max_num_seqs=max(cfg.max_batch_size, 8) * 16,
            # vLLM V1's default too, written out: agents' calls repeat their preamble and earlier turns.
            enable_prefix_caching=True,
        )
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
                   max_context=max_context, lora=cfg.lora)

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
            self._engine.shutdown()
            self._engine = None

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, on_token: TokenCallback | None = None,
        adapter: str | None = None,
    ) -> Generation:
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        self.version_of(adapter)  # refuses a named adapter
        await self._open.wait()
        version, lora = self._version, self._lora  # this request's policy, fixed now
        sp = VSamplingParams(
            n=params.n, temperature=params.temperature, top_p=params.top_p, max_tokens=params.max_tokens,
            stop=list(params.stop) or None, seed=params.seed, logprobs=0, skip_special_tokens=True,
            output_kind=RequestOutputKind.DELTA,
        )
        ids: dict[int, list[int]] = {i: [] for i in range(params.n)}
        lps: dict[int, list[float]] = {i: [] for i in range(params.n)}
        texts: dict[int, list[str]] = {i: [] for i in range(params.n)}
        finish: dict[int, tuple[str, Any]] = {}
        self._inflight += 1
        try:
            stream = self._engine.generate(TokensPrompt(prompt_token_ids=list(prompt_ids)), sp,
                                           uuid.uuid4().hex, lora_request=lora)
            async for out in stream:
                for c in out.outputs:
                    for j, tok in enumerate(c.token_ids):
                        lp = float(c.logprobs[j][tok].logprob) if c.logprobs else float("nan")
                        ids[c.index].append(int(tok))
                        lps[c.index].append(lp)
                        if on_token is not None:
                            on_token(c.index, int(tok), lp)
                    texts[c.index].append(c.text)
                    if c.finish_reason is not None:
                        finish[c.index] = (c.finish_reason, c.stop_reason)
        finally:
            self._inflight -= 1
            async with self._drained:
                self._drained.notify_all()
        completions = []
        for i in range(params.n):
            reason, stop = finish.get(i, (FINISH_LENGTH, None))
            completions.append(Completion(ids[i], lps[i], reason, "".join(texts[i]),
                                          stop if isinstance(stop, str) else None))
        return Generation(list(prompt_ids), completions, version)

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
        if await self._engine.add_lora(request) is False:  # older versions return None on success
            raise CheckpointError(f"vLLM refused the LoRA adapter in {path}")
        self._lora, self._version = request, version
        self._loras.append(request)
        while len(self._loras) > MAX_LORAS - 1:  # keep the adapters recent requests may still use
            await self._engine.remove_lora(self._loras.pop(0).lora_int_id)

    async def _load_full(self, path: Path, version: int) -> None:
        self._open.clear()  # new requests wait; in-flight ones finish on the old weights
        try:
            async with self._drained:
                await self._drained.wait_for(lambda: self._inflight == 0)
            try:
                await self._engine.collective_rpc("load_checkpoint", args=(str(path),))
            except Exception:
                log.error("loading %s failed; restoring %s", path, self._full_path)
                await self._engine.collective_rpc("load_checkpoint", args=(str(self._full_path),))
                raise
            await self._engine.reset_prefix_cache()
            self._full_path, self._version, self._lora = path, version, None
        finally:
            self._open.set()


class CheckpointLoader:
    """vLLM worker extension: runs INSIDE vLLM's worker processes (``self`` is the vLLM Worker there).

    vLLM mixes this class into its GPU worker (``worker_extension_cls``);
    :meth:`VllmBackend._load_full` calls it on every worker through
    ``collective_rpc("load_checkpoint", args=(path,))``. The model's own
    ``load_weights`` maps Hugging Face tensor names onto vLLM's fused layers
    (q/k/v -> qkv_proj, ...) and shards them for tensor parallelism, so any
    ``save_pretrained`` directory of the served architecture works.
    """

    model_runner: Any

    def load_checkpoint(self, path: str) -> int:
        """Stream every tensor of ``path/*.safetensors`` into the model; returns how many were read."""
        from safetensors import safe_open

        files = sorted(Path(path).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no .safetensors files in {path}")
        count = 0

        def weights() -> Iterator[tuple[str, Any]]:
            nonlocal count
            for f in files:
                with safe_open(str(f), framework="pt", device="cpu") as sf:
                    for name in sf.keys():
                        count += 1
                        yield name, sf.get_tensor(name)

        model = self.model_runner.model
        model.load_weights(weights())
        try:
            from vllm.model_executor.model_loader.utils import process_weights_after_loading

            device = next(model.parameters()).device
            process_weights_after_loading(model, self.model_runner.model_config, device)
        except ImportError:  # older/newer layouts: plain (unquantised) weights need no post-processing
            pass
        return count
