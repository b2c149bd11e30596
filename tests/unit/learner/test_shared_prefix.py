"""A prefix shared by every sample runs once per step and the micro-batches continue from its cached
keys/values (learner/shared_prefix.py, learner/step.py): log-probs, losses and gradients equal the
flat step's, on a tiny real Llama, with the tries split over several micro-batches."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model

from boltstream.learner.collate import collate
from boltstream.learner.config import StepConfig
from boltstream.learner.shared_prefix import SharedPrefix, probe_shared_prefix
from boltstream.learner.step import accumulate_gradients, sequence_logprobs, train_step
from boltstream.learner.step_plan import plan_step
from boltstream.learner.tiny import shared_prefix_samples, tiny_llama
from boltstream.learner.token_trie import build_tree, shared_prefix_length

VOCAB = 64

SYSTEM = 9  # shared_prefix_samples' system prompt: the prefix every sample starts with
ON = StepConfig(shared_prefix_min_tokens=4, max_tokens_per_micro_batch=12, logprob_chunk_size=7)


def make_model(variant: str, attention: str) -> torch.nn.Module:
    model = tiny_llama(VOCAB, seed=1, tie_word_embeddings=variant == "tied", attn_implementation=attention)
    if variant == "lora":
        torch.manual_seed(0)
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"]
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets))
        with torch.no_grad():  # make the adapters matter
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.5)
    return model.train()


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_grads_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys() and want
    for name in want:
        scale = float(want[name].abs().max())
        assert float((got[name] - want[name]).abs().max()) <= 1e-5 * max(scale, 1e-6), name


def assert_same_update(flat: Any, w_flat: dict[str, torch.Tensor], other: Any,
                       w_other: dict[str, torch.Tensor]) -> None:
    """Two train_step results (metrics, weights after) agree: loss, gradient norm, KL and every weight."""
    assert other.loss == pytest.approx(flat.loss, abs=1e-6)
    assert flat.grad_norm > 0 and other.grad_norm == pytest.approx(flat.grad_norm, rel=1e-5)
    assert other.ref_kl == pytest.approx(flat.ref_kl, abs=1e-6)
    for name in w_flat:
        assert torch.allclose(w_other[name], w_flat[name], atol=1e-6, rtol=1e-5), name


def norm(g: dict[str, torch.Tensor]) -> float:
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in g.values()])))


def test_the_samples_share_a_system_prompt_before_any_loss_token() -> None:
    assert shared_prefix_length(shared_prefix_samples(VOCAB), 4) == SYSTEM


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("variant", ["plain", "lora", "unfused"])
def test_logprobs_and_gradients_from_a_shared_prefix_equal_flat(variant: str, attention: str) -> None:
    model = make_model("plain" if variant == "unfused" else variant, attention)
    samples = shared_prefix_samples(VOCAB)  # temperatures 0.7, 1.3, greedy, unrecorded
    batch = collate(samples)
    cfg = StepConfig(logprob_chunk_size=7, fused_head=variant != "unfused")
    weights = torch.randn(batch.loss_mask.shape, generator=torch.Generator().manual_seed(0))
    model.zero_grad(set_to_none=True)
    lp_flat, ent_flat = sequence_logprobs(model, batch, cfg, with_entropy=True)
    (lp_flat * weights).sum().backward()
    g_flat = grads(model)
    model.zero_grad(set_to_none=True)
    prefix = SharedPrefix.run(model, torch.tensor(samples[0]["token_ids"][:SYSTEM]), chunk_size=4)  # 3 chunks
    tree = build_tree([s["token_ids"][SYSTEM:] for s in samples])
    lp, ent = sequence_logprobs(model, batch, cfg, with_entropy=True, tree=tree, prefix=prefix)
    (lp * weights).sum().backward()
    prefix.backward()
    assert float(lp_flat.detach()[batch.loss_mask].abs().min()) > 0
    assert torch.allclose(lp, lp_flat, atol=1e-5, rtol=0)
    assert torch.allclose(ent, ent_flat, atol=1e-5, rtol=0)
    assert_grads_equal(grads(model), g_flat)


@pytest.mark.parametrize("keep", [0, 9])  # 0: the prefix is recomputed for the backward; 9: its graph is kept
@pytest.mark.parametrize("budget", [12, 4])  # 4: the 9-token prefix also runs in 3 chunks
@pytest.mark.parametrize("variant", ["plain", "lora"])
def test_a_step_split_into_micro_batches_computes_the_prefix_once_and_equals_flat(variant: str, budget: int,
                                                                                  keep: int) -> None:
    samples = shared_prefix_samples(VOCAB, seed=2)
    model = make_model(variant, "sdpa")
    out = {}
    on = dataclasses.replace(ON, max_tokens_per_micro_batch=budget, shared_prefix_keep_tokens=keep)
    for name, cfg in (("flat", StepConfig(prefix_tree=False, logprob_chunk_size=7)), ("shared", on),
                      ("tree", StepConfig(shared_prefix_min_tokens=0, max_tokens_per_micro_batch=12 + SYSTEM))):
        model.zero_grad(set_to_none=True)
        out[name] = (accumulate_gradients(model, samples, cfg), grads(model))
    (flat, g_flat), (shared, g_shared), (tree, _) = out["flat"], out["shared"], out["tree"]
    assert shared.micro_batches >= 3
    # the prefix counts once, not once per micro-batch as the plain tree's
    assert shared.unique_tokens < tree.unique_tokens < flat.unique_tokens == flat.input_tokens == shared.input_tokens
    assert shared.loss == pytest.approx(flat.loss, abs=1e-6)
    assert shared.entropy == pytest.approx(flat.entropy, abs=1e-5)
    assert norm(g_shared) == pytest.approx(norm(g_flat), rel=1e-5)
    assert_grads_equal(g_shared, g_flat)


def test_without_a_common_prefix_the_step_is_todays_tree_step() -> None:
    samples = shared_prefix_samples(VOCAB, seed=5)
    samples[-1] = {**samples[-1], "token_ids": [VOCAB - 1] + list(samples[-1]["token_ids"][1:])}
    assert shared_prefix_length(samples, 1) == 0
    model = make_model("plain", "sdpa")
    out = []
    for min_tokens in (4, 0):
        model.zero_grad(set_to_none=True)
        m = accumulate_gradients(model, samples, StepConfig(shared_prefix_min_tokens=min_tokens,
                                                            max_tokens_per_micro_batch=20))
        out.append((m, grads(model)))
    (on, g_on), (off, g_off) = out
    assert (on.unique_tokens, on.micro_batches, on.loss) == (off.unique_tokens, off.micro_batches, off.loss)
    for name in g_off:
        assert torch.equal(g_on[name], g_off[name]), name


def test_a_prefix_that_reaches_a_loss_token_is_not_shared() -> None:
    samples = shared_prefix_samples(VOCAB, seed=6)
    early = dict(samples[0])
    mask = list(early["loss_mask"])
    mask[5] = True  # a loss token inside the system prompt: its hidden state at 4 must stay in the trie
    early["loss_mask"], early["prompt_length"] = mask, 5
    samples[0] = early
    assert shared_prefix_length(samples, 4) == 4 and shared_prefix_length(samples, 5) == 0
    model = make_model("plain", "sdpa")
    out = []
    for cfg in (StepConfig(prefix_tree=False), StepConfig(shared_prefix_min_tokens=4, max_tokens_per_micro_batch=16)):
        model.zero_grad(set_to_none=True)
        out.append((accumulate_gradients(model, samples, cfg), grads(model)))
    (flat, g_flat), (shared, g_shared) = out
    assert shared.unique_tokens < flat.unique_tokens and shared.loss == pytest.approx(flat.loss, abs=1e-6)
    assert_grads_equal(g_shared, g_flat)


@pytest.mark.parametrize("keep", [0, 8, 9])  # 8: one token short of the prefix, so it is recomputed
@pytest.mark.parametrize("variant", ["plain", "lora"])
def test_train_step_gives_the_flat_step_s_weights(variant: str, keep: int) -> None:
    samples = shared_prefix_samples(VOCAB, seed=3)
    results = []
    for cfg in (StepConfig(prefix_tree=False), dataclasses.replace(ON, shared_prefix_keep_tokens=keep)):
        model = make_model(variant, "sdpa")
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
        cfg = dataclasses.replace(cfg, kl_coef=0.1 if variant == "lora" else 0.0)
        m = train_step(model, optimizer, samples, cfg)
        results.append((m, {n: p.detach().clone() for n, p in model.named_parameters()}))
    (flat, w_flat), (shared, w_shared) = results
    assert shared.micro_batches >= 3 and shared.unique_tokens < flat.unique_tokens
    assert_same_update(flat, w_flat, shared, w_shared)


def test_a_separate_reference_model_scores_from_its_own_prefix() -> None:
    samples = shared_prefix_samples(VOCAB, seed=7)
    model, ref = make_model("plain", "sdpa"), make_model("tied", "sdpa")
    flat = accumulate_gradients(model, samples, StepConfig(prefix_tree=False, kl_coef=0.2), ref_model=ref,
                                backward=False)
    shared = accumulate_gradients(model, samples, dataclasses.replace(ON, kl_coef=0.2), ref_model=ref,
                                  backward=False)
    assert flat.ref_kl > 0 and shared.ref_kl == pytest.approx(flat.ref_kl, abs=1e-6)
    assert shared.loss == pytest.approx(flat.loss, abs=1e-6)


def test_a_custom_backward_computes_the_prefix_in_each_micro_batch(caplog: pytest.LogCaptureFixture) -> None:
    samples = shared_prefix_samples(VOCAB, seed=8)
    model = make_model("plain", "sdpa")
    with caplog.at_level(logging.WARNING):
        plan = plan_step(model, ON, custom_backward=True)
    assert plan.tree and not plan.shared_prefix and "custom backward" in plan.paths()["shared_prefix"]
    assert caplog.text.count("custom backward") == 1
    m = accumulate_gradients(model, samples, plan, backward_fn=torch.Tensor.backward)
    plain = accumulate_gradients(model, samples, dataclasses.replace(ON, shared_prefix_min_tokens=0), backward=False)
    assert m.unique_tokens == plain.unique_tokens


def test_the_probe_passes_on_a_real_model_and_the_plan_takes_the_shared_prefix() -> None:
    for attention in ("sdpa", "eager"):
        model = make_model("lora", attention)
        assert probe_shared_prefix(model) is None
        plan = plan_step(model, ON)
        assert plan.shared_prefix and plan.mode == "tree+shared-prefix" and plan.cfg == ON and not plan.fallbacks
        assert model.training


@pytest.mark.parametrize(("keep", "chunks"), [(9, [(0, 9)]), (8, [(0, 4), (4, 8), (8, 9), (8, 9), (4, 8), (0, 4)])])
def test_a_short_prefix_keeps_its_graph_and_runs_once(monkeypatch: pytest.MonkeyPatch, keep: int,
                                                      chunks: list[tuple[int, int]]) -> None:
    """At most ``shared_prefix_keep_tokens`` tokens: one forward over the prefix, in one piece (the budget
    of 4 would chunk it), not a second for the backward (last chunk first)."""
    from boltstream.learner import shared_prefix

    calls = []
    real = shared_prefix._chunk_forward
    monkeypatch.setattr(shared_prefix, "_chunk_forward", lambda decoder, ids, start, end, cache: calls.append(
        (start, end, torch.is_grad_enabled())) or real(decoder, ids, start, end, cache))
    model = make_model("lora", "sdpa")
    plan = plan_step(model, dataclasses.replace(ON, shared_prefix_keep_tokens=keep, max_tokens_per_micro_batch=4))
    calls.clear()  # the plan's probe ran a prefix of its own
    accumulate_gradients(model, shared_prefix_samples(VOCAB, seed=2), plan)
    assert [(start, end) for start, end, _ in calls] == chunks
    assert calls[0][2] == (keep == SYSTEM)  # kept: the forward ran with gradient
