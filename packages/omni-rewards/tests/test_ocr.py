from __future__ import annotations

import numpy as np
import pytest
from omni_rewards_testutils import render_text, solid

from omni_rewards import RewardInputError, load_reward
from omni_rewards.ocr import extract_target, levenshtein, normalize_text, ocr_score


def test_text_helpers():
    assert extract_target('a sign that says "Hello World" in neon') == "Hello World"
    assert extract_target('a poster reading “Open Late” and "x"') == "Open Late"
    assert extract_target("no quotes") is None
    assert extract_target('empty "" target') == ""
    assert normalize_text(" Hello\tWor ld\n") == "helloworld"
    assert levenshtein("kitten", "sitting") == 3
    assert levenshtein("", "abc") == 3
    assert ocr_score("xx HELLO world yy", "hello world") == 1.0  # substring
    assert ocr_score("hellp world", "hello world") == pytest.approx(1 - 1 / 10)
    assert ocr_score("something entirely different and long", "abc") == 0.0  # capped
    assert ocr_score("", "") == 1.0
    assert ocr_score("noise", "") == 0.0


@pytest.fixture(scope="module")
def ocr():
    return load_reward("ocr")


TEXTS = ["Hello World", "Quantum Leap 42", "Sphinx of black quartz"]


def test_ocr_scores_rendered_text(ocr):
    imgs = [render_text(t) for t in TEXTS]
    right = ocr(images=imgs, prompts=[f'a sign that says "{t}"' for t in TEXTS])
    assert right.scores.min() >= 0.9, (right.scores, right.details["text"])
    wrong_texts = ["Goodbye Moon", "banana", "Purple Elephant Dance"]
    wrong = ocr(images=imgs, prompts=[f'a sign that says "{t}"' for t in wrong_texts])
    assert wrong.scores.max() <= 0.5, (wrong.scores, wrong.details["text"])


def test_ocr_references_videos_and_empty(ocr):
    blank = solid((255, 255, 255), (64, 160))
    out = ocr(images=[blank, render_text("abc")], references=["", ""])
    np.testing.assert_allclose(out.scores, [1.0, 0.0])
    # video: half the frames show the text
    vid = np.stack([render_text("Go"), np.full_like(render_text("Go"), 255)] * 2)
    v = ocr(videos=vid[None], prompts=['"Go"'])
    assert v.scores[0] == pytest.approx(0.5)


def test_ocr_input_errors(ocr):
    img = render_text("abc")
    with pytest.raises(RewardInputError, match=r"prompts\[1\]: no text in double quotes"):
        ocr(images=[img, img], prompts=['"abc"', "no quotes here"])
    with pytest.raises(RewardInputError, match="images: ocr needs `images` or `videos`"):
        ocr(prompts=['"abc"'])
    with pytest.raises(RewardInputError, match="prompts: ocr needs"):
        ocr(images=[img])
    with pytest.raises(ValueError, match="backend"):
        load_reward("ocr", backend="tesseract")


def test_paddleocr_backend_missing_gives_pip_command():
    pytest.importorskip("rapidocr")
    try:
        import paddleocr  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"pip install 'omni-rewards\[paddleocr\]'"):
            load_reward("ocr", backend="paddleocr")
    else:  # pragma: no cover - only where paddleocr is installed
        assert load_reward("ocr", backend="paddleocr") is not None


def test_batched_reading_matches_one_by_one(ocr):
    imgs = [render_text(t, size=32) for t in ("Batch one", "second 22", "x")] + [
        solid((255, 255, 255), (40, 90))
    ]
    one_by_one = [ocr.backend.read(im) for im in imgs]
    batched = ocr.read_many(imgs)
    assert [normalize_text(t) for t in batched] == [normalize_text(t) for t in one_by_one]
    assert normalize_text(batched[0]) == "batchone" and batched[3] == ""
