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


def _chaos_runner():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "benchmarks" / "chaos.py"
    spec = importlib.util.spec_from_file_location("chaos_runner", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_partial_run_replaces_its_rows_and_keeps_the_others() -> None:
    chaos = _chaos_runner()
    old = "\n".join([chaos.BEGIN, "Command: `make chaos` (vm)", "", chaos.HEADER,
                     "| baseline | 40 | none | 1 |", "| s3-stall | 17 | frozen | 1 |", ""])
    block = chaos.merge_block(old, {"sigkill-runner": "| sigkill-runner | 9 | kill | 1 |",
                                    "s3-stall": "| s3-stall | 20 | frozen again | 1 |"},
                              "Command: `benchmarks/chaos.py --scenarios s3-stall,sigkill-runner` (vm)", full=False)
    assert block.splitlines() == [
        chaos.BEGIN, "Command: `make chaos` (vm)", "Command: `benchmarks/chaos.py --scenarios s3-stall,sigkill-runner` (vm)",
        "", *chaos.HEADER.splitlines(), "| baseline | 40 | none | 1 |", "| s3-stall | 20 | frozen again | 1 |",
        "| sigkill-runner | 9 | kill | 1 |", chaos.END]
    full = chaos.merge_block(old, {"baseline": "| baseline | 1 |"}, "Command: `make chaos` (new)", full=True)
    assert full.splitlines() == [chaos.BEGIN, "Command: `make chaos` (new)", "", *chaos.HEADER.splitlines(),
                                 "| baseline | 1 |", chaos.END]
