from __future__ import annotations

import numpy as np
import pytest
from omni_rewards_testutils import noise

from omni_rewards import RewardInputError, load_reward

torch = pytest.importorskip("torch")

from omni_rewards.imagebind import (  # noqa: E402
    ImageBindConfig,
    TowerConfig,
    build_imagebind,
    load_imagebind,
    save_imagebind,
)

TINY = ImageBindConfig(
    embed_dim=16,
    vision=TowerConfig(32, 1, 2),
    text=TowerConfig(32, 1, 2),
    audio=TowerConfig(32, 1, 2, add_bias_kv=True),
    image_size=32,
    patch_size=8,
    vocab_size=300,
    context_length=16,
    mel_bins=32,
)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = build_imagebind(TINY)
    with torch.no_grad():  # random (not zero) positional embeddings and cls tokens
        for name, p in model.named_parameters():
            if "pos_embed" in name or "cls_token" in name:
                p.normal_(0, 0.5)
    return save_imagebind(model, tmp_path_factory.mktemp("ib") / "tiny")


def _inputs(n=2):
    rng = np.random.default_rng(0)
    videos = np.stack([np.stack([noise(10 * i + t) for t in range(3)]) for i in range(n)])
    audio = (0.1 * rng.standard_normal((n, 8000))).astype(np.float32)
    return dict(
        videos=videos, audio=audio, sample_rate=8000, prompts=["a dog barking", "waves"][:n]
    )


def test_state_dict_names_follow_released_format(tiny_dir):
    model = load_imagebind(tiny_dir)
    keys = set(model.state_dict())
    for k in [
        "modality_preprocessors.vision.rgbt_stem.proj.1.weight",
        "modality_preprocessors.vision.cls_token",
        "modality_preprocessors.vision.pos_embedding_helper.pos_embed",
        "modality_preprocessors.text.token_embedding.weight",
        "modality_preprocessors.audio.rgbt_stem.norm_layer.weight",
        "modality_trunks.vision.pre_transformer_layer.0.weight",
        "modality_trunks.audio.blocks.0.attn.bias_k",
        "modality_trunks.text.blocks.0.attn.in_proj_weight",
        "modality_trunks.text.blocks.0.mlp.fc1.weight",
        "modality_heads.vision.2.weight",
        "modality_heads.text.proj.1.weight",
        "modality_postprocessors.text.1.log_logit_scale",
        "modality_postprocessors.audio.1.log_logit_scale",
    ]:
        assert k in keys, k


def test_modes_and_weights(tiny_dir):
    inp = _inputs()
    r = load_reward("imagebind", checkpoint=str(tiny_dir))
    out = r(**inp)
    d = out.details
    np.testing.assert_allclose(
        out.scores,
        0.5 * d["audio_video"] + 0.25 * d["text_audio"] + 0.25 * d["text_video"],
        rtol=1e-5,
        atol=1e-6,
    )
    for k in ("audio_video", "text_audio", "text_video"):
        assert np.all(np.abs(d[k]) <= 1 + 1e-5)
        single = load_reward("imagebind", checkpoint=str(tiny_dir), mode=k)(**inp)
        np.testing.assert_allclose(single.scores, d[k], rtol=1e-5, atol=1e-6)
    # different inputs give different scores (the towers are not degenerate)
    assert abs(d["audio_video"][0] - d["audio_video"][1]) > 1e-4
    tv = load_reward("imagebind", checkpoint=str(tiny_dir), mode="text_video")
    with pytest.raises(
        RewardInputError, match=r"prompts: imagebind \(mode=text_video\) needs `prompts`"
    ):
        tv(videos=inp["videos"])
    with pytest.raises(RewardInputError, match="audio: imagebind"):
        r(videos=inp["videos"], prompts=inp["prompts"])
    with pytest.raises(ValueError, match="mode"):
        load_reward("imagebind", checkpoint=str(tiny_dir), mode="smell")


def test_released_pth_converts_and_loads(tmp_path, capsys):
    """A checkpoint in imagebind_huge.pth's layout (written from the official names by
    release_fixtures, all six modalities) converts once and loads strictly."""
    import json
    from dataclasses import asdict

    from release_fixtures import imagebind_release_state

    from omni_rewards.cli import main

    sd = imagebind_release_state(seed=3)
    torch.save(sd, str(tmp_path / "imagebind_tiny.pth"))
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps(asdict(TINY)))
    # the reward never unpickles: a .pth is an error pointing to the converter
    with pytest.raises(ValueError, match="omni-rewards convert imagebind"):
        load_imagebind(tmp_path / "imagebind_tiny.pth")
    out = tmp_path / "converted"
    argv = ["convert", "imagebind", str(tmp_path / "imagebind_tiny.pth"), str(out)]
    assert main([*argv, "--config", str(cfg)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    model = load_imagebind(out)
    own = model.state_dict()
    kept = {k: v for k, v in sd.items() if k.split(".")[1] in ("vision", "text", "audio")}
    assert set(own) == set(kept)  # depth / thermal / imu dropped, nothing else
    for k, v in kept.items():
        torch.testing.assert_close(own[k], v, msg=k)
    r = load_reward("imagebind", checkpoint=str(out))
    assert np.isfinite(r(**_inputs()).scores).all()


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (
            "modality_preprocessors.audio.rgbt_stem.proj.weight",
            "modality_preprocessors.audio.rgbt_stem.proj.0.weight",
        ),
        ("modality_heads.text.proj.1.weight", "modality_heads.text.proj.2.weight"),
    ],
)
def test_a_renamed_tensor_fails_the_conversion_naming_it(tmp_path, old, new, capsys):
    import json
    from dataclasses import asdict

    from release_fixtures import imagebind_release_state

    from omni_rewards.cli import main

    sd = imagebind_release_state()
    sd[new] = sd.pop(old)
    torch.save(sd, str(tmp_path / "bad.pth"))
    (tmp_path / "tiny.json").write_text(json.dumps(asdict(TINY)))
    argv = ["convert", "imagebind", str(tmp_path / "bad.pth"), str(tmp_path / "out")]
    assert main([*argv, "--config", str(tmp_path / "tiny.json")]) == 2
    err = capsys.readouterr().err
    assert "does not match the ImageBind architecture" in err and old in err and new in err
    assert not (tmp_path / "out").exists()


class _FixedEncoder:
    """Any object with the encoder interface works."""

    def embed_text(self, texts):
        return np.tile([1.0, 0.0], (len(texts), 1))

    def embed_audio(self, waves, sample_rate):
        return np.tile([0.6, 0.8], (len(waves), 1))

    def embed_video(self, videos):
        return np.tile([0.0, 1.0], (len(videos), 1))


def test_custom_encoder_exact():
    r = load_reward("imagebind", encoder=_FixedEncoder())
    out = r(**_inputs(1))
    assert out.details["audio_video"][0] == pytest.approx(0.8)
    assert out.details["text_audio"][0] == pytest.approx(0.6)
    assert out.details["text_video"][0] == pytest.approx(0.0)
    assert out.scores[0] == pytest.approx(0.5 * 0.8 + 0.25 * 0.6)
