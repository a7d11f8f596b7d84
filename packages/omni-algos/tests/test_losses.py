import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_algos.losses import LOSSES, LossOutput, flow_grpo, register


def _ref_flow_grpo(lp, old, adv, clip, cmax, w=None):
    out = []
    for i in range(lp.shape[0]):
        a = min(max(float(adv[i]), -cmax), cmax)
        r = torch.exp(lp[i] - old[i])
        l1 = -a * r
        l2 = -a * torch.clamp(r, 1 - clip, 1 + clip)
        li = l1 if l1 > l2 else l2
        out.append(li * (1.0 if w is None else float(w[i])))
    return torch.stack(out).mean()


def test_flow_grpo_matches_reference_and_grad():
    g = torch.Generator().manual_seed(0)
    lp = (torch.randn(16, generator=g) * 1e-3).double().requires_grad_(True)
    old = torch.randn(16, generator=g).double() * 1e-3
    adv = torch.randn(16, generator=g).double() * 4
    adv[0] = 9.0
    w = torch.rand(16, generator=g).double()
    out = flow_grpo(lp, old, adv, clip_range=1e-3, adv_clip_max=5.0, weights=w)
    ref = _ref_flow_grpo(lp, old, adv, 1e-3, 5.0, w)
    torch.testing.assert_close(out.loss, ref)
    (ga,) = torch.autograd.grad(out.loss, lp)
    (gb,) = torch.autograd.grad(ref, lp)
    torch.testing.assert_close(ga, gb)
    assert isinstance(out, LossOutput)
    for k in (
        "ratio_mean",
        "ratio_std",
        "clipfrac",
        "clipfrac_higher",
        "clipfrac_lower",
        "approx_kl",
    ):
        assert isinstance(out.metrics[k], float)
    ratio = torch.exp(lp - old).detach()
    assert out.metrics["clipfrac_higher"] == pytest.approx(
        float((ratio - 1 > 1e-3).double().mean())
    )
    assert out.metrics["approx_kl"] == pytest.approx(float(0.5 * ((lp - old).detach() ** 2).mean()))


def test_ratio_spread_of_pieces_gives_the_whole_batchs_std():
    """`ratio_dev_sq_mean` and `ratio_mean`, averaged over pieces weighted by their sizes, give
    the whole batch's std; the pieces' own `ratio_std` do not (a one-element piece's is 0)."""
    g = torch.Generator().manual_seed(2)
    lp, old = torch.randn(12, generator=g) * 0.05, torch.zeros(12)
    adv = torch.randn(12, generator=g)
    want = float(torch.exp(lp).std(unbiased=False))
    sizes = [1, 5, 6]
    pieces = [
        flow_grpo(a, b, c, clip_range=0.2).metrics
        for a, b, c in zip(lp.split(sizes), old.split(sizes), adv.split(sizes), strict=True)
    ]
    mean = sum(m["ratio_mean"] * n for m, n in zip(pieces, sizes, strict=True)) / 12
    dev_sq = sum(m["ratio_dev_sq_mean"] * n for m, n in zip(pieces, sizes, strict=True)) / 12
    assert (dev_sq - (mean - 1) ** 2) ** 0.5 == pytest.approx(want, rel=1e-4)
    assert pieces[0]["ratio_std"] == 0.0 and want > 0.01


def test_flow_grpo_gradcheck():
    g = torch.Generator().manual_seed(1)
    lp = (torch.randn(6, generator=g) * 0.3).double().requires_grad_(True)
    old = torch.randn(6, generator=g).double() * 0.3
    adv = torch.randn(6, generator=g).double()
    assert torch.autograd.gradcheck(lambda x: flow_grpo(x, old, adv, clip_range=0.2).loss, (lp,))


def test_flow_grpo_on_policy_gradient_is_minus_advantage():
    lp = torch.zeros(4, requires_grad=True)
    adv = torch.tensor([1.0, -2.0, 7.0, 0.5])
    out = flow_grpo(lp, lp.detach(), adv)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, -torch.tensor([1.0, -2.0, 5.0, 0.5]) / 4)
    assert out.metrics["clipfrac"] == 0.0


def test_register_rules():
    assert {"flow_grpo", "dance_grpo", "mix_grpo"} <= set(LOSSES)
    register("flow_grpo")(flow_grpo)  # same function again: no-op

    with pytest.raises(ValueError, match="flow_grpo"):

        @register("flow_grpo")
        def other(*a, **k):
            return LossOutput(torch.zeros(()))

    @register("my_test_loss")
    def mine(x):
        return LossOutput(x.sum())

    assert LOSSES["my_test_loss"] is mine
    del LOSSES["my_test_loss"]


def test_shape_mismatch_is_named():
    with pytest.raises(ValueError, match="old_log_prob"):
        flow_grpo(torch.zeros(3), torch.zeros(4), torch.zeros(3))


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 12),
    seed=st.integers(0, 10_000),
    clip=st.floats(1e-5, 0.5),
    scale=st.floats(1e-4, 2.0),
)
def test_property_flow_grpo_matches_reference(n, seed, clip, scale):
    g = torch.Generator().manual_seed(seed)
    lp = torch.randn(n, generator=g, dtype=torch.float64) * scale
    old = torch.randn(n, generator=g, dtype=torch.float64) * scale
    adv = torch.randn(n, generator=g, dtype=torch.float64) * 4
    w = torch.rand(n, generator=g, dtype=torch.float64)
    out = flow_grpo(lp, old, adv, clip_range=clip, weights=w)
    assert abs(out.loss.item() - _ref_flow_grpo(lp, old, adv, clip, 5.0, w).item()) < 1e-9
    ones = flow_grpo(lp, old, adv, clip_range=clip, weights=torch.ones(n, dtype=torch.float64))
    assert ones.loss.item() == flow_grpo(lp, old, adv, clip_range=clip).loss.item()
    assert 0.0 <= out.metrics["clipfrac"] <= 1.0
