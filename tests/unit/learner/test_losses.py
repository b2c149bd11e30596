"""Loss functions: hand-computed values AND naive reference implementations."""

from __future__ import annotations

import math

import pytest
import torch

from boltstream.learner.losses import (
    aggregate_loss,
    entropy_from_logits,
    k3_kl,
    linear_token_logprobs,
    loss_normaliser,
    ppo_clip_loss,
    token_logprobs,
)

# ----------------------------------------------------------------- hand-computed values

# logits = log([1, 2, 3]) -> softmax = [1/6, 2/6, 3/6];  logits = log([4, 4, 2]) -> [.4, .4, .2]
HAND_LOGITS = torch.log(torch.tensor([[1.0, 2.0, 3.0], [4.0, 4.0, 2.0]]))


def test_token_logprobs_hand_computed() -> None:
    # row 0, label 2: log(3/6) = -0.693147;  row 1, label 2: log(0.2) = -1.609438
    lp = token_logprobs(HAND_LOGITS, torch.tensor([2, 2]), chunk_size=1)
    assert lp.tolist() == pytest.approx([-0.693147, -1.609438], abs=1e-6)
    # row 0, label 0: log(1/6) = -1.791759
    assert float(token_logprobs(HAND_LOGITS[:1], torch.tensor([0]))[0]) == pytest.approx(-1.791759, abs=1e-6)


def test_entropy_hand_computed() -> None:
    # row 0: 1/6*1.791759 + 1/3*1.098612 + 1/2*0.693147 = 0.298627 + 0.366204 + 0.346574 = 1.011404
    # row 1: 2*0.4*0.916291 + 0.2*1.609438 = 0.733033 + 0.321888 = 1.054920
    assert entropy_from_logits(HAND_LOGITS, chunk_size=1).tolist() == pytest.approx(
        [1.011404, 1.054920], abs=1e-5
    )


def _ppo_case():
    """One sequence, ratios r = [1.5, 0.5, 1.1, 2.0] against behaviour -1, A = [1, 1, -1, -1],
    mask = [1, 1, 1, 0], clip [0.8, 1.28]:
      t0: min(1.5*1, 1.28*1) = 1.28   -> loss -1.28 (clipped: A>0, r>1.28)
      t1: min(0.5, 0.8)      = 0.5    -> loss -0.5
      t2: min(-1.1, -1.1)    = -1.1   -> loss +1.1
      t3: masked
    token-mean = (-1.28 - 0.5 + 1.1) / 3 = -0.226667; clip fraction 1/3."""
    ratios = torch.tensor([[1.5, 0.5, 1.1, 2.0]])
    behaviour = torch.full((1, 4), -1.0)
    logprobs = (behaviour + torch.log(ratios)).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.tensor([[True, True, True, False]])
    return logprobs, behaviour, adv, mask


def test_ppo_clip_hand_computed_value_metrics_and_gradient() -> None:
    logprobs, behaviour, adv, mask = _ppo_case()
    loss, m = ppo_clip_loss(logprobs, behaviour, adv, mask, clip_low=0.2, clip_high=0.28)
    assert loss.item() == pytest.approx(-0.226667, abs=1e-5)
    assert m.clip_fraction == pytest.approx(1 / 3)
    # k3(r) = r - 1 - ln r: 0.5-0.405465=0.094535, -0.5+0.693147=0.193147, 0.1-0.095310=0.004690
    assert m.approx_kl == pytest.approx((0.094535 + 0.193147 + 0.004690) / 3, abs=1e-5)
    assert m.ratio_mean == pytest.approx((1.5 + 0.5 + 1.1) / 3, abs=1e-5)
    loss.backward()
    # d loss / d logp_t = -A_t r_t / 3 where unclipped: t0 clipped -> 0, t1 -0.5/3, t2 +1.1/3, t3 masked
    assert logprobs.grad.tolist()[0] == pytest.approx([0.0, -0.166667, 0.366667, 0.0], abs=1e-5)


def test_aggregation_modes_hand_computed() -> None:
    """Sequence 0 is the case above (per-token losses -1.28, -0.5, +1.1). Sequence 1 has one
    token r=0.7, A=-2: min(-1.4, 0.8*-2=-1.6) = -1.6 -> loss +1.6 (clipped: A<0, r<0.8).
    Weights [1, 0.5]:
      token-mean          = (-1.28 - 0.5 + 1.1 + 0.5*1.6) / 4 = 0.12 / 4 = 0.03
      seq-mean-token-mean = (-0.68/3 + 0.5*1.6) / 2 = (-0.226667 + 0.8) / 2 = 0.286667
      seq-mean-token-sum  = (-0.68 + 0.8) / 2 = 0.06"""
    lp0, b0, a0, m0 = _ppo_case()
    lp = torch.cat([lp0.detach(), torch.tensor([[-1.0 + math.log(0.7), 0.0, 0.0, 0.0]])])
    beh = torch.cat([b0, torch.tensor([[-1.0, 0.0, 0.0, 0.0]])])
    adv = torch.cat([a0, torch.tensor([[-2.0, 0.0, 0.0, 0.0]])])
    mask = torch.cat([m0, torch.tensor([[True, False, False, False]])])
    w = torch.tensor([1.0, 0.5])
    expected = {"token-mean": 0.03, "seq-mean-token-mean": 0.286667, "seq-mean-token-sum": 0.06}
    for mode, value in expected.items():
        loss, m = ppo_clip_loss(lp, beh, adv, mask, weights=w, loss_agg=mode)
        assert float(loss) == pytest.approx(value, abs=1e-5), mode
        assert m.clip_fraction == pytest.approx(0.5)


def test_dual_clip_hand_computed() -> None:
    # r = 5, A = -1: -min(-5, -1.28) = 5, dual clip 3 -> min(5, 3*1) = 3
    loss, _ = ppo_clip_loss(
        torch.tensor([[math.log(5.0)]]), torch.zeros(1, 1), -torch.ones(1, 1), torch.ones(1, 1, dtype=torch.bool),
        dual_clip=3.0,
    )  # fmt: skip
    assert float(loss) == pytest.approx(3.0, abs=1e-5)


def test_decoupled_truncated_is_hand_computed() -> None:
    """t0: behaviour -2, proximal -1 -> w = e^1 = 2.718 truncated to 2; r = 1.1 vs proximal, A=1:
      loss = -2 * 1.1 = -2.2
    t1: behaviour -1, proximal -1.5 -> w = e^-0.5 = 0.606531; r = 1, A = -1: loss = +0.606531
    token-mean = (-2.2 + 0.606531) / 2 = -0.796735; IS mean = (2 + 0.606531)/2; truncated 1/2"""
    prox = torch.tensor([[-1.0, -1.5]])
    logprobs = prox + torch.log(torch.tensor([[1.1, 1.0]]))
    loss, m = ppo_clip_loss(
        logprobs, torch.tensor([[-2.0, -1.0]]), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2, dtype=torch.bool),
        proximal_logprobs=prox, is_cap=2.0,
    )  # fmt: skip
    assert float(loss) == pytest.approx(-0.796735, abs=1e-5)
    assert m.is_weight_mean == pytest.approx(1.303265, abs=1e-5)
    assert m.is_truncated_fraction == pytest.approx(0.5)


def test_k3_kl_hand_computed() -> None:
    # d = ref - logp = [-1, 1]: e^-1 + 1 - 1 = 0.367879; e^1 - 1 - 1 = 0.718282
    kl = k3_kl(torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -1.0]))
    assert kl.tolist() == pytest.approx([0.367879, 0.718282], abs=1e-5)
    # with A = 0 only the penalty remains: 0.1 * (0.367879 + 0.718282) / 2 = 0.054308
    loss, m = ppo_clip_loss(
        torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.0, -2.0]]), torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool),
        ref_logprobs=torch.tensor([[-2.0, -1.0]]), kl_coef=0.1,
    )  # fmt: skip
    assert float(loss) == pytest.approx(0.054308, abs=1e-5)
    assert m.ref_kl == pytest.approx(0.543081, abs=1e-5)


def test_normaliser_counts_tokens_or_nonempty_sequences() -> None:
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [0, 1, 0]], dtype=torch.bool)
    assert float(loss_normaliser(mask, "token-mean")) == 3
    assert float(loss_normaliser(mask, "seq-mean-token-mean")) == 2
    with pytest.raises(ValueError):
        loss_normaliser(mask, "mean")


# ----------------------------------------------------------------- naive references


def naive_ppo(logp, beh, adv, mask, w, mode, clip_low, clip_high, dual, prox, cap, ref, kl_coef) -> float:
    """Python loops over sequences and tokens; the textbook formulas."""
    seq_losses, tok_total, tok_count, n_seq = [], 0.0, 0, 0
    for i in range(logp.shape[0]):
        s, n = 0.0, 0
        for t in range(logp.shape[1]):
            if not mask[i, t]:
                continue
            anchor = float(prox[i, t]) if prox is not None else float(beh[i, t])
            r = math.exp(float(logp[i, t]) - anchor)
            a = float(adv[i, t])
            val = -min(r * a, min(max(r, 1 - clip_low), 1 + clip_high) * a)
            if dual is not None and a < 0:
                val = min(val, -dual * a)
            if prox is not None:
                iw = math.exp(anchor - float(beh[i, t]))
                val *= min(iw, cap) if cap is not None else iw
            if ref is not None:
                d = float(ref[i, t]) - float(logp[i, t])
                val += kl_coef * (math.exp(d) - d - 1)
            s += float(w[i]) * val
            n += 1
        tok_total += s
        tok_count += n
        if n:
            n_seq += 1
            seq_losses.append(s / n if mode == "seq-mean-token-mean" else s)
    if mode == "token-mean":
        return tok_total / max(tok_count, 1)
    return sum(seq_losses) / max(n_seq, 1)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("decoupled", [False, True])
def test_ppo_matches_naive_reference(mode: str, decoupled: bool) -> None:
    g = torch.Generator().manual_seed(7)
    b, t = 4, 7
    beh = -torch.rand(b, t, generator=g) * 3
    logp = beh + 0.4 * torch.randn(b, t, generator=g)
    prox = beh + 0.3 * torch.randn(b, t, generator=g) if decoupled else None
    adv = torch.randn(b, 1, generator=g).expand(b, t).contiguous()
    mask = torch.rand(b, t, generator=g) > 0.3
    mask[3] = False  # an all-masked sequence must not count in seq modes
    w = torch.rand(b, generator=g) + 0.5
    ref = beh + 0.2 * torch.randn(b, t, generator=g)
    kw = dict(clip_low=0.2, clip_high=0.28, dual=3.0, prox=prox, cap=1.5 if decoupled else None)
    loss, _ = ppo_clip_loss(
        logp, beh, adv, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0, proximal_logprobs=prox,
        is_cap=kw["cap"], ref_logprobs=ref, kl_coef=0.05, weights=w, loss_agg=mode,
    )  # fmt: skip
    assert float(loss) == pytest.approx(
        naive_ppo(logp, beh, adv, mask, w, mode, ref=ref, kl_coef=0.05, **kw), abs=1e-5
    )


def test_metrics_merge_equals_whole_batch() -> None:
    g = torch.Generator().manual_seed(3)
    beh = -torch.rand(6, 5, generator=g)
    logp = beh + 0.5 * torch.randn(6, 5, generator=g)
    adv = torch.randn(6, 5, generator=g)
    mask = torch.rand(6, 5, generator=g) > 0.4
    _, whole = ppo_clip_loss(logp, beh, adv, mask)
    _, a = ppo_clip_loss(logp[:2], beh[:2], adv[:2], mask[:2])
    _, b = ppo_clip_loss(logp[2:], beh[2:], adv[2:], mask[2:])
    merged = a.merge(b)
    for name in ("clip_fraction", "approx_kl", "ratio_mean", "is_weight_mean"):
        assert getattr(merged, name) == pytest.approx(getattr(whole, name), abs=1e-6)
    assert float(merged.ratio_max) == pytest.approx(float(whole.ratio_max))


def test_aggregate_with_external_normaliser_sums_over_parts() -> None:
    g = torch.Generator().manual_seed(5)
    loss_tok = torch.randn(6, 5, generator=g)
    mask = torch.rand(6, 5, generator=g) > 0.4
    w = torch.rand(6, generator=g)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        whole = aggregate_loss(loss_tok, mask, mode, w)
        norm = loss_normaliser(mask, mode)
        parts = sum(
            aggregate_loss(loss_tok[s], mask[s], mode, w[s], norm)
            for s in (slice(0, 1), slice(1, 4), slice(4, 6))
        )
        assert float(parts) == pytest.approx(float(whole), abs=1e-6), mode


@pytest.mark.parametrize("chunk", [1, 3, 1024])
def test_chunked_logprobs_and_entropy_match_full_log_softmax(chunk: int) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (2, 5), generator=g)
    naive = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    lp = token_logprobs(logits, labels, chunk_size=chunk)
    assert torch.allclose(lp.double(), naive.float().double(), atol=1e-6)
    p = torch.softmax(logits, -1)
    naive_ent = -(p * torch.log(p)).sum(-1)
    assert torch.allclose(entropy_from_logits(logits, chunk).double(), naive_ent, atol=1e-5)
    (g1,) = torch.autograd.grad(lp.sum(), logits)
    (g2,) = torch.autograd.grad(naive.sum(), logits)
    assert torch.allclose(g1, g2, atol=1e-5)


def _assert_matches_naive(chunk: int, temperature: float | torch.Tensor, seed: int) -> tuple[torch.Tensor, ...]:
    """The chunked head against ``log_softmax(logits / T)`` (T a number or one per row): values,
    entropies and gradients. Returns (hidden, weight, bias, labels) for further checks."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(9, 6, generator=g, requires_grad=True)
    weight = torch.randn(13, 6, generator=g, requires_grad=True)
    bias = torch.randn(13, generator=g, requires_grad=True)
    labels = torch.randint(0, 13, (9,), generator=g)
    upstream = torch.randn(9, generator=g)
    divisor = temperature.unsqueeze(-1) if isinstance(temperature, torch.Tensor) else temperature
    logits = (hidden @ weight.t() + bias) / divisor
    naive = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    p = torch.softmax(logits, -1)
    naive_ent = -(p * torch.log(p)).sum(-1)
    lp, ent = linear_token_logprobs(
        hidden, weight, labels, bias=bias, chunk_size=chunk, temperature=temperature, with_entropy=True
    )
    assert torch.allclose(lp, naive, atol=1e-5)
    assert torch.allclose(ent, naive_ent, atol=1e-5)
    got = torch.autograd.grad((lp * upstream).sum(), (hidden, weight, bias))
    want = torch.autograd.grad((naive * upstream).sum(), (hidden, weight, bias))
    for a, b in zip(got, want, strict=True):
        assert torch.allclose(a, b, atol=1e-5)
    return hidden, weight, bias, labels


@pytest.mark.parametrize("chunk", [1, 4, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_linear_logprobs_match_naive_values_and_gradients(chunk: int, temperature: float) -> None:
    _assert_matches_naive(chunk, temperature, seed=1)


def test_linear_logprobs_per_row_temperature_hand_computed() -> None:
    """Row 0 at T = 2: logits log([1, 4, 9]) / 2 = log([1, 2, 3]) -> log(3/6) for label 2.
    Row 1 at T = 1: logits log([4, 4, 2]) -> log(0.2) for label 2. Row 2 at T = 0.5:
    logits log([1, 1, 2]) / 0.5 = log([1, 1, 4]) -> log(4/6) for label 2."""
    logits = torch.log(torch.tensor([[1.0, 4.0, 9.0], [4.0, 4.0, 2.0], [1.0, 1.0, 2.0]]))
    eye = torch.eye(3)  # hidden = logits, weight = identity: the head computes the logits themselves
    lp, _ = linear_token_logprobs(logits, eye, torch.tensor([2, 2, 2]), chunk_size=2,
                                  temperature=torch.tensor([2.0, 1.0, 0.5]))  # fmt: skip
    assert lp.tolist() == pytest.approx([math.log(3 / 6), math.log(0.2), math.log(4 / 6)], abs=1e-6)


@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_linear_logprobs_per_row_temperatures_match_naive_values_and_gradients(chunk: int) -> None:
    """Each row divided by its own T, forward and backward, as ``log_softmax(logits / T)`` per row."""
    temps = torch.tensor([0.7, 0.7, 1.0, 1.0, 0.3, 1.6, 0.7, 1.0, 2.0])
    hidden, weight, bias, labels = _assert_matches_naive(chunk, temps, seed=3)
    # a tensor of equal values is the same as that one value
    same, _ = linear_token_logprobs(hidden, weight, labels, bias=bias, temperature=torch.full((9,), 0.7))
    assert torch.equal(same, linear_token_logprobs(hidden, weight, labels, bias=bias, temperature=0.7)[0])


@pytest.mark.parametrize(
    ("temperature", "match"),
    [(torch.ones(3), r"one value per row \(4\)"), (0.0, "must be > 0"), (torch.tensor([1.0, 1, -1, 1]), "must be > 0")],
)
def test_linear_logprobs_reject_bad_temperatures(temperature, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        linear_token_logprobs(torch.zeros(4, 2), torch.zeros(3, 2), torch.zeros(4, dtype=torch.long),
                              temperature=temperature)  # fmt: skip


def test_linear_logprobs_gradcheck_float64_and_frozen_head() -> None:
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(7, 4, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 7, (5,), generator=g)

    def fn(h, w):
        # the forward computes in float32 internally; gradcheck in float64 with a loose tolerance
        return linear_token_logprobs(h, w, labels, chunk_size=2)[0].double()

    assert torch.autograd.gradcheck(fn, (hidden, weight), eps=1e-3, atol=1e-3, rtol=1e-3)
    # a frozen head (LoRA) gets no gradient and the hidden states still do
    frozen = weight.detach()
    lp, _ = linear_token_logprobs(hidden, frozen, labels)
    lp.sum().backward()
    assert hidden.grad is not None and frozen.grad is None
