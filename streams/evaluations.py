"""GenAI evaluation results (OpenTelemetry ``gen_ai.evaluation.result``) read as rewards.

Why: evaluators that follow the OpenTelemetry GenAI semantic conventions (Azure AI, LangChain's
tracer, DeepEval/Ragas exporters, an LLM judge instrumented by hand) already write their scores
into the trace. Reading them means a deployed agent gets rewards without a line of boltstream code.

What is read (per the conventions, ``gen_ai.evaluation.result``, stability "development"):

* an event named ``gen_ai.evaluation.result`` on a span: it evaluates THAT span;
* a span named ``gen_ai.evaluation.result`` (emitters that write the event as a zero-length
  span, parented to the operation it evaluates): it evaluates its PARENT span;

each with ``gen_ai.evaluation.name`` (the reward's name; ``evaluation`` when absent) and
``gen_ai.evaluation.score.value`` (the reward). A result with no numeric score (a label
only) or with ``error.type`` set (the evaluation itself failed) is not a reward and is
skipped. A non-finite score is kept, so the rollout is refused whole like any other
non-finite reward (streams/validate.py).

Which reward it becomes:

* it evaluates an LLM call of the rollout (the evaluated span is the call, or the result's
  ``gen_ai.response.id`` is the call's): an INTERMEDIATE reward on that call (dropped with
  the call when the call is not trained, like AIR's);
* anything else (the rollout's root, an agent or session span, a tool span): a FINAL reward
  of the rollout, listed in the trajectory's ``rewards``, not primary. The trajectory's
  ``final_reward`` is the latest primary final reward (``emit_reward``, the rollout
  function's return value, delayed feedback) when there is one, else the earliest final
  reward (streams/assembly.py), so a feedback overrides an evaluator's score.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .spans import RewardInfo, Span, attr, unwrap

log = logging.getLogger(__name__)

EVALUATION_RESULT = "gen_ai.evaluation.result"
EVALUATION_NAME = "gen_ai.evaluation.name"
SCORE_VALUE = "gen_ai.evaluation.score.value"
RESPONSE_ID = "gen_ai.response.id"
ERROR_TYPE = "error.type"
DEFAULT_NAME = "evaluation"


@dataclass(frozen=True)
class Evaluation:
    """One evaluation result with a numeric score, and what it evaluates."""

    name: str
    value: float
    subject: str | None  # span id of the evaluated span
    response_id: str | None
    time_ns: int
    source: str  # "<span id>" of an evaluation span, "<span id>#<event index>" of an event


def _result(attributes: Mapping[str, Any], subject: str | None, time_ns: int, source: str) -> Evaluation | None:
    score = unwrap(attributes.get(SCORE_VALUE))
    if attributes.get(ERROR_TYPE) is not None:
        log.debug("evaluation %s failed (%s): not a reward", source, attributes.get(ERROR_TYPE))
        return None
    if isinstance(score, bool) or not isinstance(score, int | float):
        return None  # a label only ("pass"), or no score: nothing to train on
    name = attributes.get(EVALUATION_NAME)
    response_id = attributes.get(RESPONSE_ID)
    return Evaluation(name if isinstance(name, str) and name.strip() else DEFAULT_NAME, float(score), subject,
                      response_id if isinstance(response_id, str) and response_id else None, time_ns, source)


def evaluations_of(span: Span) -> list[Evaluation]:
    """The evaluation results ``span`` carries (its events), or is (an evaluation span)."""
    span_id = str(span.get("span_id"))
    out = []
    for index, event in enumerate(span.get("events") or ()):
        if event.get("name") == EVALUATION_RESULT:
            result = _result(event.get("attributes") or {}, span_id, int(event.get("time_ns") or 0),
                             f"{span_id}#{index}")
            if result is not None:
                out.append(result)
    if span.get("name") == EVALUATION_RESULT:
        result = _result(span.get("attributes") or {}, span.get("parent_span_id"),
                         int(span.get("start_time_ns") or 0), span_id)
        if result is not None:
            out.append(result)
    return out


def evaluation_rewards(
    spans: Iterable[Span], calls: Sequence[Span]
) -> tuple[dict[str, list[dict[str, Any]]], list[RewardInfo]]:
    """(intermediate rewards by call span id, final rewards) from the evaluation results of a rollout.

    ``calls`` are the rollout's LLM calls (trained or not), which intermediate results attach to.
    """
    call_ids = {str(c["span_id"]) for c in calls}
    by_response = {rid: str(c["span_id"]) for c in calls if isinstance(rid := attr(c, RESPONSE_ID), str)}
    by_call: dict[str, list[dict[str, Any]]] = {}
    finals: list[RewardInfo] = []
    # in time order (then source), so the result does not depend on the order the spans arrived in
    for ev in sorted((ev for span in spans for ev in evaluations_of(span)), key=lambda e: (e.time_ns, e.source)):
        source = f"evaluation:{ev.source}"
        call = ev.subject if ev.subject in call_ids else by_response.get(ev.response_id or "")
        if call is not None:
            by_call.setdefault(call, []).append({"name": ev.name, "value": ev.value, "source": source})
        else:
            finals.append(RewardInfo(name=ev.name, value=ev.value, final=True, primary=False, span_id=source,
                                     time_ns=ev.time_ns))
    return by_call, finals
