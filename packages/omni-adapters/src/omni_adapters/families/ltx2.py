"""LTX-2 / LTX-2.3 text-to-video+audio (``LTX2Pipeline``): ``LTX2VideoTransformer3DModel`` (a dual-stream
video/audio DiT with video<->audio cross-attention), ``AutoencoderKLLTX2Video``,
``AutoencoderKLLTX2Audio`` (mel-spectrogram VAE), ``LTX2Vocoder`` (mel -> waveform),
``LTX2TextConnectors`` and a Gemma-3 text encoder.

As in the diffusers pipeline (LTX-2.0 layout):

- text: the prompt is stripped, tokenized left-padded to a fixed length, *every* hidden state
  of the Gemma-3 encoder is stacked and flattened ``(B, L, D * (layers + 1))``, and the text
  connectors turn it into the video and audio prompt embeddings and their attention mask;
- latents: video ``(C, (F - 1) / t + 1, H / s, W / s)`` and audio
  ``(C_a, round(F / fps * sr / hop / t_a), mel_bins / m)``, both in the transformer's
  (normalised) space. One row of this adapter's latents is the two flattened and
  concatenated, ``x = [vec(video); vec(audio)]`` (shape ``(D_video + D_audio,)``), so the SDE
  step, its log-prob and the rollout engine treat the joint sample as one vector; video noise
  is drawn before audio noise from the row's generator, the pipeline's order;
- the transformer takes the packed token sequences, ``timestep = 1000 sigma`` and the RoPE
  coordinates of both streams, and predicts both velocities ``eps - x0``; classifier-free
  guidance ``v = v_neg + s (v_pos - v_neg)`` on both streams (the pipeline's x0-space guidance
  ``x0_neg + s (x0_pos - x0_neg)`` is the same map, since ``x0 = x - sigma v`` is affine in v);
- sigmas: ``linspace(1, 1/N, N)`` with resolution-dependent shifting,
  ``mu = calculate_shift(video tokens, 1024, 4096, 0.95, 2.05)``, then a terminal 0;
- decode: video latents de-normalised (per-channel mean/std) and VAE-decoded to uint8 frames;
  audio latents de-normalised in packed space, mel-decoded, then the vocoder makes the
  waveform. :meth:`LTX2Adapter.decode` returns the frames (the ``Denoiser`` contract: one
  uint8 tensor); :meth:`LTX2Adapter.decode_av` returns frames plus waveform.

LTX-2.3 (the release the recipe trains) is the same pipeline with gated attention,
cross-attention modulation and per-modality text projections switched on in the configs
(diffusers' conversion script, version "2.3"); the tiny model is built in that layout.

Not covered: spatio-temporal (STG) and modality-isolation guidance, a separate audio
guidance scale, image conditioning and the latent upsampler stages.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor

from ..base import (
    component_class,
    load_module,
    model_index_entries,
    module_dtype,
    register_adapter,
    write_adapter_options,
)
from ..diffusion import DiffusionAdapter, to_uint8
from ..tiny import register_tiny

__all__ = [
    "LTX2_LORA_TARGETS",
    "LTX23_CONNECTORS",
    "LTX23_TRANSFORMER",
    "LTX2Adapter",
    "build_tiny",
    "build_tiny_version",
]

FAMILY = "ltx2"

#: attention projections of every LTX2Attention in the transformer (video self/cross,
#: audio self/cross, audio->video and video->audio cross-modal attention)
LTX2_LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")

#: model_index libraries that are pipeline-local modules in diffusers
_LOCAL_LIBRARIES = {"ltx2": "diffusers.pipelines.ltx2"}


def _pipeline_cls() -> Any:
    from diffusers import LTX2Pipeline

    return LTX2Pipeline


@register_adapter("LTX2Pipeline", family=FAMILY)
class LTX2Adapter(DiffusionAdapter):
    """LTX-2 text-to-video+audio adapter (one joint latent vector per row)."""

    modality: ClassVar[str] = "video+audio"
    cfg_param: ClassVar[str] = "guidance_scale"
    lora_target_modules: ClassVar[tuple[str, ...]] = LTX2_LORA_TARGETS
    no_split_modules: ClassVar[tuple[str, ...]] = ("LTX2VideoTransformerBlock",)
    #: components the text-to-video+audio stage does not use
    unused_components: ClassVar[tuple[str, ...]] = ("processor", "prompt_enhancer", "duration_head")

    # ------------------------------------------------------------ loading
    @classmethod
    def load_components(
        cls, path: Path, *, dtype: torch.dtype, device: torch.device, skip: Any = ()
    ) -> dict[str, Any]:
        """Load every ``model_index.json`` component; ``["ltx2", cls]`` entries (connectors,
        vocoder) come from ``diffusers.pipelines.ltx2``; the tokenizer through AutoTokenizer."""
        from transformers import AutoTokenizer

        out: dict[str, Any] = {}
        for name, library, class_name in model_index_entries(path, skip):
            sub = path / name
            if device.type == "meta" and not (sub / "config.json").is_file():
                continue  # config-only folder (architecture checks): tokenizer etc. absent
            if name == "tokenizer":
                tok = AutoTokenizer.from_pretrained(sub)
                tok.padding_side = "left"
                out[name] = tok
                continue
            klass = component_class(path, name, _LOCAL_LIBRARIES.get(library, library), class_name)
            if isinstance(klass, type) and issubclass(klass, torch.nn.Module):
                out[name] = load_module(klass, sub, dtype=dtype, device=device)
            else:
                out[name] = klass.from_pretrained(sub)
        return out

    # --------------------------------------------------------------- text
    @property
    def max_text_length(self) -> int:
        """Gemma tokens per prompt (option ``max_sequence_length``, 1024 as released)."""
        return int(self.options.get("max_sequence_length", 1024))

    def frame_rate(self, params: Any) -> float:
        """``params.frame_rate`` if present, else option ``frame_rate`` (24 as released)."""
        fr = getattr(params, "frame_rate", None) or self.options.get("frame_rate", 24.0)
        return float(fr)

    def encode_prompts(self, prompts: list[str], **inputs: Any) -> dict[str, Tensor]:
        """``prompt_embeds`` (B, L, Dv), ``audio_prompt_embeds`` (B, L, Da) and
        ``prompt_attention_mask`` (B, L) float: connectors over all stacked encoder states."""
        tok = self.components["tokenizer"]
        enc = self.components["text_encoder"]
        con = self.components["connectors"]
        tok.padding_side = "left"
        ids = tok(
            [p.strip() for p in prompts],
            padding="max_length",
            max_length=self.max_text_length,
            truncation=True,
            add_special_tokens=True,
            return_tensors="pt",
        ).to(self.device)
        out = enc(
            input_ids=ids.input_ids, attention_mask=ids.attention_mask, output_hidden_states=True
        )
        states = torch.stack(out.hidden_states, dim=-1).flatten(2, 3).to(self.dtype)
        video, audio, mask = con(states, ids.attention_mask, padding_side="left")
        return {
            "prompt_embeds": video.float(),
            "audio_prompt_embeds": audio.float(),
            "prompt_attention_mask": mask.float(),
        }

    # ------------------------------------------------------------ latents
    def geometry(self, params: Any) -> dict[str, int]:
        """Latent sizes for ``params``: video ``(cv, f, h, w)``, audio ``(ca, la, ma)`` and the
        flat sizes ``dv``, ``da``."""
        vae = self.components["vae"]
        avae = self.components["audio_vae"]
        s, t = int(vae.spatial_compression_ratio), int(vae.temporal_compression_ratio)
        h, w, f = int(params.height), int(params.width), int(params.num_frames)
        if f < 1 or (f - 1) % t:
            raise ValueError(f"num_frames: {f} - 1 is not a multiple of {t}")
        p = int(self.model.config.patch_size)
        for name, v in (("height", h), ("width", w)):
            if v <= 0 or v % (s * p):
                raise ValueError(f"{name}: {v} is not a positive multiple of {s * p}")
        cv = int(self.model.config.in_channels)
        fl, hl, wl = (f - 1) // t + 1, h // s, w // s
        acfg = avae.config
        per_second = acfg.sample_rate / acfg.mel_hop_length / float(avae.temporal_compression_ratio)
        la = round(f / self.frame_rate(params) * per_second)
        if la < 1:
            raise ValueError(f"num_frames: {f} frames give no audio latent frame")
        ca = int(acfg.latent_channels)
        ma = int(acfg.mel_bins) // int(avae.mel_compression_ratio)
        return {
            "cv": cv, "f": fl, "h": hl, "w": wl, "ca": ca, "la": la, "ma": ma,
            "dv": cv * fl * hl * wl, "da": ca * la * ma,
        }  # fmt: skip

    def latent_shape(self, params: Any) -> tuple[int, ...]:
        """``(D_video + D_audio,)``: the flattened video and audio latents of one row."""
        g = self.geometry(params)
        return (g["dv"] + g["da"],)

    def split_latents(self, latents: Tensor, params: Any) -> tuple[Tensor, Tensor]:
        """Flat rows -> video ``(B, Cv, F, H, W)`` and audio ``(B, Ca, La, Ma)`` latents."""
        g = self.geometry(params)
        if latents.shape[1:] != (g["dv"] + g["da"],):
            raise ValueError(
                f"latents: expected (B, {g['dv'] + g['da']}) for these params, "
                f"got {tuple(latents.shape)}"
            )
        b = latents.shape[0]
        video = latents[:, : g["dv"]].reshape(b, g["cv"], g["f"], g["h"], g["w"])
        audio = latents[:, g["dv"] :].reshape(b, g["ca"], g["la"], g["ma"])
        return video, audio

    @staticmethod
    def join_latents(video: Tensor, audio: Tensor) -> Tensor:
        """Inverse of :meth:`split_latents`."""
        return torch.cat([video.flatten(1), audio.flatten(1)], dim=1)

    def shift_mu(self, params: Any) -> float | None:
        from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift

        g = self.geometry(params)
        p, pt = int(self.model.config.patch_size), int(self.model.config.patch_size_t)
        tokens = (g["f"] // pt) * (g["h"] // p) * (g["w"] // p)
        cfg = self.components["scheduler"].config
        return float(
            calculate_shift(
                tokens,
                cfg.get("base_image_seq_len", 1024),
                cfg.get("max_image_seq_len", 4096),
                cfg.get("base_shift", 0.95),
                cfg.get("max_shift", 2.05),
            )
        )

    def schedule_sigmas(self, params: Any) -> list[float] | None:
        n = int(params.num_steps)
        return np.linspace(1.0, 1.0 / n, n).tolist()

    # -------------------------------------------------------- transformer
    def transformer_forward(
        self, latents: Tensor, sigma: Tensor, condition: dict[str, Tensor], params: Any
    ) -> Tensor:
        pipe = _pipeline_cls()
        model = self.model
        dt = module_dtype(model)
        g = self.geometry(params)
        video, audio = self.split_latents(latents, params)
        p, pt = int(model.config.patch_size), int(model.config.patch_size_t)
        hv = pipe._pack_latents(video, p, pt)
        ha = pipe._pack_audio_latents(audio)
        b = latents.shape[0]
        fps = self.frame_rate(params)
        video_coords = model.rope.prepare_video_coords(
            b, g["f"], g["h"], g["w"], latents.device, fps=fps
        )
        audio_coords = model.audio_rope.prepare_audio_coords(b, g["la"], latents.device)
        t = (sigma * 1000.0).to(dt)
        mask = condition["prompt_attention_mask"].to(dt)
        out_v, out_a = model(
            hidden_states=hv.to(dt),
            audio_hidden_states=ha.to(dt),
            encoder_hidden_states=condition["prompt_embeds"].to(dt),
            audio_encoder_hidden_states=condition["audio_prompt_embeds"].to(dt),
            timestep=t,
            sigma=t,
            encoder_attention_mask=mask,
            audio_encoder_attention_mask=mask,
            num_frames=g["f"],
            height=g["h"],
            width=g["w"],
            fps=fps,
            audio_num_frames=g["la"],
            video_coords=video_coords,
            audio_coords=audio_coords,
            # the pipeline's default: each stream's cross-attention modulation reads the other
            # stream's sigma (the LTX-2.3 behaviour; both sigmas are equal here)
            use_cross_timestep=True,
            return_dict=False,
        )
        v_video = pipe._unpack_latents(out_v.float(), g["f"], g["h"], g["w"], p, pt)
        v_audio = pipe._unpack_audio_latents(out_a.float(), g["la"], num_mel_bins=g["ma"])
        return self.join_latents(v_video, v_audio)

    # ------------------------------------------------------------- decode
    def init_latents(self, batch: int, params: Any, generators: list[torch.Generator]) -> Tensor:
        self._last_params = params
        return super().init_latents(batch, params, generators)

    def velocity(
        self, latents: Tensor, sigma: Tensor, condition: dict[str, Tensor], params: Any
    ) -> Tensor:
        self._last_params = params
        return super().velocity(latents, sigma, condition, params)

    @torch.no_grad()
    def decode_av(self, latents: Tensor, params: Any | None = None) -> dict[str, Any]:
        """Frames and waveform: ``frames`` uint8 (B, F, H, W, 3), ``waveform`` float32
        (B, channels, samples) in [-1, 1], ``sample_rate`` (Hz)."""
        params = params or getattr(self, "_last_params", None)
        if params is None:
            raise ValueError("params: decode_av needs the sampling params of these latents")
        pipe = _pipeline_cls()
        vae = self.components["vae"]
        avae = self.components["audio_vae"]
        vocoder = self.components["vocoder"]
        g = self.geometry(params)
        video, audio = self.split_latents(latents.to(self.device, torch.float32), params)
        z = pipe._denormalize_latents(
            video, vae.latents_mean, vae.latents_std, vae.config.scaling_factor
        ).to(vae.dtype)
        timestep = None
        if vae.config.timestep_conditioning:  # decode_timestep 0 as the pipeline's default
            timestep = torch.zeros(z.shape[0], device=z.device, dtype=z.dtype)
        frames = to_uint8(vae.decode(z, timestep, return_dict=False)[0])
        packed = pipe._pack_audio_latents(audio)
        packed = pipe._denormalize_audio_latents(packed, avae.latents_mean, avae.latents_std)
        za = pipe._unpack_audio_latents(packed, g["la"], num_mel_bins=g["ma"]).to(avae.dtype)
        mel = avae.decode(za, return_dict=False)[0]
        wave = vocoder(mel.to(next(vocoder.parameters()).dtype)).float().cpu()
        return {
            "frames": frames,
            "waveform": wave,
            "sample_rate": int(vocoder.config.output_sampling_rate),
        }

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        """The ``Denoiser`` media: uint8 video frames (B, F, H, W, 3) of the joint latents
        (geometry from the last ``init_latents``/``velocity`` params); the waveform comes with
        :meth:`decode_av`."""
        return self.decode_av(latents)["frames"]


# ------------------------------------------------------------------ tiny model
_GEMMA_SPECIALS = (
    "<pad>",
    "<bos>",
    "<eos>",
    "<start_of_image>",
    "<image_soft_token>",
    "<end_of_image>",
)


def _tiny_gemma_tokenizer(max_length: int) -> Any:
    """Byte-level BPE (256 symbols, no merges) plus Gemma-3's special tokens, left padding."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(_GEMMA_SPECIALS))
    bos = tok.token_to_id("<bos>")
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", bos)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        model_max_length=max_length,
        padding_side="left",
    )


#: the transformer / connector flags that make an LTX-2.0 config an LTX-2.3 one (diffusers'
#: scripts/convert_ltx2_to_diffusers.py, version "2.3": gated attention, cross-attention
#: modulation, perturbed attention, per-modality text projections with bias, no caption
#: projection in the transformer)
LTX23_TRANSFORMER = {
    "gated_attn": True,
    "cross_attn_mod": True,
    "audio_gated_attn": True,
    "audio_cross_attn_mod": True,
    "use_prompt_embeddings": False,
    "perturbed_attn": True,
}
LTX23_CONNECTORS = {
    "video_gated_attn": True,
    "audio_gated_attn": True,
    "per_modality_projections": True,
    "proj_bias": True,
}


@register_tiny(FAMILY, revision=2)  # 2: the LTX-2.3 layout
def build_tiny(path: str | Path, seed: int = 0) -> Path:
    """Tiny LTX-2.3 pipeline (:func:`build_tiny_version` with ``"2.3"``)."""
    return build_tiny_version(path, seed, "2.3")


def build_tiny_version(path: str | Path, seed: int = 0, version: str = "2.3") -> Path:
    """Tiny LTX-2 pipeline in the ``version`` ("2.0" or "2.3") layout: dual-stream DiT with 2
    blocks (video 2 heads x 8, audio 2 heads x 4), video VAE with 4 latent channels (spatial
    and temporal factor 2: 32 px x 5 frames -> 4 x 3 x 16 x 16), audio VAE with 2 latent
    channels over 8 mel bins (factor 4 in time and mel), a 2-layer vocoder (x4 upsampling,
    stereo, 16 kHz), text connectors (4 heads x 8) and a Gemma-3 encoder (hidden 32, 2 layers,
    tiny SigLIP tower); 16 text tokens. 2.3 adds :data:`LTX23_TRANSFORMER` /
    :data:`LTX23_CONNECTORS` (its text connectors project straight to each stream's width)."""
    if version not in ("2.0", "2.3"):
        raise ValueError(f"version: expected '2.0' or '2.3', got {version!r}")
    v23 = version == "2.3"
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2Pipeline,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors, LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    tok = _tiny_gemma_tokenizer(max_length=1024)
    ids = {t: tok.convert_tokens_to_ids(t) for t in _GEMMA_SPECIALS}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        gcfg = Gemma3Config(
            text_config={
                "vocab_size": 320,
                "hidden_size": 32,
                "intermediate_size": 32,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 1,
                "head_dim": 8,
                "max_position_embeddings": 1024,
                "sliding_window": 8,
                "pad_token_id": ids["<pad>"],
                "bos_token_id": ids["<bos>"],
                "eos_token_id": ids["<eos>"],
            },
            vision_config={
                "hidden_size": 16,
                "intermediate_size": 32,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "image_size": 16,
                "patch_size": 4,
            },
            mm_tokens_per_image=4,
            boi_token_index=ids["<start_of_image>"],
            eoi_token_index=ids["<end_of_image>"],
            image_token_index=ids["<image_soft_token>"],
        )
        text_encoder = Gemma3ForConditionalGeneration(gcfg).eval()
        width = gcfg.text_config.hidden_size
        layers = gcfg.text_config.num_hidden_layers
        transformer = LTX2VideoTransformer3DModel(
            in_channels=4,
            out_channels=4,
            patch_size=1,
            patch_size_t=1,
            num_attention_heads=2,
            attention_head_dim=8,
            cross_attention_dim=16,
            vae_scale_factors=(2, 2, 2),
            audio_in_channels=4,
            audio_out_channels=4,
            audio_num_attention_heads=2,
            audio_attention_head_dim=4,
            audio_cross_attention_dim=8,
            num_layers=2,
            qk_norm="rms_norm_across_heads",
            caption_channels=width,
            rope_double_precision=False,
            rope_type="split",
            **(LTX23_TRANSFORMER if v23 else {}),
        )
        connectors = LTX2TextConnectors(
            caption_channels=width,
            text_proj_in_factor=layers + 1,
            # 2.3: each connector runs at its stream's width (video 2 x 8, audio 2 x 4), as
            # the release's 32 x 128 = 4096 and 32 x 64 = 2048
            video_connector_num_attention_heads=2 if v23 else 4,
            video_connector_attention_head_dim=8,
            video_connector_num_layers=1,
            video_connector_num_learnable_registers=None,
            audio_connector_num_attention_heads=2 if v23 else 4,
            audio_connector_attention_head_dim=4 if v23 else 8,
            audio_connector_num_layers=1,
            audio_connector_num_learnable_registers=None,
            connector_rope_base_seq_len=32,
            rope_theta=10000.0,
            rope_double_precision=False,
            causal_temporal_positioning=False,
            rope_type="split",
            **(
                {**LTX23_CONNECTORS, "video_hidden_dim": 2 * 8, "audio_hidden_dim": 2 * 4}
                if v23
                else {}
            ),
        )
        vae = AutoencoderKLLTX2Video(
            in_channels=3,
            out_channels=3,
            latent_channels=4,
            block_out_channels=(8,),
            decoder_block_out_channels=(8,),
            layers_per_block=(1,),
            decoder_layers_per_block=(1, 1),
            spatio_temporal_scaling=(True,),
            decoder_spatio_temporal_scaling=(True,),
            decoder_inject_noise=(False, False),
            downsample_type=("spatial",),
            upsample_residual=(False,),
            upsample_factor=(1,),
            timestep_conditioning=False,
            patch_size=1,
            patch_size_t=1,
            encoder_causal=True,
            decoder_causal=False,
        )
        audio_vae = AutoencoderKLLTX2Audio(
            base_channels=4,
            output_channels=2,
            ch_mult=(1,),
            num_res_blocks=1,
            attn_resolutions=None,
            in_channels=2,
            resolution=32,
            latent_channels=2,
            norm_type="pixel",
            causality_axis="height",
            dropout=0.0,
            mid_block_add_attention=False,
            sample_rate=16000,
            mel_hop_length=160,
            is_causal=True,
            mel_bins=8,
        )
        vocoder = LTX2Vocoder(
            in_channels=2 * 8,
            hidden_channels=32,
            out_channels=2,
            upsample_kernel_sizes=[4, 4],
            upsample_factors=[2, 2],
            resnet_kernel_sizes=[3],
            resnet_dilations=[[1, 3, 5]],
            leaky_relu_negative_slope=0.1,
            output_sampling_rate=16000,
        )
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True,
        base_shift=0.95,
        max_shift=2.05,
        base_image_seq_len=1024,
        max_image_seq_len=4096,
    )
    pipe = LTX2Pipeline(
        scheduler=scheduler,
        vae=vae,
        audio_vae=audio_vae,
        text_encoder=text_encoder,
        tokenizer=tok,
        connectors=connectors,
        transformer=transformer,
        vocoder=vocoder,
    )
    pipe.save_pretrained(root, safe_serialization=True)
    write_adapter_options(root, max_sequence_length=16, frame_rate=24.0)
    return root
