import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_algos.advantages import ADVANTAGES, group_advantages, group_stats


def _ref(rewards, ids, std, eps=1e-4):
    """Loop-based reference: per group, (r - mean) / (std + eps) with torch's unbiased std."""
    r = torch.tensor(rewards, dtype=torch.float64)
    out = torch.zeros_like(r)
    glob = r.std() if len(rewards) > 1 else torch.tensor(0.0)
    for g in set(ids):
        idx = [i for i, x in enumerate(ids) if x == g]
        if len(idx) < 2:
            continue
        sub = r[idx]
        d = {"group": sub.std(), "global": glob, "none": None}[std]
        out[idx] = (sub - sub.mean()) / (d + eps) if d is not None else sub - sub.mean()
    return out


@pytest.mark.parametrize("std", ["global", "group", "none"])
def test_matches_reference(std):
    rewards = [0.1, 0.5, 0.9, 0.3, 2.0, 2.0, -1.0, 4.0, 3.3]
    ids = ["a", "a", "a", "b", "c", "c", "b", "b", "d"]
    got = group_advantages(torch.tensor(rewards), ids, std=std)
    torch.testing.assert_close(got.double(), _ref(rewards, ids, std), atol=1e-5, rtol=1e-5)
    assert got.dtype == torch.float32
    assert got[8] == 0  # singleton group
    assert got[4] == 0 and got[5] == 0  # zero-variance group


def test_tensor_group_ids_and_registry():
    r = torch.tensor([1.0, 2.0, 3.0, 5.0])
    ids = torch.tensor([7, 7, 3, 3])
    torch.testing.assert_close(ADVANTAGES["grpo"](r, ids), group_advantages(r, ids))
    torch.testing.assert_close(ADVANTAGES["dr_grpo"](r, ids), torch.tensor([-0.5, 0.5, -1, 1]))
    # RLOO: r_i - mean of the others
    r2 = torch.tensor([1.0, 2.0, 6.0, 4.0])
    ids2 = [0, 0, 0, 1]
    want = torch.tensor([1 - 4.0, 2 - 3.5, 6 - 1.5, 0.0])
    torch.testing.assert_close(ADVANTAGES["rloo"](r2, ids2), want)
    assert set(ADVANTAGES) >= {"grpo", "dr_grpo", "rloo"}


def test_nan_rewards_name_the_rows():
    with pytest.raises(ValueError, match=r"rows \[1, 3\]"):
        group_advantages(torch.tensor([1.0, float("nan"), 0.0, float("inf")]), [0, 0, 1, 1])


def test_bad_arguments():
    with pytest.raises(ValueError, match="std"):
        group_advantages(torch.ones(2), [0, 0], std="bogus")
    with pytest.raises(ValueError, match="group_ids"):
        group_advantages(torch.ones(3), [0, 0])


def test_group_stats():
    m = group_stats(torch.tensor([1.0, 1.0, 0.0, 2.0]), [0, 0, 1, 1])
    assert m["zero_std_ratio"] == 0.5
    assert abs(m["std_mean"] - (0.0 + torch.tensor([0.0, 2.0]).std().item()) / 2) < 1e-6
    assert m["num_groups"] == 2


@settings(max_examples=50, deadline=None)
@given(
    rewards=st.lists(st.floats(-100, 100), min_size=1, max_size=24),
    ngroups=st.integers(1, 5),
    std=st.sampled_from(["global", "group", "none"]),
    seed=st.integers(0, 1000),
)
def test_property_group_sums_zero_and_matches_reference(rewards, ngroups, std, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, ngroups, (len(rewards),), generator=g).tolist()
    got = group_advantages(torch.tensor(rewards), ids, std=std)
    assert torch.isfinite(got).all()
    ref = _ref(rewards, ids, std)
    torch.testing.assert_close(got.double(), ref, atol=1e-3, rtol=1e-4)
    for gid in set(ids):
        idx = [i for i, x in enumerate(ids) if x == gid]
        assert abs(got[idx].double().sum().item()) < 1e-2 * max(1.0, got.abs().max().item())
