"""The one small interface every generation engine implements (transformers on CPU, vLLM on GPU).

Why so small: the HTTP layer, span capture and checkpoint reload are the same
for every engine; an engine only has to turn prompt token ids into sampled
token ids with their log-probabilities, tag them with the policy version that
produced them, and swap weights without dropping requests.

Log-probability convention (both engines, recorded in every LLM span as
``boltstream.logprobs_mode = "temperature_scaled"``): the log-probability of
each SAMPLED token under ``log_softmax(logits / T)`` with the request's
temperature T (T = 1 for greedy, T = 0), computed BEFORE top-p truncation.
That is exactly what a learner recomputes from the recorded token ids and
temperature (``log_softmax(model(x).logits / T)``), so the PPO/GRPO importance
ratio starts at 1 on-policy; with the usual RL setting top_p = 1 it is also
exactly the distribution the token was drawn from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

LOGPROBS_MODE = "temperature_scaled"
FINISH_STOP = "stop"
FINISH_LENGTH = "length"
FINISH_ABORT = "abort"

# Called on the event loop for every sampled token: (choice index, token id, logprob).
TokenCallback = Callable[[int, int, float], None]


@dataclass(frozen=True)
class SamplingParams:
    """Validated sampling parameters of one request (``n`` completions of one prompt)."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    seed: int | None = None
    n: int = 1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Completion:
    """One sampled continuation: exactly what the engine produced, never re-tokenised.

    ``token_ids`` include a sampled end-of-turn token (the learner must learn to
    stop) and every token up to the one that completed a stop string; ``text``
    is their decoding without special tokens, cut before a matched stop string.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    text: str
    stop_string: str | None = None


@dataclass
class Generation:
    """All completions of one request and the policy version (of ``adapter``, when the worker serves
    several) whose weights produced every one of them."""

    prompt_token_ids: list[int]
    completions: list[Completion]
    policy_version: int
    adapter: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Backend(Protocol):
    """What the server needs from an engine."""

    model_name: str
    tokenizer: Any
    max_context: int
    adapters: tuple[str, ...]  # named LoRA adapters on the shared base (empty: one policy)

    @property
    def policy_version(self) -> int:
        """Version of the weights new requests are served with (the default adapter's, with adapters)."""
        ...

    def version_of(self, adapter: str | None) -> int:
        """Version ``adapter`` serves now (None: the default); ValueError for an adapter not served."""
        ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, on_token: TokenCallback | None = None,
        adapter: str | None = None,
    ) -> Generation:
        """Sample ``params.n`` completions with ``adapter`` (None: the default); requests that started
        before a reload finish on the old weights."""
        ...

    async def load_weights(self, path: Path, kind: str, version: int, adapter: str | None = None) -> None:
        """Serve ``path`` (an HF model dir for ``full``, a PEFT adapter dir for ``lora``) as ``version``
        of ``adapter`` (None: the one policy of a worker without named adapters).

        Raises on anything unusable; the previous version then stays loaded.
        """
        ...


def cut_at_stop(text: str, stops: tuple[str, ...]) -> tuple[str, str | None]:
    """(text before the earliest stop string, that stop string) or (text, None)."""
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return (text, None) if best is None else (text[: best[0]], best[1])
