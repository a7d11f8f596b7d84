from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from omni_train.data import PromptData
from omni_train.seeds import derive_seed, mix64, sample_seed


def test_sample_seed_is_pure_and_distinct() -> None:
    a = [sample_seed(0, s, i) for s in range(20) for i in range(64)]
    assert a == [sample_seed(0, s, i) for s in range(20) for i in range(64)]
    assert len(set(a)) == len(a)
    assert all(0 <= x < 2**63 for x in a)
    assert sample_seed(1, 0, 0) != sample_seed(0, 0, 0)
    assert sample_seed(0, 1, 0) != sample_seed(0, 0, 1)  # step and index are not interchangeable


def test_known_value() -> None:
    # SplitMix64 of 0 is a published constant
    assert mix64(0) == 0xE220A8397B1DCDAF
    assert sample_seed(0, 0, 0) == sample_seed(0, 0, 0)


@given(st.integers(0, 2**32), st.integers(0, 10**6), st.integers(0, 10**6))
def test_domains_differ(seed: int, step: int, index: int) -> None:
    assert derive_seed(seed, step, index, 0) != derive_seed(seed, step, index, 1)


def test_prompt_order_pure_and_covers_epoch() -> None:
    prompts = [f"p{i}" for i in range(10)]
    d = PromptData(prompts, per_step=5, seed=3)
    first_epoch = d.prompts_for_step(0) + d.prompts_for_step(1)
    assert sorted(first_epoch) == sorted(prompts)
    assert PromptData(prompts, per_step=5, seed=3).prompts_for_step(7) == d.prompts_for_step(7)
    assert PromptData(prompts, 5, seed=4).prompts_for_step(0) != d.prompts_for_step(0) or (
        PromptData(prompts, 5, seed=4).prompts_for_step(1) != d.prompts_for_step(1)
    )
    d2 = PromptData(prompts, per_step=5, seed=3, shuffle=False)
    assert d2.prompts_for_step(1) == prompts[5:]
