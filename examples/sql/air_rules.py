"""AIR matchers of the SQL example that the YAML built-ins cannot express (``air.yaml`` names them).

Why: most queries the untrained 135M model writes fail or filter by a made-up id
(``WHERE customer_id = 1000``; 2 of 32 held-out samples right, 14 ran: examples/sql/README.md).
Two bonuses separate the near misses from the rest in a group where every final answer is wrong:

* :func:`rows_returned`: the query found something (a ``COUNT(*)`` of ``0`` is not something:
  it is what a made-up filter returns, and the first version of this rule, which paid for it,
  taught the writer exactly those queries);
* :func:`quotes_the_question`: the query filters by a value the question names (``'Oslo'`` in
  "How many customers live in Oslo?"), read from the worker's LLM span of the writer's call.
"""

from __future__ import annotations

import json
import re
from typing import Any

NO_ROWS = "(no rows)"  # what agent.format_rows returns for an empty result


def rows_returned(span: dict[str, Any]) -> float | None:
    """+0.1 for an ``execute_sql`` run whose result has rows (OpenInference puts it in ``output.value``)."""
    if span.get("name") != "execute_sql" or (span.get("status") or {}).get("code") == "ERROR":
        return None
    output = (span.get("attributes") or {}).get("output.value")
    if not isinstance(output, str):
        return None
    text = output.strip()
    if '"content"' in text or text.startswith("{"):  # a ToolMessage serialised as JSON: its content
        try:
            value = json.loads(text)
            text = str(value.get("content", value) if isinstance(value, dict) else value).strip()
        except ValueError:
            pass
    return 0.1 if text and text not in (NO_ROWS, "0") and not text.startswith("ERROR") else None


_QUOTED = re.compile(r"'([^']{2,})'")


def _texts(value: Any) -> list[str]:
    """The ``content`` strings of a JSON message list attribute (``gen_ai.input/output.messages``)."""
    try:
        messages = json.loads(value) if isinstance(value, str) else None
    except ValueError:
        return []
    if not isinstance(messages, list):
        return []
    return [m["content"] for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str)]


def quotes_the_question(span: dict[str, Any]) -> float | None:
    """+0.1 for an LLM call whose reply quotes a value (2+ characters) found in the last question it was asked."""
    attrs = span.get("attributes") or {}
    asked, said = _texts(attrs.get("gen_ai.input.messages")), _texts(attrs.get("gen_ai.output.messages"))
    if not asked or not said:
        return None
    question = asked[-1].casefold()
    return 0.1 if any(v.casefold() in question for v in _QUOTED.findall(said[0])) else None
