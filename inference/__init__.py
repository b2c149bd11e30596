"""OpenAI-compatible inference workers that record what the policy sampled, and reload checkpoints live.

``boltstream serve`` (:mod:`boltstream.inference.cli`) runs one worker: an
OpenAI HTTP API (:mod:`~boltstream.inference.server`) over an engine behind
one small interface (:mod:`~boltstream.inference.backend`: transformers on
CPU, vLLM on GPU). Every completion becomes an LLM span with token ids,
logprobs and the policy version (:mod:`~boltstream.inference.capture`),
acknowledged by the broker before the client gets its answer; new checkpoints
arrive over the ``checkpoints`` topic (:mod:`~boltstream.inference.reload`).

Heavy dependencies (torch, transformers, vLLM) are imported only by the
modules that need them, so importing this package is cheap.
"""
