"""``dina_lrm``: DiNa-LRM, a diffusion-native latent reward model on SD3.5-Medium latents
(Liu et al. 2026, "Beyond VLM-Based Rewards: Diffusion-Native Latent Reward Modeling";
HKUST-C4G/diffusion-rm), extra ``dina-lrm``.

The model (``diffusion_rm/models/sd3_rm.py``, ``reward_head.py``): the first
``num_transformer_layers`` (12) joint blocks of SD3.5-Medium's transformer with its patch,
timestep/pooled-text and context embedders, fine-tuned with a LoRA adapter (``rm_lora``), then
a reward head reading the image tokens after blocks ``visual_head_idx`` and the text tokens
after blocks ``text_head_idx`` (4, 8, 12): per layer a FiLM adapter conditioned on the
timestep embedding, two cross-attention blocks from 4 learned queries (value-gated over
image + text tokens, then image only), an FFN, a linear head, the mean over queries.

Scoring, as the official ``DRMInferencer.reward``: ``z`` are clean SD3 latents (the
transformer's normalised space, ``(vae(x) - shift) * scale``: what the SD3 adapter's
rollouts hold); the noise level ``u`` picks the scheduler's nearest sigma ``s`` and its
timestep; ``x = (1 - s) z + s eps`` (``eps`` from a generator seeded by option ``seed``, so
scores are reproducible); the prompt is encoded as the SD3 pipeline does (CLIP-L / CLIP-G
penultimate states + T5, 256 T5 tokens, the README's setting); ``score = (raw + 10) / 10``
(the README's normalisation; ``details["raw"]`` keeps ``raw``). ``u = 0.4`` is the
README's value for generated latents.

Released layout (``liuhuohuo/DiNa-LRM-SD35M-12layers``): ``config.json`` (the model config:
``model.num_transformer_layers``, ``visual_head_idx``, ``text_head_idx``, ``use_t_embed``,
``reward_head{...}``, ``backbone_model_id``...), ``checkpoint/backbone_lora/`` (a peft adapter:
``adapter_config.json`` + ``adapter_model.safetensors``), ``checkpoint/rm_head.pt`` (a torch
pickle of the head's state dict: convert it once with ``omni-rewards convert dina-lrm ROOT``,
which writes ``checkpoint/rm_head.safetensors``; the reward never unpickles). The SD3.5-Medium
folder (diffusers layout) comes from option ``backbone`` or the config's
``backbone_model_id``. Every tensor is loaded strictly (a missing or extra name is an error
naming it).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import numpy as np

from .base import Reward, require_module
from .types import RewardInput, RewardInputError, RewardOutput

__all__ = ["DiNaLRMReward", "build_reward_head", "load_dina_lrm"]


def _torch() -> Any:
    return require_module("torch", "dina-lrm", "dina_lrm")


def build_reward_head(
    token_dim: int,
    *,
    n_visual_heads: int,
    n_text_heads: int,
    t_embed_dim: int,
    width: int = -1,
    out_dim: int = 1,
    num_queries: int = 4,
    num_attn_heads: int = 8,
    use_proj_in: bool = False,
    dropout: float = 0.0,
    **_: Any,
) -> Any:
    """The reward head with the official module names (``layer_adapters_visual.<i>``,
    ``layer_adapters_text.<i>``, ``agg_visual``, ``agg_text``, ``query_tokens``, ``attn1``,
    ``attn2``, ``norm_ff``, ``ff``, ``head``)."""
    torch = _torch()
    nn, F = torch.nn, torch.nn.functional
    width = token_dim if width == -1 else width
    feat = width // 4

    class FiLMLayerAdapter(nn.Module):
        """``proj(film(proj_in(x), t) + layer_embed)``, ``film = x (1 + gamma) + beta``."""

        def __init__(self) -> None:
            super().__init__()
            self.proj_in = (
                nn.Linear(token_dim, width) if token_dim != width or use_proj_in else nn.Identity()
            )
            self.layer_embed = nn.Parameter(torch.zeros(1, 1, width))
            self.cond_mlp = nn.Sequential(
                nn.Linear(t_embed_dim, 2 * width), nn.SiLU(), nn.Linear(2 * width, 2 * width)
            )
            self.proj = nn.Linear(width, feat)

        def forward(self, x: Any, t: Any) -> Any:
            x = self.proj_in(x)
            gamma, beta = self.cond_mlp(t).chunk(2, dim=-1)
            x = x * (1 + gamma[:, None]) + beta[:, None]
            return self.proj(x + self.layer_embed)

    class CrossAttnBlockVGated(nn.Module):
        """Queries attend to image tokens (and text tokens, summed), RMS-normed inputs,
        values gated per context token by ``sigmoid(MLP(token))``; residual."""

        def __init__(self, use_text: bool, gated: bool) -> None:
            super().__init__()
            self.heads = num_attn_heads
            self.use_text, self.gated = use_text, gated
            self.norm_q = nn.RMSNorm(width)
            self.norm_v = nn.RMSNorm(width)
            if use_text:
                self.norm_t = nn.RMSNorm(width)
            self.to_q = nn.Linear(width, width)
            self.to_k_vis = nn.Linear(width, width)
            self.to_v_vis = nn.Linear(width, width)
            if use_text:
                self.to_k_text = nn.Linear(width, width)
                self.to_v_text = nn.Linear(width, width)
            self.to_out = nn.Sequential(nn.Linear(width, width), nn.Dropout(dropout))
            if gated:

                def gate() -> Any:
                    return nn.Sequential(nn.Linear(width, width), nn.SiLU(), nn.Linear(width, 1))

                self.gate_vis = gate()
                if use_text:
                    self.gate_text = gate()

        def _attend(self, q: Any, k: Any, v: Any) -> Any:
            b, n, _ = q.shape

            def heads(x: Any) -> Any:
                return x.view(x.shape[0], x.shape[1], self.heads, -1).transpose(1, 2)

            out = F.scaled_dot_product_attention(heads(q), heads(k), heads(v))
            return out.transpose(1, 2).reshape(b, n, width)

        def forward(self, queries: Any, vis: Any, text: Any = None) -> Any:
            q = self.to_q(self.norm_q(queries))
            vis = self.norm_v(vis)
            v = self.to_v_vis(vis)
            if self.gated:
                v = v * torch.sigmoid(self.gate_vis(vis))
            h = self._attend(q, self.to_k_vis(vis), v)
            if self.use_text and text is not None:
                text = self.norm_t(text)
                vt = self.to_v_text(text)
                if self.gated:
                    vt = vt * torch.sigmoid(self.gate_text(text))
                h = h + self._attend(q, self.to_k_text(text), vt)
            return queries + self.to_out(h)

    class RewardHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer_adapters_visual = nn.ModuleList(
                FiLMLayerAdapter() for _ in range(n_visual_heads)
            )
            self.layer_adapters_text = nn.ModuleList(
                FiLMLayerAdapter() for _ in range(n_text_heads)
            )
            self.agg_visual = nn.Linear(n_visual_heads * feat, width)
            if n_text_heads:
                self.agg_text = nn.Linear(n_text_heads * feat, width)
            self.query_tokens = nn.Parameter(torch.zeros(1, num_queries, width))
            self.attn1 = CrossAttnBlockVGated(use_text=n_text_heads > 0, gated=True)
            self.attn2 = CrossAttnBlockVGated(use_text=False, gated=False)
            self.norm_ff = nn.RMSNorm(width)
            self.ff = nn.Sequential(
                nn.Linear(width, 4 * width),
                nn.GELU(),
                nn.Linear(4 * width, width),
                nn.Dropout(dropout),
            )
            self.head = nn.Linear(width, out_dim)

        def forward(self, visual: list[Any], text: list[Any], temb: Any) -> Any:
            vis = self.agg_visual(
                torch.cat([a(x, temb) for a, x in zip(self.layer_adapters_visual, visual)], -1)
            )
            txt = None
            if len(self.layer_adapters_text):
                txt = self.agg_text(
                    torch.cat([a(x, temb) for a, x in zip(self.layer_adapters_text, text)], -1)
                )
            q = self.query_tokens.expand(vis.shape[0], -1, -1)
            q = self.attn1(q, vis, txt)
            q = self.attn2(q, vis, None)
            q = q + self.ff(self.norm_ff(q))
            return self.head(q).mean(dim=1)

    return RewardHead()


def _strict_load(module: Any, state: dict[str, Any], source: str) -> None:
    own = module.state_dict()
    missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
    shapes = sorted(
        f"{k} {tuple(state[k].shape)} != {tuple(own[k].shape)}"
        for k in set(own) & set(state)
        if tuple(state[k].shape) != tuple(own[k].shape)
    )
    if missing or unexpected or shapes:
        raise ValueError(
            f"{source}: does not match the DiNa-LRM model: {len(missing)} missing "
            f"{missing[:8]}, {len(unexpected)} unexpected {unexpected[:8]}, shape {shapes[:8]}"
        )
    module.load_state_dict(state, strict=True)


def _hf_strict(klass: Any, folder: Path, **kw: Any) -> Any:
    obj, info = klass.from_pretrained(folder, output_loading_info=True, **kw)
    bad = {k: sorted(info.get(k) or ()) for k in ("missing_keys", "unexpected_keys")}
    if any(bad.values()):
        raise ValueError(f"{folder}: does not match {klass.__name__}: {bad}")
    return obj.eval()


def load_dina_lrm(
    root: str | Path,
    *,
    backbone: str | Path | None = None,
    device: str = "cpu",
    dtype: str = "float32",
) -> dict[str, Any]:
    """The released DiNa-LRM folder + the SD3.5-Medium folder, loaded strictly: a dict with
    ``backbone`` (module with ``pos_embed``, ``time_text_embed``, ``context_embedder``,
    ``transformer_blocks``; LoRA ``rm_lora`` active), ``head``, ``text_encoders``,
    ``tokenizers``, ``scheduler`` and the ``config``."""
    torch = _torch()
    require_module("diffusers", "dina-lrm", "dina_lrm")
    require_module("peft", "dina-lrm", "dina_lrm")
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from peft import LoraConfig, inject_adapter_in_model
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, CLIPTextModelWithProjection, T5EncoderModel

    root = Path(root).expanduser()
    cfg_file = root / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"checkpoint: {root} has no config.json (not a DiNa-LRM folder)")
    config = json.loads(cfg_file.read_text())
    mcfg = config["model"]
    if mcfg.get("use_logistic"):
        raise ValueError(
            "config.json: model.use_logistic is not supported (the released format stores no "
            "eta3/eta4)"
        )
    if not mcfg.get("use_lora", True) or mcfg.get("freeze_backbone"):
        raise ValueError("config.json: only the released LoRA + head format is supported")
    head_file = root / "checkpoint" / "rm_head.safetensors"
    if not head_file.is_file():
        pt = root / "checkpoint" / "rm_head.pt"
        hint = f"; convert it once: omni-rewards convert dina-lrm {root}" if pt.is_file() else ""
        raise FileNotFoundError(f"checkpoint: {head_file} not found{hint}")
    sd3 = Path(str(backbone or mcfg["backbone_model_id"])).expanduser()
    if not sd3.is_dir():
        raise FileNotFoundError(
            f"backbone: {sd3} is not a local SD3.5-Medium folder (diffusers layout); pass "
            "backbone=PATH"
        )
    dt = getattr(torch, dtype)
    transformer = _hf_strict(SD3Transformer2DModel, sd3 / "transformer", torch_dtype=dt)
    n = int(mcfg["num_transformer_layers"])
    if n > len(transformer.transformer_blocks):
        raise ValueError(
            f"config.json: {n} layers but the backbone has {len(transformer.transformer_blocks)}"
        )

    net = torch.nn.Module()
    net.pos_embed = transformer.pos_embed
    net.time_text_embed = transformer.time_text_embed
    net.context_embedder = transformer.context_embedder
    net.transformer_blocks = torch.nn.ModuleList(transformer.transformer_blocks[:n])
    lora_dir = root / "checkpoint" / "backbone_lora"
    lcfg = json.loads((lora_dir / "adapter_config.json").read_text())
    peft_cfg = LoraConfig(
        r=int(lcfg["r"]),
        lora_alpha=float(lcfg["lora_alpha"]),
        target_modules=lcfg["target_modules"],
        exclude_modules=lcfg.get("exclude_modules"),
        lora_dropout=0.0,
    )
    inject_adapter_in_model(peft_cfg, net, adapter_name="rm_lora")
    lora_state = load_file(str(lora_dir / "adapter_model.safetensors"))
    renamed = {}
    for k, v in lora_state.items():
        short = k.removeprefix("base_model.model.")
        for part in (".lora_A.", ".lora_B."):
            short = short.replace(part, part + "rm_lora.")
        renamed[short] = v
    own = {k for k in net.state_dict() if ".lora_" in k}
    missing, unexpected = sorted(own - set(renamed)), sorted(set(renamed) - own)
    if missing or unexpected:
        raise ValueError(
            f"{lora_dir / 'adapter_model.safetensors'}: LoRA tensors do not match the backbone: "
            f"{len(missing)} missing {missing[:6]}, {len(unexpected)} unexpected {unexpected[:6]}"
        )
    net.load_state_dict(renamed, strict=False)  # the base weights are the transformer's
    inner = int(transformer.inner_dim)
    head_cfg = dict(mcfg.get("reward_head", {}))
    head = build_reward_head(
        inner,
        n_visual_heads=len(mcfg["visual_head_idx"]),
        n_text_heads=len(mcfg["text_head_idx"]),
        t_embed_dim=inner,
        **head_cfg,
    )
    _strict_load(head, load_file(str(head_file)), str(head_file))
    encoders = [
        _hf_strict(
            CLIPTextModelWithProjection, sd3 / "text_encoder", dtype=dt, use_safetensors=True
        ),
        _hf_strict(
            CLIPTextModelWithProjection, sd3 / "text_encoder_2", dtype=dt, use_safetensors=True
        ),
        _hf_strict(T5EncoderModel, sd3 / "text_encoder_3", dtype=dt, use_safetensors=True),
    ]
    tokenizers = [
        AutoTokenizer.from_pretrained(sd3 / name)
        for name in ("tokenizer", "tokenizer_2", "tokenizer_3")
    ]
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(sd3 / "scheduler")
    return {
        "backbone": net.to(device=device, dtype=dt).eval(),
        "head": head.to(device=device, dtype=dt).eval(),
        "text_encoders": [e.to(device) for e in encoders],
        "tokenizers": tokenizers,
        "scheduler": scheduler,
        "config": config,
    }


class DiNaLRMReward(Reward):
    """Options: ``checkpoint`` (the DiNa-LRM folder), ``backbone`` (SD3.5-Medium folder;
    default the config's ``backbone_model_id``), ``noise_level`` (u, default 0.4),
    ``seed``, ``max_sequence_length`` (T5 tokens, 256), ``normalize`` (``(raw + 10) / 10``,
    default true), ``device``, ``dtype``. Inputs: ``latents`` (B, 16, h, w) clean SD3 latents
    and ``prompts``."""

    name = "dina_lrm"
    default_batch_size = 8

    def __init__(
        self,
        checkpoint: str | None = None,
        *,
        backbone: str | None = None,
        noise_level: float = 0.4,
        seed: int = 0,
        max_sequence_length: int = 256,
        normalize: bool = True,
        device: str = "cpu",
        dtype: str = "float32",
        batch_size: int | None = None,
        workers: int = 1,
    ) -> None:
        super().__init__(batch_size=batch_size, workers=workers)
        if checkpoint is None:
            raise ValueError("checkpoint: dina_lrm needs the DiNa-LRM folder")
        if not 0.0 <= float(noise_level) <= 1.0:
            raise ValueError(f"noise_level: must be in [0, 1], got {noise_level}")
        self.torch = _torch()
        self.parts = load_dina_lrm(checkpoint, backbone=backbone, device=device, dtype=dtype)
        cfg = self.parts["config"]["model"]
        self.visual_idx = [int(i) for i in cfg["visual_head_idx"]]
        self.text_idx = [int(i) for i in cfg["text_head_idx"]]
        self.add_noise = bool(self.parts["config"].get("training", {}).get("add_noise", True))
        self.u, self.seed = float(noise_level), int(seed)
        self.max_sequence_length = int(max_sequence_length)
        self.normalize = bool(normalize)
        self.device = device
        self.lock = threading.Lock()

    def encode_prompts(self, prompts: list[str]) -> tuple[Any, Any]:
        """(prompt_embeds, pooled): CLIP-L / CLIP-G penultimate states (77 tokens), zero-padded
        to T5's width, then T5's states on the token axis; pooled = both CLIP projections."""
        torch = self.torch
        (c1, c2, t5), (k1, k2, k3) = self.parts["text_encoders"], self.parts["tokenizers"]
        states, pooled = [], []
        for enc, tok in ((c1, k1), (c2, k2)):
            ids = tok(
                prompts, padding="max_length", max_length=77, truncation=True, return_tensors="pt"
            )
            out = enc(ids.input_ids.to(self.device), output_hidden_states=True)
            states.append(out.hidden_states[-2])
            pooled.append(out[0])
        ids = k3(
            prompts,
            padding="max_length",
            max_length=self.max_sequence_length,
            truncation=True,
            add_special_tokens=True,
            return_tensors="pt",
        )
        t5_states = t5(ids.input_ids.to(self.device))[0]
        clip = torch.cat(states, dim=-1)
        clip = torch.nn.functional.pad(clip, (0, t5_states.shape[-1] - clip.shape[-1]))
        return torch.cat([clip, t5_states], dim=-2), torch.cat(pooled, dim=-1)

    def raw_scores(self, latents: Any, prompts: list[str]) -> Any:
        """The head's output (B,) for clean latents and prompts (noised at ``noise_level``)."""
        torch = self.torch
        net, head, sched = self.parts["backbone"], self.parts["head"], self.parts["scheduler"]
        dt = next(net.parameters()).dtype
        z = latents.to(self.device, torch.float32)
        sigmas = sched.sigmas.to(torch.float32)
        idx = int(torch.argmin((sigmas - self.u).abs()))
        sigma, timestep = float(sigmas[idx]), sched.timesteps[idx].to(self.device)
        if self.add_noise:
            g = torch.Generator().manual_seed(self.seed)
            eps = torch.randn(z.shape, generator=g).to(self.device)
            z = (1.0 - sigma) * z + sigma * eps
        enc, pooled = self.encode_prompts(prompts)
        hidden = net.pos_embed(z.to(dt))
        temb = net.time_text_embed(timestep.expand(z.shape[0]).to(dt), pooled.to(dt))
        text = net.context_embedder(enc.to(dt))
        visual, textual = [], []
        if self.visual_idx[0] == 0:
            visual.append(hidden)
        if self.text_idx[0] == 0:
            textual.append(text)
        for i, block in enumerate(net.transformer_blocks):
            text, hidden = block(hidden_states=hidden, encoder_hidden_states=text, temb=temb)
            if i + 1 in self.visual_idx:
                visual.append(hidden)
            if i + 1 in self.text_idx:
                textual.append(text)
        return head(visual, textual, temb)[:, 0].float()

    def score_batch(self, inp: RewardInput) -> RewardOutput:
        torch = self.torch
        lat = inp.require("latents", self.name)
        z = torch.as_tensor(
            np.stack([np.asarray(x) for x in lat])
            if isinstance(lat, list | tuple)
            else np.asarray(lat)
        )
        if z.ndim != 4:
            raise RewardInputError(
                f"latents: dina_lrm expects (B, C, H, W) SD3 latents, got {tuple(z.shape)}"
            )
        prompts = inp.prompt_list(self.name)
        with self.lock, torch.no_grad():
            raw = self.raw_scores(z, prompts).cpu().numpy()
        score = (raw + 10.0) / 10.0 if self.normalize else raw
        return RewardOutput(score.astype(np.float32), {"raw": raw.astype(np.float32)})
