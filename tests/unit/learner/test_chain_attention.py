"""Tries run by chains (learner/chain_attention.py, learner/flash_cpu.py): the chains of hand-drawn
tries, the two-part flash attention against a dense mask, and whole steps equal to the dense tree's
and the flat one's on a tiny real Llama (GQA, LoRA, a shared prefix over several micro-batches)."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from boltstream.learner import flash_cpu
from boltstream.learner.chain_attention import NAME, chain_plan, install, installed, resolve_chain_attention
from boltstream.learner.config import StepConfig
from boltstream.learner.step import accumulate_gradients, train_step
from boltstream.learner.tiny import shared_prefix_samples, tiny_llama
from boltstream.learner.token_trie import build_tree
from tests.unit.learner.test_shared_prefix import assert_grads_equal, grads, make_model, norm

VOCAB = 64
CHAINS = StepConfig(chain_attention_min_tokens=1, max_tokens_per_micro_batch=12, shared_prefix_min_tokens=4,
                    logprob_chunk_size=7)
DENSE = dataclasses.replace(CHAINS, chain_attention_min_tokens=0)


def plan_of(sequences: list[list[int]], prefix_length: int = 0, min_mean_tokens: int = 1):
    return chain_plan(build_tree(sequences).parents, prefix_length, min_mean_tokens)


def test_a_shared_system_prompt_then_two_answers() -> None:
    # nodes: 1 2 3 (prompt) 4 5 (first answer) 6 (second answer, child of node 2)
    plan = plan_of([[1, 2, 3, 4, 5], [1, 2, 3, 6]])
    assert plan.chains == ((0, 5), (5, 6))
    assert plan.visible == ((), ((0, 3),))  # the second chain sees the prompt in full, itself causally


def test_a_turn_that_extends_the_previous_one_is_one_chain() -> None:
    plan = plan_of([[1, 2, 3], [1, 2, 3, 4, 5, 6]])
    assert plan.chains == ((0, 6),) and plan.visible == ((),)


def test_no_sharing_gives_one_chain_per_sample_seeing_only_the_shared_prefix() -> None:
    plan = plan_of([[1, 2], [3, 4, 5]], prefix_length=10)
    assert plan.chains == ((0, 2), (2, 5))
    assert plan.visible == (((0, 10),), ((0, 10),))


def test_nested_branches_see_their_ancestors_ranges() -> None:
    # nodes: 1(0) 2(1) 3(2) | 4(3, child of 2) | 5(4, child of 1) 6(5)
    plan = plan_of([[1, 2, 3], [1, 2, 4], [1, 5, 6]], prefix_length=2)
    assert plan.chains == ((0, 3), (3, 4), (4, 6))
    # key axis: the 2 prefix keys, then node j at 2 + j; the prefix and the ancestors merge into one range
    assert plan.visible == (((0, 2),), ((0, 4),), ((0, 3),))


def test_two_identical_responses_share_their_chain() -> None:
    plan = plan_of([[1, 2, 3], [1, 2, 3], [1, 2, 4]])
    assert plan.chains == ((0, 3), (3, 4)) and plan.visible == ((), ((0, 2),))


def test_short_chains_keep_the_dense_mask() -> None:
    assert plan_of([[1, 2, 3, 4], [1, 2, 5, 6]], min_mean_tokens=4) is None  # 4 + 2 nodes in 2 chains
    assert plan_of([[1, 2, 3, 4], [1, 2, 5, 6]], min_mean_tokens=3) is not None


def test_torch_flash_ops_are_the_ones_this_code_relies_on() -> None:
    """Fails on a torch whose private CPU flash ops changed: the learner then keeps the dense mask."""
    assert flash_cpu.problem() is None, flash_cpu.problem()


@pytest.mark.parametrize("visible", [0, 6])
def test_visible_then_causal_equals_a_dense_mask(visible: int) -> None:
    gen = torch.Generator().manual_seed(0)
    q, k_own, v_own = (torch.randn(1, 3, 9, 16, generator=gen, requires_grad=True) for _ in range(3))
    k_vis, v_vis = (torch.randn(1, 3, visible, 16, generator=gen, requires_grad=True) for _ in range(2))
    mask = torch.cat([torch.ones(9, visible, dtype=torch.bool), torch.ones(9, 9, dtype=torch.bool).tril()], 1)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, torch.cat([k_vis, k_own], 2), torch.cat([v_vis, v_own], 2), attn_mask=mask, scale=0.3)
    got = flash_cpu.visible_then_causal(q, k_vis if visible else None, v_vis if visible else None, k_own, v_own, 0.3)
    seed = torch.randn(want.shape, generator=gen)
    inputs = (q, k_vis, v_vis, k_own, v_own) if visible else (q, k_own, v_own)
    for a, b in zip(torch.autograd.grad(got, inputs, seed), torch.autograd.grad(want, inputs, seed), strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=0)
    assert torch.allclose(got, want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("budget", [12, 40])  # 12: the prefix runs once, the tries over 3+ micro-batches
@pytest.mark.parametrize("variant", ["plain", "lora"])
def test_a_step_by_chains_equals_the_dense_tree_and_the_flat_step(variant: str, budget: int) -> None:
    samples = shared_prefix_samples(VOCAB, seed=2)
    model = make_model(variant, "sdpa")
    assert install(model) is None and installed(model)
    out = {}
    chains = dataclasses.replace(CHAINS, max_tokens_per_micro_batch=budget)
    for name, cfg in (("flat", StepConfig(prefix_tree=False, logprob_chunk_size=7)), ("chains", chains),
                      ("dense", dataclasses.replace(chains, chain_attention_min_tokens=0))):
        model.zero_grad(set_to_none=True)
        out[name] = (accumulate_gradients(model, samples, cfg), grads(model))
    (flat, g_flat), (by_chains, g_chains), (dense, g_dense) = out["flat"], out["chains"], out["dense"]
    assert by_chains.unique_tokens == dense.unique_tokens < flat.unique_tokens
    for other, g_other in ((flat, g_flat), (dense, g_dense)):
        assert by_chains.loss == pytest.approx(other.loss, abs=1e-6)
        assert by_chains.entropy == pytest.approx(other.entropy, abs=1e-5)
        assert norm(g_chains) == pytest.approx(norm(g_other), rel=1e-5)
        assert_grads_equal(g_chains, g_other)


def test_the_step_really_runs_by_chains(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = flash_cpu.visible_then_causal
    monkeypatch.setattr(flash_cpu, "visible_then_causal", lambda *a: calls.append(a[0].shape) or real(*a))
    samples = shared_prefix_samples(VOCAB, seed=2)
    model = make_model("plain", "sdpa")
    install(model)
    accumulate_gradients(model, samples, DENSE, backward=False)
    assert calls == []
    accumulate_gradients(model, samples, CHAINS, backward=False)
    layers = model.config.num_hidden_layers
    assert calls and len(calls) % layers == 0


def test_train_step_by_chains_gives_the_flat_step_s_weights() -> None:
    samples = shared_prefix_samples(VOCAB, seed=3)
    results = []
    for cfg in (StepConfig(prefix_tree=False), CHAINS):
        model = make_model("lora", "sdpa")
        assert resolve_chain_attention(model, cfg) == cfg
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
        m = train_step(model, optimizer, samples, cfg)
        results.append((m, {n: p.detach().clone() for n, p in model.named_parameters()}))
    (flat, w_flat), (by_chains, w_chains) = results
    assert by_chains.loss == pytest.approx(flat.loss, abs=1e-6)
    assert flat.grad_norm > 0 and by_chains.grad_norm == pytest.approx(flat.grad_norm, rel=1e-5)
    for name in w_flat:
        assert torch.allclose(w_chains[name], w_flat[name], atol=1e-6, rtol=1e-5), name


def test_eager_attention_keeps_the_dense_mask_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    model = tiny_llama(VOCAB, seed=1, attn_implementation="eager").train()
    with caplog.at_level(logging.WARNING):
        cfg = resolve_chain_attention(model, CHAINS)
    assert cfg == dataclasses.replace(CHAINS, chain_attention_min_tokens=0)
    assert "chain attention off" in caplog.text and "'eager'" in caplog.text
    assert not installed(model)


def test_a_probe_failure_turns_chains_off_and_restores_sdpa(monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    model = make_model("plain", "sdpa")
    monkeypatch.setattr(flash_cpu, "visible_then_causal", lambda q, *a: torch.zeros_like(q))  # a wrong kernel
    with caplog.at_level(logging.WARNING):
        cfg = resolve_chain_attention(model, CHAINS)
    assert cfg.chain_attention_min_tokens == 0 and "differs from the plain one" in caplog.text
    assert model.config._attn_implementation == "sdpa" != NAME


def test_the_learner_config_rejects_a_negative_threshold() -> None:
    from boltstream.errors import ConfigError

    with pytest.raises(ConfigError, match="chain_attention_min_tokens"):
        StepConfig(chain_attention_min_tokens=-1)
