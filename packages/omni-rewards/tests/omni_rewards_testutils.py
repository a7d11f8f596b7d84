"""Test helpers (imported by the tests; conftest puts this folder on sys.path)."""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw, ImageFont


def solid(rgb, size=(32, 32)) -> np.ndarray:
    """A uint8 (H, W, 3) image of one colour."""
    img = np.zeros((*size, 3), dtype=np.uint8)
    img[...] = np.asarray(rgb, dtype=np.uint8)
    return img


def noise(seed=0, size=(32, 32)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(*size, 3), dtype=np.uint8)


def render_text(text: str, *, size: int = 40, pad: int = 24) -> np.ndarray:
    """Black text on white with PIL's default font at ``size`` px, as uint8 (H, W, 3)."""
    font = ImageFont.load_default(size=size)
    probe = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    left, top, right, bottom = probe.textbbox((0, 0), text, font=font)
    w, h = right - left + 2 * pad, bottom - top + 2 * pad
    img = Image.new("RGB", (max(w, 32), max(h, 32)), "white")
    ImageDraw.Draw(img).text((pad - left, pad - top), text, fill="black", font=font)
    return np.asarray(img)


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """Runs an ASGI app with uvicorn on 127.0.0.1:<random port> in a background thread, on the
    guarded protocol of `omni_rewards.serving` (as `omni-rewards serve` does)."""

    def __init__(self, app) -> None:
        import threading
        import time

        import uvicorn

        from omni_rewards.limits import HTTPLimits
        from omni_rewards.serving import uvicorn_config

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        limits = getattr(getattr(app, "state", None), "limits", None)
        config = uvicorn_config(
            app,
            host="127.0.0.1",
            port=self.port,
            limits=limits.http if limits is not None else HTTPLimits(),
            log_level="critical",
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def tiny_clip_tokenizer():
    """A real transformers CLIPTokenizer over a tiny byte-level vocabulary (letters, digits)."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for ch in "abcdefghijklmnopqrstuvwxyz0123456789.,!?'\"":
        vocab.setdefault(ch, len(vocab))
        vocab.setdefault(ch + "</w>", len(vocab))
    return CLIPTokenizer(vocab=vocab, merges=[])


def save_tiny_clip(path, seed: int = 0, projection_dim: int = 16) -> str:
    """Build a tiny random transformers CLIPModel + tokenizer and save_pretrained them."""
    import torch
    from transformers import CLIPConfig, CLIPModel

    tok = tiny_clip_tokenizer()
    torch.manual_seed(seed)
    cfg = CLIPConfig(
        text_config=dict(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=32,
            eos_token_id=tok.eos_token_id,
            bos_token_id=tok.bos_token_id,
            pad_token_id=tok.pad_token_id,
        ),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        ),
        projection_dim=projection_dim,
    )
    model = CLIPModel(cfg).eval()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


TINY_OPEN_CLIP = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 8, "head_width": 16},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
}


def save_tiny_clap(path, seed: int = 0, sampling_rate: int = 16000) -> str:
    """A tiny random transformers ClapModel + ClapProcessor (tiny RoBERTa BPE vocab), saved."""
    import torch
    from transformers import (
        ClapConfig,
        ClapFeatureExtractor,
        ClapModel,
        ClapProcessor,
        RobertaTokenizer,
    )

    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for ch in "abcdefghijklmnopqrstuvwxyz0123456789Ġ":
        vocab[ch] = len(vocab)
    tok = RobertaTokenizer(vocab=vocab, merges=[])
    torch.manual_seed(seed)
    cfg = ClapConfig(
        text_config=dict(
            vocab_size=len(vocab) + 2,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=64,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
        ),
        audio_config=dict(
            depths=[1, 1],
            num_attention_heads=[1, 2],
            patch_embeds_hidden_size=16,
            hidden_size=32,
            spec_size=256,
            num_mel_bins=64,
            window_size=8,
            enable_fusion=False,
        ),
        projection_dim=16,
    )
    ClapModel(cfg).eval().save_pretrained(path)
    fe = ClapFeatureExtractor(
        feature_size=64,
        sampling_rate=sampling_rate,
        hop_length=160,
        max_length_s=2,
        fft_window_size=512,
        truncation="rand_trunc",
        padding="repeatpad",
    )
    ClapProcessor(feature_extractor=fe, tokenizer=tok).save_pretrained(path)
    return str(path)


def save_tiny_sd3(path, seed: int = 0) -> str:
    """A tiny SD3.5-style diffusers folder (the parts DiNa-LRM reads): ``transformer/``
    (SD3Transformer2DModel, 3 blocks, dual attention in block 0, rms qk-norm), ``text_encoder``
    + ``text_encoder_2`` (CLIPTextModelWithProjection), ``text_encoder_3`` (T5EncoderModel),
    their tokenizers and ``scheduler/`` (flow matching, shift 3), saved with the libraries'
    own ``save_pretrained``."""
    from pathlib import Path

    import torch
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import (
        CLIPTextConfig,
        CLIPTextModelWithProjection,
        T5Config,
        T5EncoderModel,
        T5TokenizerFast,
    )
    from transformers.convert_slow_tokenizer import SpmConverter  # noqa: F401  (sentencepiece)

    root = Path(path)
    torch.manual_seed(seed)
    tok = tiny_clip_tokenizer()
    tok.model_max_length = 77
    for name, width in (("", 16), ("_2", 24)):
        cfg = CLIPTextConfig(
            vocab_size=len(tok),
            hidden_size=width,
            intermediate_size=2 * width,
            num_hidden_layers=2,
            num_attention_heads=2,
            max_position_embeddings=77,
            projection_dim=width,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        CLIPTextModelWithProjection(cfg).save_pretrained(root / f"text_encoder{name}")
        tok.save_pretrained(root / f"tokenizer{name}")
    t5_tok = _tiny_t5_tokenizer()
    T5EncoderModel(
        T5Config(vocab_size=len(t5_tok), d_model=48, d_kv=8, d_ff=64, num_layers=1, num_heads=2)
    ).save_pretrained(root / "text_encoder_3")
    t5_tok.save_pretrained(root / "tokenizer_3")
    assert isinstance(t5_tok, T5TokenizerFast)
    SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=16,
        num_layers=3,
        attention_head_dim=8,
        num_attention_heads=4,
        joint_attention_dim=48,
        caption_projection_dim=32,
        pooled_projection_dim=16 + 24,
        out_channels=16,
        pos_embed_max_size=16,
        dual_attention_layers=(0,),
        qk_norm="rms_norm",
    ).save_pretrained(root / "transformer")
    FlowMatchEulerDiscreteScheduler(shift=3.0).save_pretrained(root / "scheduler")
    return str(root)


def _tiny_t5_tokenizer():
    """A T5TokenizerFast over a tiny Unigram vocabulary (letters, digits)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import T5TokenizerFast

    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    for ch in "abcdefghijklmnopqrstuvwxyz0123456789":
        vocab += [(ch, -3.0), ("▁" + ch, -3.5)]
    t = Tokenizer(models.Unigram(vocab, unk_id=2))
    t.normalizer = normalizers.Lowercase()
    t.pre_tokenizer = pre_tokenizers.Metaspace()
    t.decoder = decoders.Metaspace()
    return T5TokenizerFast(
        tokenizer_object=t, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", extra_ids=0
    )
