"""One realistic, fully populated example per record type, shared by every test that needs records.

Rules that keep these usable as golden fixtures:
* every field is given explicitly, so ``as_lists(decode(encode(x))) == x`` holds with plain ``==``
  (decoded token payloads are ``array.array``: ``boltstream.schemas.packed.as_lists`` turns them into lists);
* values are fixed (no clocks, no randomness);
* ``float`` fields (logprobs) hold values exact in 32 bits (-0.5, -0.125, ...), because Avro ``float``
  is single precision and any other value would come back rounded.

Import as ``from tests.unit.schemas.record_examples import EXAMPLES`` (or copy a dict and change it:
``{**EXAMPLES["Span"], "span_id": ...}``); treat the dicts as read-only.
"""

from __future__ import annotations

from typing import Any

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
ROOT_SPAN_ID = "00f067aa0ba902b7"
LLM_SPAN_ID = "53995c3f42cd8ad8"
ROLLOUT_ID = "ro-7f3a9c1e"
ATTEMPT_ID = "ro-7f3a9c1e:0"
TASK_ID = "gsm8k-00042"
T0 = 1_732_250_000_000_000_000  # 2024-11-22T04:33:20Z in ns

PROMPT_IDS = [1, 9690, 198, 2683, 314, 28, 15, 540, 22, 30, 2]
RESPONSE_IDS = [1837, 314, 28, 33, 2]
RESPONSE_LOGPROBS = [-0.5, -0.125, -1.25, -0.0625, -0.015625]

SPAN: dict[str, Any] = {
    "trace_id": TRACE_ID,
    "span_id": LLM_SPAN_ID,
    "parent_span_id": ROOT_SPAN_ID,
    "name": "chat SmolLM2-135M-Instruct",
    "kind": "CLIENT",
    "start_time_ns": T0 + 1_000_000,
    "end_time_ns": T0 + 181_000_000,
    "status": {"code": "OK", "message": None},
    "attributes": {
        "gen_ai.operation.name": "chat",
        "gen_ai.system": "openai",
        "gen_ai.request.model": "SmolLM2-135M-Instruct",
        "gen_ai.request.temperature": 0.7,
        "gen_ai.usage.input_tokens": 11,
        "gen_ai.usage.output_tokens": 5,
        "gen_ai.response.finish_reasons": {"strings": ["stop"]},
        "boltstream.rollout_id": ROLLOUT_ID,
        "boltstream.agent_name": "calculator",
        "llm.is_streaming": False,
        "boltstream.stop_token_ids": {"longs": [2, 0]},
        "boltstream.scores": {"doubles": [0.25, 1.5]},
        "boltstream.flags": {"bools": [True, False]},
        "http.response.header.x-request-id": None,
    },
    "events": [
        {
            "name": "gen_ai.content.completion",
            "time_ns": T0 + 180_000_000,
            "attributes": {"gen_ai.completion": "x = 3", "index": 0},
        }
    ],
    "resource": {
        "service.name": "calculator-agent",
        "telemetry.sdk.language": "python",
        "process.pid": 4242,
    },
    "scope": {"name": "boltstream.inference", "version": "0.1.0"},
    "rollout_id": ROLLOUT_ID,
    "attempt_id": ATTEMPT_ID,
    "task_id": TASK_ID,
    "llm": {
        "prompt_token_ids": PROMPT_IDS,
        "response_token_ids": RESPONSE_IDS,
        "response_logprobs": RESPONSE_LOGPROBS,
        "model": "SmolLM2-135M-Instruct",
        "policy_version": 3,
        "temperature": 0.7,
        "top_p": 0.95,
        "max_tokens": 256,
        "seed": 1234,
        "finish_reason": "stop",
        "input_tokens": 11,
        "output_tokens": 5,
    },
}

TASK: dict[str, Any] = {
    "task_id": TASK_ID,
    "payload_json": '{"question": "What is 1 + 2?", "answer": "3"}',
    "split": "train",
    "group_size": 4,
    "created_ns": T0,
}

REWARD_TOOL_OK: dict[str, Any] = {"name": "air.tool_ok", "value": 0.1, "source": "air:tool_success"}

TRAJECTORY: dict[str, Any] = {
    "rollout_id": ROLLOUT_ID,
    "attempt_id": ATTEMPT_ID,
    "task_id": TASK_ID,
    "turns": [
        {
            "call_index": 0,
            "span_id": LLM_SPAN_ID,
            "prompt_token_ids": PROMPT_IDS,
            "response_token_ids": RESPONSE_IDS,
            "response_logprobs": RESPONSE_LOGPROBS,
            "policy_version": 3,
            "agent_name": "calculator",
            "model": "SmolLM2-135M-Instruct",
            "start_time_ns": T0 + 1_000_000,
            "rewards": [REWARD_TOOL_OK],
            "temperature": 0.7,
        },
        {
            "call_index": 1,
            "span_id": "a3ce929d0e0e4736",
            "prompt_token_ids": [*PROMPT_IDS, *RESPONSE_IDS, 13, 2],
            "response_token_ids": [33, 2],
            "response_logprobs": [-0.25, -0.03125],
            "policy_version": 3,
            "agent_name": "calculator",
            "model": None,
            "start_time_ns": T0 + 300_000_000,
            "rewards": [],
            "temperature": None,
        },
    ],
    "final_reward": 1.0,
    "rewards": [
        {"name": "correct", "value": 1.0, "source": ROOT_SPAN_ID},
        {"name": "format", "value": 0.5, "source": None},
    ],
    "status": "ok",
    "error": None,
    "start_time_ns": T0,
    "end_time_ns": T0 + 450_000_000,
    "span_count": 6,
    "dropped_calls": [
        {"span_id": "e0e4736a3ce929d0", "reason": "no token ids (not served by an inference worker)"}
    ],
}

SAMPLE: dict[str, Any] = {
    "sample_id": f"{ATTEMPT_ID}:0",
    "rollout_id": ROLLOUT_ID,
    "attempt_id": ATTEMPT_ID,
    "task_id": TASK_ID,
    "call_index": 0,
    "token_ids": [*PROMPT_IDS, *RESPONSE_IDS],
    "prompt_length": len(PROMPT_IDS),
    "loss_mask": [False] * len(PROMPT_IDS) + [True] * len(RESPONSE_IDS),
    "behaviour_logprobs": [0.0] * len(PROMPT_IDS) + RESPONSE_LOGPROBS,
    "advantage": 0.8660254037844386,
    "loss_weight": 0.5,
    "reward": 1.1,
    "policy_version": 3,
    "agent_name": "calculator",
    "temperature": 0.7,
}

TRAINING_BATCH: dict[str, Any] = {
    "batch_id": f"{TASK_ID}:3",
    "task_id": TASK_ID,
    "part": 0,
    "num_parts": 1,
    "samples": [
        SAMPLE,
        {
            **SAMPLE,
            "sample_id": "ro-7f3a9c1e:1:0",
            "attempt_id": "ro-7f3a9c1e:1",
            "advantage": -0.8660254037844386,
            "reward": 0.0,
            "loss_weight": 1.0,
            "agent_name": None,
        },
    ],
    "group_size": 2,
    "num_rollouts": 2,
    "reward_mean": 0.55,
    "reward_std": 0.55,
    "rollout_ids": [ROLLOUT_ID],
    "complete": True,
    "created_ns": T0 + 500_000_000,
}

CHECKPOINT_EVENT: dict[str, Any] = {
    "model": "SmolLM2-135M-Instruct",
    "version": 4,
    "uri": "s3://boltstream/checkpoints/SmolLM2-135M-Instruct/v000004/",
    "manifest_uri": "s3://boltstream/checkpoints/SmolLM2-135M-Instruct/v000004/manifest.json",
    "kind": "full",
    "files": [
        {
            "path": "model.safetensors",
            "sha256": "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08",
            "size": 269_060_552,
        },
        {
            "path": "config.json",
            "sha256": "60303ae22b998861bce3b28f33eec1be758a213c86c93c076dbe9f558c11c752",
            "size": 861,
        },
    ],
    "base_model": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "learner_step": 40,
    "offsets": [
        {"topic": "boltstream.batches", "partition": 0, "offset": 117},
        {"topic": "boltstream.batches", "partition": 1, "offset": 98},
    ],
    "created_ns": T0 + 900_000_000,
}

DEAD_LETTER: dict[str, Any] = {
    "reason": "topic 'boltstream.spans': wrong magic byte 0x7b",
    "component": "stream",
    "topic": "boltstream.spans",
    "partition": 2,
    "offset": 1234,
    "key": ROLLOUT_ID.encode(),
    "value": b'{"not": "avro"}',
    "timestamp_ns": T0 + 2_000_000_000,
}

REPLAY_DONE: dict[str, Any] = {
    "namespace": "exp1.",
    "source_topic": "boltstream.spans",
    "range_from": "earliest",
    "range_to": "now",
    "source_offsets": [{"partition": 0, "start": 0, "end": 622}, {"partition": 1, "start": 0, "end": 0}],
    "outputs": [{"topic": "exp1.batches", "partition": 0, "end": 32}, {"topic": "exp1.trajectories", "partition": 0,
                                                                       "end": 128}],
    "settings_json": '{"call_credit": "episode", "group_size": 4}',
    "counts": {"spans": 622, "samples": 246},
    "finished_ns": T0 + 3_000_000_000,
}

#: record name -> a fully populated example (the golden fixtures are these, encoded).
EXAMPLES: dict[str, dict[str, Any]] = {
    "Task": TASK,
    "Span": SPAN,
    "Trajectory": TRAJECTORY,
    "Sample": SAMPLE,
    "TrainingBatch": TRAINING_BATCH,
    "CheckpointEvent": CHECKPOINT_EVENT,
    "DeadLetter": DEAD_LETTER,
    "ReplayDone": REPLAY_DONE,
}

#: record name -> only the fields without a schema default (what a producer must always set).
MINIMAL: dict[str, dict[str, Any]] = {
    "Task": {"task_id": TASK_ID, "payload_json": "{}"},
    "Span": {
        "trace_id": TRACE_ID,
        "span_id": ROOT_SPAN_ID,
        "name": "boltstream.rollout",
        "start_time_ns": T0,
        "end_time_ns": T0 + 1,
    },
    "Trajectory": {"rollout_id": ROLLOUT_ID, "attempt_id": ATTEMPT_ID, "task_id": TASK_ID, "turns": []},
    "Sample": {
        "sample_id": f"{ATTEMPT_ID}:0",
        "rollout_id": ROLLOUT_ID,
        "attempt_id": ATTEMPT_ID,
        "task_id": TASK_ID,
        "call_index": 0,
        "token_ids": [1, 2],
        "prompt_length": 1,
        "loss_mask": [False, True],
        "behaviour_logprobs": [0.0, -0.5],
        "advantage": 0.0,
    },
    "TrainingBatch": {
        "batch_id": "b",
        "task_id": TASK_ID,
        "samples": [],
        "group_size": 4,
        "num_rollouts": 0,
        "reward_mean": 0.0,
        "reward_std": 0.0,
    },
    "CheckpointEvent": {
        "model": "m",
        "version": 1,
        "uri": "s3://b/m/v1/",
        "manifest_uri": "s3://b/m/v1/manifest.json",
        "files": [],
        "base_model": "m",
        "learner_step": 0,
    },
    "DeadLetter": {"reason": "r", "component": "stream", "topic": "boltstream.spans", "value": b""},
    "ReplayDone": {"namespace": "r.", "source_topic": "boltstream.spans", "range_from": "earliest", "range_to": "now",
                   "source_offsets": [], "outputs": [], "settings_json": "{}", "counts": {}, "finished_ns": 0},
}


def _without_temperature(record: dict[str, Any]) -> dict[str, Any]:
    return {**record, "temperature": None}


#: version -> record name -> what that version's fixture (``tests/golden/v<N>/``) decodes to today: the
#: example as it was then, with the fields added since filled from their defaults.
#: The token payloads moved into packed bytes fields (Span v2, the others v3) without changing what the
#: record dicts hold, so the v1 span and the v2 fixtures decode to today's examples unchanged.
OLDER_VERSIONS: dict[int, dict[str, dict[str, Any]]] = {
    1: {
        "Span": SPAN,
        "Trajectory": {**TRAJECTORY, "turns": [_without_temperature(t) for t in TRAJECTORY["turns"]]},
        "Sample": _without_temperature(SAMPLE),
        "TrainingBatch": {**TRAINING_BATCH, "samples": [_without_temperature(s) for s in TRAINING_BATCH["samples"]]},
    },
    2: {
        "Trajectory": TRAJECTORY,
        "Sample": SAMPLE,
        "TrainingBatch": TRAINING_BATCH,
    },
}
