"""Qwen3-Omni thinker: the any-to-text stage of ``Qwen3OmniMoeForConditionalGeneration``.

Qwen3-Omni (Qwen team 2025, "Qwen3-Omni Technical Report") is a thinker-talker model: the
*thinker* (a MoE text decoder with a vision tower and an audio tower) reads text, images,
video and audio and writes text; the *talker* and *code2wav* turn the thinker's states into
speech. RL post-training of the text answers only needs the thinker, so this adapter

- loads the saved full model with ``enable_audio_output=False`` (talker and code2wav are
  never built; their weights in the checkpoint are skipped) and keeps ``model.thinker`` as
  the trainable component: every forward goes straight to the thinker;
- computes the multimodal rotary index (M-RoPE, 3 x (B, L): temporal, height, width) itself,
  with the audio feature lengths passed in explicitly so audio placeholders get their true
  positions, and hands the thinker **int64** position ids (transformers returns float);
- puts LoRA on the text decoder's attention projections ``q_proj, k_proj, v_proj, o_proj``
  only (the towers are excluded by regex, so the audio tower's identically named
  projections stay untouched); zero bound modules is an error (base ``add_lora``).

Log-probs (what :meth:`Qwen3OmniThinkerAdapter.generate` records and
:meth:`~Qwen3OmniThinkerAdapter.token_log_probs` replays) are those of the sampled token under
the model's distribution at temperature ``T`` *before* top-p truncation::

    log pi(y_t | x, y_<t) = log_softmax(z_t / T)[y_t]

where ``z_t`` are the thinker's logits with the multimodal placeholder ids (image, video and
audio pad tokens) set to ``-inf`` (the model must never emit them as text: a sampled
placeholder would break the replay's feature scatter) and, under constrained decoding
(``allowed_tokens``: token ids, see :meth:`Qwen3OmniThinkerAdapter.allowed_token_ids`), every
id outside the allowed set set to ``-inf`` as well, so the distribution is renormalised over
the allowed ids; generate and replay apply the same mask. Sampling draws from the top-p (nucleus,
Holtzman et al. 2020) renormalised version of that distribution, from one CPU
``torch.Generator`` per row. This is the convention of vLLM's ``logprobs`` (raw, temperature
scaled) and of verl's actor replay (``logits / T``), so rollout and trainer agree.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from torch import Tensor, nn

from ..base import register_adapter
from ..thinker import ThinkerAdapter
from ..tiny import register_tiny

__all__ = [
    "LORA_EXCLUDE_REGEX",
    "Qwen3OmniThinkerAdapter",
    "Qwen3OmniThinkerOnlyAdapter",
    "build_tiny",
    "tiny_config",
]

FAMILY = "qwen3_omni_thinker"

#: LoRA stays out of the vision and audio towers (the audio tower also has q/k/v_proj).
#: A regex *target* is not used: peft rewrites it to name suffixes for transformers models,
#: which would bind the audio tower's projections too; a regex *exclude* is kept as is.
#: The towers sit at the thinker's top level up to transformers 5.14 and under ``model.``
#: from later releases, hence the optional prefix.
LORA_EXCLUDE_REGEX = r"(.*\.)?(audio_tower|visual)\..*"

#: transformers > 5.14 nests the thinker as ``model.{language_model, audio_tower, visual}``;
#: released checkpoints (and vllm-omni) use ``model.layers``, ``audio_tower``, ``visual``.
_NESTED_TO_CHECKPOINT = (
    ("model.language_model.", "model."),
    ("model.audio_tower.", "audio_tower."),
    ("model.visual.", "visual."),
)

#: keys of a processor batch that carry multimodal inputs into the thinker forward
_MM_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "pixel_values_videos",
    "video_grid_thw",
    "video_second_per_grid",
    "input_features",
    "feature_attention_mask",
)

#: special tokens of the Qwen3-Omni chat format (names as in the released tokenizer)
_SPECIALS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<|audio_pad|>",
)

_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'audio' %}<|audio_start|><|audio_pad|><|audio_end|>"
    "{% elif c['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# ---------------------------------------------------------------------- adapter
@register_adapter("Qwen3OmniMoeForConditionalGeneration", "thinker", family=FAMILY)
class Qwen3OmniThinkerAdapter(ThinkerAdapter):
    """Adapter for the Qwen3-Omni thinker (text, image, video and audio in; text out).

    Components: ``thinker`` (``Qwen3OmniMoeThinkerForConditionalGeneration``, trainable),
    ``processor`` (``Qwen3OmniMoeProcessor``) and ``tokenizer`` (the processor's tokenizer).
    """

    modality: ClassVar[str] = "text"
    trainable_component: ClassVar[str] = "thinker"
    lora_target_modules: ClassVar[tuple[str, ...]] = ("q_proj", "k_proj", "v_proj", "o_proj")
    lora_exclude_modules: ClassVar[Any] = LORA_EXCLUDE_REGEX
    no_split_modules: ClassVar[tuple[str, ...]] = (
        "Qwen3OmniMoeThinkerTextDecoderLayer",
        "Qwen3OmniMoeVisionBlock",
        "Qwen3OmniMoeAudioEncoderLayer",
    )
    unused_components: ClassVar[tuple[str, ...]] = ("talker", "code2wav")
    #: vllm-omni loads the full checkpoint, where the thinker sits under ``thinker.``
    vllm_omni_prefix: ClassVar[str] = "base_model.model.thinker."

    # ----------------------------------------------------------- model setup
    @classmethod
    def load_components(
        cls, path: Path, *, dtype: torch.dtype, device: torch.device, skip: Sequence[str] = ()
    ) -> dict[str, Any]:
        """Load the thinker (talker and code2wav are not built) and the processor.

        ``skip`` may also name thinker submodules to drop (``"audio_tower"``, ``"visual"``)
        for text-only training."""
        from transformers import AutoProcessor

        thinker = _load_thinker(path, audio_output="talker" not in skip, device=device)
        for name in skip:
            if name in ("talker", "code2wav", "processor", "tokenizer"):
                continue
            delattr(_tower_owner(thinker, name), name)
        thinker.to(device=device, dtype=dtype).eval()
        out: dict[str, Any] = {"thinker": thinker}
        if device.type == "meta":
            return out
        if "processor" not in skip:
            processor = AutoProcessor.from_pretrained(path)
            processor.tokenizer.padding_side = "left"
            out["processor"] = processor
            out["tokenizer"] = processor.tokenizer
        return out

    def fsdp_wrap_units(self) -> list[type[nn.Module]]:
        """FSDP2 wrap units: the text decoder layer always; the vision block and the audio
        encoder layer while their towers are loaded (``strip=["audio_tower"]`` drops one)."""
        present = {type(m).__name__: type(m) for m in self.model.modules()}
        text = self.no_split_modules[0]
        if text not in present:
            raise ValueError(f"no_split_modules: {text} not found in {type(self.model).__name__}")
        return [present[n] for n in self.no_split_modules if n in present]

    def checkpoint_name(self, name: str) -> str:
        """Module names of the nested layout (transformers > 5.14) in checkpoint layout."""
        if not _is_nested(self.thinker):
            return name
        for nested, flat in _NESTED_TO_CHECKPOINT:
            if name.startswith(nested):
                return flat + name[len(nested) :]
        return name

    def module_name(self, name: str) -> str:
        """Checkpoint-layout names back to this transformers release's module names."""
        if not _is_nested(self.thinker):
            return name
        for nested, flat in _NESTED_TO_CHECKPOINT:
            if name.startswith(flat):
                return nested + name[len(flat) :]
        return name

    @property
    def thinker(self) -> nn.Module:
        """The thinker module (every forward of this adapter runs it)."""
        return self.components["thinker"]

    @property
    def tokenizer(self) -> Any:
        return self.components["tokenizer"]

    def tokenizer_config(self) -> dict[str, Any]:
        """Base tokenizer config plus the multimodal token ids the rotary index relies on."""
        out = super().tokenizer_config()
        cfg = self.thinker.config
        out["multimodal_token_ids"] = {
            "image_token_id": cfg.image_token_id,
            "video_token_id": cfg.video_token_id,
            "audio_token_id": cfg.audio_token_id,
            "vision_start_token_id": getattr(cfg, "vision_start_token_id", None),
            "audio_start_token_id": cfg.audio_start_token_id,
        }
        return out

    # ------------------------------------------------------------- batching
    def build_batch(
        self,
        prompts: Sequence[str | Sequence[dict[str, Any]]],
        *,
        images: Sequence[Any] | None = None,
        audios: Sequence[np.ndarray] | None = None,
        system: str | None = None,
    ) -> dict[str, Tensor]:
        """Processor batch (left padded) for chat prompts.

        A prompt is a string (one user turn) or a list of content parts
        ``{"type": "text"|"image"|"audio", ...}``; ``images`` / ``audios`` hold the media in
        the order their parts appear over the whole batch (audio: 16 kHz mono float32)."""
        texts = []
        for p in prompts:
            content = p if isinstance(p, str) else list(p)
            msgs = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": content}
            ]
            texts.append(
                self.components["processor"].apply_chat_template(
                    msgs, add_generation_prompt=True, tokenize=False
                )
            )
        kwargs: dict[str, Any] = {}
        if images:
            kwargs["images"] = list(images)
        if audios:
            kwargs["audio"] = [np.asarray(a, dtype=np.float32) for a in audios]
        out = self.components["processor"](text=texts, return_tensors="pt", padding=True, **kwargs)
        return dict(out)

    def _as_batch(self, batch: Any) -> dict[str, Tensor]:
        if isinstance(batch, (list, tuple)):
            return self.build_batch(list(batch))
        if not isinstance(batch, dict) and hasattr(batch, "keys"):
            batch = dict(batch)
        if not isinstance(batch, dict):
            raise TypeError(
                f"batch: expected a dict of tensors or a list of prompts, got {type(batch)}"
            )
        for key in ("input_ids", "attention_mask"):
            if key not in batch:
                raise ValueError(f"batch: missing {key!r}")
        return batch

    def _mm_inputs(self, batch: dict[str, Tensor]) -> dict[str, Any]:
        out = {}
        for k in _MM_KEYS:
            v = batch.get(k)
            if v is None:
                continue
            if isinstance(v, Tensor):
                v = v.to(self.device)
                if v.is_floating_point():
                    v = v.to(self.dtype)
            out[k] = v
        return out

    # ------------------------------------------------------------ positions
    def position_ids(self, batch: dict[str, Tensor]) -> Tensor:
        """M-RoPE index of the prompt, int64 ``(3, B, L)``.

        Audio placeholders take their positions from the audio feature lengths
        (``feature_attention_mask.sum(-1)``, or ``audio_feature_lengths``), which are passed
        explicitly to ``get_rope_index`` so they always reach it."""
        ids = batch["input_ids"].to(self.device)
        mask = batch["attention_mask"].to(self.device)
        audio_lens = batch.get("audio_feature_lengths")
        fam = batch.get("feature_attention_mask")
        if audio_lens is None and fam is not None:
            audio_lens = fam.sum(-1)
        if audio_lens is not None:
            audio_lens = torch.as_tensor(audio_lens).to(self.device).long()
        n_audio = int((ids == self.thinker.config.audio_start_token_id).sum())
        if n_audio and audio_lens is None:
            raise ValueError(
                "batch: audio placeholders present but neither 'feature_attention_mask' nor "
                "'audio_feature_lengths' given"
            )
        sec = batch.get("video_second_per_grid")
        pos, _ = self.thinker.get_rope_index(
            ids,
            batch.get("image_grid_thw"),
            batch.get("video_grid_thw"),
            mask,
            bool(batch.get("use_audio_in_video", False)),
            audio_lens,
            None if sec is None else torch.as_tensor(sec),
        )
        return pos.round().to(torch.int64)

    def _placeholder_ids(self) -> list[int]:
        cfg = self.thinker.config
        return [cfg.image_token_id, cfg.video_token_id, cfg.audio_token_id]

    def _processed_logits(
        self, logits: Tensor, temperature: float, allowed: Tensor | None = None
    ) -> Tensor:
        """``z / T`` in float32 with the multimodal placeholder ids masked to ``-inf`` and,
        with ``allowed`` (a bool (V,) keep-mask), every id it does not keep as well."""
        z = logits.float()
        bad = [i for i in self._placeholder_ids() if 0 <= i < z.shape[-1]]
        if bad:
            z = z.clone()
            z[..., bad] = float("-inf")
        if allowed is not None:
            z = z.masked_fill(~allowed.to(z.device), float("-inf"))
        return z / (temperature if temperature > 0 else 1.0)

    def _keep_mask(
        self, allowed_tokens: Sequence[int] | Tensor | None, vocab: int
    ) -> Tensor | None:
        """The bool (V,) keep-mask of constrained decoding (None: unconstrained)."""
        if allowed_tokens is None:
            return None
        ids = torch.as_tensor(allowed_tokens, dtype=torch.long).flatten()
        if ids.numel() == 0:
            return None
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"allowed_tokens: ids must lie in [0, {vocab}), got {ids.tolist()}")
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[ids] = True
        keep[[i for i in self._placeholder_ids() if 0 <= i < vocab]] = False
        if not keep.any():
            raise ValueError("allowed_tokens: only multimodal placeholder ids, nothing to emit")
        return keep

    def allowed_token_ids(self, strings: Sequence[str]) -> list[int]:
        """Token ids for constrained decoding: the union of the ids each string tokenizes to
        (no special tokens added; a special token such as ``<|im_end|>`` written out counts),
        plus the EOS id(s), sorted. ``ValueError`` naming the string when it is empty, maps to
        the unknown token, to an id outside the thinker's logits, or to a placeholder."""
        if isinstance(strings, str):
            raise ValueError(f"allowed_tokens: a list of strings, got the string {strings!r}")
        vocab = int(self.thinker.config.get_text_config().vocab_size)
        unk = self.tokenizer.unk_token_id
        placeholders = set(self._placeholder_ids())
        out = set(self._eos_ids())
        for s in strings:
            if not isinstance(s, str) or not s:
                raise ValueError(f"allowed_tokens: {s!r} is not a non-empty string")
            ids = list(self.tokenizer.encode(s, add_special_tokens=False))
            if not ids or (unk is not None and unk in ids):
                raise ValueError(f"allowed_tokens: {s!r} does not map to tokens in the vocabulary")
            bad = [i for i in ids if not 0 <= i < vocab or i in placeholders]
            if bad:
                raise ValueError(
                    f"allowed_tokens: {s!r} maps to ids {bad} that the model cannot emit "
                    f"(outside its {vocab} logits, or a multimodal placeholder)"
                )
            out.update(int(i) for i in ids)
        return sorted(out)

    def forward(self, batch: dict[str, Tensor], **kwargs: Any) -> Any:
        """The thinker forward with int64 M-RoPE position ids computed here."""
        batch = self._as_batch(batch)
        return self.thinker(
            input_ids=batch["input_ids"].to(self.device),
            attention_mask=batch["attention_mask"].to(self.device),
            position_ids=self.position_ids(batch),
            **self._mm_inputs(batch),
            **kwargs,
        )

    __call__ = forward

    # ------------------------------------------------------------- generate
    @torch.no_grad()
    def generate(
        self,
        batch: Any,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | list[int] = 0,
        allowed_tokens: Sequence[int] | None = None,
    ) -> dict[str, Any]:
        """Sample up to ``max_new_tokens`` per row with a KV cache.

        Row ``b`` draws from ``torch.Generator("cpu").manual_seed(seed[b])`` (an int ``seed``
        gives ``seed + b``). ``temperature <= 0`` is greedy (log-probs then at T = 1).
        Returns ``tokens`` (B, T) int64 (pad after EOS), ``log_probs`` (B, T) float32 (0 after
        EOS), ``mask`` (B, T) bool (True up to and including EOS), ``texts`` and the
        ``temperature`` the log-probs refer to. ``allowed_tokens`` (token ids, e.g. from
        :meth:`allowed_token_ids`; None or empty = unconstrained) restricts sampling and the
        log-probs to those ids. See the module docstring for the distribution.
        """
        from transformers import DynamicCache

        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p: must be in (0, 1], got {top_p}")
        batch = self._as_batch(batch)
        ids = batch["input_ids"].to(self.device)
        mask = batch["attention_mask"].to(self.device)
        b = ids.shape[0]
        seeds = [int(seed) + i for i in range(b)] if isinstance(seed, int) else list(seed)
        if len(seeds) != b:
            raise ValueError(f"seed: {len(seeds)} seeds for batch {b}")
        gens = [torch.Generator("cpu").manual_seed(s) for s in seeds]
        eos = self._eos_ids()
        pad = self.tokenizer.pad_token_id
        pad = eos[0] if pad is None else pad

        pos = self.position_ids(batch)
        next_pos = pos.amax(dim=(0, 2)) + 1  # (B,)
        cache = DynamicCache(config=self.thinker.config.get_text_config())
        out = self.thinker(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            past_key_values=cache,
            use_cache=True,
            **self._mm_inputs(batch),
        )
        logits = out.logits[:, -1]
        keep = self._keep_mask(allowed_tokens, logits.shape[-1])
        tokens, log_probs, alive_hist = [], [], []
        alive = torch.ones(b, dtype=torch.bool)
        attn = mask
        for k in range(max_new_tokens):
            z = self._processed_logits(logits, temperature, keep).cpu()
            lp = torch.log_softmax(z, dim=-1)
            if temperature <= 0:
                tok = z.argmax(-1)
            else:
                probs = _top_p_probs(torch.softmax(z, dim=-1), top_p)
                tok = torch.stack(
                    [torch.multinomial(probs[i], 1, generator=gens[i])[0] for i in range(b)]
                )
            tok = torch.where(alive, tok, torch.full_like(tok, pad))
            tokens.append(tok)
            log_probs.append(torch.where(alive, lp.gather(-1, tok[:, None])[:, 0], 0.0))
            alive_hist.append(alive.clone())
            alive = alive & ~torch.isin(tok, torch.tensor(eos))
            if not alive.any() or k == max_new_tokens - 1:
                break
            attn = torch.cat([attn, torch.ones(b, 1, dtype=attn.dtype, device=attn.device)], 1)
            step_pos = (next_pos + k).view(1, b, 1).expand(3, b, 1).contiguous()
            out = self.thinker(
                input_ids=tok[:, None].to(self.device),
                attention_mask=attn,
                position_ids=step_pos,
                past_key_values=cache,
                use_cache=True,
            )
            logits = out.logits[:, -1]
        toks = torch.stack(tokens, 1)
        msk = torch.stack(alive_hist, 1)
        vocab = len(self.tokenizer)
        texts = [
            self.tokenizer.decode(
                [int(t) for t, m in zip(row, mrow) if m and int(t) < vocab],
                skip_special_tokens=True,
            )
            for row, mrow in zip(toks, msk)
        ]
        return {
            "tokens": toks,
            "log_probs": torch.stack(log_probs, 1).float(),
            "mask": msk,
            "texts": texts,
            "temperature": float(temperature if temperature > 0 else 1.0),
        }

    def _eos_ids(self) -> list[int]:
        eos = self.thinker.config.get_text_config().eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        if eos is None:
            raise ValueError("eos_token_id: neither the text config nor the tokenizer has one")
        return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]

    # ------------------------------------------------------------- replay
    def token_log_probs(self, batch: Any, temperature: float | None = None) -> Tensor:
        """Trainer replay: ``log_softmax(z / T)[y_t]`` for the given response tokens, with grad.

        ``batch`` is the prompt batch (as given to :meth:`generate`) plus ``responses``
        (B, T) int64 (or ``tokens``) and optionally ``response_mask`` (B, T) (or ``mask``);
        ``temperature`` defaults to ``batch["temperature"]`` or 1; ``batch["allowed_tokens"]``
        (token ids, as given to :meth:`generate`) replays the constrained distribution. One
        forward over prompt + response; response positions continue the prompt's M-RoPE index
        exactly as in :meth:`generate`. Returns (B, T) float32, 0 where the mask is False."""
        batch = self._as_batch(batch)
        resp = batch.get("responses", batch.get("tokens"))
        if resp is None:
            raise ValueError("batch: missing 'responses' (B, T) token ids")
        resp = torch.as_tensor(resp).to(self.device).long()
        rmask = batch.get("response_mask", batch.get("mask"))
        rmask = torch.ones_like(resp, dtype=torch.bool) if rmask is None else rmask.bool()
        rmask = rmask.to(self.device)
        if temperature is None:
            temperature = float(batch.get("temperature", 1.0))
        ids = batch["input_ids"].to(self.device)
        mask = batch["attention_mask"].to(self.device)
        b, length = ids.shape
        t = resp.shape[1]
        if resp.shape[0] != b:
            raise ValueError(f"responses: batch {resp.shape[0]} != prompt batch {b}")
        pos = self.position_ids(batch)
        next_pos = pos.amax(dim=(0, 2)) + 1
        resp_pos = (next_pos[:, None] + torch.arange(t, device=pos.device)).unsqueeze(0)
        full_pos = torch.cat([pos, resp_pos.expand(3, b, t)], dim=2)
        full_ids = torch.cat([ids, resp], 1)
        full_mask = torch.cat([mask, rmask.to(mask.dtype)], 1)
        out = self.thinker(
            input_ids=full_ids,
            attention_mask=full_mask,
            position_ids=full_pos,
            **self._mm_inputs(batch),
        )
        keep = self._keep_mask(batch.get("allowed_tokens"), out.logits.shape[-1])
        z = self._processed_logits(out.logits[:, length - 1 : length - 1 + t], temperature, keep)
        lp = torch.log_softmax(z, dim=-1).gather(-1, resp[..., None])[..., 0]
        return torch.where(rmask, lp, torch.zeros_like(lp)).float()


@register_adapter("Qwen3OmniMoeThinkerForConditionalGeneration", "thinker", family=FAMILY)
class Qwen3OmniThinkerOnlyAdapter(Qwen3OmniThinkerAdapter):
    """The same adapter for a checkpoint saved as the thinker alone."""

    vllm_omni_prefix: ClassVar[str] = "base_model.model."


def _is_nested(thinker: nn.Module) -> bool:
    """Whether the thinker uses the nested layout (``model.language_model`` and the towers
    under ``model``), as transformers > 5.14 builds it."""
    inner = getattr(thinker, "model", None)
    return isinstance(inner, nn.Module) and isinstance(
        getattr(inner, "language_model", None), nn.Module
    )


def _tower_owner(thinker: nn.Module, name: str) -> nn.Module:
    """The module holding the submodule ``name`` (``audio_tower``, ``visual``) in either
    layout: the thinker itself, or its ``model`` in the nested one."""
    owner = thinker.model if _is_nested(thinker) else thinker
    if not isinstance(getattr(owner, name, None), nn.Module) or name in ("model", "lm_head"):
        raise ValueError(f"strip: {name!r} is not a tower of the thinker (audio_tower, visual)")
    return owner


def _load_thinker(
    path: Path, *, audio_output: bool = False, device: torch.device | None = None
) -> nn.Module:
    """The thinker of a saved full model or a saved thinker; the talker is never built.

    Strict: every thinker tensor of the checkpoint is loaded and every thinker parameter is
    set; the only checkpoint tensors not used are the talker's and code2wav's (``talker.*``,
    ``code2wav.*``), which this stage does not build. On the meta device only
    ``config.json`` is read (full-size architecture checks)."""
    from transformers import (
        Qwen3OmniMoeConfig,
        Qwen3OmniMoeForConditionalGeneration,
        Qwen3OmniMoeThinkerConfig,
        Qwen3OmniMoeThinkerForConditionalGeneration,
    )
    from transformers.utils import logging as hf_logging

    from ..checkpoints import check_loading_info

    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    if device is not None and device.type == "meta":
        with torch.device("meta"):
            if arch == "Qwen3OmniMoeThinkerForConditionalGeneration":
                cfg = Qwen3OmniMoeThinkerConfig.from_pretrained(path)
            else:
                cfg = Qwen3OmniMoeConfig.from_pretrained(path).thinker_config
            return Qwen3OmniMoeThinkerForConditionalGeneration._from_config(cfg)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # the skipped talker weights are reported as unexpected
    try:
        if arch == "Qwen3OmniMoeThinkerForConditionalGeneration":
            thinker, info = Qwen3OmniMoeThinkerForConditionalGeneration.from_pretrained(
                path, output_loading_info=True, use_safetensors=True
            )
            check_loading_info(str(path), info)
            return thinker
        full, info = Qwen3OmniMoeForConditionalGeneration.from_pretrained(
            path, enable_audio_output=audio_output, output_loading_info=True, use_safetensors=True
        )
    finally:
        hf_logging.set_verbosity(verbosity)
    skipped = () if audio_output else ("talker.", "code2wav.")
    check_loading_info(str(path), info, allow_unexpected=skipped)
    full.disable_talker()
    return full.thinker


def _top_p_probs(probs: Tensor, top_p: float) -> Tensor:
    """Nucleus filter: keep the smallest prefix of the sorted distribution whose mass reaches
    ``top_p`` (the top token always stays), renormalise."""
    if top_p >= 1.0:
        return probs
    sorted_p, idx = probs.sort(dim=-1, descending=True)
    cum = sorted_p.cumsum(-1)
    drop = (cum - sorted_p) >= top_p
    sorted_p = sorted_p.masked_fill(drop, 0.0)
    out = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
    return out / out.sum(-1, keepdim=True)


# ------------------------------------------------------------------- tiny model
def _tiny_tokenizer() -> Any:
    """Byte-level BPE over the 256 byte symbols (no merges) plus the Qwen3-Omni specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(_SPECIALS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=512,
        extra_special_tokens={
            "image_token": "<|image_pad|>",
            "audio_token": "<|audio_pad|>",
            "video_token": "<|video_pad|>",
            "vision_bos_token": "<|vision_start|>",
            "vision_eos_token": "<|vision_end|>",
            "audio_bos_token": "<|audio_start|>",
            "audio_eos_token": "<|audio_end|>",
        },
    )


def tiny_config(token_ids: dict[str, int]) -> Any:
    """A ``Qwen3OmniMoeConfig`` with every sub-model tiny (the full layout: thinker with MoE
    text decoder, vision tower with deepstack, audio tower; a tiny talker and code2wav so the
    checkpoint has them to strip)."""
    from transformers import Qwen3OmniMoeConfig

    # Weights drawn with std 0.2, not transformers' 0.02: in a 32-wide random model at 0.02 the
    # output head caps the gap between two logits below ~1 and an image moves the answer logits
    # by ~2e-4, so not even supervised training teaches the tiny model to read an image; at 0.2
    # it can (the CPU twin's shapes task rises above chance). Real checkpoints are unaffected.
    init = 0.2
    thinker = {
        "initializer_range": init,
        "audio_config": {
            "initializer_range": init,
            "num_mel_bins": 16,
            "encoder_layers": 1,
            "encoder_attention_heads": 2,
            "encoder_ffn_dim": 32,
            "d_model": 16,
            "output_dim": 32,
            "max_source_positions": 64,
            "n_window": 50,
            "n_window_infer": 100,
            "conv_chunksize": 50,
            "downsample_hidden_size": 4,
        },
        "vision_config": {
            "initializer_range": init,
            "depth": 2,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "patch_size": 4,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": 32,
            "num_position_embeddings": 16,
            "deepstack_visual_indexes": [0],
        },
        "text_config": {
            "initializer_range": init,
            "vocab_size": 320,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "moe_intermediate_size": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "max_position_embeddings": 512,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [2, 1, 1],
                "interleaved": True,
                "mrope_interleaved": True,
            },
            "pad_token_id": token_ids["<|endoftext|>"],
            "eos_token_id": token_ids["<|im_end|>"],
        },
        "audio_token_id": token_ids["<|audio_pad|>"],
        "image_token_id": token_ids["<|image_pad|>"],
        "video_token_id": token_ids["<|video_pad|>"],
        "audio_start_token_id": token_ids["<|audio_start|>"],
        "vision_start_token_id": token_ids["<|vision_start|>"],
        "user_token_id": token_ids["<|im_start|>"],
        "position_id_per_seconds": 25,
    }
    talker = {
        "thinker_hidden_size": 32,
        "num_code_groups": 2,
        "accept_hidden_layer": 1,
        "spatial_merge_size": 2,
        "text_config": {
            "vocab_size": 64,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 8,
            "moe_intermediate_size": 8,
            "shared_expert_intermediate_size": 16,
            "num_experts": 2,
            "num_experts_per_tok": 1,
        },
        "code_predictor_config": {
            "vocab_size": 32,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 8,
            "num_code_groups": 2,
        },
    }
    code2wav = {
        "codebook_size": 32,
        "hidden_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "intermediate_size": 32,
        "num_quantizers": 2,
        "decoder_dim": 16,
        "upsample_rates": [2, 2],
        "upsampling_ratios": [2, 2],
        "sliding_window": 8,
        "max_position_embeddings": 64,
    }
    return Qwen3OmniMoeConfig(
        thinker_config=thinker,
        talker_config=talker,
        code2wav_config=code2wav,
        enable_audio_output=True,
    )


@register_tiny(FAMILY, revision=2)  # 2: weights drawn with std 0.2
def build_tiny(path: str | Path, seed: int = 0) -> Path:
    """Write a tiny random ``Qwen3OmniMoeForConditionalGeneration`` (thinker + talker +
    code2wav, ~90k parameters) with its processor (byte-level tokenizer, Qwen2-VL image
    processor with 4-pixel patches, 16-bin Whisper features) to ``path``."""
    from transformers import (
        Qwen2VLImageProcessorPil,
        Qwen2VLVideoProcessor,
        Qwen3OmniMoeForConditionalGeneration,
        Qwen3OmniMoeProcessor,
        WhisperFeatureExtractor,
    )

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    tok = _tiny_tokenizer()
    token_ids = {s: tok.convert_tokens_to_ids(s) for s in _SPECIALS}
    cfg = tiny_config(token_ids)
    cfg.architectures = ["Qwen3OmniMoeForConditionalGeneration"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3OmniMoeForConditionalGeneration(cfg)
        # transformers leaves the talker's per-expert MLPs uninitialised (torch.empty)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.startswith("talker.") and ".experts." in name:
                    p.normal_(0.0, cfg.initializer_range)
    model.save_pretrained(root)
    pix = {"patch_size": 4, "merge_size": 2, "temporal_patch_size": 2}
    pix.update(min_pixels=16 * 16, max_pixels=32 * 32)
    image_processor = Qwen2VLImageProcessorPil(**pix)
    video_processor = Qwen2VLVideoProcessor(**pix)
    features = WhisperFeatureExtractor(
        feature_size=16, sampling_rate=16000, hop_length=160, chunk_length=1, n_fft=400
    )
    processor = Qwen3OmniMoeProcessor(
        image_processor=image_processor,
        video_processor=video_processor,
        feature_extractor=features,
        tokenizer=tok,
        chat_template=_CHAT_TEMPLATE,
    )
    processor.save_pretrained(root)
    return root
