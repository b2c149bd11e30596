"""The step plan (learner/step_plan.py): decided once per trainer; a broken library internal turns a fast
path off with a warning naming the fix, the learner's step-mode gauge and a `boltstream status` line, and the
step still trains exactly as the slower path does."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from boltstream.inference import transformers_internals
from boltstream.learner.config import LearnerConfig, StepConfig
from boltstream.learner.metrics import MetricsSink
from boltstream.learner.step import evaluate_loss
from boltstream.learner.step_plan import Fallback, StepPlan, plan_step
from boltstream.learner.tiny import shared_prefix_samples, tiny_llama
from boltstream.learner.trainer import TorchTrainer
from boltstream.monitoring import status
from tests.unit.learner.test_shared_prefix import assert_same_update

VOCAB = 64
STEP = StepConfig(max_tokens_per_micro_batch=16)  # several micro-batches: the shared prefix is used


def attention_ignores_the_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def causal_only(module, query, key, value, attention_mask, **kwargs):
        return sdpa(module, query, key, value, None, **{**kwargs, "is_causal": True})

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", causal_only)


def cache_is_not_growing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transformers_internals, "is_growing", lambda cache: False)


BROKEN = {  # the internal broken -> the path that falls back, the config that takes the slower path itself
    "4-D mask ignored": (attention_ignores_the_mask, "prefix_tree", dataclasses.replace(STEP, prefix_tree=False)),
    "KV cache not growing": (cache_is_not_growing, "shared_prefix", dataclasses.replace(STEP, shared_prefix_min_tokens=0)),
}


def trained(step: StepConfig, caplog: pytest.LogCaptureFixture) -> tuple[TorchTrainer, object, dict]:
    trainer = TorchTrainer(LearnerConfig(model="tiny", lr=1e-2, step=step), model=tiny_llama(VOCAB, seed=0),
                           tokenizer=None)
    with caplog.at_level(logging.WARNING):
        m = trainer.step(shared_prefix_samples(VOCAB, seed=3))
    return trainer, m, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("broken", sorted(BROKEN))
def test_a_broken_internal_is_a_warning_a_gauge_a_status_line_and_a_correct_slower_step(
        broken: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    breaks, path, slower = BROKEN[broken]
    healthy, m_slow, w_slow = trained(slower, caplog)
    assert not healthy.plan.fallbacks  # asked for nothing it could not run
    caplog.clear()
    breaks(monkeypatch)
    trainer, m, w = trained(STEP, caplog)
    assert [f.path for f in trainer.plan.fallbacks] == [path]
    assert f"{path} off, a slower path runs" in caplog.text and "(fix: " in caplog.text
    assert caplog.text.count("slower path runs") == 1  # planned once, not per step
    assert_same_update(m_slow, w_slow, m, w)
    sink = MetricsSink(port=0, model_name="policy")
    try:
        sink.plan(trainer.plan)
        report = status.endpoint_metrics(f"http://127.0.0.1:{sink.port}/metrics")
    finally:
        sink.close()
    assert report["step_fallbacks"] == {path: trainer.plan.paths()[path]} and report["step_fallbacks"][path]
    text = status.format_report({"bootstrap_servers": "-", "namespace": "-", "topics": {}, "groups": {},
                                 "learner": {}, "workers": [], "metrics": [report]})
    assert f"learner step SLOWER: {path} off: {trainer.plan.paths()[path]}" in text


def test_a_healthy_model_runs_every_fast_path_and_the_gauge_says_so(tmp_path) -> None:
    plan = plan_step(tiny_llama(VOCAB, seed=0), STEP)
    assert (plan.tree, plan.shared_prefix, plan.fused_head, plan.mode) == (True, True, True, "tree+shared-prefix")
    sink = MetricsSink(tmp_path / "m.jsonl", port=0, model_name="policy")
    try:
        sink.plan(plan)
        text = status._http(f"http://127.0.0.1:{sink.port}/metrics").decode()
    finally:
        sink.close()
    assert status.step_fallbacks(text) == {}
    assert 'boltstream_learner_step_mode{model="policy",path="prefix_tree",reason=""} 1.0' in text
    assert '"event":"plan","time"' in (tmp_path / "m.jsonl").read_text()


def test_paths_lists_what_the_config_asks_for() -> None:
    """Hand-made plans: a path is listed only when asked for; a fallback carries its reason."""
    cfg = StepConfig(fused_head=False, shared_prefix_min_tokens=0)
    assert StepPlan(cfg, tree=True).paths() == {"prefix_tree": ""}
    off = StepPlan(StepConfig(), fused_head=True, fallbacks=(Fallback("prefix_tree", "no 4-D mask"),))
    assert off.paths() == {"prefix_tree": "no 4-D mask", "shared_prefix": "", "fused_head": ""}
    assert off.mode == "flat" and "sdpa" in off.fallbacks[0].fix


def test_a_head_that_is_not_a_plain_linear_falls_back_to_the_model_forward() -> None:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny_llama(VOCAB, seed=0), LoraConfig(r=2, target_modules=["q_proj", "lm_head"]))
    plan = plan_step(model, StepConfig())
    assert not plan.fused_head and "head" in plan.paths()["fused_head"]


def test_a_reference_model_that_cannot_run_tries_scores_flat() -> None:
    ref = tiny_llama(VOCAB, seed=1)
    ref.config._attn_implementation = "flash_attention_2"
    model = tiny_llama(VOCAB, seed=0)
    plan = plan_step(model, StepConfig(kl_coef=0.1), ref_model=ref)
    assert plan.tree and plan.reference == "model" and not plan.reference_tree
    assert "flash_attention_2" in plan.paths()["reference_tree"]
    ref.config._attn_implementation = "sdpa"  # the forward needs one that runs on CPU; the plan is kept
    samples = shared_prefix_samples(VOCAB, seed=4)
    assert evaluate_loss(model, samples, plan, ref_model=ref).ref_kl == pytest.approx(
        evaluate_loss(model, samples, dataclasses.replace(StepConfig(kl_coef=0.1), prefix_tree=False),
                      ref_model=ref).ref_kl, abs=1e-6)


def test_a_kl_term_without_a_reference_is_refused_at_plan_time() -> None:
    with pytest.raises(ValueError, match="kl_coef > 0 needs a ref_model"):
        plan_step(tiny_llama(VOCAB, seed=0), StepConfig(kl_coef=0.1))
