import math

import pytest
import torch
from algos_refs import ref_cps, ref_dance, ref_flow_grpo_sde
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_algos import sde

KINDS = ["sde", "cps", "dance", "ode"]


def _inputs(b=3, shape=(4, 3, 2), seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, *shape, generator=g).to(dtype)
    v = torch.randn(b, *shape, generator=g).to(dtype)
    return x, v


@pytest.mark.parametrize("sigma,sigma_next", [(1.0, 0.9), (0.7, 0.6), (0.3, 0.05), (0.2, 0.0)])
def test_sde_kind_matches_flow_grpo_formula(sigma, sigma_next):
    x, v = _inputs()
    out = sde.step(
        x,
        v,
        sigma,
        sigma_next,
        noise_level=0.7,
        kind="sde",
        sigma_max=0.95,
        generator=torch.Generator().manual_seed(1),
    )
    for b in range(x.shape[0]):
        mean, lp, s = ref_flow_grpo_sde(
            x[b], v[b], sigma, sigma_next, 0.7, out.prev_sample[b], 0.95
        )
        torch.testing.assert_close(out.mean[b].double(), mean, atol=1e-5, rtol=1e-5)
        assert abs(out.log_prob[b].item() - lp.item()) < 1e-5
        assert abs(out.std[b].item() - s) < 1e-6
    assert torch.allclose(out.sqrt_dt, torch.full((3,), math.sqrt(sigma - sigma_next)))


def test_sde_default_sigma_max_is_sigma_next_at_sigma_one():
    x, v = _inputs()
    a = sde.step(x, v, 1.0, 0.9, noise_level=0.5, kind="sde", prev_sample=x)
    b = sde.step(x, v, 1.0, 0.9, noise_level=0.5, kind="sde", prev_sample=x, sigma_max=0.9)
    torch.testing.assert_close(a.log_prob, b.log_prob)
    assert abs(a.std[0].item() - 0.5 * math.sqrt(1 / 0.1)) < 1e-5
    assert torch.isfinite(a.log_prob).all()


@pytest.mark.parametrize("sigma,sigma_next", [(1.0, 0.9), (0.5, 0.3), (0.1, 0.0)])
def test_cps_matches_formula(sigma, sigma_next):
    x, v = _inputs(seed=3)
    out = sde.step(
        x,
        v,
        sigma,
        sigma_next,
        noise_level=0.6,
        kind="cps",
        generator=torch.Generator().manual_seed(2),
    )
    for b in range(x.shape[0]):
        mean, lp, s = ref_cps(x[b], v[b], sigma, sigma_next, 0.6, out.prev_sample[b])
        torch.testing.assert_close(out.mean[b].double(), mean, atol=1e-5, rtol=1e-5)
        assert abs(out.log_prob[b].item() - lp.item()) < 1e-5
        assert abs(out.std[b].item() - s) < 1e-6
    if sigma_next == 0:  # s = 0: the last step is deterministic
        torch.testing.assert_close(out.prev_sample, out.mean)
        return
    # the step's noise has std s (not s sqrt(-dt))
    noise = (out.prev_sample - out.mean) / out.std.reshape(-1, 1, 1, 1)
    g = torch.Generator().manual_seed(2)
    torch.testing.assert_close(noise, torch.randn(x.shape, generator=g), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("sigma,sigma_next", [(1.0, 0.9), (0.5, 0.3)])
def test_dance_matches_formula(sigma, sigma_next):
    x, v = _inputs(seed=4)
    out = sde.step(
        x,
        v,
        sigma,
        sigma_next,
        noise_level=0.3,
        kind="dance",
        generator=torch.Generator().manual_seed(5),
    )
    for b in range(x.shape[0]):
        mean, lp, s = ref_dance(x[b], v[b], sigma, sigma_next, 0.3, out.prev_sample[b])
        torch.testing.assert_close(out.mean[b].double(), mean, atol=1e-5, rtol=1e-5)
        assert abs(out.log_prob[b].item() - lp.item()) < 1e-5
        assert abs(out.std[b].item() - s) < 1e-6


def test_ode_kind():
    x, v = _inputs()
    out = sde.step(x, v, 0.8, 0.5, noise_level=0.7, kind="ode")
    torch.testing.assert_close(out.prev_sample, x - 0.3 * v)
    assert torch.equal(out.log_prob, torch.zeros(3))
    assert torch.equal(out.std, torch.zeros(3))


def test_per_row_sigmas_equal_rowwise_calls():
    x, v = _inputs(b=4, seed=7)
    sig = torch.tensor([1.0, 0.8, 0.5, 0.2])
    sig_n = torch.tensor([0.9, 0.6, 0.45, 0.0])
    for kind in ["sde", "cps", "dance"]:
        gens = [torch.Generator().manual_seed(10 + b) for b in range(4)]
        out = sde.step(x, v, sig, sig_n, noise_level=0.8, kind=kind, generator=gens, sigma_max=0.95)
        for b in range(4):
            one = sde.step(
                x[b : b + 1],
                v[b : b + 1],
                float(sig[b]),
                float(sig_n[b]),
                noise_level=0.8,
                kind=kind,
                sigma_max=0.95,
                generator=[torch.Generator().manual_seed(10 + b)],
            )
            torch.testing.assert_close(out.prev_sample[b : b + 1], one.prev_sample)
            torch.testing.assert_close(out.log_prob[b : b + 1], one.log_prob)
            torch.testing.assert_close(out.std[b : b + 1], one.std)


def test_per_row_generators_are_independent_of_batch_neighbours():
    x, v = _inputs(b=3)
    a = sde.step(
        x,
        v,
        0.5,
        0.4,
        noise_level=1.0,
        generator=[torch.Generator().manual_seed(s) for s in (1, 2, 3)],
    )
    b = sde.step(
        x[1:2], v[1:2], 0.5, 0.4, noise_level=1.0, generator=[torch.Generator().manual_seed(2)]
    )
    torch.testing.assert_close(a.prev_sample[1:2], b.prev_sample)
    noise = torch.randn(x.shape[1:], generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(
        (a.prev_sample[1] - a.mean[1]) / (a.std[1] * a.sqrt_dt[1]), noise, atol=1e-4, rtol=1e-4
    )


def test_single_generator_is_one_full_draw():
    x, v = _inputs(b=2)
    a = sde.step(
        x, v, 0.5, 0.4, noise_level=1.0, kind="dance", generator=torch.Generator().manual_seed(9)
    )
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(9))
    torch.testing.assert_close(a.prev_sample, a.mean + a.std[0] * noise)


def test_bad_inputs_raise_named_errors():
    x, v = _inputs()
    with pytest.raises(ValueError, match="kind"):
        sde.step(x, v, 0.5, 0.4, noise_level=1.0, kind="nope")
    with pytest.raises(ValueError, match="sigma"):
        sde.step(x, v, torch.tensor([0.5, 0.4]), 0.3, noise_level=1.0)
    with pytest.raises(ValueError, match="sigma_next"):
        sde.step(x, v, 0.4, 0.5, noise_level=1.0)
    with pytest.raises(ValueError, match="generator"):
        sde.step(x, v, 0.5, 0.4, noise_level=1.0, generator=[torch.Generator()])
    with pytest.raises(ValueError, match="velocity"):
        sde.step(x, v[:, :2], 0.5, 0.4, noise_level=1.0)
    with pytest.raises(ValueError, match="noise_level"):
        sde.step(x, v, 0.5, 0.4, noise_level=-1.0)


def test_bfloat16_inputs_computed_in_float32():
    x, v = _inputs()
    out = sde.step(
        x.bfloat16(),
        v.bfloat16(),
        0.5,
        0.4,
        noise_level=0.7,
        generator=torch.Generator().manual_seed(0),
    )
    ref = sde.step(
        x.bfloat16().float(),
        v.bfloat16().float(),
        0.5,
        0.4,
        noise_level=0.7,
        generator=torch.Generator().manual_seed(0),
    )
    assert out.prev_sample.dtype == torch.float32 and out.log_prob.dtype == torch.float32
    torch.testing.assert_close(out.log_prob, ref.log_prob)


def test_replay_gradient_flows_through_mean_only():
    x, v = _inputs()
    v = v.clone().requires_grad_(True)
    out = sde.step(x, v, 0.6, 0.5, noise_level=0.7, generator=torch.Generator().manual_seed(0))
    out.log_prob.sum().backward()
    assert v.grad is not None and torch.isfinite(v.grad).all() and v.grad.abs().sum() > 0


@pytest.mark.parametrize("kind", ["sde", "cps", "dance"])
def test_gradcheck_float64(kind):
    x, v = _inputs(b=2, shape=(3,), dtype=torch.float64)
    prev = x + 0.1 * torch.randn(
        x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3)
    )
    v.requires_grad_(True)
    sig = torch.tensor([0.7, 0.4], dtype=torch.float64)
    sig_n = torch.tensor([0.6, 0.2], dtype=torch.float64)

    def f(v_):
        o = sde.step(x, v_, sig, sig_n, noise_level=0.7, kind=kind, prev_sample=prev)
        return o.log_prob, o.mean

    assert f(v)[0].dtype == torch.float64
    assert torch.autograd.gradcheck(f, (v,))


# ---------- property tests ----------

sig_pairs = st.tuples(st.floats(0.05, 1.0), st.floats(0.0, 0.95)).map(
    lambda p: (p[0], min(p[1], p[0]) * 0.99)
)


@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from(KINDS),
    sp=sig_pairs,
    b=st.integers(1, 3),
    ndim=st.integers(1, 4),
    seed=st.integers(0, 10_000),
)
def test_noise_level_zero_is_ode(kind, sp, b, ndim, seed):
    sigma, sigma_next = sp
    g = torch.Generator().manual_seed(seed)
    shape = (b, *([2] * (ndim - 1)))
    x, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    out = sde.step(x, v, sigma, sigma_next, noise_level=0.0, kind=kind, sigma_max=0.9)
    torch.testing.assert_close(out.prev_sample, x + (sigma_next - sigma) * v, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.mean, out.prev_sample)
    assert out.log_prob.shape == (b,) and torch.equal(out.log_prob, torch.zeros(b))


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(KINDS),
    b=st.integers(1, 4),
    ndim=st.integers(1, 5),
    eta=st.floats(0.05, 1.0),
    seed=st.integers(0, 10_000),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
    per_row=st.booleans(),
)
def test_shapes_dtypes_and_replay(kind, b, ndim, eta, seed, dtype, per_row):
    g = torch.Generator().manual_seed(seed)
    shape = (b, *([3] * (ndim - 1)))
    x = torch.randn(shape, generator=g).to(dtype)
    v = torch.randn(shape, generator=g).to(dtype)
    if per_row:
        sigma = torch.rand(b, generator=g) * 0.9 + 0.1
        sigma_next = sigma * torch.rand(b, generator=g) * 0.95
    else:
        sigma, sigma_next = 0.6, 0.45
    gens = [torch.Generator().manual_seed(seed + i) for i in range(b)]
    out = sde.step(
        x, v, sigma, sigma_next, noise_level=eta, kind=kind, generator=gens, sigma_max=0.9
    )
    want = torch.float64 if dtype == torch.float64 else torch.float32
    for t in (out.prev_sample, out.mean):
        assert t.shape == shape and t.dtype == want
    for t in (out.log_prob, out.std, out.sqrt_dt):
        assert t.shape == (b,) and t.dtype == want
    assert torch.isfinite(out.log_prob).all()
    replay = sde.step(
        x,
        v,
        sigma,
        sigma_next,
        noise_level=eta,
        kind=kind,
        prev_sample=out.prev_sample,
        sigma_max=0.9,
    )
    torch.testing.assert_close(replay.log_prob, out.log_prob, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(replay.mean, out.mean)


# ---------- windows ----------


def test_sample_windows_per_row_generator_and_range():
    gens = [torch.Generator().manual_seed(s) for s in range(50)]
    wins = sde.sample_windows(gens, 10, 3, 1, 8)
    starts = set()
    for s, (a, e) in enumerate(wins):
        assert e - a == 3 and a >= 1 and e <= 8
        want = int(
            torch.randint(1, 8 - 3 + 1, (1,), generator=torch.Generator().manual_seed(s)).item()
        )
        assert a == want
        starts.add(a)
    assert starts == {1, 2, 3, 4, 5}


def test_sample_windows_none_size_and_errors():
    g = torch.Generator().manual_seed(0)
    state = g.get_state()
    assert sde.sample_windows([g, g], 10, None, 0, 10) == [(0, 9), (0, 9)]
    assert torch.equal(g.get_state(), state)  # nothing drawn
    with pytest.raises(ValueError, match="size"):
        sde.sample_windows([g], 10, 5, 0, 4)
    with pytest.raises(ValueError, match="high"):
        sde.sample_windows([g], 10, 2, 0, 11)


def test_mix_grpo_progressive_and_random():
    assert sde.mix_grpo_window(0, 10, 4, shift_interval=5) == (0, 4)
    assert sde.mix_grpo_window(12, 10, 4, shift_interval=5, stride=2) == (4, 8)
    assert sde.mix_grpo_window(1000, 10, 4, shift_interval=5) == (6, 10)
    a = sde.mix_grpo_window(7, 10, 3, placement="random", seed=11)
    want = int(torch.randint(0, 8, (1,), generator=torch.Generator().manual_seed(18)).item())
    assert a == (want, want + 3)
    assert a == sde.mix_grpo_window(7, 10, 3, placement="random", seed=11)
    with pytest.raises(ValueError, match="placement"):
        sde.mix_grpo_window(0, 10, 3, placement="bogus")
