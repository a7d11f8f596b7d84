from __future__ import annotations

import asyncio

import numpy as np
import pytest

from omni_rewards import RewardInputError, load_reward
from omni_rewards.math import answers_equivalent, extract_answer, extract_boxed, is_well_formed

T = "<think>some reasoning</think> "

# (response, reference, accuracy, well_formed)
TABLE = [
    (T + "<answer>42</answer>", "42", 1, True),
    (T + "<answer>\\boxed{42}</answer>", "42", 1, True),
    (T + "<answer>41</answer>", "42", 0, True),
    ("<answer>3/4</answer>", "0.75", 1, True),
    ("<answer>\\frac{3}{4}</answer>", "3/4", 1, True),
    ("<answer>$\\dfrac{1}{2}$</answer>", "0.5", 1, True),
    ("<answer>1,000</answer>", "1000", 1, True),
    ("<answer>50%</answer>", "0.5", 1, True),
    ("<answer>x = 5</answer>", "5", 1, True),
    ("The answer is \\boxed{7}.", "7", 1, False),
    ("The answer is \\boxed{\\frac{1}{3}}", "1/3", 1, False),
    ("no answer at all", "7", 0, False),
    ("<answer>B</answer>", "B", 1, True),
    ("<answer>(B) 12 apples</answer>", "B", 1, True),
    ("<answer>C</answer>", "B", 0, True),
    ("<answer>\\sqrt{2}/2</answer>", "\\frac{\\sqrt{2}}{2}", 1, True),
    ("<answer>2x + 2</answer>", "2(x+1)", 1, True),
    ("<answer>2x + 3</answer>", "2(x+1)", 0, True),
    ("<answer></answer>", "1", 0, False),
    ("<answer>1</answer><answer>2</answer>", "1", 1, False),
    (T + "<answer>\\pi</answer> trailing text", "\\pi", 1, False),
]


@pytest.mark.parametrize(("response", "reference", "acc", "fmt"), TABLE)
def test_math_table(response, reference, acc, fmt):
    r = load_reward("math")
    out = r(texts=[response], references=[reference])
    assert out.details["accuracy"][0] == acc, (response, reference, out.details["answer"])
    assert out.details["format"][0] == pytest.approx(0.3 if fmt else 0.0)
    assert out.scores[0] == pytest.approx((acc + (0.3 if fmt else 0.0)) / 1.3)


def test_math_in_worker_thread_and_batches():
    r = load_reward("math", batch_size=4)
    texts = [row[0] for row in TABLE]
    refs = [row[1] for row in TABLE]
    sync = r(texts=texts, references=refs)
    # ascore runs in a worker thread, where math-verify cannot use SIGALRM timeouts
    out = asyncio.run(r.ascore(texts=texts, references=refs))
    np.testing.assert_array_equal(out.scores, sync.scores)
    np.testing.assert_array_equal(out.details["accuracy"], [row[2] for row in TABLE])


def test_extractors():
    assert extract_boxed("a \\boxed{\\frac{1}{2}} and \\boxed{x^{2}}") == "x^{2}"
    assert extract_boxed("\\boxed{unclosed") is None
    assert extract_answer("<answer> 12 </answer>") == "12"
    assert is_well_formed("<think>a</think>\n<answer>b</answer>\n")
    assert not is_well_formed("<answer>b</answer> extra")
    assert answers_equivalent("-0.25", "-1/4")
    assert not answers_equivalent(None, "1")


def test_choice_reward():
    r = load_reward("choice")
    out = r(
        texts=[
            "<answer>C</answer>",
            "I think the answer is (B).",
            "Answer: D",
            "no idea",
            "\\boxed{A}",
        ],
        references=["C", "B", "A", "A", "(A)"],
    )
    np.testing.assert_array_equal(out.scores, [1, 1, 0, 0, 1])
    assert out.details["choice"].tolist() == ["C", "B", "D", "", "A"]
    with pytest.raises(RewardInputError, match=r"references\[0\].*not a letter"):
        r(texts=["A"], references=["42"])
    with pytest.raises(RewardInputError, match="references: choice needs `references`"):
        r(texts=["A"])
