"""Automatic Intermediate Rewards (AIR): span outcomes -> rewards on the LLM call that caused them.

Why: a final reward says *whether* a rollout worked, not *which* call went wrong.
Agent Lightning's AIR turns observable system signals (a tool that failed, a tool
call whose arguments were not JSON, a timeout) into small intermediate rewards
on the call that produced them, so credit assignment can tell calls apart.

Attachment: a reward goes to the latest LLM call (of this rollout) that ended at
or before the span started - the call whose output led to that tool run. For a
rule that matches an LLM span itself (its own tool-call output is malformed) the
reference time is the span's end, so the reward lands on that call. A reward with
no such call (before the first call) is dropped and logged. A reward whose call is
not trained (filtered by ``agent_match``, or recorded without token ids) is
dropped too: it was caused by a call the learner never sees.

Default rules (``DEFAULT_AIR_RULES``, evaluated in this order per span):

=================  =====================  =======  ==============================================
rule name          when                   value    fires on
=================  =====================  =======  ==============================================
emitted_reward     ``reward_span``        span's   ``boltstream.reward`` spans with
                                          value    ``boltstream.reward.final`` false
                                                   (``emit_reward``); reward name = span's name
tool_args_invalid  ``tool_args_invalid``  -0.2     tool span whose ``gen_ai.tool.call.arguments``
                                                   (or OpenInference JSON ``input.value``) is not
                                                   JSON, or an LLM span whose
                                                   ``llm.output_messages.*.tool_call.function.
                                                   arguments`` is not JSON; stops; once per call
timeout            ``timeout``            -0.1     non-LLM span whose status message, ``error.type``
                                                   / ``exception.type`` attributes, exception events
                                                   or HTTP status (408/504) mark a timeout; stops
tool_error         ``tool_error``         -0.1     tool span with status ``ERROR``
=================  =====================  =======  ==============================================

Rule semantics: ``stop`` - once this rule fired on a span, later rules are not
evaluated for that span (an invalid-args failure is not also a tool error);
``once_per_call`` - at most one reward of this rule per LLM call; ``once_per_rollout`` -
at most one per rollout (a bonus the policy cannot farm by repeating the action); a rule never
fires on a span whose ancestor it already fired on (one timeout, not one per
nested HTTP span). The rollout root span is never matched; reward spans are only
matched by ``reward_span``.

Rules are :class:`AirRule` values: built-in matchers by name (also
``span_error``: any span with status ERROR, and ``span``: any span, both usually
narrowed with ``span_name``), or any Python callable ``(span) -> bool | float |
None`` (True fires with ``value``, a float fires with that value). From YAML
(:func:`air_rules_from_yaml`), ``when`` may also be ``"package.module:function"``.
"""

from __future__ import annotations

import importlib
import logging
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from .air_matchers import BUILTIN_MATCHERS, WITH_KIND, KindMatcher, Matcher
from .air_matchers import match_any_span as match_any_span
from .air_matchers import match_reward_span as match_reward_span
from .air_matchers import match_span_error as match_span_error
from .air_matchers import match_timeout as match_timeout
from .air_matchers import match_tool_args_invalid as match_tool_args_invalid
from .air_matchers import match_tool_error as match_tool_error
from .spans import Span, SpanFlags, is_rollout_root, reward_of, span_flags

logger = logging.getLogger(__name__)

Reward = dict[str, Any]


@dataclass(frozen=True)
class AirRule:
    """One AIR rule: when it matches a span, reward the call that caused the span.

    ``when`` is a built-in matcher name (see ``BUILTIN_MATCHERS``) or a callable
    ``(span) -> bool | float | None``. ``value`` is the reward when the matcher
    returns True (required for built-ins except ``reward_span``); a float returned
    by the matcher overrides it (``reward_span`` returns the span's own value). ``span_name`` is an optional regex (``re.search``)
    the span name must match.
    """

    name: str
    when: str | Matcher
    value: float | None = None
    span_name: str | None = None
    stop: bool = False
    once_per_call: bool = False
    once_per_rollout: bool = False
    enabled: bool = True
    _pattern: re.Pattern[str] | None = field(default=None, init=False, repr=False, compare=False)
    _matcher: Matcher | None = field(default=None, init=False, repr=False, compare=False)
    _with_kind: KindMatcher | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError("air rule name: must be a non-empty string")
        if isinstance(self.when, str):
            if self.when not in BUILTIN_MATCHERS:
                raise ValueError(
                    f"air rule {self.name!r} when: unknown matcher {self.when!r} "
                    f"(built-ins: {', '.join(BUILTIN_MATCHERS)})"
                )
        elif not callable(self.when):
            raise ValueError(f"air rule {self.name!r} when: must be a matcher name or a callable")
        if self.value is not None:
            if isinstance(self.value, bool) or not isinstance(self.value, int | float) or not math.isfinite(self.value):
                raise ValueError(f"air rule {self.name!r} value: must be a finite number, got {self.value!r}")
        elif isinstance(self.when, str) and self.when != "reward_span":
            raise ValueError(f"air rule {self.name!r} value: required for matcher {self.when!r}")
        if isinstance(self.when, str):
            object.__setattr__(self, "_with_kind", WITH_KIND[self.when])
        else:
            object.__setattr__(self, "_matcher", self.when)
        if self.span_name is not None:
            try:
                object.__setattr__(self, "_pattern", re.compile(self.span_name))
            except re.error as exc:
                raise ValueError(f"air rule {self.name!r} span_name: invalid regex: {exc}") from None

    def evaluate(self, span: Span) -> float | None:
        """The reward this rule gives ``span``, or None when it does not fire."""
        return self._evaluate(span, span_flags(span))

    def _evaluate(self, span: Span, kind: SpanFlags) -> float | None:
        """:meth:`evaluate` with the span's kind already known (classified once per span)."""
        if not self.enabled:
            return None
        if self._pattern is not None and not self._pattern.search(str(span.get("name", ""))):
            return None
        if kind.reward and self.when != "reward_span":
            return None
        if self._with_kind is not None:
            outcome = self._with_kind(span, kind)
        else:
            outcome = self._matcher(span)  # type: ignore[misc]  # a callable, set in __post_init__
        if outcome is None or outcome is False:
            return None
        if outcome is True:
            if self.value is None:
                logger.warning("air rule %s matched span %s but has no value; ignored", self.name, span.get("span_id"))
                return None
            return float(self.value)
        if isinstance(outcome, int | float) and math.isfinite(outcome):
            return float(outcome)
        logger.warning("air rule %s returned %r for span %s; ignored", self.name, outcome, span.get("span_id"))
        return None


DEFAULT_AIR_RULES: tuple[AirRule, ...] = (
    AirRule(name="emitted_reward", when="reward_span"),
    AirRule(name="tool_args_invalid", when="tool_args_invalid", value=-0.2, stop=True, once_per_call=True),
    AirRule(name="timeout", when="timeout", value=-0.1, stop=True),
    AirRule(name="tool_error", when="tool_error", value=-0.1),
)

_RULE_KEYS = {"name", "when", "value", "span_name", "stop", "once_per_call", "once_per_rollout", "enabled"}


def _resolve_callable(path: str) -> Matcher:
    module_name, _, attr_name = path.partition(":")
    try:
        target = getattr(importlib.import_module(module_name), attr_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"air rule when: cannot import {path!r}: {exc}") from None
    if not callable(target):
        raise ValueError(f"air rule when: {path!r} is not callable")
    return target


def air_rules_from_dicts(items: Iterable[Mapping[str, Any]]) -> tuple[AirRule, ...]:
    """Rules from plain mappings (what YAML/JSON give); ``when: "pkg.mod:func"`` imports a callable."""
    rules = []
    for index, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise ValueError(f"air rule #{index}: must be a mapping, got {type(item).__name__}")
        unknown = set(item) - _RULE_KEYS
        if unknown:
            raise ValueError(f"air rule #{index}: unknown keys {sorted(unknown)}")
        spec = dict(item)
        when = spec.get("when")
        if isinstance(when, str) and ":" in when:
            spec["when"] = _resolve_callable(when)
        if "name" not in spec or "when" not in spec:
            raise ValueError(f"air rule #{index}: 'name' and 'when' are required")
        rules.append(AirRule(**spec))
    return tuple(rules)


def air_rules_from_yaml(text: str) -> tuple[AirRule, ...]:
    """Rules from YAML text: a list of rule mappings, or ``{rules: [...]}`` / ``{air: {rules: [...]}}``.

    ``defaults: true`` next to ``rules`` prepends ``DEFAULT_AIR_RULES``.
    """
    data = yaml.safe_load(text)
    defaults = False
    if isinstance(data, Mapping) and "air" in data:
        data = data["air"]
    if isinstance(data, Mapping):
        defaults = bool(data.get("defaults", False))
        data = data.get("rules", [])
    if data is None:
        data = []
    if not isinstance(data, list):
        raise ValueError("air rules: YAML must be a list of rules or a mapping with 'rules'")
    rules = air_rules_from_dicts(data)
    return (DEFAULT_AIR_RULES + rules) if defaults else rules


@dataclass(frozen=True)
class CallRef:
    """What AIR needs to know about an LLM call: its span id and end time."""

    span_id: str
    end_time_ns: int


@dataclass
class AirResult:
    """Rewards per LLM call span id (in span time order), plus those no call could take."""

    rewards_by_call: dict[str, list[Reward]] = field(default_factory=dict)
    unattached: list[Reward] = field(default_factory=list)


def _make_reward(rule: AirRule, span: Span, value: float) -> Reward:
    name = rule.name
    if rule.when == "reward_span":
        info = reward_of(span)
        if info is not None:
            name = info.name
    return {"name": name, "value": value, "source": f"{rule.name}:{span.get('span_id')}"}


def _latest_call_before(calls: Sequence[CallRef], time_ns: int) -> CallRef | None:
    best: CallRef | None = None
    for call in calls:
        if call.end_time_ns <= time_ns and (best is None or call.end_time_ns >= best.end_time_ns):
            best = call
    return best


def evaluate_air(
    spans: Iterable[Span],
    calls: Sequence[CallRef],
    rules: Sequence[AirRule] = DEFAULT_AIR_RULES,
    parent_of: Mapping[str, str | None] | None = None,
    kinds: Mapping[str, SpanFlags] | None = None,
) -> AirResult:
    """Apply ``rules`` to the spans of one rollout and attach the rewards to ``calls``.

    ``calls`` should hold every LLM call of the rollout (trained or not), so a
    reward caused by an untrained call is not moved onto a trained one.
    ``parent_of`` (span id -> parent id) enables the nested-span dedupe.
    ``kinds`` (span id -> :func:`~boltstream.streams.spans.span_flags`) saves
    classifying the spans again when the caller already did.
    """
    result = AirResult()
    active = [rule for rule in rules if rule.enabled]
    if not active:
        return result
    ordered = sorted(spans, key=lambda s: (s.get("start_time_ns", 0), -s.get("end_time_ns", 0), s.get("span_id")))
    fired: dict[str, set[str]] = {}  # rule name -> span ids it fired on
    per_call_seen: set[tuple[str, str]] = set()
    per_rollout_seen: set[str] = set()  # names of once_per_rollout rules that gave their reward
    call_ids = {call.span_id for call in calls}
    for span in ordered:
        if is_rollout_root(span):
            continue
        span_id = str(span.get("span_id"))
        kind = kinds.get(span_id) if kinds is not None else None
        if kind is None:
            kind = span_flags(span)
        for rule in active:
            value = rule._evaluate(span, kind)
            if value is None:
                continue
            if parent_of is not None and _ancestor_fired(span_id, parent_of, fired.get(rule.name, set())):
                if rule.stop:
                    break
                continue
            fired.setdefault(rule.name, set()).add(span_id)
            reward = _make_reward(rule, span, value)
            if span_id in call_ids or kind.llm:
                reference = int(span.get("end_time_ns", 0))
            else:
                reference = int(span.get("start_time_ns", 0))
            target = _latest_call_before(calls, reference)
            if target is None:
                logger.debug("AIR %s on span %s: no LLM call ended before it; dropped", rule.name, span_id)
                result.unattached.append(reward)
            elif rule.once_per_call and (rule.name, target.span_id) in per_call_seen:
                logger.debug("AIR %s already rewarded call %s; span %s skipped", rule.name, target.span_id, span_id)
            elif rule.once_per_rollout and rule.name in per_rollout_seen:
                logger.debug("AIR %s already rewarded this rollout; span %s skipped", rule.name, span_id)
            else:
                per_call_seen.add((rule.name, target.span_id))
                per_rollout_seen.add(rule.name)
                result.rewards_by_call.setdefault(target.span_id, []).append(reward)
            if rule.stop:
                break
    return result


def _ancestor_fired(span_id: str, parent_of: Mapping[str, str | None], fired_ids: set[str]) -> bool:
    if not fired_ids:
        return False
    seen = {span_id}
    current = parent_of.get(span_id)
    while current is not None and current not in seen:
        if current in fired_ids:
            return True
        seen.add(current)
        current = parent_of.get(current)
    return False
