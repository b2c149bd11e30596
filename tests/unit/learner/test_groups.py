"""Group assembly and offset bookkeeping without a broker: parts, duplicates, staleness, offsets."""

from __future__ import annotations

import math

import pytest

from boltstream.learner.groups import GroupAssembler, IdWindow, OffsetTracker, staleness_key
from boltstream.learner.tiny import random_samples

VOCAB = 64


def batch(name: str, n: int = 4, *, part: int = 0, parts: int = 1, version: int = 0, seed: int = 0) -> dict:
    samples = random_samples(n, VOCAB, seed=seed, policy_version=version)
    for i, s in enumerate(samples):
        s["sample_id"] = f"{name}-{part}-{i}"
    return {"batch_id": name, "task_id": name, "part": part, "num_parts": parts, "samples": samples,
            "reward_mean": 0.25, "complete": True}


def feed(asm: GroupAssembler, records: list[tuple[int, int, dict | None]]) -> None:
    for partition, offset, b in records:
        asm.add(partition, offset, b)


# ----------------------------------------------------------------------------- reassembly


def test_split_parts_are_reassembled_in_part_order_across_partitions_and_arrival_order() -> None:
    asm = GroupAssembler()
    p0, p1, p2 = (batch("g", 2, part=i, parts=3) for i in range(3))
    feed(asm, [(0, 0, p2), (1, 0, p0)])
    assert not asm.ready and asm.tracker.pending == 2
    feed(asm, [(0, 1, p1)])
    (group,) = asm.ready
    assert [s["sample_id"] for s in group.samples] == ["g-0-0", "g-0-1", "g-1-0", "g-1-1", "g-2-0", "g-2-1"]
    assert sorted(group.refs) == [(0, 0), (0, 1), (1, 0)] and group.reward_mean == 0.25


def test_duplicate_parts_batches_and_bad_part_numbers_are_dropped_and_counted() -> None:
    asm = GroupAssembler()
    a0, a1 = batch("a", part=0, parts=2), batch("a", part=1, parts=2)
    feed(asm, [(0, 0, a0), (0, 1, a0), (0, 2, {**batch("a", part=1), "num_parts": 3}),
               (0, 3, {**batch("x"), "part": 5}), (0, 4, a1), (0, 5, a1), (0, 6, None)])
    assert len(asm.ready) == 1
    assert asm.dropped == {"record_duplicate_part": 1, "record_inconsistent_parts": 1,
                           "record_bad_part_number": 1, "record_duplicate_batch": 1, "record_undecodable": 1}
    step = asm.take_step(1, version=0)
    asm.commit(step)
    feed(asm, [(0, 7, batch("a"))])  # the same batch again after it was trained
    assert asm.dropped["record_duplicate_batch"] == 2 and not asm.ready
    assert asm.tracker.positions() == {0: 8}


def test_incomplete_batches_are_evicted_beyond_the_pending_limit() -> None:
    asm = GroupAssembler(max_pending=2)
    feed(asm, [(0, i, batch(f"b{i}", part=0, parts=2)) for i in range(3)])
    assert asm.dropped == {"record_parts_never_completed": 1}
    assert asm.tracker.positions() == {0: 1}, "the evicted record is used, the other two still pin the offset"


def test_groups_the_stream_app_closed_short_can_be_dropped() -> None:
    asm = GroupAssembler(drop_incomplete=True)
    feed(asm, [(0, 0, {**batch("a"), "complete": False}), (0, 1, batch("b"))])
    assert [g.batch_id for g in asm.ready] == ["b"] and asm.dropped == {"record_incomplete_group": 1}


# ----------------------------------------------------------------------------- steps, staleness, validity


def test_steps_take_k_groups_and_drop_stale_and_malformed_samples_with_reasons() -> None:
    asm = GroupAssembler()
    old, new, bad = batch("old", version=1, seed=1), batch("new", version=5, seed=2), batch("bad", version=5, seed=3)
    bad["samples"][0]["advantage"] = math.nan
    bad["samples"][1]["loss_mask"] = bad["samples"][1]["loss_mask"][:-1]
    bad["samples"][2]["token_ids"][-1] = VOCAB + 3
    new["samples"][3]["policy_version"] = -1  # unknown version: kept, shown as such
    feed(asm, [(0, 0, old), (0, 1, new), (0, 2, bad)])
    assert asm.take_step(3, version=6, max_staleness=2, vocab_size=VOCAB) is None, "old is fully stale"
    assert asm.tracker.positions() == {0: 1}, "the stale group is used up, the others wait for a step"
    feed(asm, [(1, 0, batch("more", version=6, seed=4))])
    step = asm.take_step(3, version=6, max_staleness=2, vocab_size=VOCAB)
    assert [g.batch_id for g in step.groups] == ["new", "bad", "more"]
    assert len(step.samples) == 4 + 1 + 4
    assert step.staleness == {"1": 4, "unknown": 1, "0": 4}
    assert step.dropped == {"stale": 4, "nonfinite_advantage": 1, "length_mismatch": 1, "token_out_of_vocab": 1}
    assert asm.dropped == step.dropped
    assert asm.tracker.positions() == {0: 1, 1: 0}, "nothing is used before the step is committed"
    asm.commit(step)
    assert asm.tracker.positions() == {0: 3, 1: 1} and asm.tracker.used_above() == {}


def test_no_max_staleness_keeps_everything_and_versions_count_from_the_learner() -> None:
    asm = GroupAssembler()
    feed(asm, [(0, 0, batch("a", version=0))])
    step = asm.take_step(1, version=100)
    assert len(step.samples) == 4 and step.staleness == {"100": 4}
    assert staleness_key(3, 7) == "0" and staleness_key(3, -1) == "unknown"


def test_a_sample_id_seen_before_is_dropped_even_in_another_batch() -> None:
    asm = GroupAssembler()
    a, b = batch("a"), batch("b", seed=9)
    b["samples"][0]["sample_id"] = a["samples"][0]["sample_id"]
    feed(asm, [(0, 0, a), (0, 1, b)])
    step = asm.take_step(2, version=0)
    assert len(step.samples) == 7 and step.dropped == {"duplicate_sample": 1}


def test_the_buffer_survives_until_k_groups_and_is_judged_at_one_version() -> None:
    asm = GroupAssembler()
    feed(asm, [(0, 0, batch("a", version=3))])
    assert asm.take_step(2, version=3, max_staleness=0) is None
    feed(asm, [(0, 1, batch("b", version=3, seed=1))])
    step = asm.take_step(2, version=3, max_staleness=0)
    assert [g.batch_id for g in step.groups] == ["a", "b"] and step.staleness == {"0": 8}
    assert asm.buffered_groups == 0


# ----------------------------------------------------------------------------- offsets


def test_watermark_waits_for_the_oldest_pending_record_and_remembers_used_ones_above_it() -> None:
    t = OffsetTracker()
    t.start(0, 10)
    for o in (10, 11, 12):
        t.read(0, o)
    t.use([(0, 11)])
    assert t.positions() == {0: 10} and t.used_above() == {0: [11]}
    t.use([(0, 10)])
    assert t.positions() == {0: 12} and t.used_above() == {}
    t.use([(0, 12)])
    assert t.positions() == {0: 13}


def test_a_restarted_tracker_skips_exactly_the_records_used_above_the_watermark() -> None:
    asm = GroupAssembler()
    feed(asm, [(0, 0, batch("x", part=0, parts=2)), (0, 1, batch("y")), (0, 2, batch("z"))])
    asm.commit(asm.take_step(1, version=0))  # y trained while x waits for its second part
    positions, used = asm.tracker.positions(), asm.tracker.used_above()
    assert positions == {0: 0} and used == {0: [1]}

    again = GroupAssembler(OffsetTracker(positions, used), seen=asm.seen.to_list())
    feed(again, [(0, 0, batch("x", part=0, parts=2)), (0, 1, batch("y")), (0, 2, batch("z")),
                 (0, 3, batch("x", part=1, parts=2))])
    assert not again.dropped, "the replayed record is skipped silently because it was already counted"
    assert [g.batch_id for g in again.ready] == ["z", "x"]
    assert again.tracker.positions() == {0: 0} and again.tracker.used_above() == {0: [1]}
    again.commit(again.take_step(2, version=1))
    assert again.tracker.positions() == {0: 4} and again.tracker.used_above() == {}


def test_used_offsets_not_yet_replayed_stay_owed_in_the_next_checkpoint() -> None:
    t = OffsetTracker({0: 5}, {0: [7, 9]})
    t.read(0, 5)
    assert t.used_before(0, 7) and not t.used_before(0, 8)
    assert t.used_above() == {0: [7, 9]} and t.positions() == {0: 5}


@pytest.mark.parametrize("size", [1, 3])
def test_id_window_is_bounded_and_ordered(size: int) -> None:
    w = IdWindow(size, ["a", "b", "c", "a"])
    assert w.to_list() == ["b", "c", "a"][-size:]
    assert ("a" in w) and (("b" in w) == (size == 3))


def test_empty_responses_are_rejected_with_their_reason_and_the_rest_trains() -> None:
    asm = GroupAssembler()
    b = batch("e")
    s = b["samples"][0]
    s["token_ids"], s["loss_mask"], s["behaviour_logprobs"] = s["token_ids"][:3], [False] * 3, [0.0] * 3
    s["prompt_length"] = 3  # the prompt alone: nothing was generated
    feed(asm, [(0, 0, b)])
    step = asm.take_step(1, version=0)
    assert len(step.samples) == 3 and step.dropped == {"no_loss_tokens": 1}
