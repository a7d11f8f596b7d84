import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_algos.correction import pearson_from_sums, pearson_sums, rollout_correction


def test_token_level_decoupled_weights_and_mask():
    a = torch.log(torch.tensor([[1.0, 3.0, 0.4], [1.5, 1.0, 1.0]]))
    r = torch.zeros(2, 3)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    c = rollout_correction(
        a, r, mode="decoupled", is_threshold=2.0, rs_bounds=(0.5, 2.5), mask=mask
    )
    # ratios 1, 3 (rejected > 2.5), 0.4 (rejected < 0.5); 1.5, 1, padded
    torch.testing.assert_close(c.weights, torch.tensor([[1.0, 0.0, 0.0], [1.5, 1.0, 0.0]]))
    assert c.mask.tolist() == [[True, False, False], [True, True, False]]
    assert c.metrics["rejected_frac"] == pytest.approx(2 / 5)
    assert c.metrics["logprob_abs_diff_max"] == pytest.approx(math.log(3.0))
    b = rollout_correction(a, r, mode="bypass", rs_bounds=(0.5, 2.5), mask=mask)
    torch.testing.assert_close(b.weights, c.mask.float())


def test_sequence_level_and_truncation():
    a = torch.tensor([[0.2, 0.3], [0.0, -0.1]])
    r = torch.zeros(2, 2)
    c = rollout_correction(
        a, r, mode="decoupled", is_level="sequence", is_threshold=1.5, rs_bounds=None
    )
    want = torch.tensor([[1.5, 1.5], [math.exp(-0.1)] * 2])
    torch.testing.assert_close(c.weights, want)
    assert c.metrics["is_truncated_frac"] == 0.5


def test_metrics_reference():
    g = torch.Generator().manual_seed(0)
    r = torch.randn(3, 5, generator=g) - 2
    a = r + 0.1 * torch.randn(3, 5, generator=g)
    c = rollout_correction(a, r, rs_bounds=None)
    d = a - r
    assert c.metrics["logprob_abs_diff_mean"] == pytest.approx(float(d.abs().mean()), rel=1e-5)
    assert c.metrics["k3_kl"] == pytest.approx(float((d.exp() - 1 - d).mean()), rel=1e-4)
    want_ppl = float((-a.mean(1) + r.mean(1)).mean())
    assert c.metrics["log_ppl_diff"] == pytest.approx(want_ppl, rel=1e-4, abs=1e-6)
    pear = float(torch.corrcoef(torch.stack([a.flatten(), r.flatten()]))[0, 1])
    assert c.metrics["pearson"] == pytest.approx(pear, rel=1e-4)


def test_all_rejected_gives_zero_weights():
    c = rollout_correction(torch.full((4,), 5.0), torch.zeros(4), mode="decoupled")
    assert torch.equal(c.weights, torch.zeros(4))
    assert all(math.isfinite(v) for v in c.metrics.values())
    c = rollout_correction(torch.zeros(2, 3), torch.zeros(2, 3), mask=torch.zeros(2, 3))
    assert torch.equal(c.weights, torch.zeros(2, 3))
    assert all(math.isfinite(v) for v in c.metrics.values())


def test_errors():
    with pytest.raises(ValueError, match="mode"):
        rollout_correction(torch.zeros(2), torch.zeros(2), mode="bogus")
    with pytest.raises(ValueError, match="rollout_log_prob"):
        rollout_correction(torch.zeros(2), torch.zeros(3))
    with pytest.raises(ValueError, match="rs_bounds"):
        rollout_correction(torch.zeros(2), torch.zeros(2), rs_bounds=(2.0, 1.0))


@settings(max_examples=40, deadline=None)
@given(
    b=st.integers(1, 4),
    t=st.integers(1, 5),
    seed=st.integers(0, 1000),
    level=st.sampled_from(["token", "sequence"]),
    mode=st.sampled_from(["bypass", "decoupled"]),
    scale=st.floats(0.0, 30.0),
)
def test_property_weights_bounded_and_finite(b, t, seed, level, mode, scale):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(b, t, generator=g)
    a = r + scale * torch.randn(b, t, generator=g)
    c = rollout_correction(a, r, mode=mode, is_level=level, is_threshold=2.0)
    assert torch.isfinite(c.weights).all()
    assert (c.weights >= 0).all() and (c.weights <= 2.0).all()
    assert torch.equal(c.weights == 0, ~c.mask) or mode == "decoupled"
    assert all(math.isfinite(v) for v in c.metrics.values())


def test_pearson_sums_add_over_shards():
    """Data-parallel ranks all-reduce `pearson_sums` and get the whole batch's correlation,
    which a mean of the shards' own correlations is not."""
    g = torch.Generator().manual_seed(3)
    a = torch.randn(40, generator=g) * 30 - 200  # log-prob-like magnitudes
    b = a + torch.randn(40, generator=g) * torch.linspace(0.1, 20, 40)
    want = float(torch.corrcoef(torch.stack([a, b]).double())[0, 1])
    shards = [pearson_sums(a[:13], b[:13]), pearson_sums(a[13:], b[13:])]
    whole = [x + y for x, y in zip(*shards, strict=True)]
    assert pearson_from_sums(whole) == pytest.approx(want, rel=1e-9)
    assert pearson_from_sums(pearson_sums(a, b)) == pytest.approx(want, rel=1e-9)
    mean_of_shards = sum(pearson_from_sums(s) for s in shards) / 2
    assert abs(mean_of_shards - want) > 1e-3
    assert pearson_from_sums(pearson_sums(torch.ones(5), a[:5])) == 0.0  # a constant side
    assert pearson_from_sums(pearson_sums(a[:1], b[:1])) == 0.0
