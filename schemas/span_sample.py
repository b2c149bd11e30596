"""A Span record that exercises every branch of the Span schema's layout: the fixture the hand-written
Span encoder (producers/span_encoder.py) checks itself against at start, against fastavro, and its
tests use."""

from __future__ import annotations

from typing import Any


def sample_record(empty: bool = False) -> dict[str, Any]:
    """A Span exercising every branch the fast path writes (used for the self-check and tests)."""
    if empty:
        return {"trace_id": "0" * 32, "span_id": "0" * 16, "parent_span_id": None, "name": "", "kind": "INTERNAL",
                "start_time_ns": 0, "end_time_ns": 0, "status": {"code": "UNSET", "message": None},
                "attributes": {}, "events": [], "resource": {}, "scope": None, "rollout_id": None,
                "attempt_id": None, "task_id": None, "llm": None}
    attrs = {"s": "ü✓", "b": False, "t": True, "i": -(2**63), "j": 2**63 - 1, "k": 300, "d": -1.5e300,
             "n": None, "ab": {"bools": [True, False]}, "al": {"longs": [0, -1, 2**40]},
             "ad": {"doubles": [0.1]}, "as": {"strings": ["x", ""]}, "ae": {"strings": []}}
    return {
        "trace_id": "ab" * 16, "span_id": "cd" * 8, "parent_span_id": "ef" * 8, "name": "n" * 200,
        "kind": "CLIENT", "start_time_ns": 1_700_000_000_123_456_789, "end_time_ns": 1_700_000_001_000_000_000,
        "status": {"code": "ERROR", "message": "boom"}, "attributes": attrs,
        "events": [{"name": "e", "time_ns": 5, "attributes": {"x": 1}}, {"name": "f", "time_ns": 6, "attributes": {}}],
        "resource": {"service.name": "svc", "n": 2}, "scope": {"name": "sc", "version": None},
        "rollout_id": "r", "attempt_id": "a:0", "task_id": "t",
        "llm": {"prompt_token_ids": [1, 2, 150_000], "response_token_ids": [3], "response_logprobs": [-0.5],
                "model": "m", "policy_version": 7, "temperature": 0.7, "top_p": None, "max_tokens": 16,
                "seed": None, "finish_reason": "stop", "input_tokens": 3, "output_tokens": 1},
    }
