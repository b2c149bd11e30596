"""``boltstream serve``: run one OpenAI-compatible inference worker with token capture and hot reload.

Configuration follows boltstream's rule (explicit flag > ``BOLTSTREAM_SERVE_*``
env var > default; broker/S3 settings from ``BOLTSTREAM_*`` or the embedded
stack's state file). Once the worker listens it writes one line to stdout,
``boltstream serve: ready on http://HOST:PORT ...``, so scripts and tests can
wait for readiness without polling (``--port 0`` picks a free port and that
line says which).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, ClassVar

from boltstream.allocator import keep_heap_for_requests
from boltstream.config import Settings, flags_from_dataclass, load, opt
from boltstream.errors import ConfigError

log = logging.getLogger(__name__)

BACKENDS = ("transformers", "vllm")
DTYPES = ("auto", "float32", "bfloat16", "float16")


def valid_rollout_temperature(t: float) -> bool:
    """(0, 2]: what the API accepts, less greedy (every attempt of a task would answer alike)."""
    return 0.0 < t <= 2.0


@dataclasses.dataclass(frozen=True)
class ServeConfig:
    """Everything ``boltstream serve`` needs; see ``boltstream serve --help``."""

    env_prefix: ClassVar[str] = "BOLTSTREAM_SERVE_"

    settings: Settings = dataclasses.field(default_factory=Settings)
    model: str = opt("smollm2", "smollm2 | tiny | an HF model directory | a .gguf file")
    served_model_name: str | None = opt(None, "name clients use in 'model' (default: derived from --model)")
    strict_model_names: bool = opt(False, "answer 404 model_not_found to a 'model' that is neither the served "
                                          "name nor an adapter (default: serve any other name as an alias "
                                          "of the policy)")
    host: str = opt("127.0.0.1", "listen address")
    port: int = opt(8000, "listen port (0: any free port)")
    backend: str = opt("transformers", "transformers (CPU) or vllm (GPU, extra [vllm])", choices=BACKENDS)
    lora: bool = opt(False, "expect LoRA checkpoints (vLLM: enable_lora)")
    max_lora_rank: int = opt(64, "vLLM: largest LoRA rank to accept")
    dtype: str | None = opt(None, "torch dtype of the weights: float32, bfloat16, float16, or auto (bfloat16 where "
                                  "the device computes it natively, e.g. a CPU with AVX512-BF16; else the "
                                  "checkpoint's) (default: the checkpoint's)", choices=DTYPES)
    device: str = opt("cpu", "transformers backend device")
    seed: int = opt(0, "seed of the tiny model's random weights")
    max_batch_size: int = opt(32, "most sequences decoded together")
    batch_window_ms: float = opt(2.0, "how long to collect concurrent requests into a batch")
    max_context: int | None = opt(None, "context limit in tokens (default: the model's)")
    threads: int = opt(0, "transformers backend on CPU: torch threads of the generation thread (0: every CPU this "
                          "process may use, fewer while other processes keep some busy)")
    merge_lora: bool = opt(True, "transformers backend: serve the policy's LoRA checkpoints merged into a copy of "
                                 "the base weights (faster decoding; one more copy of the weights; several "
                                 "--adapters are always served unmerged)")
    prefix_cache_mib: int = opt(256, "transformers backend: MiB of prompt KV kept for reuse by later requests "
                                     "(0: off; the vLLM backend uses vLLM's own prefix caching)")
    default_max_tokens: int = opt(256, "max_tokens when a request gives none")
    rollout_temperature: float | None = opt(None, "sample every captured call (a training rollout's) at this "
                                                  "temperature, whatever the request asks; calls that are not "
                                                  "captured, e.g. an evaluation's, keep theirs (default: the "
                                                  "request's)")
    policy_version: int = opt(0, "version number of the weights loaded at start")
    capture: bool = opt(True, "write LLM spans (--no-capture: no broker needed, NOT for training)")
    spool_dir: str = opt("auto", "spool mode: LLM spans go to this on-disk spool first and the worker "
                                 "keeps answering while the broker is down ('auto': $XDG_STATE_HOME/"
                                 "boltstream/spool/<topic>, i.e. ~/.local/state/...; 'off': ack before "
                                 "answer, 503 capture_failed without a broker)")
    spool_fsync: bool = opt(False, "fsync the spool per response (survives a machine crash, not just a "
                                   "worker crash)")
    spool_ack_timeout_s: float = opt(2.0, "spool mode: longest wait for the broker's ack before answering "
                                          "from the spool")
    reload: bool = opt(True, "follow the checkpoints topic and reload new versions")
    checkpoint_model: str | None = opt(None, "model name in checkpoint events to follow (default: the served "
                                             "name)")
    adapters: tuple[str, ...] = opt((), "serve these named LoRA adapters on the one base model, "
                                        "NAME[=CHECKPOINT_MODEL],... (each follows its own checkpoint model, "
                                        "default its name; the first is the default adapter; transformers "
                                        "backend only)")
    adapter_agents: tuple[str, ...] = opt((), "ADAPTER=REGEX,...: agent names (baggage boltstream.agent_name) "
                                              "that pick an adapter (default: the adapter's own name)")
    workdir: str | None = opt(None, "where downloaded checkpoints go (default: a temporary directory)")
    gpu_memory_utilization: float = opt(0.85, "vLLM: fraction of GPU memory to use")
    log_level: str = opt("info", "debug | info | warning")
    api_key: str | None = opt(None, "clients must send 'Authorization: Bearer <key>' on /v1/... (env only: "
                                    "argv is visible to every user of the machine)", secret=True)
    api_key_file: str | None = opt(None, "file holding the API key (instead of BOLTSTREAM_SERVE_API_KEY)")

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError("backend", self.backend, f"one of {', '.join(BACKENDS)}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ConfigError("dtype", self.dtype, f"one of {', '.join(DTYPES)}")
        if not 0 <= self.port <= 65535:
            raise ConfigError("port", self.port, "must be 0-65535 (0: any free port)")
        if self.max_batch_size < 1:
            raise ConfigError("max_batch_size", self.max_batch_size, "must be >= 1")
        if self.threads < 0:
            raise ConfigError("threads", self.threads, "must be >= 0 (0: as many as the idle CPUs)")
        if self.prefix_cache_mib < 0:
            raise ConfigError("prefix_cache_mib", self.prefix_cache_mib, "must be >= 0 (0: no prefix cache)")
        if self.default_max_tokens < 1:
            raise ConfigError("default_max_tokens", self.default_max_tokens, "must be >= 1")
        if self.rollout_temperature is not None and not valid_rollout_temperature(self.rollout_temperature):
            raise ConfigError("rollout_temperature", self.rollout_temperature, "must be in (0, 2] (a training "
                              "rollout explores: a greedy one gives every attempt of a task the same answer)")
        if self.api_key_file is not None:
            if self.api_key:
                raise ConfigError("api_key_file", self.api_key_file, "give the API key by env or by file, not both")
            try:
                key = Path(self.api_key_file).read_text().strip()
            except OSError as exc:
                raise ConfigError("api_key_file", self.api_key_file, f"unreadable: {exc.strerror}") from exc
            if not key:
                raise ConfigError("api_key_file", self.api_key_file, "the file is empty")
            object.__setattr__(self, "api_key", key)
        specs = self.adapter_specs  # every mistake in --adapters / --adapter-agents fails at start
        if specs and self.backend != "transformers":
            raise ConfigError("adapters", ",".join(self.adapters), "several adapters are served by the transformers "
                              "backend only (the vLLM backend serves one policy)")
        if specs and self.checkpoint_model:
            raise ConfigError("checkpoint_model", self.checkpoint_model, "with --adapters each adapter names its "
                              "checkpoint model (NAME=CHECKPOINT_MODEL)")

    @property
    def adapter_specs(self) -> tuple[Any, ...]:
        """The parsed ``--adapters`` (AdapterSpec), empty for a worker serving one policy."""
        from boltstream.inference.adapters import parse_adapters

        if not self.adapters:
            if self.adapter_agents:
                raise ConfigError("adapter_agents", ",".join(self.adapter_agents), "needs --adapters")
            return ()
        return parse_adapters(self.adapters, self.adapter_agents)

    @property
    def name(self) -> str:
        """The model name clients send and checkpoint events carry."""
        if self.served_model_name:
            return self.served_model_name
        p = Path(self.model)
        return self.model if len(p.parts) == 1 and not p.suffix else p.stem


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="boltstream serve", description=__doc__.split("\n\n")[0])
    flags_from_dataclass(p, ServeConfig)
    return p


def build_backend(cfg: ServeConfig) -> Any:
    """The engine for ``cfg.backend`` (vLLM imported only when asked for)."""
    if cfg.backend == "vllm":
        from boltstream.inference.vllm_backend import VllmBackend

        return VllmBackend.create(cfg)
    import transformers

    from boltstream.inference.transformers_backend import TransformersBackend
    from boltstream.weights.models import cpu_facts, describe_cpu, load_model, resolve_dtype

    transformers.utils.logging.disable_progress_bar()
    dtype = resolve_dtype(cfg.dtype, cfg.device)
    if cfg.dtype == "auto":
        log.info("--dtype auto: serving in %s", dtype or "the checkpoint's dtype")
    model, tokenizer = load_model(cfg.model, dtype=dtype, device=cfg.device, seed=cfg.seed)
    log.info("serving in %s on %s", next(model.parameters()).dtype, describe_cpu(cpu_facts()))
    return TransformersBackend(model, tokenizer, model_name=cfg.name, policy_version=cfg.policy_version,
                               max_batch_size=cfg.max_batch_size, batch_window_ms=cfg.batch_window_ms,
                               max_context=cfg.max_context, adapters=tuple(a.name for a in cfg.adapter_specs),
                               prefix_cache_bytes=cfg.prefix_cache_mib << 20, merge_lora=cfg.merge_lora,
                               threads=cfg.threads)


def build_app(cfg: ServeConfig, workdir: Path) -> Any:
    """Backend + span sink + checkpoint follower wired into the HTTP app."""
    from boltstream.inference.capture import KafkaSpanSink, MemorySpanSink
    from boltstream.inference.metrics import Metrics
    from boltstream.inference.reload import CheckpointFollower, ReloadStatus
    from boltstream.inference.server import create_app

    backend = build_backend(cfg)
    adapters = cfg.adapter_specs
    metrics = Metrics(cfg.name)
    status = ReloadStatus()
    if getattr(backend, "prefix_cache", None) is not None:
        metrics.watch_prefix_cache(backend.prefix_cache.stats)
    if hasattr(backend, "engine_stats"):
        metrics.watch_engine(backend.engine_stats)
    if cfg.capture:
        from boltstream.producers.spool import spool_directory

        spool_dir = spool_directory(cfg.spool_dir, cfg.settings.topic("spans"))
        sink: Any = KafkaSpanSink(cfg.settings, spool_dir=spool_dir, fsync=cfg.spool_fsync,
                                  ack_timeout=cfg.spool_ack_timeout_s)
        if spool_dir is not None:
            metrics.watch_spool(sink.spool_stats)
    else:
        sink = MemorySpanSink(keep=0)
    follower = None
    if cfg.reload:
        targets: dict[str, str | None] = {a.checkpoint_model: a.name for a in adapters} or {
            cfg.checkpoint_model or cfg.name: None}
        follower = CheckpointFollower(cfg.settings, backend, targets=targets, workdir=workdir, status=status,
                                      metrics=metrics)
    names = tuple(dict.fromkeys((cfg.name, cfg.model)))
    return create_app(backend, sink=sink, served_names=names, follower=follower, status=status,
                      metrics=metrics, default_max_tokens=cfg.default_max_tokens, api_key=cfg.api_key,
                      adapters=adapters, strict_model_names=cfg.strict_model_names,
                      rollout_temperature=cfg.rollout_temperature)


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    cfg = load(ServeConfig, explicit=vars(args))
    logging.getLogger().setLevel(cfg.log_level.upper())
    keep_heap_for_requests()  # boltstream/allocator.py: per-call buffers stay in the heap
    import uvicorn

    workdir = Path(cfg.workdir) if cfg.workdir else Path(tempfile.mkdtemp(prefix="boltstream-serve-"))

    def remove_workdir() -> None:
        if not cfg.workdir:
            shutil.rmtree(workdir, ignore_errors=True)

    class _Server(uvicorn.Server):
        """Announces readiness on stdout once the socket is bound and the app has started."""

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started and self.servers:
                host, port = self.servers[0].sockets[0].getsockname()[:2]
                sys.stdout.write(f"boltstream serve: ready on http://{host}:{port} (model {cfg.name}, "
                                 f"backend {cfg.backend})\n")
                sys.stdout.flush()

        async def shutdown(self, sockets: Any = None) -> None:
            # uvicorn re-raises a caught SIGTERM/SIGINT once serve() is done, which ends the process
            # before any `finally` after it: downloaded checkpoints are removed here, while it can.
            try:
                await app.state.reload_status.close()  # long polls of /health answer now, not at their timeout
                await super().shutdown(sockets)
            finally:
                remove_workdir()

    try:
        app = build_app(cfg, workdir)
        server = _Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level.lower(),
                                        lifespan="on", access_log=False))
        asyncio.run(server.serve())
    finally:
        remove_workdir()
    return 0 if server.started else 1
