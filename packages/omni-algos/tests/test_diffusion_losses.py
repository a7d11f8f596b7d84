import math

import pytest
import torch

from omni_algos.losses import (
    diffusion_dpo,
    diffusion_nft,
    flow_dppo,
    grpo_guard,
    kl_penalty,
    nft_reward_prob,
    pair_by_reward,
)


def _g(seed):
    return torch.Generator().manual_seed(seed)


def test_kl_penalty_reference():
    g = _g(0)
    m, ref = torch.randn(3, 4, 2, generator=g), torch.randn(3, 4, 2, generator=g)
    std = torch.tensor([0.5, 1.0, 2.0])
    out = kl_penalty(m, ref, std)
    want = sum(((m[b] - ref[b]) ** 2).mean() / (2 * std[b] ** 2) for b in range(3)) / 3
    assert abs(out.loss.item() - want.item()) < 1e-6
    # equals the KL of the two Gaussians, per element, averaged
    b = 1
    kl = torch.distributions.kl_divergence(
        torch.distributions.Normal(m[b], std[b]), torch.distributions.Normal(ref[b], std[b])
    ).mean()
    assert abs(((m[b] - ref[b]) ** 2).mean() / (2 * std[b] ** 2) - kl) < 1e-6


def _dppo_inputs(seed=0):
    g = _g(seed)
    b = 8
    lp = torch.randn(b, generator=g, dtype=torch.float64) * 0.1
    old = lp + torch.randn(b, generator=g, dtype=torch.float64) * 0.05
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    mean = torch.randn(b, 3, 2, generator=g, dtype=torch.float64)
    old_mean = mean + torch.randn(b, 3, 2, generator=g, dtype=torch.float64) * 0.01
    old_mean[:3] = mean[:3]  # no divergence: never masked
    return lp, old, adv, mean, old_mean


def test_flow_dppo_reference():
    lp, old, adv, mean, old_mean = _dppo_inputs()
    std, sdt = (
        torch.full((8,), 0.7, dtype=torch.float64),
        torch.full((8,), 0.3, dtype=torch.float64),
    )
    lp.requires_grad_(True)
    out = flow_dppo(lp, old, adv, mean, old_mean, std=std, sqrt_dt=sdt, threshold=1e-3)
    tot, masked = 0.0, 0
    for i in range(8):
        d = ((mean[i] - old_mean[i]) ** 2).mean() / (2 * (0.7 * 0.3) ** 2)
        r = math.exp(float(lp[i].detach() - old[i]))
        a = float(adv[i])
        m = d >= 1e-3 and ((r > 1 and a > 0) or (r < 1 and a < 0))
        masked += m
        tot += 0.0 if m else -a * r
    assert abs(out.loss.item() - tot / 8) < 1e-9
    assert out.metrics["mask_frac"] == masked / 8
    assert 0 < masked < 8
    # no coefficient: D = mean (dm)^2 / 2
    out2 = flow_dppo(lp, old, adv, mean, old_mean, threshold=1e-30)
    r = torch.exp(lp - old).detach()
    want_mask = ((mean - old_mean) ** 2).mean(dim=(1, 2)) / 2 >= 1e-30
    want_mask &= ((r > 1) & (adv > 0)) | ((r < 1) & (adv < 0))
    assert out2.metrics["mask_frac"] == float(want_mask.double().mean())
    assert torch.autograd.gradcheck(
        lambda x: flow_dppo(x, old, adv, mean, old_mean, std=std, sqrt_dt=sdt).loss, (lp,)
    )


def test_grpo_guard_reference():
    lp, old, adv, mean, old_mean = _dppo_inputs(1)
    std = torch.linspace(0.5, 1.0, 8, dtype=torch.float64)
    sdt = torch.full((8,), 0.2, dtype=torch.float64)
    clip = 0.05
    out = grpo_guard(lp, old, adv, mean, old_mean, std, sdt, clip_range=clip)
    s = 0.2 * float(std.mean())
    tot = 0.0
    for i in range(8):
        bias = float(((mean[i] - old_mean[i]) ** 2).mean()) / (2 * s**2)
        r = math.exp((float(lp[i] - old[i]) + bias) * s)
        a = max(min(float(adv[i]), 5), -5)
        tot += max(-a * r, -a * min(max(r, 1 - clip), 1 + clip))
    assert abs(out.loss.item() - tot / 8 / 0.2**2) < 1e-9
    m = mean.clone().requires_grad_(True)
    x = lp.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda a, b: grpo_guard(a, old, adv, b, old_mean, std, sdt, clip_range=0.3).loss, (x, m)
    )


def test_nft_reward_prob_modes():
    a = torch.tensor([-7.0, -2.5, 0.0, 2.5, 7.0])
    torch.testing.assert_close(nft_reward_prob(a), torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0]))
    torch.testing.assert_close(
        nft_reward_prob(a, adv_mode="positive_only"), torch.tensor([0.5, 0.5, 0.5, 0.75, 1.0])
    )
    torch.testing.assert_close(
        nft_reward_prob(a, adv_mode="negative_only"), torch.tensor([0.0, 0.25, 0.5, 0.5, 0.5])
    )
    torch.testing.assert_close(
        nft_reward_prob(a, adv_mode="binary"), torch.tensor([0.4, 0.4, 0.5, 0.6, 0.6])
    )
    torch.testing.assert_close(
        nft_reward_prob(a, adv_mode="one_only"), torch.tensor([0.5, 0.5, 0.5, 0.6, 0.6])
    )
    with pytest.raises(ValueError, match="adv_mode"):
        nft_reward_prob(a, adv_mode="bogus")


def test_diffusion_nft_reference():
    g = _g(3)
    b, shape = 4, (2, 3)
    x0 = torch.randn(b, *shape, generator=g, dtype=torch.float64)
    eps = torch.randn(b, *shape, generator=g, dtype=torch.float64)
    t = torch.tensor([0.2, 0.5, 0.7, 0.9], dtype=torch.float64)
    xt = (1 - t.view(-1, 1, 1)) * x0 + t.view(-1, 1, 1) * eps
    v_old = (eps - x0) + 0.3 * torch.randn(b, *shape, generator=g, dtype=torch.float64)
    v = v_old + 0.1 * torch.randn(b, *shape, generator=g, dtype=torch.float64)
    v_ref = v_old + 0.05
    adv = torch.tensor([-3.0, 1.0, 6.0, 0.0], dtype=torch.float64)
    beta, c, lam = 0.7, 5.0, 0.1
    vv = v.clone().requires_grad_(True)
    out = diffusion_nft(vv, v_old, xt, x0, t, adv, ref_velocity=v_ref, beta=beta, kl_weight=lam)
    vr = v.clone().requires_grad_(True)
    tot = 0.0
    for i in range(b):
        p = min(max(max(min(float(adv[i]), c), -c) / (2 * c) + 0.5, 0), 1)
        vp = beta * vr[i] + (1 - beta) * v_old[i]
        vn = (1 + beta) * v_old[i] - beta * vr[i]
        xp, xn = xt[i] - t[i] * vp, xt[i] - t[i] * vn
        # adaptive weights are constants (python floats): stop-gradient
        lp_ = ((xp - x0[i]) ** 2).mean() / max(float((xp - x0[i]).detach().abs().mean()), 1e-5)
        ln_ = ((xn - x0[i]) ** 2).mean() / max(float((xn - x0[i]).detach().abs().mean()), 1e-5)
        tot = tot + c * (p * lp_ + (1 - p) * ln_) / beta
    want = tot / b + lam * ((vr - v_ref) ** 2).mean()
    assert abs(out.loss.item() - float(want.detach())) < 1e-9
    out.loss.backward()
    want.backward()
    torch.testing.assert_close(vv.grad, vr.grad, atol=1e-10, rtol=1e-9)


def test_diffusion_nft_positive_advantage_pulls_towards_x0():
    """With p = 1 the loss is minimised by v+ predicting x0 exactly, i.e. v = eps - x0."""
    g = _g(4)
    x0 = torch.randn(2, 3, generator=g)
    eps = torch.randn(2, 3, generator=g)
    xt = 0.5 * x0 + 0.5 * eps
    v = torch.zeros(2, 3, requires_grad=True)
    start = float((v.detach() - (eps - x0)).abs().max())
    for _ in range(400):  # plain gradient descent
        loss = diffusion_nft(v, torch.zeros(2, 3), xt, x0, 0.5, torch.full((2,), 10.0)).loss
        (grad,) = torch.autograd.grad(loss, v)
        with torch.no_grad():
            v -= 0.02 * grad
    assert float((v.detach() - (eps - x0)).abs().max()) < 0.1 * start


def test_diffusion_dpo_reference_and_pairing():
    g = _g(5)
    b, shape = 3, (4, 2)
    x0w, x0l = torch.randn(b, *shape, generator=g), torch.randn(b, *shape, generator=g)
    eps = torch.randn(b, *shape, generator=g)
    vw, vl = torch.randn(b, *shape, generator=g), torch.randn(b, *shape, generator=g)
    rw = vw + 0.01 * torch.randn(b, *shape, generator=g)
    rl = vl + 0.01 * torch.randn(b, *shape, generator=g)
    beta = 50.0
    out = diffusion_dpo(vw, vl, rw, rl, x0w, x0l, eps, beta=beta)
    tot, acc = 0.0, 0
    for i in range(b):
        ew = ((vw[i] - (eps[i] - x0w[i])) ** 2).mean()
        el = ((vl[i] - (eps[i] - x0l[i])) ** 2).mean()
        erw = ((rw[i] - (eps[i] - x0w[i])) ** 2).mean()
        erl = ((rl[i] - (eps[i] - x0l[i])) ** 2).mean()
        z = float(-beta / 2 * ((ew - erw) - (el - erl)))
        tot += math.log1p(math.exp(-z))
        acc += z > 0
    assert abs(out.loss.item() - tot / b) < 1e-5
    assert out.metrics["implicit_acc"] == acc / b
    w, lo = pair_by_reward(
        torch.tensor([0.1, 0.9, 0.5, 0.3, 0.3, 2.0]), ["a", "a", "a", "b", "b", "c"]
    )
    assert w.tolist() == [1] and lo.tolist() == [0]
    with pytest.raises(ValueError, match="rows"):
        pair_by_reward([0.0, float("nan")], [0, 0])


def test_pair_by_reward_several_pairs_per_group():
    # group a: rewards 0.1 0.9 0.5 0.7 -> best 1, 3, 2, 0; worst 0, 2, 3, 1
    # group b: binary with ties -> 1s at rows 5, 7; 0s at rows 4, 6, 8 (earlier row first)
    rewards = [0.1, 0.9, 0.5, 0.7, 0.0, 1.0, 0.0, 1.0, 0.0]
    groups = ["a"] * 4 + ["b"] * 5
    w, lo = pair_by_reward(rewards, groups, per_group=8)  # capped at half of each group
    assert list(zip(w.tolist(), lo.tolist())) == [(1, 0), (3, 2), (5, 4), (7, 6)]
    w, lo = pair_by_reward(rewards, groups, per_group=1)  # the best vs the worst
    assert list(zip(w.tolist(), lo.tolist())) == [(1, 0), (5, 4)]
    # a pair needs a strict gap: one 1 among 0s gives one pair however many are asked for
    w, lo = pair_by_reward([0.0, 1.0, 0.0, 0.0], [0, 0, 0, 0], per_group=2)
    assert list(zip(w.tolist(), lo.tolist())) == [(1, 0)]
    with pytest.raises(ValueError, match="per_group"):
        pair_by_reward(rewards, groups, per_group=0)


def test_kl_penalty_and_dpo_gradcheck():
    g = _g(9)
    m = torch.randn(2, 3, generator=g, dtype=torch.float64).requires_grad_(True)
    ref = torch.randn(2, 3, generator=g, dtype=torch.float64)
    std = torch.tensor([0.3, 0.9], dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda x: kl_penalty(x, ref, std).loss, (m,))
    xs = [torch.randn(2, 3, generator=g, dtype=torch.float64) for _ in range(5)]
    vw = torch.randn(2, 3, generator=g, dtype=torch.float64).requires_grad_(True)
    vl = torch.randn(2, 3, generator=g, dtype=torch.float64).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a, b: diffusion_dpo(a, b, *xs, beta=5.0).loss, (vw, vl))


def test_flow_dppo_zero_divergence_is_plain_policy_gradient():
    lp, old, adv, mean, _ = _dppo_inputs(2)
    out = flow_dppo(lp, old, adv, mean, mean.clone())
    assert out.metrics["mask_frac"] == 0.0
    assert abs(out.loss.item() - float((-adv * torch.exp(lp - old)).mean())) < 1e-12
