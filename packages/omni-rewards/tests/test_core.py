from __future__ import annotations

import asyncio
import importlib.util
import math
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
from omni_rewards_testutils import noise, solid
from PIL import Image

import omni_rewards
from omni_rewards import (
    PALETTE,
    MultiReward,
    Reward,
    RewardError,
    RewardInput,
    RewardInputError,
    RewardOutput,
    load_reward,
)
from omni_rewards.registry import ENTRY_POINT_GROUP


def test_reward_input_accepts_numpy_pil_torch_and_float():
    arr = np.stack([noise(0), noise(1)])
    as_list = RewardInput(images=[Image.fromarray(arr[0]), arr[1]]).image_list()
    as_float = RewardInput(images=arr.astype(np.float32) / 255.0).image_list()
    chw = RewardInput(images=[np.moveaxis(arr[0], -1, 0), arr[1]]).image_list()
    variants = [as_list, as_float, chw]
    if importlib.util.find_spec("torch") is not None:  # torch is optional for the core
        import torch

        variants.append(RewardInput(images=torch.from_numpy(arr)).image_list())
    for imgs in variants:
        assert len(imgs) == 2
        assert all(im.dtype == np.uint8 and im.shape == (32, 32, 3) for im in imgs)
        np.testing.assert_array_equal(imgs[0], arr[0])


def test_reward_input_errors_name_the_field():
    with pytest.raises(RewardInputError, match=r"images=2.*prompts=3"):
        RewardInput(images=np.zeros((2, 8, 8, 3), np.uint8), prompts=["a", "b", "c"])
    with pytest.raises(RewardInputError, match=r"images\[1\].*range"):
        RewardInput(images=[np.zeros((8, 8, 3)), np.full((8, 8, 3), 7.0)]).image_list()
    with pytest.raises(RewardInputError, match=r"prompts: .*str"):
        RewardInput(prompts="a single string")
    with pytest.raises(RewardInputError, match="sample_rate"):
        RewardInput(audio=np.zeros((1, 100), np.float32))
    with pytest.raises(RewardInputError, match=r"images: jpeg_compressibility needs `images`"):
        load_reward("jpeg_compressibility")(prompts=["a"])


def test_slice_keeps_fields_together():
    inp = RewardInput(
        images=np.stack([solid((i, i, i)) for i in range(5)]),
        prompts=list("abcde"),
        metadata=[{"i": i} for i in range(5)],
    )
    part = inp.slice(1, 3)
    assert part.batch_size == 2
    assert part.prompts == ["b", "c"]
    assert part.metadata_for(1) == {"i": 2}
    assert part.image_list()[0][0, 0, 0] == 1


def test_jpeg_rewards_order_and_sign():
    imgs = np.stack([solid((128, 128, 128), (64, 64)), noise(0, (64, 64))])
    comp = load_reward("jpeg_compressibility")(images=imgs)
    incomp = load_reward("jpeg_incompressibility")(images=imgs)
    assert comp.scores.dtype == np.float32 and comp.scores.shape == (2,)
    # noise is much harder to compress than a flat image
    assert incomp.scores[1] > 5 * incomp.scores[0]
    np.testing.assert_allclose(comp.scores, -incomp.scores)
    np.testing.assert_allclose(incomp.details["jpeg_kb"], incomp.scores)


def test_jpeg_batching_matches_unbatched_and_rejects_videos():
    imgs = np.stack([noise(i, (24, 24)) for i in range(7)])
    full = load_reward("jpeg_incompressibility")(images=imgs)
    chunked = load_reward("jpeg_incompressibility", batch_size=3)(images=imgs)
    np.testing.assert_array_equal(full.scores, chunked.scores)
    with pytest.raises(RewardInputError, match=r"images only.*videos"):
        load_reward("jpeg_compressibility")(videos=np.zeros((1, 2, 8, 8, 3), np.uint8))
    with pytest.raises(ValueError, match="batch_size"):
        load_reward("jpeg_compressibility", batch_size=0)


def test_brightness():
    r = load_reward("brightness")
    out = r(images=np.stack([solid((0, 0, 0)), solid((255, 255, 255)), solid((255, 0, 0))]))
    np.testing.assert_allclose(out.scores, [0.0, 1.0, 0.299], atol=1e-6)
    vid = np.stack([solid((0, 0, 0)), solid((255, 255, 255))])[None]
    np.testing.assert_allclose(r(videos=vid).scores, [0.5], atol=1e-6)


def test_color_match():
    r = load_reward("color_match")
    imgs = np.stack([solid(PALETTE["red"]), solid(PALETTE["red"]), solid((128, 0, 128))])
    out = r(images=imgs, prompts=["a red car", "a Cyan sky, then blue", "purple rain"])
    assert out.scores[0] == pytest.approx(1.0)
    # red vs cyan (first colour named): distance sqrt(3)*255 -> 0
    assert out.scores[1] == pytest.approx(0.0, abs=1e-6)
    assert out.scores[2] == pytest.approx(1.0)
    np.testing.assert_allclose(out.details["target_rgb"][1], PALETTE["cyan"])
    half = r(images=solid((255, 128, 0))[None], prompts=["orange"]).scores[0]
    assert half == pytest.approx(
        1 - math.dist((255, 128, 0), (255, 165, 0)) / (255 * math.sqrt(3)), rel=1e-5
    )


def test_color_match_missing_colour():
    imgs = np.stack([solid((0, 0, 0)), solid((0, 0, 0))])
    with pytest.raises(ValueError, match=r"prompts\[1\].*'a dog'"):
        load_reward("color_match")(images=imgs, prompts=["black cat", "a dog"])
    with pytest.raises(ValueError, match="default_color"):
        load_reward("color_match", default_color="mauve")
    out = load_reward("color_match", default_color="white")(
        images=imgs, prompts=["black cat", "a dog"]
    )
    np.testing.assert_allclose(out.scores, [1.0, 0.0], atol=1e-6)
    # "reddish" is not the word "red"
    assert omni_rewards.find_color("a reddish fox") is None


def test_ascore_and_submit():
    r = load_reward("brightness")
    imgs = np.stack([solid((255, 255, 255))])
    out = asyncio.run(r.ascore(images=imgs))
    assert isinstance(out, RewardOutput) and out.scores[0] == pytest.approx(1.0)
    assert r.submit(RewardInput(images=imgs)).result().scores[0] == pytest.approx(1.0)
    r.close()


class _Const(Reward):
    name = "const"

    def __init__(self, value=1.0, fail=False, **kw):
        super().__init__(**kw)
        self.value, self.fail = value, fail

    def score_batch(self, inp):
        if self.fail:
            raise RuntimeError("backend down")
        return RewardOutput(np.full(inp.batch_size, self.value), {"v": np.full(inp.batch_size, 1)})


def test_nan_score_is_an_error():
    with pytest.raises(RewardError, match=r"sample\(s\) \[0, 1\]"):
        _Const(float("nan"))(prompts=["a", "b"])


def test_multi_reward_weighted_sum_and_failures():
    imgs = np.stack([solid((255, 255, 255)), solid((0, 0, 0))])
    multi = MultiReward(
        {"b": ("brightness", 2.0), "c": (_Const(0.5), -1.0), "flaky": (_Const(fail=True), 10.0)},
        optional=["flaky"],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = multi(images=imgs)
    np.testing.assert_allclose(out.scores, [1.5, -0.5], atol=1e-6)
    np.testing.assert_allclose(out.details["b"], [1.0, 0.0], atol=1e-6)
    assert np.isnan(out.details["flaky"]).all()
    assert out.details["c/v"].tolist() == [1, 1]
    assert multi.metrics["reward/flaky/failures"] == 1
    assert any("flaky" in str(w.message) for w in caught)
    out2 = asyncio.run(multi.ascore(images=imgs))
    np.testing.assert_allclose(out2.scores, out.scores)
    assert multi.metrics["reward/flaky/failures"] == 2
    strict = MultiReward({"b": ("brightness", 1.0), "flaky": (_Const(fail=True), 1.0)})
    with pytest.raises(RuntimeError, match="required reward 'flaky' failed: backend down"):
        strict(images=imgs)
    with pytest.raises(ValueError, match="optional"):
        MultiReward({"b": ("brightness", 1.0)}, optional=["nope"])


def test_unknown_reward_lists_known():
    with pytest.raises(KeyError, match="jpeg_compressibility"):
        load_reward("no_such_reward")


def test_entry_point_group(tmp_path, monkeypatch):
    pkg = tmp_path / "thirdparty_reward_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        textwrap.dedent("""
        import numpy as np
        from omni_rewards import Reward, RewardOutput

        class Seven(Reward):
            name = "seven"
            def score_batch(self, inp):
                return RewardOutput(np.full(inp.batch_size, 7.0))
    """)
    )
    dist = tmp_path / "thirdparty_reward_pkg-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: thirdparty-reward-pkg\nVersion: 1.0\n"
    )
    (dist / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\nseven = thirdparty_reward_pkg:Seven\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "seven" in omni_rewards.available_rewards()
    out = load_reward("seven")(prompts=["x", "y"])
    np.testing.assert_array_equal(out.scores, [7.0, 7.0])


def test_core_imports_without_heavy_deps():
    code = textwrap.dedent("""
        import sys, importlib.abc
        BLOCK = {"torch", "onnxruntime", "rapidocr", "transformers", "open_clip", "starlette",
                 "uvicorn", "httpx", "safetensors", "sympy", "math_verify", "scipy"}
        class Blocker(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.split(".")[0] in BLOCK:
                    raise ImportError(f"blocked {name}")
        sys.meta_path.insert(0, Blocker())
        import numpy as np
        import omni_rewards
        from omni_rewards import load_reward
        out = load_reward("jpeg_compressibility")(images=np.zeros((1, 8, 8, 3), np.uint8))
        out = load_reward("color_match")(images=np.zeros((1, 8, 8, 3), np.uint8), prompts=["black"])
        assert out.scores[0] == 1.0
        try:
            load_reward("ocr")
        except ImportError as e:
            assert "pip install 'omni-rewards[ocr]'" in str(e), e
        else:
            raise SystemExit("ocr loaded without rapidocr")
        out = load_reward("choice")(texts=["<answer>B</answer>"], references=["B"])
        assert out.scores[0] == 1.0
        try:
            load_reward("math")
        except ImportError as e:
            assert "pip install 'omni-rewards[math]'" in str(e), e
        else:
            raise SystemExit("math loaded without sympy")
        print("ok")
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "ok"


def test_check_prompts_finds_what_a_reward_could_not_score_without_loading_it() -> None:
    from omni_rewards import check_prompts

    bad = check_prompts("color_match", ["a red car", "a sunny beach"])
    assert len(bad) == 1 and bad[0].startswith("prompts[1] 'a sunny beach': names no palette")
    assert check_prompts("color_match", ["a sunny beach"], {"default_color": "red"}) == []
    bad = check_prompts("ocr", ['a sign that says "OPEN"', "a cat"])
    assert len(bad) == 1 and "double quotes" in bad[0]
    assert check_prompts("ocr", ["a cat"], {"missing_target": "empty"}) == []
    assert check_prompts("brightness", ["anything"]) == []  # reads no target from prompts
