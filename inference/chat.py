"""Chat messages (+ tool definitions) -> prompt token ids, and tool calls back out of generated text.

Why here and not in the engine: the prompt token ids are part of the training
record, so they must come from exactly one rendering, done once, and be the
ids the engine sees. The model's own chat template is used; tools go to the
template when it can render them (``tools`` appears in it). For templates that
cannot (SmolLM2's), the same Hermes-style tool prompt the tiny model's template
renders is put into the system message, so small models still see the tools;
calls come back as ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from typing import Any

from boltstream.inference.protocol import ApiError

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
ROLES = ("system", "developer", "user", "assistant", "tool")


def template_supports_tools(tokenizer: Any) -> bool:
    template = tokenizer.chat_template
    if isinstance(template, Mapping):
        template = " ".join(str(v) for v in template.values())
    return bool(template) and "tools" in str(template)


def tools_system_prompt(tools: list[dict[str, Any]]) -> str:
    """Hermes-style tool instructions (what Qwen2.5's and the tiny model's templates render)."""
    sigs = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{sigs}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
        "<args-json-object>}\n</tool_call>"
    )


def _text(content: Any, index: int) -> str:
    """Message content as text: a string, or the text parts of a content list."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") not in ("text", "input_text"):
                raise ApiError(400, f"messages[{index}]: only text content parts are supported",
                               param=f"messages[{index}].content", code="unsupported_content")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise ApiError(400, f"messages[{index}].content must be a string or a list of parts",
                   param=f"messages[{index}].content")


def _tool_call_text(call: Mapping[str, Any]) -> str:
    fn = call.get("function") or {}
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            pass
    return "<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False) + \
        "\n</tool_call>"


def normalise_messages(messages: Any, native_tools: bool) -> list[dict[str, Any]]:
    """Validate OpenAI chat messages and turn them into what a chat template can render."""
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty array", param="messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or m.get("role") not in ROLES:
            raise ApiError(400, f"messages[{i}] needs a role, one of {', '.join(ROLES)}", param=f"messages[{i}]")
        role = "system" if m["role"] == "developer" else m["role"]
        content = _text(m.get("content"), i)
        calls = m.get("tool_calls") or []
        if not isinstance(calls, list):
            raise ApiError(400, f"messages[{i}].tool_calls must be an array", param=f"messages[{i}].tool_calls")
        if native_tools:
            msg: dict[str, Any] = {"role": role, "content": content}
            if calls:
                msg["tool_calls"] = calls
            if m.get("tool_call_id"):
                msg["tool_call_id"] = m["tool_call_id"]
            out.append(msg)
        elif role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        else:
            pieces = [content] if content else []
            pieces += [_tool_call_text(c) for c in calls if isinstance(c, Mapping)]
            out.append({"role": role, "content": "\n".join(pieces)})
    return out


def validate_tools(tools: Any) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(
        isinstance(t, Mapping) and t.get("type", "function") == "function"
        and isinstance(t.get("function"), Mapping) and isinstance(t["function"].get("name"), str)
        for t in tools
    ):
        raise ApiError(400, "'tools' must be an array of {type: function, function: {name, ...}}", param="tools")
    return [dict(t) for t in tools] or None


def render_prompt(tokenizer: Any, messages: Any, tools: list[dict[str, Any]] | None) -> list[int]:
    """Prompt token ids for a chat request (the generation prompt for the assistant appended)."""
    native = template_supports_tools(tokenizer)
    msgs = normalise_messages(messages, native)
    if tools and not native:
        prompt = tools_system_prompt(tools)
        if msgs[0]["role"] == "system":
            msgs[0] = {"role": "system", "content": f"{msgs[0]['content']}\n\n{prompt}"}
        else:
            msgs.insert(0, {"role": "system", "content": prompt})
    if not tokenizer.chat_template:
        raise ApiError(400, "this model has no chat template; use /v1/completions", code="no_chat_template")
    try:
        text = tokenizer.apply_chat_template(
            msgs, tools=tools if native else None, tokenize=False, add_generation_prompt=True
        )
    except Exception as exc:  # jinja errors, template-raised exceptions
        raise ApiError(400, f"the chat template rejected these messages: {exc}", param="messages") from exc
    return list(tokenizer.encode(text, add_special_tokens=False))


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(remaining content or None, OpenAI tool_calls) from generated text; unparsable blocks stay as text."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    last = 0
    for m in _TOOL_CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
            name = obj["name"]
            args = obj.get("arguments", obj.get("parameters", {}))
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        kept.append(text[last:m.start()])
        last = m.end()
        calls.append({
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": str(name), "arguments": args if isinstance(args, str) else json.dumps(args)},
        })
    kept.append(text[last:])
    content = "".join(kept).strip()
    return (content or None) if calls else text, calls
