from __future__ import annotations

import itertools

import numpy as np
import pytest
from omni_rewards_testutils import TINY_OPEN_CLIP, noise, save_tiny_clip, solid

from omni_rewards import RewardInputError, load_reward

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return save_tiny_clip(tmp_path_factory.mktemp("clip") / "tiny-clip")


def _reference_cosines(path, images, prompts):
    """Independent computation with transformers' own CLIPProcessor-free path."""
    from transformers import AutoTokenizer, CLIPModel

    from omni_rewards.clip import clip_preprocess

    model = CLIPModel.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        px = torch.from_numpy(clip_preprocess(images, 32))
        t = tok(prompts, padding=True, return_tensors="pt")
        out = model(input_ids=t["input_ids"], attention_mask=t["attention_mask"], pixel_values=px)
        # logits_per_image = exp(logit_scale) * cos; take the diagonal
        return out.logits_per_image.diagonal().numpy(), float(model.logit_scale.exp())


def test_clip_score_matches_transformers_logits(clip_dir):
    imgs = [noise(0, (40, 48)), noise(1, (32, 32)), solid((200, 10, 10))]
    prompts = ["a red square", "noise", "a dog on a bike"]
    reward = load_reward("clip_score", model=clip_dir, batch_size=2)
    out = reward(images=imgs, prompts=prompts)
    ref, scale = _reference_cosines(clip_dir, imgs, prompts)
    np.testing.assert_allclose(out.scores, ref, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(out.scores, scale * out.details["cosine"], rtol=1e-5)
    assert np.all(np.abs(out.details["cosine"]) <= 1 + 1e-6)


def test_pickscore_divides_by_26(clip_dir):
    imgs = np.stack([noise(3), noise(4)])
    prompts = ["one", "two"]
    clip = load_reward("clip_score", model=clip_dir)(images=imgs, prompts=prompts)
    pick = load_reward("pickscore", model=clip_dir)(images=imgs, prompts=prompts)
    np.testing.assert_allclose(pick.scores, clip.scores / 26, rtol=1e-5)


def test_clip_video_is_mean_over_frames(clip_dir):
    r = load_reward("clip_score", model=clip_dir, video_frames=2)
    frames = np.stack([noise(5), noise(6)])
    vid = r(videos=frames[None], prompts=["x"]).scores[0]
    per_frame = r(images=frames, prompts=["x", "x"]).scores
    assert vid == pytest.approx(per_frame.mean(), rel=1e-5)


def test_clip_errors(clip_dir):
    r = load_reward("clip_score", model=clip_dir)
    with pytest.raises(RewardInputError, match="prompts: clip_score needs `prompts`"):
        r(images=np.stack([noise(0)]))
    with pytest.raises(ValueError, match="backend"):
        load_reward("clip_score", model=clip_dir, backend="jax")


def _tiny_open_clip(path, seed=0):
    import open_clip
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    model = open_clip.CLIP(**TINY_OPEN_CLIP).eval()
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(sd, str(path / "hps.safetensors"))
    torch.save({"state_dict": sd}, str(path / "hps.pt"))
    return model


def test_hpsv2_and_open_clip_backend(tmp_path):
    pytest.importorskip("open_clip")
    import open_clip

    model = _tiny_open_clip(tmp_path)
    imgs = [noise(0), solid((10, 200, 30))]
    prompts = ["a green field", "static"]
    hps = load_reward(
        "hpsv2", checkpoint=str(tmp_path / "hps.safetensors"), model_config=TINY_OPEN_CLIP
    )
    out = hps(images=imgs, prompts=prompts)
    # independent: open_clip's own encoders on the same preprocessing
    from omni_rewards.clip import clip_preprocess

    tok = open_clip.SimpleTokenizer(context_length=16)
    with torch.no_grad():
        fi = torch.nn.functional.normalize(
            model.encode_image(torch.from_numpy(clip_preprocess(imgs, 32))), dim=-1
        )
        ft = torch.nn.functional.normalize(model.encode_text(tok(prompts)), dim=-1)
    np.testing.assert_allclose(out.scores, (fi * ft).sum(-1).numpy(), atol=1e-5)
    # the released torch format ({"state_dict": ...}) is never unpickled by the reward: it is
    # converted once (omni-rewards convert hpsv2), then gives the same scores
    with pytest.raises(ValueError, match="omni-rewards convert"):
        load_reward("hpsv2", checkpoint=str(tmp_path / "hps.pt"), model_config=TINY_OPEN_CLIP)
    from omni_rewards.cli import main

    conv = tmp_path / "hps_converted.safetensors"
    assert main(["convert", "hpsv2", str(tmp_path / "hps.pt"), str(conv)]) == 0
    hps_pt = load_reward("hpsv2", checkpoint=str(conv), model_config=TINY_OPEN_CLIP)
    np.testing.assert_allclose(hps_pt(images=imgs, prompts=prompts).scores, out.scores, atol=1e-6)
    oc = load_reward(
        "clip_score",
        backend="open_clip",
        checkpoint=str(tmp_path / "hps.safetensors"),
        model_config=TINY_OPEN_CLIP,
    )
    np.testing.assert_allclose(
        oc(images=imgs, prompts=prompts).scores,
        out.scores * model.logit_scale.exp().item(),
        rtol=1e-4,
    )
    with pytest.raises(ValueError, match="checkpoint"):
        load_reward("hpsv2")


def test_hpsv2_rejects_mismatched_checkpoint(tmp_path):
    pytest.importorskip("open_clip")
    from safetensors.torch import save_file

    save_file({"foo": torch.zeros(2)}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ValueError, match="does not match the architecture"):
        load_reward(
            "hpsv2", checkpoint=str(tmp_path / "bad.safetensors"), model_config=TINY_OPEN_CLIP
        )


def test_aesthetic_head(clip_dir, tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    dims = [16, 8, 4, 1]
    sd = {}
    for i, (a, b) in enumerate(itertools.pairwise(dims)):
        sd[f"layers.{2 * i}.weight"] = torch.randn(b, a)
        sd[f"layers.{2 * i}.bias"] = torch.randn(b)
    save_file(sd, str(tmp_path / "head.safetensors"))
    r = load_reward("aesthetic", head=str(tmp_path / "head.safetensors"), clip_model=clip_dir)
    imgs = [noise(0), noise(1)]
    out = r(images=imgs)
    emb = r.encoder.encode_images(imgs)
    x = emb
    for i in range(3):
        x = x @ sd[f"layers.{2 * i}.weight"].T + sd[f"layers.{2 * i}.bias"]
    np.testing.assert_allclose(out.scores, x.squeeze(-1).numpy(), rtol=1e-5, atol=1e-6)
    save_file({"layers.0.weight": torch.randn(1, 7)}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ValueError, match="expects 7-d embeddings"):
        load_reward("aesthetic", head=str(tmp_path / "bad.safetensors"), clip_model=clip_dir)


def official_aesthetic_mlp(input_size: int):
    """The MLP of christophschuhmann/improved-aesthetic-predictor (`simple_inference.py`): its
    `layers` Sequential, layer order, widths and dropouts as released (the ReLUs commented out
    there), for an embedding of `input_size` (768 for the released CLIP ViT-L/14 heads)."""
    from torch import nn

    mlp = nn.Module()
    mlp.layers = nn.Sequential(
        nn.Linear(input_size, 1024),
        nn.Dropout(0.2),
        nn.Linear(1024, 128),
        nn.Dropout(0.2),
        nn.Linear(128, 64),
        nn.Dropout(0.1),
        nn.Linear(64, 16),
        nn.Linear(16, 1),
    )
    return mlp


@pytest.mark.parametrize("wrapped", [False, True])
def test_released_aesthetic_pth_converts_and_scores_as_the_official_mlp(
    clip_dir, tmp_path, wrapped
):
    """A `.pth` in the released head's layout (`torch.save(model.state_dict())`, keys
    layers.0/2/4/6/7; also wrapped as {"state_dict": DataParallel's module.* keys}) goes
    through `omni-rewards convert aesthetic`, and the reward scores as the official MLP does on
    the unit-normalised CLIP image embedding (simple_inference.py normalises it)."""
    import torch

    from omni_rewards.cli import main

    torch.manual_seed(0)
    mlp = official_aesthetic_mlp(16).eval()  # the tiny CLIP's projection width
    state = mlp.state_dict()
    assert sorted({k.split(".")[1] for k in state}) == ["0", "2", "4", "6", "7"]
    if wrapped:
        state = {"state_dict": {f"module.{k}": v for k, v in state.items()}}
    torch.save(state, tmp_path / "sac+logos+ava1-l14-linearMSE.pth")
    dst = tmp_path / "aesthetic.safetensors"
    assert (
        main(["convert", "aesthetic", str(tmp_path / "sac+logos+ava1-l14-linearMSE.pth"), str(dst)])
        == 0
    )
    r = load_reward("aesthetic", head=str(dst), clip_model=clip_dir)
    imgs = [noise(0), noise(1), solid((200, 30, 30))]
    emb = r.encoder.encode_images(imgs)
    torch.testing.assert_close(emb.norm(dim=-1), torch.ones(3))
    with torch.no_grad():
        want = mlp.layers(emb).squeeze(-1).numpy()
    np.testing.assert_allclose(r(images=imgs).scores, want, rtol=1e-5, atol=1e-6)


def test_pickscore_release_layout_without_tokenizer(tmp_path):
    """PickScore_v1 is a CLIPModel folder (config.json + model.safetensors) without tokenizer
    files; the reward takes the processor's tokenizer (option, default the laion repo)."""
    import shutil

    full = save_tiny_clip(tmp_path / "full")
    model_dir = tmp_path / "PickScore_v1"
    model_dir.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(f"{full}/{f}", model_dir / f)
    r = load_reward("pickscore", model=str(model_dir), tokenizer=full)
    ref = load_reward("pickscore", model=full)
    imgs, prompts = [noise(1), solid((0, 0, 255))], ["a blue sky", "noise"]
    np.testing.assert_allclose(
        r(images=imgs, prompts=prompts).scores, ref(images=imgs, prompts=prompts).scores
    )
    with pytest.raises(Exception, match="laion/CLIP-ViT-H-14-laion2B-s32B-b79K"):
        load_reward("pickscore", model=str(model_dir))  # offline: names the processor repo


def test_hf_checkpoints_load_strictly_and_never_unpickle(tmp_path, clip_dir):
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "renamed"
    shutil.copytree(clip_dir, bad)
    sd = load_file(str(bad / "model.safetensors"))
    sd["text_projection.weightX"] = sd.pop("text_projection.weight")
    save_file(sd, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing \['text_projection.weight'\].*weightX"):
        load_reward("clip_score", model=str(bad))
    pickled = tmp_path / "bin_only"
    shutil.copytree(clip_dir, pickled)
    (pickled / "model.safetensors").unlink()
    torch.save(sd, str(pickled / "pytorch_model.bin"))
    with pytest.raises(ValueError, match="from safetensors"):
        load_reward("clip_score", model=str(pickled))


def test_convert_state_dict_keeps_names_and_refuses_what_is_not_a_tensor(tmp_path):
    """`omni-rewards convert state-dict`: any torch state dict to safetensors under its own
    names, the {"state_dict"} wrapper and DataParallel's `module.` prefix removed; a value that
    is not a tensor is named, and nothing is written."""
    import torch
    from safetensors.torch import load_file

    from omni_rewards.cli import main

    a, b = torch.randn(3, 2), torch.arange(4)
    torch.save({"state_dict": {"module.enc.weight": a, "module.step": b}}, tmp_path / "m.pt")
    dst = tmp_path / "m.safetensors"
    assert main(["convert", "state-dict", str(tmp_path / "m.pt"), str(dst)]) == 0
    out = load_file(dst)
    assert sorted(out) == ["enc.weight", "step"]
    assert torch.equal(out["enc.weight"], a) and torch.equal(out["step"], b)
    torch.save({"enc.weight": a, "note": "text"}, tmp_path / "bad.pt")
    bad = tmp_path / "bad.safetensors"
    assert main(["convert", "state-dict", str(tmp_path / "bad.pt"), str(bad)]) != 0
    assert not bad.exists()
