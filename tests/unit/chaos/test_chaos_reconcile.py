"""The chaos runner's reconciliation, by hand: what counts as lost, duplicated and unexpected."""

from __future__ import annotations

from tests.integration.chaos.chaos_scenarios import Reconciled, fit_vocab, reconcile, with_poison
from tests.integration.streams.stream_workload import make_workload, reference_samples


def test_reconcile_counts_each_failure_kind() -> None:
    steps = [{"sample_ids": ["a:0", "b:0"]}, {"sample_ids": ["b:0", "x:0"]}]
    assert reconcile(["a:0", "b:0", "c:0"], steps) == Reconciled(trained=3, lost=1, duplicated=1, unexpected=1)
    assert reconcile(["a:0", "b:0"], [{"sample_ids": ["b:0", "a:0"]}]) == Reconciled(2, 0, 0, 0)
    assert reconcile(["a:0"], []) == Reconciled(0, 1, 0, 0)


def test_fit_vocab_folds_spans_and_reference_alike() -> None:
    rollouts = fit_vocab(make_workload(2, 2, seed=1))
    ids = [t for r in rollouts for s in r.spans if s.get("llm") for t in
           s["llm"]["prompt_token_ids"] + s["llm"]["response_token_ids"]]
    assert ids and all(1 <= t <= 255 for t in ids)
    first = rollouts[0]
    llm = [s["llm"] for s in first.spans if s.get("llm")][0]
    assert first.calls[0] == (llm["prompt_token_ids"], llm["response_token_ids"])
    assert reference_samples(rollouts)[f"{first.attempt_id}:0"]["token_ids"] == first.calls[0][0] + first.calls[0][1]


def test_with_poison_inserts_one_after_every_n() -> None:
    records = [(b"k%d" % i, b"\xc3\x01" + bytes(8) + b"body%d" % i) for i in range(7)]
    out, n = with_poison(records, 3)
    assert n == 2 and len(out) == 9
    assert out[3][0] == b"poison-3" and out[3][1] == records[2][1][:10] + b"\xff" * 7
    assert [r for r in out if not r[0].startswith(b"poison")] == records
