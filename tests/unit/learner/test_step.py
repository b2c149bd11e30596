"""The optimizer step on a tiny real Llama: log-prob alignment against a naive forward,
micro-batch accumulation equality, every trainable parameter moves, the loss goes down,
for full fine-tuning and for LoRA."""

from __future__ import annotations

import math

import pytest
import torch
from peft import LoraConfig, get_peft_model

from boltstream.learner.step import (
    StepConfig,
    accumulate_gradients,
    evaluate_loss,
    train_step,
    warmup_lr,
    with_model_logprobs,
)
from boltstream.learner.tiny import random_samples, tiny_llama

VOCAB = 64


def lora(model: torch.nn.Module, targets=("q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj")):
    torch.manual_seed(0)  # LoRA A is initialised from the global RNG
    return get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(targets))
    )


def naive_logprobs(model: torch.nn.Module, sample: dict, temperature: float = 1.0) -> list[float]:
    """Full logits over the whole sequence, full log_softmax at ``temperature``, a python loop:
    token t's log-prob comes from position t-1."""
    ids = torch.tensor([sample["token_ids"]])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float() / temperature, -1)
    return [float(logp[t - 1, ids[0, t]]) if m and t > 0 else 0.0 for t, m in enumerate(sample["loss_mask"])]


@pytest.mark.parametrize("variant", ["plain", "tied", "lora", "lora_on_lm_head", "unfused"])
def test_model_logprobs_match_naive_forward(variant: str) -> None:
    model = tiny_llama(VOCAB, seed=1, tie_word_embeddings=variant == "tied")
    cfg = StepConfig(logprob_chunk_size=5, fused_head=variant != "unfused")
    if variant == "lora":
        model = lora(model)
    if variant == "lora_on_lm_head":  # the head is no plain Linear: the fallback path
        model = lora(model, ("q_proj", "lm_head"))
    if variant.startswith("lora"):  # make the adapters matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.5)
    samples = random_samples(5, VOCAB, seed=2)
    for got, s in zip(with_model_logprobs(model, samples, cfg), samples, strict=True):
        assert got["behaviour_logprobs"] == pytest.approx(naive_logprobs(model, s), abs=1e-5)


@pytest.mark.parametrize("fused_head", [True, False])
def test_each_sample_is_scored_at_its_own_temperature(fused_head: bool) -> None:
    """One micro-batch mixing temperatures (and a greedy / an unrecorded one, scored at 1):
    each row's log-probs are log_softmax(logits / its T), on the fused and the plain path."""
    model = tiny_llama(VOCAB, seed=1)
    temps = [0.7, 1.3, 0.0, None, 0.7]
    samples = [{**s, "temperature": t} for s, t in zip(random_samples(5, VOCAB, seed=4), temps, strict=True)]
    cfg = StepConfig(logprob_chunk_size=3, fused_head=fused_head)
    for got, s, t in zip(with_model_logprobs(model, samples, cfg), samples, temps, strict=True):
        assert got["behaviour_logprobs"] == pytest.approx(naive_logprobs(model, s, t or 1.0), abs=1e-5)
        if t not in (None, 0.0):  # and not at T = 1: the test could tell
            assert got["behaviour_logprobs"] != pytest.approx(naive_logprobs(model, s), abs=1e-3)


def test_on_policy_ratio_is_one_only_at_the_sampling_temperature() -> None:
    """Behaviour log-probs taken at T = 0.7: the step's ratio is 1 when the samples say 0.7,
    and off when the same tokens are scored at 1 (the bug of a learner-wide temperature)."""
    model = tiny_llama(VOCAB, seed=5)
    samples = random_samples(6, VOCAB, seed=5)
    at_07 = with_model_logprobs(model, [{**s, "temperature": 0.7} for s in samples])
    right = evaluate_loss(model, at_07)
    assert (right.ratio_mean, right.ratio_max) == (pytest.approx(1.0, abs=1e-5), pytest.approx(1.0, abs=1e-5))
    wrong = evaluate_loss(model, [{**s, "temperature": None} for s in at_07])
    assert wrong.ratio_max > 1.05


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("prefix_tree", [False, True])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batch_accumulation_equals_single_batch_gradient(mode: str, prefix_tree: bool) -> None:
    model = tiny_llama(VOCAB, seed=3)
    samples = random_samples(9, VOCAB, seed=3)  # behaviour -1.0: off-policy, some tokens clip
    for i, s in enumerate(samples):
        s["loss_weight"] = 0.5 + 0.1 * i
    results = []
    for budget in (100_000, 40):
        model.zero_grad(set_to_none=True)
        m = accumulate_gradients(model, samples, StepConfig(loss_agg=mode, max_tokens_per_micro_batch=budget,
                                                            prefix_tree=prefix_tree))
        results.append((m, _grads(model)))
    (big, g_big), (small, g_small) = results
    assert big.micro_batches == 1 and small.micro_batches >= 3  # trees pack tighter: no padding
    assert small.loss == pytest.approx(big.loss, abs=1e-6)
    assert small.clip_fraction == pytest.approx(big.clip_fraction)
    assert small.entropy == pytest.approx(big.entropy, abs=1e-5)
    assert g_big.keys() == g_small.keys() and len(g_big) == len(list(model.parameters()))
    for name in g_big:
        assert torch.allclose(g_big[name], g_small[name], atol=1e-6, rtol=1e-4), name


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_zero_advantage_samples_are_not_run_and_the_gradient_is_unchanged(mode: str) -> None:
    model = tiny_llama(VOCAB, seed=4)
    samples = random_samples(8, VOCAB, seed=4)
    for i, s in enumerate(samples):
        s["advantage"] = 0.0 if i % 3 else (1.0 if i % 2 else -0.5)  # samples 0, 3, 6 carry a gradient
    results = []
    for skip in (False, True):
        model.zero_grad(set_to_none=True)
        m = accumulate_gradients(model, samples, StepConfig(loss_agg=mode, skip_zero_advantage=skip,
                                                            max_tokens_per_micro_batch=60))
        results.append((m, _grads(model)))
    (full, g_full), (lean, g_lean) = results
    assert (full.zero_advantage_skipped, lean.zero_advantage_skipped) == (0, 5)
    assert lean.input_tokens < full.input_tokens and lean.samples == full.samples == 8
    assert lean.loss == pytest.approx(full.loss, abs=1e-7)
    assert g_full.keys() == g_lean.keys()
    for name in g_full:
        assert torch.allclose(g_full[name], g_lean[name], atol=1e-7, rtol=1e-5), name

    model.zero_grad(set_to_none=True)
    kl = accumulate_gradients(model, samples, StepConfig(kl_coef=0.1), ref_model=tiny_llama(VOCAB, seed=5))
    assert kl.zero_advantage_skipped == 0, "a KL term moves the weights whatever the advantage"
    for s in samples:
        s["advantage"] = 0.0
    model.zero_grad(set_to_none=True)
    none = accumulate_gradients(model, samples, StepConfig())
    assert none.zero_advantage_skipped == 7 and all(float(g.abs().max()) == 0.0 for g in _grads(model).values())


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_full_finetune_step_changes_every_parameter_and_lowers_loss() -> None:
    model = tiny_llama(VOCAB, seed=4)
    samples = with_model_logprobs(model, random_samples(8, VOCAB, seed=4))  # on-policy
    cfg = StepConfig(max_tokens_per_micro_batch=64)
    before_loss = evaluate_loss(model, samples, cfg).loss
    before = _snapshot(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    m = train_step(model, opt, samples, cfg)
    assert m.loss == pytest.approx(before_loss, abs=1e-6)  # on-policy: ratio 1, loss = -mean(A)
    assert m.clip_fraction == 0.0 and m.approx_kl == pytest.approx(0.0, abs=1e-9)
    assert math.isfinite(m.grad_norm) and m.grad_norm > 0 and not m.skipped
    assert m.loss_tokens > 0 and m.input_tokens > m.loss_tokens and m.micro_batches > 1
    for name, p in model.named_parameters():
        assert not torch.equal(p.detach(), before[name]), f"{name} did not change"
    assert evaluate_loss(model, samples, cfg).loss < before_loss - 1e-3


def test_lora_step_changes_adapters_only_and_lowers_loss() -> None:
    """LoRA B starts at zero, so after the FIRST step only the B matrices can move:
    dL/dA = B^T (...) = 0 (and Adam turns a zero gradient into a zero update; weight decay
    is off so nothing moves A by itself). From the second step B != 0, so A moves too.
    The frozen base never moves."""
    model = lora(tiny_llama(VOCAB, seed=5))
    samples = with_model_logprobs(model, random_samples(8, VOCAB, seed=5))
    cfg = StepConfig()
    before_loss = evaluate_loss(model, samples, cfg).loss
    before = _snapshot(model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)

    model.train()
    model.zero_grad(set_to_none=True)
    accumulate_gradients(model, samples, cfg)
    for name, p in model.named_parameters():
        if "lora_A" in name:
            assert p.grad is not None and torch.count_nonzero(p.grad) == 0, name
        if "lora_B" in name:
            assert torch.count_nonzero(p.grad) > 0, name

    train_step(model, opt, samples, cfg)
    for name, p in model.named_parameters():
        changed = not torch.equal(p.detach(), before[name])
        assert changed == ("lora_B" in name), name
    after_one = evaluate_loss(model, samples, cfg).loss
    assert after_one < before_loss - 1e-4

    train_step(model, opt, samples, cfg)
    for name, p in model.named_parameters():
        changed = not torch.equal(p.detach(), before[name])
        assert changed == (name in trainable), name
    assert evaluate_loss(model, samples, cfg).loss < after_one


def test_lora_kl_uses_base_model_as_reference() -> None:
    model = lora(tiny_llama(VOCAB, seed=6))
    samples = with_model_logprobs(model, random_samples(6, VOCAB, seed=6))
    cfg = StepConfig(kl_coef=0.1)
    assert evaluate_loss(model, samples, cfg).ref_kl == pytest.approx(0.0, abs=1e-9)  # B = 0: policy == base
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=5e-2, weight_decay=0.0)
    for _ in range(2):
        train_step(model, opt, samples, cfg)
    assert evaluate_loss(model, samples, cfg).ref_kl > 1e-6
    with pytest.raises(ValueError, match="ref_model"):
        evaluate_loss(tiny_llama(VOCAB), samples, cfg)  # full model, no reference given
    # an explicit reference model works for a full model too
    assert (
        evaluate_loss(tiny_llama(VOCAB, seed=6), samples, cfg, ref_model=tiny_llama(VOCAB, seed=6)).ref_kl
        == 0.0
    )


def test_decoupled_mode_reweights_by_truncated_is() -> None:
    """Decoupled: the proximal policy is the current one, so the ratio is exactly 1 and each
    token's weight is min(pi / pi_behaviour, cap). Behaviour log-probs 1.0 below the model's
    own give weight e^1 = 2.718 -> truncated at 2.0 on every token."""
    model = tiny_llama(VOCAB, seed=7)
    samples = with_model_logprobs(model, random_samples(4, VOCAB, seed=7))
    for s in samples:
        s["behaviour_logprobs"] = [
            v - 1.0 if m else 0.0 for v, m in zip(s["behaviour_logprobs"], s["loss_mask"], strict=True)
        ]
    m = evaluate_loss(model, samples, StepConfig(decoupled=True, is_cap=2.0))
    assert m.ratio_mean == pytest.approx(1.0) and m.clip_fraction == 0.0
    assert m.is_weight_mean == pytest.approx(2.0) and m.is_truncated_fraction == 1.0
    plain = evaluate_loss(model, samples, StepConfig())
    assert plain.ratio_mean == pytest.approx(math.e, rel=1e-4)


def test_nonfinite_gradient_skips_the_update() -> None:
    model = tiny_llama(VOCAB, seed=8)
    samples = random_samples(2, VOCAB, seed=8)
    samples[0]["advantage"] = math.inf  # would be rejected by sample_problem; here it reaches the step
    before = _snapshot(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    m = train_step(model, opt, samples, StepConfig())
    assert m.skipped and not math.isfinite(m.grad_norm)
    assert all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
    assert all(p.grad is None for p in model.parameters())


def test_gradient_checkpointing_gives_the_same_gradients() -> None:
    """The fused path calls the decoder directly; HF's per-layer checkpointing still applies."""
    samples = random_samples(4, VOCAB, seed=9)
    grads = []
    for checkpointing in (False, True):
        model = tiny_llama(VOCAB, seed=9)
        if checkpointing:
            model.gradient_checkpointing_enable()
        model.train()
        accumulate_gradients(model, samples, StepConfig())
        grads.append(_grads(model))
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-7), name


@pytest.mark.parametrize(("step", "warmup", "lr"), [(1, 3, 1e-3 / 3), (2, 3, 2e-3 / 3), (3, 3, 1e-3), (9, 3, 1e-3),
                                                    (1, 0, 1e-3), (1, 1, 1e-3), (0, 4, 2.5e-4)])
def test_warmup_lr_ramps_linearly_then_holds(step: int, warmup: int, lr: float) -> None:
    assert warmup_lr(1e-3, step, warmup) == pytest.approx(lr)
