"""vLLM serves through the real HTTP app: token ids and log-probs from the engine land on the LLM span,
and they are what a learner recomputes from the same weights."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch

from boltstream.inference.backend import SamplingParams
from boltstream.weights.models import byte_tokenizer
from tests.vllm.conftest import MODEL, Served, reference_logprobs, reference_model

ROLLOUT = {"X-Boltstream-Rollout-Id": "r-1", "X-Boltstream-Attempt-Id": "t-1:0", "X-Boltstream-Task-Id": "t-1"}
PROMPTS = [list(b"The quick brown fox"), list(b"a longer prompt, so that the batch holds two lengths")]


def _chat(**kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 10, **kw}


def _check_span(span: dict[str, Any], version: int) -> None:
    llm = span["llm"]
    assert len(llm["response_logprobs"]) == len(llm["response_token_ids"]) > 0
    assert all(lp <= 0 for lp in llm["response_logprobs"])
    assert llm["policy_version"] == version and llm["model"] == MODEL
    assert span["attributes"]["boltstream.logprobs_mode"] == "temperature_scaled"


def test_chat_is_captured_with_the_engines_token_ids_and_logprobs(served: Served, fresh_sink) -> None:
    version = served.serve_base(0)
    r = served.client.post("/v1/chat/completions", headers=ROLLOUT,
                           json=_chat(n=2, temperature=0.8, logprobs=True, return_token_ids=True))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["system_fingerprint"] == f"boltstream-v{version}"
    assert len(fresh_sink.spans) == 2
    tok = byte_tokenizer()
    for choice, span in zip(body["choices"], fresh_sink.spans, strict=True):
        _check_span(span, version)
        llm = span["llm"]
        assert (span["rollout_id"], span["attempt_id"], span["task_id"]) == ("r-1", "t-1:0", "t-1")
        assert choice["token_ids"] == llm["response_token_ids"].tolist()
        assert [t["logprob"] for t in choice["logprobs"]["content"]] == pytest.approx(
            llm["response_logprobs"].tolist(), rel=1e-6)
        assert llm["prompt_token_ids"].tolist() == body["prompt_token_ids"]
        assert llm["temperature"] == 0.8
        # the text answered is the decoding of exactly the recorded ids
        assert choice["message"]["content"] == tok.decode(choice["token_ids"], skip_special_tokens=True)
    assert body["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in body["choices"])


def _sse(lines: list[str]) -> list[Any]:
    data = [ln[len("data: "):] for ln in lines if ln.startswith("data: ")]
    return [d if d == "[DONE]" else json.loads(d) for d in data]


def test_streamed_answer_is_captured_whole(served: Served, fresh_sink) -> None:
    version = served.serve_base(0)
    with served.client.stream("POST", "/v1/completions", headers=ROLLOUT,
                              json={"model": MODEL, "prompt": "2 + 2 =", "max_tokens": 12, "temperature": 0,
                                    "stream": True, "logprobs": 0}) as r:
        assert r.status_code == 200
        events = _sse(list(r.iter_lines()))
    assert events[-1] == "[DONE]"
    streamed = "".join(e["choices"][0]["text"] for e in events[:-1])
    streamed_lps = [lp for e in events[:-1] if e["choices"][0]["logprobs"]
                    for lp in e["choices"][0]["logprobs"]["token_logprobs"]]
    (span,) = fresh_sink.spans
    _check_span(span, version)
    assert span["name"] == f"text_completion {MODEL}"
    assert byte_tokenizer().decode(span["llm"]["response_token_ids"], skip_special_tokens=True) == streamed
    assert streamed_lps == pytest.approx(span["llm"]["response_logprobs"].tolist(), rel=1e-6)


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.3])
def test_logprobs_match_what_the_learner_recomputes(served: Served, model_dirs, tolerance: float,
                                                    temperature: float) -> None:
    served.serve_base(0)
    reference = reference_model(model_dirs(0))
    gens = [served.generate(p, SamplingParams(temperature, 1.0, 12, n=2)) for p in PROMPTS]
    for prompt, gen in zip(PROMPTS, gens, strict=True):
        for c in gen.completions:
            assert len(c.token_ids) == 12  # the model has no reason to stop: a short one proves less
            assert c.logprobs == pytest.approx(reference_logprobs(reference, prompt, c.token_ids, temperature),
                                               abs=tolerance)


def test_top_p_logprobs_are_renormalised_over_the_nucleus(served: Served, model_dirs) -> None:
    """vLLM's documented difference from the transformers engine (vllm_backend's docstring): with
    top_p < 1 it reports log p(token | nucleus), i.e. the temperature-scaled log-prob minus the log of
    the nucleus's mass."""
    served.serve_base(0)
    reference = reference_model(model_dirs(0))
    temperature, top_p = 0.9, 0.5
    prompt = PROMPTS[0]
    c = served.generate(prompt, SamplingParams(temperature, top_p, 12)).completions[0]
    ids = torch.tensor([prompt + list(c.token_ids)])
    with torch.no_grad():
        logits = reference(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    for step, (tok, lp) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
        logp = torch.log_softmax(logits[step], dim=-1)
        probs, order = logp.exp().sort(descending=True)
        kept = int((probs.cumsum(0) - probs < top_p).sum())  # the smallest prefix reaching top_p
        nucleus = order[:kept]
        assert tok in nucleus.tolist()
        expected = float(logp[tok] - torch.logsumexp(logp[nucleus], 0))
        assert math.isclose(lp, expected, abs_tol=1e-3), (step, lp, expected, float(logp[tok]))


def test_stop_string_cuts_the_text_and_keeps_the_sampled_tokens(served: Served, fresh_sink) -> None:
    served.serve_base(0)
    tok = byte_tokenizer()
    first = served.client.post("/v1/completions", json={
        "model": MODEL, "prompt": "2 + 2 =", "max_tokens": 12, "temperature": 0, "return_token_ids": True}).json()
    ids = first["choices"][0]["token_ids"]
    # a stop string of one ASCII byte the greedy answer reaches after a few tokens
    at = next(i for i in range(2, len(ids)) if 32 <= ids[i] < 127 and ids[i] not in ids[:i])
    stop = chr(ids[at])
    r = served.client.post("/v1/completions", json={
        "model": MODEL, "prompt": "2 + 2 =", "max_tokens": 12, "temperature": 0, "stop": [stop]}).json()
    assert r["choices"][0]["finish_reason"] == "stop"
    assert r["choices"][0]["text"] == tok.decode(ids[:at], skip_special_tokens=True)
    span = fresh_sink.spans[-1]
    assert span["llm"]["response_token_ids"].tolist() == ids[: at + 1]  # up to the token that completed it
    assert span["attributes"]["boltstream.stop_string"] == stop


def test_seeded_requests(served: Served) -> None:
    """On a GPU a seed replays its answer. vLLM's CPU sampler cannot honour per-request seeds (it kills
    its engine on one whose prefill is chunked): there the backend drops them, and seeded requests,
    long prompts included, are answered."""
    served.serve_base(0)
    long_prompt = list(b"x" * 400)  # longer than one KV block (128 tokens on a CPU)
    params = SamplingParams(0.8, 1.0, 6, seed=3, n=2)
    first, second = ([served.generate(p, params) for p in (long_prompt, PROMPTS[0])] for _ in range(2))
    assert all(len(c.token_ids) == 6 for g in first + second for c in g.completions)
    if not served.backend.on_cpu:
        assert [[c.token_ids for c in g.completions] for g in first] == \
            [[c.token_ids for c in g.completions] for g in second]
