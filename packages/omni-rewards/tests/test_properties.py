from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_rewards import PALETTE, load_reward
from omni_rewards.math import parse_number
from omni_rewards.ocr import levenshtein, normalize_text, ocr_score

words = st.text(alphabet="abcXYZ 12", max_size=12)


@given(words, words)
def test_levenshtein_metric(a, b):
    d = levenshtein(a, b)
    assert d == levenshtein(b, a)
    assert abs(len(a) - len(b)) <= d <= max(len(a), len(b))
    assert (d == 0) == (a == b)


@given(words, words, words)
def test_ocr_score_bounds_and_substring(pre, target, post):
    s = ocr_score(pre + target + post, target)
    if normalize_text(target):
        assert s == 1.0
    assert 0.0 <= ocr_score(pre, target) <= 1.0


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 9), st.integers(1, 5), st.integers(0, 2**31 - 1))
def test_batching_does_not_change_scores(n, batch_size, seed):
    rng = np.random.default_rng(seed)
    imgs = rng.integers(0, 256, size=(n, 8, 8, 3), dtype=np.uint8)
    names = list(PALETTE)
    prompts = [f"a {names[i]} thing" for i in rng.integers(0, len(names), n)]
    whole = load_reward("color_match")(images=imgs, prompts=prompts)
    chunked = load_reward("color_match", batch_size=batch_size)(images=imgs, prompts=prompts)
    np.testing.assert_array_equal(whole.scores, chunked.scores)
    assert np.all((whole.scores >= 0) & (whole.scores <= 1))
    b = load_reward("brightness")(images=imgs).scores
    assert np.all((b >= 0) & (b <= 1))


@given(st.integers(-(10**6), 10**6), st.integers(1, 1000))
def test_parse_number_fractions(p, q):
    assert parse_number(f"{p}/{q}") * q == p
    assert parse_number(f"\\frac{{{abs(p)}}}{{{q}}}") * q == abs(p)
