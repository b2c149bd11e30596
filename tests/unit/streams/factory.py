"""Hand-built Span / Trajectory dicts for the stream-core tests, shaped exactly like the Avro schemas."""

from __future__ import annotations

from typing import Any

TRACE = "0" * 31 + "1"


def wrap(value: Any) -> Any:
    """A Python attribute value as the Span schema's union stores it (arrays become one-key records)."""
    if isinstance(value, list | tuple):
        if all(isinstance(v, bool) for v in value):
            return {"bools": list(value)}
        if all(isinstance(v, int) for v in value):
            return {"longs": list(value)}
        if all(isinstance(v, float | int) for v in value):
            return {"doubles": [float(v) for v in value]}
        return {"strings": [str(v) for v in value]}
    return value


def span(
    span_id: str,
    *,
    name: str = "step",
    parent: str | None = "root",
    start: int = 0,
    end: int = 1,
    status: str = "UNSET",
    message: str | None = None,
    attrs: dict[str, Any] | None = None,
    events: list[dict[str, Any]] | None = None,
    llm: dict[str, Any] | None = None,
    rollout_id: str | None = "r1",
    attempt_id: str | None = "t1:0",
    task_id: str | None = "t1",
) -> dict[str, Any]:
    """A finished span record."""
    return {
        "trace_id": TRACE,
        "span_id": span_id,
        "parent_span_id": parent,
        "name": name,
        "kind": "INTERNAL",
        "start_time_ns": start,
        "end_time_ns": end,
        "status": {"code": status, "message": message},
        "attributes": {k: wrap(v) for k, v in (attrs or {}).items()},
        "events": events or [],
        "resource": {},
        "scope": None,
        "rollout_id": rollout_id,
        "attempt_id": attempt_id,
        "task_id": task_id,
        "llm": llm,
    }


def llm_block(
    prompt: list[int],
    response: list[int],
    logprobs: list[float] | None = None,
    *,
    policy_version: int = 3,
    model: str | None = "m",
    temperature: float | None = None,
) -> dict[str, Any]:
    """The typed ``llm`` block the inference worker writes; logprobs default to -0.5 per response token."""
    return {
        "prompt_token_ids": list(prompt),
        "response_token_ids": list(response),
        "response_logprobs": [-0.5] * len(response) if logprobs is None else list(logprobs),
        "model": model,
        "policy_version": policy_version,
        "temperature": temperature,
        "top_p": None,
        "max_tokens": None,
        "seed": None,
        "finish_reason": "stop",
        "input_tokens": None,
        "output_tokens": None,
    }


def llm_span(
    span_id: str,
    prompt: list[int],
    response: list[int],
    *,
    start: int,
    end: int,
    parent: str | None = "root",
    logprobs: list[float] | None = None,
    policy_version: int = 3,
    temperature: float | None = None,
    **kw: Any,
) -> dict[str, Any]:
    """An LLM span as the inference worker records it."""
    return {**span(
        span_id,
        name="chat m",
        parent=parent,
        start=start,
        end=end,
        llm=llm_block(prompt, response, logprobs, policy_version=policy_version, temperature=temperature),
        **kw,
    ), "scope": {"name": "boltstream.inference", "version": None}}


def root_span(
    span_id: str = "root",
    *,
    start: int = 0,
    end: int = 1000,
    status: str | None = "ok",
    error: str | None = None,
    code: str = "OK",
    rollout_id: str = "r1",
    attempt_id: str = "t1:0",
    task_id: str = "t1",
) -> dict[str, Any]:
    """The runner's ``boltstream.rollout`` span."""
    attrs: dict[str, Any] = {
        "boltstream.rollout_id": rollout_id,
        "boltstream.attempt_id": attempt_id,
        "boltstream.task_id": task_id,
    }
    if status is not None:
        attrs["boltstream.status"] = status
    if error is not None:
        attrs["boltstream.error"] = error
    return span(
        span_id,
        name="boltstream.rollout",
        parent=None,
        start=start,
        end=end,
        status=code,
        attrs=attrs,
        rollout_id=rollout_id,
        attempt_id=attempt_id,
        task_id=task_id,
    )


def reward_span(
    span_id: str,
    value: float,
    *,
    at: int,
    name: str = "reward",
    final: bool = False,
    primary: bool = False,
    parent: str = "root",
) -> dict[str, Any]:
    """A zero-length ``boltstream.reward`` span (``emit_reward`` / the runner)."""
    return span(
        span_id,
        name="boltstream.reward",
        parent=parent,
        start=at,
        end=at,
        attrs={
            "boltstream.reward.name": name,
            "boltstream.reward.value": float(value),
            "boltstream.reward.final": final,
            "boltstream.reward.primary": primary,
        },
    )


def tool_span(
    span_id: str,
    *,
    start: int,
    end: int,
    parent: str = "root",
    error: bool = False,
    message: str | None = None,
    arguments: str | None = None,
    attrs: dict[str, Any] | None = None,
    **kw: Any,
) -> dict[str, Any]:
    """A GenAI ``execute_tool`` span."""
    all_attrs: dict[str, Any] = {"gen_ai.operation.name": "execute_tool", "gen_ai.tool.name": "calc"}
    if arguments is not None:
        all_attrs["gen_ai.tool.call.arguments"] = arguments
    all_attrs.update(attrs or {})
    return span(
        span_id,
        name="execute_tool calc",
        parent=parent,
        start=start,
        end=end,
        status="ERROR" if error else "OK",
        message=message,
        attrs=all_attrs,
        **kw,
    )


def agent_span(span_id: str, agent: str, *, start: int, end: int, parent: str = "root") -> dict[str, Any]:
    """A GenAI ``invoke_agent`` span naming its agent."""
    return span(
        span_id,
        name=f"invoke_agent {agent}",
        parent=parent,
        start=start,
        end=end,
        attrs={"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": agent},
    )


def turn(
    call_index: int,
    prompt: list[int],
    response: list[int],
    *,
    logprobs: list[float] | None = None,
    rewards: list[float] | None = None,
    policy_version: int = 3,
    agent: str | None = None,
    temperature: float | None = None,
) -> dict[str, Any]:
    """A Trajectory Turn."""
    return {
        "call_index": call_index,
        "span_id": f"s{call_index}",
        "prompt_token_ids": list(prompt),
        "response_token_ids": list(response),
        "response_logprobs": [-0.5] * len(response) if logprobs is None else list(logprobs),
        "policy_version": policy_version,
        "agent_name": agent,
        "model": "m",
        "start_time_ns": call_index * 100,
        "rewards": [{"name": "air", "value": float(v), "source": None} for v in (rewards or [])],
        "temperature": temperature,
    }


def trajectory(
    attempt_id: str,
    turns: list[dict[str, Any]],
    *,
    final_reward: float | None = 1.0,
    status: str = "ok",
    rollout_id: str | None = None,
    task_id: str = "t1",
) -> dict[str, Any]:
    """A Trajectory record."""
    return {
        "rollout_id": rollout_id or f"r-{attempt_id}",
        "attempt_id": attempt_id,
        "task_id": task_id,
        "turns": turns,
        "final_reward": final_reward,
        "rewards": [] if final_reward is None else [{"name": "reward", "value": final_reward, "source": "x"}],
        "status": status,
        "error": None,
        "start_time_ns": 0,
        "end_time_ns": 1000,
        "span_count": 1 + len(turns),
        "dropped_calls": [],
    }


def always_minus_one(span: dict[str, Any]) -> float | None:
    """A custom AIR matcher for the YAML import-path test: every tool span is worth -1."""
    return -1.0 if span["name"].startswith("execute_tool") else None
