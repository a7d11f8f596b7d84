import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_algos.losses import agg_loss, grpo, gspo
from omni_algos.losses.token import AGG_MODES


def _data(b=4, t=6, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    lp = (torch.randn(b, t, generator=g) * 0.5 - 1).to(dtype)
    old = lp + torch.randn(b, t, generator=g).to(dtype) * 3e-4
    adv = torch.randn(b, generator=g).to(dtype)
    mask = (torch.rand(b, t, generator=g) > 0.3).to(dtype)
    mask[0] = 0  # a fully masked row
    mask[1, 0] = 1
    return lp, old, adv, mask


def _ref_gspo(lp, old, adv, mask, lo, hi):
    """Loop reference for GSPO's loss (seq-mean-token-mean) and its analytic gradient."""
    b, t = lp.shape
    rows = [i for i in range(b) if mask[i].sum() > 0]
    loss = 0.0
    grad = torch.zeros(b, t, dtype=torch.float64)
    for i in rows:
        n = float(mask[i].sum())
        s = math.exp(min(sum(float(lp[i, j] - old[i, j]) for j in range(t) if mask[i, j]) / n, 10))
        a = float(adv[i])
        l1, l2 = -a * s, -a * min(max(s, 1 - lo), 1 + hi)
        loss += max(l1, l2) / len(rows)
        # the unclipped branch is active when l1 >= l2; the clipped one has zero gradient
        # unless s is inside the clip range, where both coincide
        if l1 >= l2:
            for j in range(t):
                if mask[i, j]:
                    grad[i, j] = -a * s / n / len(rows)
    return loss, grad


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gspo_loss_and_gradient_match_reference(seed):
    lp, old, adv, mask = _data(seed=seed)
    lp.requires_grad_(True)
    out = gspo(lp, old, adv, mask)
    ref_loss, ref_grad = _ref_gspo(lp.detach(), old, adv, mask, 3e-4, 4e-4)
    assert abs(out.loss.item() - ref_loss) < 1e-6
    out.loss.backward()
    torch.testing.assert_close(lp.grad, ref_grad, atol=1e-6, rtol=1e-6)


def test_gspo_float32_close_to_float64():
    lp, old, adv, mask = _data(seed=5)
    a = gspo(lp, old, adv, mask).loss.item()
    b = gspo(lp.float(), old.float(), adv.float(), mask.float()).loss.item()
    assert abs(a - b) < 1e-6


def test_gspo_token_level_advantages_and_clip():
    lp, old, adv, mask = _data(seed=3)
    a1 = gspo(lp, old, adv, mask).loss
    a2 = gspo(lp, old, adv[:, None].expand_as(lp), mask).loss
    torch.testing.assert_close(a1, a2)
    far = gspo(lp, lp.detach() - 1.0, adv, mask)  # ratio e >> 1 + clip: clipped where A > 0
    assert far.metrics["clipfrac"] > 0


def test_gspo_all_masked_is_zero_not_nan():
    lp = torch.zeros(2, 3, requires_grad=True)
    out = gspo(lp, lp.detach(), torch.ones(2), torch.zeros(2, 3))
    out.loss.backward()
    assert out.loss.item() == 0 and torch.equal(lp.grad, torch.zeros(2, 3))


def test_gspo_gradcheck():
    lp, old, adv, mask = _data(b=3, t=4, seed=7)
    old = lp + 0.1 * torch.randn(
        lp.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1)
    )
    lp.requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda x: gspo(x, old, adv, mask, clip_low=0.2, clip_high=0.2).loss, (lp,)
    )


def _ref_agg(loss, mask, mode):
    b, t = loss.shape
    rows = [i for i in range(b) if mask[i].sum() > 0]
    tot = sum(float(loss[i, j]) for i in range(b) for j in range(t) if mask[i, j])
    if mode == "token-mean":
        return tot / float(mask.sum())
    if mode == "seq-mean-token-sum-norm":
        return tot / (len(rows) * t)
    per = []
    for i in rows:
        s = sum(float(loss[i, j]) for j in range(t) if mask[i, j])
        per.append(s / float(mask[i].sum()) if mode == "seq-mean-token-mean" else s)
    return sum(per) / len(per)


@pytest.mark.parametrize(
    "mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
)
def test_agg_modes(mode):
    g = torch.Generator().manual_seed(0)
    loss = torch.randn(5, 7, generator=g, dtype=torch.float64)
    mask = (torch.rand(5, 7, generator=g) > 0.4).double()
    mask[2] = 0
    assert abs(agg_loss(loss, mask, mode).item() - _ref_agg(loss, mask, mode)) < 1e-9
    with pytest.raises(ValueError, match="agg"):
        agg_loss(loss, mask, "bogus")


def _ref_grpo(lp, old, adv, mask, lo, hi, c):
    b, t = lp.shape
    tot, n = 0.0, 0
    for i in range(b):
        for j in range(t):
            if not mask[i, j]:
                continue
            r = math.exp(float(lp[i, j] - old[i, j]))
            a = float(adv[i])
            v = max(-a * r, -a * min(max(r, 1 - lo), 1 + hi))
            if a < 0:
                v = min(v, -a * c)
            tot += v
            n += 1
    return tot / n


def test_grpo_token_loss_matches_reference():
    lp, old, adv, mask = _data(seed=4)
    old = (
        lp
        + torch.randn(lp.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        * 0.8
    )
    out = grpo(lp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    assert abs(out.loss.item() - _ref_grpo(lp, old, adv, mask, 0.2, 0.28, 3.0)) < 1e-9
    assert 0 < out.metrics["clipfrac"] < 1


def test_grpo_on_policy_gradient():
    lp = torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.float64)
    out = grpo(lp, lp.detach(), torch.tensor([1.0, -2.0], dtype=torch.float64), mask)
    out.loss.backward()
    want = torch.tensor([[-1, -1, 0], [2, 0, 0]], dtype=torch.float64) / 3
    torch.testing.assert_close(lp.grad, want)


@settings(max_examples=30, deadline=None)
@given(
    b=st.integers(1, 4),
    t=st.integers(1, 6),
    seed=st.integers(0, 1000),
    agg=st.sampled_from(
        ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
    ),
)
def test_property_on_policy_loss_is_minus_mean_advantage(b, t, seed, agg):
    g = torch.Generator().manual_seed(seed)
    lp = torch.randn(b, t, generator=g, dtype=torch.float64)
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    mask = (torch.rand(b, t, generator=g) > 0.3).double()
    for fn in (grpo, gspo):
        out = fn(lp, lp, adv, mask, agg=agg)
        want = agg_loss(-adv[:, None].expand(b, t), mask, agg)
        assert torch.isfinite(out.loss)
        assert abs(out.loss.item() - want.item()) < 1e-9


def test_k3_kl_zero_at_equal_and_positive_otherwise() -> None:
    from omni_algos.losses import k3_kl

    lp = torch.tensor([[-1.0, -2.0, -3.0]])
    mask = torch.tensor([[True, True, False]])
    assert float(k3_kl(lp, lp.clone(), mask)) == pytest.approx(0.0, abs=1e-7)
    ref = lp + torch.tensor([[0.5, -0.5, 100.0]])  # the masked token must not count
    d = torch.tensor([0.5, -0.5])
    expect = float((torch.exp(d) - d - 1).mean())
    assert float(k3_kl(lp, ref, mask)) == pytest.approx(expect, rel=1e-6)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batches_weighted_by_their_units_give_the_whole_batch(mode):
    """Split into micro-batches (same padded length), each aggregate weighted by its share of
    the units (tokens for token-mean, non-empty rows for the seq-mean modes), as omni_train's
    updates and verl's global batch normalisation weigh them, sums to the whole batch's."""
    g = torch.Generator().manual_seed(3)
    loss = torch.randn(8, 6, generator=g, dtype=torch.float64)
    mask = (torch.rand(8, 6, generator=g) > 0.3).double()
    mask[5] = 0

    def units(m):
        return m.sum() if mode == "token-mean" else (m.sum(-1) > 0).sum().double()

    parts = [slice(0, 3), slice(3, 4), slice(4, 8)]
    split = sum(units(mask[p]) / units(mask) * agg_loss(loss[p], mask[p], mode) for p in parts)
    assert abs(float(split) - float(agg_loss(loss, mask, mode))) < 1e-12
