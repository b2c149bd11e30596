"""AIR matchers of the SQL example that the YAML built-ins cannot express (``air.yaml`` names them).

Why a rows bonus: most queries a 135M model writes either fail or filter on a value that
matches nothing (``WHERE customer_id = 1000``); a query that returns rows is usually on the
right table and column, one step from the answer. On top of ``sql_ran`` it separates
"ran" from "found something" in a group where every final answer was wrong.
"""

from __future__ import annotations

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
        import json

        try:
            value = json.loads(text)
            text = str(value.get("content", value) if isinstance(value, dict) else value).strip()
        except ValueError:
            pass
    return 0.1 if text and text != NO_ROWS and not text.startswith("ERROR") else None
