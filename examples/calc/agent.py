"""A calculator agent written with the plain ``openai`` SDK.

The protocol is plain text so that even a 135M-parameter model can follow it:
the model writes ``CALC: <expression>``, the agent evaluates it and answers
``RESULT: <value>``, then the model writes ``ANSWER: <value>``. The calculator
call is traced as an OpenTelemetry tool span (status ERROR when the expression
does not evaluate), which is all boltstream needs to give it an intermediate
reward. Nothing here depends on boltstream: point ``base_url`` at any
OpenAI-compatible endpoint and it runs.
"""

from __future__ import annotations

import ast
import json
import operator
import os
import re

from openai import OpenAI
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from .. import endpoint

tracer = trace.get_tracer("examples.calc")

SYSTEM = (
    "You solve arithmetic word problems with a calculator. First write one line "
    "'CALC: <expression>' using only numbers and + - * /. You will receive "
    "'RESULT: <value>'. Then write 'ANSWER: <value>'."
)
# One worked example: enough for the model to follow the protocol on some problems.
EXAMPLE = [
    {"role": "user", "content": "A farmer plants 4 rows with 9 trees in each row. How many trees are there?"},
    {"role": "assistant", "content": "CALC: 4 * 9"},
    {"role": "user", "content": "RESULT: 36"},
    {"role": "assistant", "content": "ANSWER: 36"},
]
CALC_RE = re.compile(r"CALC:\s*([0-9+\-*/(). ]+)")
ANSWER_RE = re.compile(r"ANSWER:\s*(-?\d+(?:\.\d+)?)")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def evaluate(expression: str) -> float:
    """Evaluate + - * / over numbers; anything else is an error the model caused."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError(f"unsupported expression: {expression!r}")

    return ev(ast.parse(expression.strip(), mode="eval").body)


def _fmt(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.4g}"


def calculator(expression: str) -> str:
    with tracer.start_as_current_span("execute_tool calculator") as span:
        span.set_attribute("gen_ai.operation.name", "execute_tool")
        span.set_attribute("gen_ai.tool.name", "calculator")
        # JSON, as the GenAI conventions expect: raw text here reads as an invalid tool call to AIR
        # (boltstream's default tool_args_invalid rule, -0.2), which taught earlier demos to stop calling it.
        span.set_attribute("gen_ai.tool.call.arguments", json.dumps({"expression": expression}))
        try:
            result = _fmt(evaluate(expression))
        except (ValueError, SyntaxError, ZeroDivisionError) as exc:
            span.set_status(Status(StatusCode.ERROR, str(exc)))
            return f"ERROR: {exc}"
        span.set_attribute("gen_ai.tool.call.result", result)
        return result


def run_agent(client: OpenAI, question: str, model: str, temperature: float = 1.0, max_turns: int = 3) -> str | None:
    """Talk to the model until it answers; returns the answer string or None."""
    messages = [{"role": "system", "content": SYSTEM}, *EXAMPLE, {"role": "user", "content": question}]
    for _ in range(max_turns):
        reply = client.chat.completions.create(
            model=model, messages=messages, temperature=temperature, max_tokens=24, stop=["\n"]
        )
        text = reply.choices[0].message.content or ""
        messages.append({"role": "assistant", "content": text})
        answer = ANSWER_RE.search(text)
        if answer:
            return answer.group(1)
        calc = CALC_RE.search(text)
        if not calc:
            return None
        messages.append({"role": "user", "content": f"RESULT: {calculator(calc.group(1))}"})
    return None


def reward(answer: str | None, expected: float) -> float:
    """Exact match of the final number."""
    if answer is None:
        return 0.0
    try:
        return 1.0 if abs(float(answer) - float(expected)) < 1e-6 else 0.0
    except ValueError:
        return 0.0


def solve(task: dict, ctx) -> float:
    """Entry point for ``boltstream runner --agent boltstream.examples.calc.agent:solve``.

    ``ctx`` carries the inference endpoint and the rollout's headers; the agent
    itself is the plain OpenAI-SDK code above.
    """
    client = endpoint.client(ctx)
    answer = run_agent(
        client,
        task["question"],
        model=os.environ.get("CALC_MODEL", "policy"),
        temperature=float(os.environ.get("CALC_TEMPERATURE", "0.7")),
    )
    return reward(answer, task["answer"])
