"""The shapes world and its reward: the grammar, the composition splits, the renderer, and the
reward's verdicts on ground-truth renders (seeds no other code here uses)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from PIL import Image

from omni_rewards import check_prompts, load_reward
from omni_rewards import shapes as S

# renders in these tests use seeds from here on; the shipped split files, the pretraining and
# the recipes draw their seeds below 10**8
FRESH = 7 * 10**8


def test_grammar_round_trip_for_every_caption():
    caps = S.all_captions()
    assert len(caps) == len({S.format_caption(c) for c in caps}) == 2256
    for cap in caps:
        text = S.format_caption(cap)
        assert S.parse_caption(text) == cap
        assert S.parse_caption("  " + text.upper().replace(" ", "  ")) == cap
    assert {c.task for c in caps} == set(S.TASKS)
    words = {w for c in caps for w in S.format_caption(c).split()}
    assert words == set(S.vocabulary())


@pytest.mark.parametrize(
    ("prompt", "task"),
    [
        ("a circle", "single_object"),
        ("a red circle", "colors"),
        ("a circle and a blue square", "two_object"),
        ("a red circle and a blue square", "color_attr"),
        ("three green triangles", "counting"),
        ("a red circle left of a square", "position"),
    ],
)
def test_task_types(prompt, task):
    assert S.parse_caption(prompt).task == task


@pytest.mark.parametrize(
    ("prompt", "why"),
    [
        ("a photo of a cat", "expected a shape"),
        ("a red circle and a red circle", "different shapes"),
        ("five circles", "must start with"),
        ("two purple circles", "counting caption"),
        ("a red circle next to a square", "after the first object"),
        ("", "empty"),
    ],
)
def test_bad_prompt_names_the_prompt(prompt, why):
    reward = load_reward("shapes")
    img = np.full((32, 32, 3), 255, np.uint8)
    with pytest.raises(S.CaptionError, match=why) as err:
        reward(images=[img, img], prompts=["a red circle", prompt])
    assert repr(prompt) in str(err.value) and "prompts[1]" in str(err.value)
    assert check_prompts("shapes", ["a red circle", prompt]) == [
        f"prompts[1] {prompt!r}: {S.CaptionError(str(err.value)).args[0].split(': ', 2)[2]}"
    ]


def test_splits_are_disjoint_compositions(tmp_path):
    caps = S.all_captions()
    held = [c for c in caps if S.split_of(c) == "heldout"]
    train = [c for c in caps if S.split_of(c) == "train"]
    assert held and train
    for cap in train:  # no train caption uses a held-out composition
        assert not any((o.color, o.shape) in S.HELD_OUT_PAIRS for o in cap.objects)
    paths = S.write_splits(tmp_path, per_task=8, seed=3)
    lines = {k: p.read_text().splitlines() for k, p in paths.items()}
    assert all(S.split_of(x) == "train" for x in lines["train"])
    assert all(S.split_of(x) == "heldout" for x in lines["heldout"])
    assert not set(lines["train"]) & set(lines["heldout"])
    # a held-out pair never appears as a coloured object in train, as words either
    for color, shape in S.HELD_OUT_PAIRS:
        assert not any(f"{color} {shape}" in x for x in lines["train"])


def test_task_weights_set_how_often_each_task_type_is_drawn():
    """Unweighted: every task type alike (and the same stream as before weights existed);
    weighted: proportional, 1 for a type not named, 0 never drawn; bad weights name the type."""

    def draw(weights):
        rng = np.random.default_rng(3)
        return Counter(S.sample_caption(rng, "train", weights).task for _ in range(3000))

    uniform = draw(None)
    assert set(uniform) == set(S.TASKS) and min(uniform.values()) > 400
    rng_a, rng_b = np.random.default_rng(5), np.random.default_rng(5)
    assert [S.sample_caption(rng_a) for _ in range(50)] == [
        S.sample_caption(rng_b, "train", None) for _ in range(50)
    ]
    weighted = draw({"position": 4.0, "single_object": 0.0})
    assert weighted["single_object"] == 0
    assert 3.3 < weighted["position"] / weighted["counting"] < 4.8  # 4 : 1, 3000 draws
    with pytest.raises(ValueError, match="unknown task type 'shapes'"):
        S.sample_caption(np.random.default_rng(0), "train", {"shapes": 1.0})
    with pytest.raises(ValueError, match="task_weights: position must be a finite number"):
        S.sample_caption(np.random.default_rng(0), "train", {"position": -1.0})
    for bad in ("2", None, True):  # not a number: the same error, not a TypeError
        with pytest.raises(ValueError, match="task_weights: colors must be a finite number"):
            S.sample_caption(np.random.default_rng(0), "train", {"colors": bad})
    with pytest.raises(ValueError, match="all 0"):
        S.sample_caption(np.random.default_rng(0), "train", dict.fromkeys(S.TASKS, 0.0))


def test_split_all_draws_from_both_splits():
    """ "all" is the whole grammar: both splits' captions come up, about in proportion to their
    share of each task type; an unknown split names the choices."""
    rng = np.random.default_rng(0)
    drawn = [S.sample_caption(rng, "all") for _ in range(2000)]
    splits = Counter(S.split_of(c) for c in drawn)
    assert splits["heldout"] > 300 and splits["train"] > 1000
    assert {c.task for c in drawn} == set(S.TASKS)
    with pytest.raises(ValueError, match="'train', 'heldout' or 'all'"):
        S.sample_caption(rng, "every")


def test_shipped_split_files_match_write_splits(tmp_path):
    from pathlib import Path

    shipped = Path(__file__).resolve().parents[3] / "recipes" / "data" / "shapes"
    if not shipped.is_dir():
        pytest.skip("the repository's recipes/ folder is not next to this package")
    paths = S.write_splits(tmp_path, per_task=32, seed=0)
    for split, path in paths.items():
        assert (shipped / f"{split}.txt").read_text() == path.read_text()
        # colors_<split>.txt (recipes/quickstart.yaml): its colour captions
        lines = path.read_text().splitlines()
        colors = [p for p, task in zip(lines, S.task_types(lines)) if task == "colors"]
        assert (shipped / f"colors_{split}.txt").read_text().splitlines() == colors


def test_the_handwritten_prompt_set_is_in_the_grammar():
    """recipes/data/shapes/handwritten.txt was written by hand, not by write_splits: every line
    is a caption of the grammar, every task type is there, both splits are, and its ground-truth
    renders score 1 (so a model's score on it measures the model, not the file)."""
    from pathlib import Path

    shipped = Path(__file__).resolve().parents[3] / "recipes" / "data" / "shapes"
    if not shipped.is_dir():
        pytest.skip("the repository's recipes/ folder is not next to this package")
    lines = (shipped / "handwritten.txt").read_text().splitlines()
    assert len(lines) == len(set(lines)) == 44
    assert set(S.task_types(lines)) == set(S.TASKS)
    assert {S.split_of(line) for line in lines} == {"train", "heldout"}
    images = [np.asarray(S.render(line, FRESH + i, 32)) for i, line in enumerate(lines)]
    out = load_reward("shapes")(images=images, prompts=lines)
    assert out.scores.tolist() == [1.0] * len(lines)


def test_render_is_deterministic_and_valid():
    a = S.render("three red squares", seed=FRESH, size=32)
    b = S.render("three red squares", seed=FRESH, size=32)
    c = S.render("three red squares", seed=FRESH + 1, size=32)
    assert isinstance(a, Image.Image) and a.size == (32, 32)
    assert np.array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(a), np.asarray(c))
    objs = S.detect_objects(np.asarray(S.render("a blue cross below a circle", FRESH, 48)))
    assert sorted(o.shape for o in objs) == ["circle", "cross"]
    with pytest.raises(ValueError, match="size"):
        S.render("a circle", 0, size=8)


def test_render_box_sides_follow_box_side():
    """One or two objects are drawn in boxes of `BOX_SIDE` x size (10-14 px at 32), three or
    four in `BOX_SIDE_CROWDED` x size (8-10 px): a square fills its box, so its area is the
    box side squared."""
    sides = {"two": set(), "four": set()}
    for seed in range(FRESH, FRESH + 40):
        for key, caption in (("two", "a red square and a blue circle"), ("four", "four squares")):
            objs = S.detect_objects(np.asarray(S.render(caption, seed, 32)))
            sides[key] |= {round(o.area**0.5) for o in objs if o.shape == "square"}
    lo, hi = (round(f * 32) for f in S.BOX_SIDE)
    assert min(sides["two"]) >= lo and max(sides["two"]) <= hi and len(sides["two"]) > 2
    lo, hi = (round(f * 32) for f in S.BOX_SIDE_CROWDED)
    assert min(sides["four"]) >= lo and max(sides["four"]) <= hi


def _heldout_prompts(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [S.format_caption(S.sample_caption(rng, "heldout")) for _ in range(n)]


@pytest.mark.parametrize("size", [32, 48])
def test_reward_on_ground_truth_and_on_other_captions(size):
    reward = load_reward("shapes")
    prompts = _heldout_prompts(300, FRESH)
    imgs = [np.asarray(S.render(p, FRESH + i, size)) for i, p in enumerate(prompts)]
    out = reward(images=imgs, prompts=prompts)
    assert out.scores.mean() >= 0.99
    for part in ("count", "object", "colour", "position"):
        assert np.nanmean(out.details[part]) >= 0.99
    # the same images scored against a different caption of the held-out split
    rng = np.random.default_rng(FRESH + 1)
    others = []
    for p in prompts:
        q = p
        while q == p:
            q = S.format_caption(S.sample_caption(rng, "heldout"))
        others.append(q)
    wrong = reward(images=imgs, prompts=others)
    assert wrong.scores.mean() <= 0.05


def test_reward_details_name_the_failing_part():
    reward = load_reward("shapes")
    img = np.asarray(S.render("a red circle right of a blue square", FRESH))
    prompts = [
        "a red circle right of a blue square",  # right
        "a red circle left of a blue square",  # position wrong
        "a green circle right of a blue square",  # colour wrong
        "a red circle right of a blue triangle",  # object wrong
        "three red circles",  # count wrong
    ]
    out = reward(images=[img] * 5, prompts=prompts)
    assert out.scores.tolist() == [1, 0, 0, 0, 0]
    assert out.details["position"][:2].tolist() == [1, 0]
    assert out.details["colour"][:3].tolist() == [1, 1, 0]
    assert out.details["object"][3] == 0 and out.details["count"][3] == 1
    assert out.details["count"][4] == 0 and np.isnan(out.details["position"][4])
    assert out.details["task_position"][:4].tolist() == [1, 0, 0, 0]
    assert np.isnan(out.details["task_position"][4]) and out.details["task_counting"][4] == 0
    # partial credit: the mean of the caption's parts; the strict verdict stays in the details
    partial = load_reward("shapes", partial_credit=True)(images=[img] * 5, prompts=prompts)
    assert partial.scores.tolist() == [1, 0.75, 0.75, 0.25, 0]
    assert partial.details["correct"].tolist() == out.scores.tolist() == [1, 0, 0, 0, 0]
    assert partial.details["task_position"][:4].tolist() == [1, 0, 0, 0]


@pytest.mark.parametrize("value", [0.0, 1.5])
def test_min_shape_iou_out_of_range_names_the_option(value):
    with pytest.raises(ValueError, match="min_shape_iou"):
        load_reward("shapes", min_shape_iou=value)


def test_blank_and_noise_images_score_zero():
    reward = load_reward("shapes")
    rng = np.random.default_rng(FRESH)
    blank = np.full((32, 32, 3), 255, np.uint8)
    noise = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
    out = reward(images=[blank, noise], prompts=["a red circle", "a red circle"])
    assert out.scores.tolist() == [0, 0]
    assert out.details["n_objects"][0] == 0


def test_reward_tolerates_a_slightly_blurred_outline():
    """A generator's decoder blurs edges; the verdict should survive a light blur."""
    from PIL import ImageFilter

    reward = load_reward("shapes")
    prompts = _heldout_prompts(200, FRESH + 2)
    blur = ImageFilter.GaussianBlur(0.4)
    imgs = [np.asarray(S.render(p, FRESH + 2 + i).filter(blur)) for i, p in enumerate(prompts)]
    assert reward(images=imgs, prompts=prompts).scores.mean() >= 0.97


def _ragged(img: np.ndarray, p: float, rng: np.random.Generator) -> np.ndarray:
    """Flip each pixel on an object's outline with probability ``p``: an object pixel to the
    background, a background pixel to the colour of an object pixel next to it."""
    out = img.copy()
    obj = np.any(img != S.BACKGROUND, axis=-1)
    h, w = obj.shape
    for r, c in zip(*np.nonzero(rng.random((h, w)) < p)):
        near = [(r + dr, c + dc) for dr, dc in ((-1, 0), (1, 0), (0, -1), (0, 1))
                if 0 <= r + dr < h and 0 <= c + dc < w and obj[r + dr, c + dc] != obj[r, c]]  # fmt: skip
        if near:
            out[r, c] = S.BACKGROUND if obj[r, c] else img[near[0]]
    return out


def test_reward_tolerates_a_ragged_outline():
    """A generator draws outlines a few pixels off: with 15% of the outline pixels flipped
    the verdict holds (the IoU shape match), and a wrong caption still scores ~0."""
    reward = load_reward("shapes")
    rng = np.random.default_rng(FRESH + 3)
    prompts = _heldout_prompts(200, FRESH + 3)
    others = _heldout_prompts(200, FRESH + 4)
    imgs = [_ragged(np.asarray(S.render(p, FRESH + 3 + i)), 0.15, rng)
            for i, p in enumerate(prompts)]  # fmt: skip
    assert reward(images=imgs, prompts=prompts).scores.mean() >= 0.95
    pairs = [(img, q) for img, q, p in zip(imgs, others, prompts) if q != p]
    wrong = reward(images=[img for img, _ in pairs], prompts=[q for _, q in pairs])
    assert wrong.scores.mean() <= 0.05


@pytest.mark.parametrize("shape", S.SHAPES)
def test_shape_iou_is_one_on_the_drawn_shape_and_below_on_others(shape):
    for seed in range(FRESH, FRESH + 20):  # sides 8-13 pixels
        img = np.asarray(S.render(f"a {shape}", seed, 32))
        pix = np.argwhere(np.any(img != S.BACKGROUND, axis=-1))
        assert S.shape_iou(pix, shape) == 1.0
        assert max(S.shape_iou(pix, other) for other in S.SHAPES if other != shape) < 0.9
