"""The tree forward equals the flat one (log-probs, gradients, whole steps), and models that cannot
take a tree mask fall back to flat (learner/tree_forward.py, learner/step.py), on a tiny real Llama."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from peft import LoraConfig, get_peft_model

from boltstream.learner.collate import collate
from boltstream.learner.config import StepConfig
from boltstream.learner.step import accumulate_gradients, sequence_logprobs, train_step
from boltstream.learner.step_plan import plan_step
from boltstream.learner.tiny import shared_prefix_samples, tiny_llama
from boltstream.learner.token_trie import build_tree
from boltstream.learner.tree_forward import label_nodes, probe_tree_support, tree_problem
from tests.unit.learner.test_shared_prefix import assert_same_update

VOCAB = 64


def lora(model: torch.nn.Module, targets=("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj")):
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(targets)))
    with torch.no_grad():  # make the adapters matter
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    return model


def make_model(variant: str, attention: str) -> torch.nn.Module:
    model = tiny_llama(VOCAB, seed=1, tie_word_embeddings=variant == "tied", attn_implementation=attention)
    if variant == "lora":
        model = lora(model)
    if variant == "lora_on_lm_head":  # the head is no plain Linear: the model's own forward
        model = lora(model, ("q_proj", "lm_head"))
    return model.train()


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_the_samples_share_prefixes() -> None:
    tree = build_tree([s["token_ids"] for s in shared_prefix_samples(VOCAB)])
    assert tree.unique_tokens < 0.6 * tree.total_tokens


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("variant", ["plain", "tied", "lora", "lora_on_lm_head", "unfused"])
def test_tree_logprobs_and_gradients_equal_flat(variant: str, attention: str) -> None:
    model = make_model(variant, attention)
    samples = shared_prefix_samples(VOCAB)
    batch = collate(samples)
    tree = build_tree([s["token_ids"] for s in samples])
    cfg = StepConfig(logprob_chunk_size=7, fused_head=variant != "unfused")
    out = {}
    for name, trie in (("flat", None), ("tree", tree)):
        model.zero_grad(set_to_none=True)
        lp, ent = sequence_logprobs(model, batch, cfg, with_entropy=True, tree=trie)
        # a loss that weights every position differently, so a swapped row would show
        weights = torch.randn(lp.shape, generator=torch.Generator().manual_seed(0))
        (lp * weights).sum().backward()
        out[name] = (lp.detach(), ent, grads(model))
    (lp_f, ent_f, g_f), (lp_t, ent_t, g_t) = out["flat"], out["tree"]
    assert bool(batch.loss_mask.any()) and float(lp_f[batch.loss_mask].abs().min()) > 0
    assert torch.allclose(lp_t, lp_f, atol=1e-5, rtol=0)
    assert torch.allclose(ent_t, ent_f, atol=1e-5, rtol=0)
    assert g_f.keys() == g_t.keys() and g_f
    for name in g_f:
        scale = float(g_f[name].abs().max())
        assert float((g_t[name] - g_f[name]).abs().max()) <= 1e-5 * max(scale, 1e-6), name


def test_label_nodes_points_each_label_at_the_node_of_the_token_before_it() -> None:
    samples = [{"token_ids": [5, 6, 7]}, {"token_ids": [5, 8]}]
    tree = build_tree([s["token_ids"] for s in samples])  # nodes 5, 6, 7, 8
    assert label_nodes(tree, (2, 2)).tolist() == [[0, 1], [0, 0]]


def test_label_nodes_after_a_shared_prefix_start_at_the_prefix() -> None:
    # full samples [1, 2, 5, 6, 7] and [1, 2, 5, 8]; after the 2-token prefix: nodes 5, 6, 7, 8
    tree = build_tree([[5, 6, 7], [5, 8]])
    assert label_nodes(tree, (2, 4), prefix_length=2).tolist() == [[0, 0, 0, 1], [0, 0, 0, 0]]


@pytest.mark.parametrize("variant", ["plain", "lora"])
def test_train_step_is_the_same_with_and_without_prefix_tree(variant: str) -> None:
    samples = shared_prefix_samples(VOCAB, seed=3)
    results = []
    for tree in (False, True):
        model = make_model(variant, "sdpa")
        # SGD: the update is the (clipped) gradient itself. Adam's first update is ~lr * sign(g), so a
        # gradient element at rounding level (1e-10 either way) would move its weight by the full lr.
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
        cfg = StepConfig(prefix_tree=tree, max_tokens_per_micro_batch=40,
                         kl_coef=0.1 if variant == "lora" else 0.0)
        m = train_step(model, optimizer, samples, cfg)
        results.append((m, {n: p.detach().clone() for n, p in model.named_parameters()}))
    (flat, w_flat), (tree_m, w_tree) = results
    assert tree_m.unique_tokens < flat.unique_tokens == flat.input_tokens == tree_m.input_tokens
    assert_same_update(flat, w_flat, tree_m, w_tree)


def test_zero_advantage_skip_and_normaliser_are_unchanged_by_trees() -> None:
    samples = shared_prefix_samples(VOCAB, seed=4)
    for i, s in enumerate(samples):
        if i % 3:
            s["advantage"] = 0.0
    model = make_model("plain", "sdpa")
    out = []
    for tree in (False, True):
        model.zero_grad(set_to_none=True)
        m = accumulate_gradients(model, samples, StepConfig(prefix_tree=tree, loss_agg="seq-mean-token-mean"))
        out.append((m, grads(model)))
    (flat, g_flat), (tree_m, g_tree) = out
    assert flat.zero_advantage_skipped == tree_m.zero_advantage_skipped > 0
    assert tree_m.loss == pytest.approx(flat.loss, abs=1e-7)
    for name in g_flat:
        assert torch.allclose(g_tree[name], g_flat[name], atol=1e-7, rtol=1e-5), name


def test_a_model_without_a_4d_mask_attention_is_planned_flat(caplog: pytest.LogCaptureFixture) -> None:
    model = make_model("plain", "sdpa")
    model.config._attn_implementation = "flash_attention_2"  # takes no dense mask (nor runs on CPU)
    assert "flash_attention_2" in (tree_problem(model) or "")
    with caplog.at_level(logging.WARNING):
        plan = plan_step(model, StepConfig())
    assert not plan.tree and plan.mode == "flat" and "flash_attention_2" in plan.paths()["prefix_tree"]
    assert "prefix_tree off" in caplog.text and "attn_implementation 'sdpa'" in caplog.text  # names the fix
    model.config._attn_implementation = "sdpa"
    samples = shared_prefix_samples(VOCAB)
    flat = accumulate_gradients(model, samples, plan, backward=False)  # the plan holds, whatever the model says now
    assert flat.unique_tokens == flat.input_tokens


def test_the_probe_catches_an_attention_that_ignores_the_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' contract (masking_utils hands a 4-D mask to the attention as it is): the probe
    passes on sdpa and eager, and fails when the attention drops the mask for plain causal."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for attention in ("sdpa", "eager"):
        assert probe_tree_support(make_model("lora", attention)) is None
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def causal_only(module, query, key, value, attention_mask, **kwargs):
        return sdpa(module, query, key, value, None, **{**kwargs, "is_causal": True})

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", causal_only)
    model = make_model("plain", "sdpa")
    assert "ignores" in (probe_tree_support(model) or "")
    assert plan_step(model, StepConfig()).tree is False
    assert model.training, "the probe restores the training mode"


def test_the_plan_keeps_the_config() -> None:
    cfg = StepConfig(max_tokens_per_micro_batch=77, kl_coef=0.5)
    plan = plan_step(make_model("lora", "eager"), cfg)
    assert plan.cfg is cfg and plan.tree and plan.reference == "base"
    off = plan_step(make_model("plain", "eager"), dataclasses.replace(cfg, prefix_tree=False, kl_coef=0.0))
    assert not off.tree and not off.fallbacks and off.paths() == {"fused_head": ""}
