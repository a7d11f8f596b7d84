"""Image-conditioned requests (Qwen-Image-Edit style): RolloutRequest.image through the engine."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

from diffusion_rollout import EmbeddedEngine, RolloutClient, RolloutRequest, SamplingParams
from diffusion_rollout.wave import denoise_wave

P = SamplingParams(
    height=32,
    width=32,
    num_steps=6,
    true_cfg_scale=4.0,
    noise_level=1.2,
    sde_window_size=2,
    sde_window_range=(0, 5),
    output="both",
)


def image(seed: int, h: int = 24, w: int = 24) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def edit_requests(n: int, sizes=None, params: SamplingParams = P) -> list[RolloutRequest]:
    prompts = ["turn the square red", "make the background brighter", "add a blue circle"]
    out = []
    for i in range(n):
        h, w = sizes[i] if sizes else (24, 24)
        img = image(i, h, w)
        out.append(
            RolloutRequest(
                prompts[i % 3],
                seed=500 + i,
                params=params,
                request_id=f"e{i}",
                negative_prompt="" if i % 2 else None,
                image=torch.from_numpy(img) if i % 2 else img,  # numpy and torch both work
            )
        )
    return out


def _same(alone, packed, max_diff) -> float:
    d = 0.0
    for a, b in zip(alone, packed):
        assert a.request_id == b.request_id and a.window == b.window
        d = max(d, max_diff(a, b))
        assert torch.equal(a.condition["image_latents"], b.condition["image_latents"])
    return d


def test_batched_edit_rollout_equals_one_at_a_time(toy_edit, max_diff):
    reqs = edit_requests(8)
    with EmbeddedEngine(toy_edit, max_num_seqs=1) as serial:
        alone = serial.generate_many(reqs)
    with EmbeddedEngine(toy_edit, max_num_seqs=8) as batched:
        packed = batched.generate_many(reqs)
    assert batched.stats()["mean_rows_per_forward"] == 8.0  # image requests share the forward
    assert len({t.window for t in alone}) > 1
    d = _same(alone, packed, max_diff)
    for a, b in zip(alone, packed):
        # the row's own noise: with the window at step 0, latents[0] is the initial draw
        assert torch.equal(a.latents[0], b.latents[0]) or a.window[0] > 0
        torch.testing.assert_close(a.log_probs, b.log_probs, atol=1e-5, rtol=0)
    # one stacked (B, H, W, 3) uint8 tensor reaches encode when the sizes agree
    seen = toy_edit.seen_images[-1]
    assert isinstance(seen, torch.Tensor) and seen.shape == (8, 24, 24, 3)
    assert seen.dtype == torch.uint8
    print(f"edit rollout: max |alone - batch8| = {d:.3g}")
    assert d <= 1e-5


def test_images_of_different_sizes_share_a_wave(toy_edit, max_diff):
    sizes = [(24, 24), (16, 40), (32, 32), (9, 13)]
    reqs = edit_requests(4, sizes)
    with EmbeddedEngine(toy_edit, max_num_seqs=1) as serial:
        alone = serial.generate_many(reqs)
    with EmbeddedEngine(toy_edit, max_num_seqs=4) as batched:
        packed = batched.generate_many(reqs)
    assert batched.stats()["waves"] == 1
    seen = toy_edit.seen_images[-1]
    assert isinstance(seen, list) and sorted(tuple(t.shape[:2]) for t in seen) == sorted(sizes)
    assert _same(alone, packed, max_diff) <= 1e-5


def test_the_image_changes_the_trajectory(toy_edit):
    a, b = edit_requests(2)
    b = RolloutRequest(a.prompt, a.seed, a.params, "other", a.negative_prompt, image=image(99))
    with EmbeddedEngine(toy_edit) as engine:
        ta, tb = engine.generate_many([a, b])
    assert not torch.equal(ta.final_latent, tb.final_latent)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ([[0, 0, 0]], "numpy array or torch tensor, got list"),
        (np.zeros((4, 4, 3), dtype=np.float32), "dtype uint8, got float32"),
        (torch.zeros(4, 4, 3), "dtype uint8"),
        (np.zeros((4, 4), dtype=np.uint8), r"shape \(H, W, 3\), got \(4, 4\)"),
        (np.zeros((4, 4, 4), dtype=np.uint8), r"got \(4, 4, 4\)"),
        (np.zeros((0, 4, 3), dtype=np.uint8), r"got \(0, 4, 3\)"),
    ],
)
def test_bad_images_name_the_field(value, match):
    with pytest.raises(ValueError, match=r"RolloutRequest\.image") as err:
        RolloutRequest("x", 1, image=value)
    assert err.match(match)


def test_edit_denoiser_without_an_image_is_a_clear_error(toy_edit):
    with (
        EmbeddedEngine(toy_edit) as engine,
        pytest.raises(ValueError, match=r"requests\[1\]: RolloutRequest.image is required"),
    ):
        engine.generate_many([edit_requests(1)[0], RolloutRequest("no image", 1, P)])
    with pytest.raises(ValueError, match="needs_images"):
        denoise_wave(toy_edit, [RolloutRequest("no image", 1, P)])


def test_text_denoiser_refuses_images(toy):
    with EmbeddedEngine(toy) as engine, pytest.raises(ValueError, match="takes no condition"):
        engine.generate_many(edit_requests(1))


def test_a_wave_mixing_images_and_none_is_an_error(toy_edit):
    mixed = [*edit_requests(1), RolloutRequest("plain", 3, P, "p")]
    with pytest.raises(ValueError, match=r"requests\[0\] carries RolloutRequest.image but"):
        denoise_wave(toy_edit, mixed)


def test_request_dict_round_trip_carries_the_image():
    img = image(3, 7, 5)
    r = RolloutRequest("make it red", 4, P, "id", image=img)
    d = r.to_dict()
    assert isinstance(d["image"], str)  # base64 safetensors, JSON-ready
    back = RolloutRequest.from_dict(d)
    assert back == r and isinstance(back.image, torch.Tensor)
    assert torch.equal(back.image, torch.from_numpy(img))
    assert "image" not in RolloutRequest("a", 1).to_dict()
    assert RolloutRequest.from_dict({"prompt": "a", "seed": 1, "image": None}).image is None


def test_wire_image_accepts_png_and_names_bad_payloads():
    from PIL import Image

    img = image(4, 6, 9)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="PNG")
    png = base64.b64encode(buf.getvalue()).decode()
    back = RolloutRequest.from_dict({"prompt": "a", "seed": 1, "image": png})
    assert torch.equal(back.image, torch.from_numpy(img))
    for bad, match in [
        (3, "base64 string"),
        ("%%%", "not valid base64"),
        (base64.b64encode(b"garbage bytes").decode(), "neither PNG/JPEG nor a safetensors"),
    ]:
        with pytest.raises(ValueError, match=r"RolloutRequest\.image") as err:
            RolloutRequest.from_dict({"prompt": "a", "seed": 1, "image": bad})
        assert err.match(match)


@pytest.mark.parametrize("live_server", [{"edit": True}], indirect=True)
def test_edit_requests_over_http_match_embedded(live_server, max_diff):
    import httpx

    url, _, served = live_server
    reqs = edit_requests(6, [(24, 24), (16, 40)] * 3)
    with EmbeddedEngine(type(served)()) as local:  # same seed, same weights
        ref = local.generate_many(reqs)
    client = RolloutClient(url, concurrency=8)
    client.wait_ready()
    got = client.generate(reqs)
    assert max(max_diff(a, b) for a, b in zip(ref, got)) <= 1e-5
    assert client.stats()["mean_rows_per_forward"] > 1
    # a request without its image is a 400 naming the field; the server keeps serving
    resp = httpx.post(url + "/generate", json={"prompt": "x", "seed": 1}, timeout=30)
    assert resp.status_code == 400 and resp.json()["field"] == "image"
    assert "RolloutRequest.image is required" in resp.json()["error"]
    assert client.generate(reqs[:1])[0].request_id == "e0"


# ------------------------------------------------ several condition images (Edit-Plus)
def multi_requests(n: int, k: int = 2, params: SamplingParams = P) -> list[RolloutRequest]:
    return [
        RolloutRequest(
            "put them together",
            seed=700 + i,
            params=params,
            request_id=f"m{k}-{i}",
            negative_prompt="",
            image=[image(10 * i + j, 16 + 4 * j, 20) for j in range(k)],
        )
        for i in range(n)
    ]


def test_multi_image_requests_batch_like_one_at_a_time(toy_edit, max_diff):
    reqs = multi_requests(4)
    with EmbeddedEngine(toy_edit, max_num_seqs=1) as serial:
        alone = serial.generate_many(reqs)
    with EmbeddedEngine(toy_edit, max_num_seqs=4) as batched:
        packed = batched.generate_many(reqs)
    assert batched.stats()["mean_rows_per_forward"] == 4.0
    seen = toy_edit.seen_images[-1]
    assert isinstance(seen, list) and [len(r) for r in seen] == [2] * 4
    assert all(t.dtype == torch.uint8 and t.shape[-1] == 3 for r in seen for t in r)
    assert packed[0].condition["image_latents"].shape == (2, 3, 8, 8)
    assert _same(alone, packed, max_diff) <= 1e-5


def test_the_order_of_the_condition_images_matters(toy_edit):
    a = multi_requests(1)[0]
    b = RolloutRequest(a.prompt, a.seed, a.params, "swapped", a.negative_prompt, a.image[::-1])
    with EmbeddedEngine(toy_edit, max_num_seqs=2) as engine:
        ta, tb = engine.generate_many([a, b])
    assert not torch.equal(ta.latents[-1], tb.latents[-1])


def test_different_image_counts_never_share_a_wave(toy_edit):
    reqs = multi_requests(2, k=2) + multi_requests(2, k=3) + edit_requests(2)
    with EmbeddedEngine(toy_edit, max_num_seqs=8) as engine:
        out = engine.generate_many(reqs)
    assert [t.request_id for t in out] == [r.request_id for r in reqs]
    assert engine.stats()["waves"] == 3  # one per image count, each wave two rows

    def per_row(seen):
        return len(seen[0]) if isinstance(seen, list) and isinstance(seen[0], list) else 1

    assert sorted(per_row(s) for s in toy_edit.seen_images[-3:]) == [1, 2, 3]
    with pytest.raises(ValueError, match=r"requests\[2\] carries 3 condition images"):
        denoise_wave(toy_edit, reqs[:2] + reqs[2:3])


def test_image_lists_are_checked_and_cross_the_wire():
    imgs = [image(1, 7, 5), torch.from_numpy(image(2, 4, 6))]
    r = RolloutRequest("a", 1, P, "id", image=imgs)
    assert r.num_images == 2 and RolloutRequest("b", 1).num_images == 0
    d = r.to_dict()
    assert isinstance(d["image"], list) and all(isinstance(x, str) for x in d["image"])
    back = RolloutRequest.from_dict(d)
    assert back.num_images == 2
    assert all(torch.equal(x, torch.as_tensor(y)) for x, y in zip(back.image, imgs))
    with pytest.raises(ValueError, match=r"RolloutRequest\.image\[1\] must have dtype uint8"):
        RolloutRequest("a", 1, image=[image(1), np.zeros((4, 4, 3), np.float32)])
    with pytest.raises(ValueError, match=r"RolloutRequest\.image: an empty list"):
        RolloutRequest("a", 1, image=[])
    with pytest.raises(ValueError, match=r"RolloutRequest\.image\[0\] is not valid base64"):
        RolloutRequest.from_dict({"prompt": "a", "seed": 1, "image": ["***"]})
