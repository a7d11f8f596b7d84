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
