"""`omni-train pretrain CONFIG`: train a toy SD3 from scratch on the shapes world.

The model is architecture-faithful to Stable Diffusion 3 (the diffusers
``SD3Transformer2DModel`` MMDiT, an ``AutoencoderKL``, two transformers CLIP text encoders
with projection and a T5 encoder), only tiny: word-level tokenizers over the world's
vocabulary (`omni_rewards.shapes.vocabulary`), text encoders and the MMDiT trained from
random initialisation. It is saved with ``StableDiffusion3Pipeline.save_pretrained`` and so
loads through ``omni_adapters.from_pretrained`` like released SD3 weights.

Two stages, both deterministic given ``seed`` (same machine, same thread count):

1. The VAE, as an autoencoder on renders: ``loss = mse(decode(z), x) + kl_weight KL(q(z|x)
   || N(0, I))`` with ``z ~ q(z|x)``. Its latents' mean and std over a batch become
   ``shift_factor`` and ``1 / scaling_factor`` (as SD3 set them for its VAE).
2. The MMDiT and text encoders, VAE frozen, by rectified flow (Esser et al. 2024, "Scaling
   Rectified Flow Transformers for High-Resolution Image Synthesis", Sec. 2-3; the loss of
   flow_grpo's SFT baseline): ``x0 = (z - shift) * scale``, ``eps ~ N(0, I)``,
   ``x_t = (1 - t) x0 + t eps``, ``loss = || v_theta(x_t, 1000 t, text) - (eps - x0) ||^2``,
   ``t`` logit-normal (``sigmoid(N(0, 1))``, the paper's default) or uniform, then shifted
   as SD3 shifts timesteps for resolution (``s t / (1 + (s - 1) t)``, paper Sec. 5.3.2;
   ``train.timestep_shift``, 1 = none). A fraction ``caption_dropout`` of captions is
   replaced by ``""`` so classifier-free guidance works. With ``train.ema_decay`` the saved
   weights are the exponential moving average of the trained ones (`ema_update`).

Each step draws ``batch_size`` captions of the split (`omni_rewards.shapes.sample_caption`:
a task type uniformly, or by ``train.task_weights``, then a caption) and renders each with its own seed. The learning rate
warms up linearly, stays constant and falls linearly to 0 over the last ``decay_steps``, so a
checkpoint at step N of a longer run, before its decay, is the N-step run without decay. The
run folder gets ``model/`` (the final pipeline), ``metrics.jsonl`` (one row per step),
``loss_curve.png``, optional ``checkpoints/step_N/`` and, after training,
``samples.png``: ODE samples of held-out captions, labelled with the `shapes` verdict, and
the held-out accuracy in ``eval.json``.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from .errors import NonFiniteError
from .recipe import RecipeError, apply_overrides

__all__ = [
    "CONFIGS",
    "ModelSpec",
    "PretrainConfig",
    "build_toy_sd3",
    "check_model_spec",
    "ema_update",
    "evaluate",
    "load_pretrain_config",
    "pretrain",
    "sample_images",
]


#: the configs that ship with omni-train (`omni-train pretrain NAME` finds them by name)
CONFIGS = Path(__file__).parent / "pretrain_configs"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSpec(_Section):
    """The toy SD3's sizes."""

    image_size: int = Field(32, ge=16, description="image side in pixels")
    patch_size: int = Field(4, ge=1, description="MMDiT patch size (latent pixels)")
    layers: int = Field(4, ge=1, description="MMDiT joint blocks")
    heads: int = Field(4, ge=1)
    head_dim: int = Field(32, ge=8)
    latent_channels: int = Field(4, ge=1, description="VAE latent channels")
    vae_channels: int = Field(32, ge=4, description="VAE conv width (one block: no downsampling)")
    vae_downsample: int = Field(0, ge=0, le=2, description="VAE down blocks (factor 2 each)")
    clip_hidden: int = Field(32, ge=8, description="width of each CLIP text encoder")
    t5_d_model: int = Field(64, ge=8, description="T5 width = MMDiT joint_attention_dim")
    text_layers: int = Field(2, ge=1, description="layers of each text encoder")
    text_len: int = Field(12, ge=4, description="tokens per prompt (each tokenizer)")


class VAEStage(_Section):
    steps: int = Field(300, ge=0)
    batch_size: int = Field(32, ge=1)
    lr: float = Field(2e-3, gt=0)
    kl_weight: float = Field(1e-6, ge=0)
    l1_weight: float = Field(1.0, ge=0, description="weight of an L1 term (sharper edges)")


class FlowStage(_Section):
    steps: int = Field(600, ge=0)
    batch_size: int = Field(64, ge=1)
    lr: float = Field(1e-3, gt=0)
    warmup_steps: int = Field(50, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    timestep_sampling: Literal["logit_normal", "uniform"] = "logit_normal"
    timestep_shift: float = Field(
        1.0,
        gt=0,
        description="SD3's timestep shift applied to the drawn t: s t / (1 + (s - 1) t); "
        "above 1 trains the high-noise steps, where the sampler (shift 3) spends its first "
        "steps and the layout is decided, more often",
    )
    decay_steps: int = Field(
        0, ge=0, description="the learning rate falls linearly to 0 over the last N steps"
    )
    caption_dropout: float = Field(0.1, ge=0, lt=1)
    ema_decay: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="keep an exponential moving average of the trained weights with this "
        "decay and save it instead of the last weights (0: none; 0.999 averages about the "
        "last 1000 steps)",
    )
    task_weights: dict[str, float] = Field(
        default_factory=dict,
        description="how often each caption task type is drawn, relative (omni_rewards.shapes."
        "TASKS; 1 for a type not named; empty: every type alike)",
    )
    save_every: int = Field(0, ge=0, description="checkpoints/step_N every N steps (0: none)")

    @field_validator("task_weights")
    @classmethod
    def _weights_the_world_accepts(cls, weights: dict[str, float]) -> dict[str, float]:
        from omni_rewards import shapes

        shapes.sample_caption(np.random.default_rng(0), "train", weights)  # raises if invalid
        return weights


class SampleStage(_Section):
    """The held-out samples and accuracy written after training."""

    prompts: int = Field(32, ge=0, description="held-out captions sampled (0: skip)")
    per_prompt: int = Field(2, ge=1)
    num_steps: int = Field(20, ge=1)
    guidance_scale: float = Field(1.0, ge=1.0)
    seed: int = 12345


class PretrainConfig(_Section):
    """`omni-train pretrain` config (YAML, with ``key=value`` overrides)."""

    world: Literal["shapes"] = "shapes"
    split: Literal["train", "heldout", "all"] = Field(
        "train",
        description="the captions trained on (omni_rewards.shapes splits; all: the whole "
        "grammar, as a released model's pretraining has seen every kind of caption)",
    )
    seed: int = 0
    threads: int | None = Field(2, ge=1, description="torch CPU threads (None: torch's default)")
    output_dir: str = "runs/pretrain/shapes_sd3"
    model: ModelSpec = ModelSpec()
    vae: VAEStage = VAEStage()
    train: FlowStage = FlowStage()
    sample: SampleStage = SampleStage()


def load_pretrain_config(
    path: str | os.PathLike[str], overrides: list[str] | None = None
) -> PretrainConfig:
    """Read a pretrain YAML, apply dotted ``key=value`` overrides, validate; errors name the
    key (`RecipeError`)."""
    p = Path(path)
    if not p.is_file() and (CONFIGS / f"{path}.yaml").is_file():
        p = CONFIGS / f"{path}.yaml"
    if not p.is_file():
        shipped = ", ".join(sorted(f.stem for f in CONFIGS.glob("*.yaml")))
        raise RecipeError(f"pretrain config not found: {p} (shipped configs: {shipped})")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise RecipeError(f"pretrain config {p} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise RecipeError(f"pretrain config {p}: the top level must be a mapping")
    apply_overrides(data, list(overrides or []))
    try:
        cfg = PretrainConfig.model_validate(data)
    except ValidationError as err:
        lines = []
        for e in err.errors():
            key = ".".join(str(x) for x in e["loc"])
            if e["type"] == "extra_forbidden":
                lines.append(f"unknown key '{key}'")
            else:
                lines.append(f"'{key}': {e['msg']} (got {e.get('input')!r})")
        raise RecipeError(f"invalid pretrain config {p}: " + "; ".join(lines)) from None
    check_model_spec(cfg.model)
    return cfg


def check_model_spec(spec: ModelSpec) -> None:
    """Sizes the toy SD3 cannot take; `RecipeError` naming the key."""
    f = 2**spec.vae_downsample
    if spec.image_size % (f * spec.patch_size):
        raise RecipeError(
            f"model.image_size: {spec.image_size} is not a multiple of "
            f"{f * spec.patch_size} (2**model.vae_downsample x model.patch_size)"
        )
    if 2 * spec.clip_hidden > spec.t5_d_model:
        raise RecipeError(
            f"model.clip_hidden: 2 x {spec.clip_hidden} exceeds model.t5_d_model "
            f"{spec.t5_d_model} (SD3 pads the two CLIPs' features to the T5 width)"
        )


# ------------------------------------------------------------------ the model
def build_toy_sd3(spec: ModelSpec, words: list[str], seed: int) -> dict[str, Any]:
    """The components of a randomly initialised toy SD3 (``StableDiffusion3Pipeline``
    names), with word-level tokenizers over ``words``."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from omni_adapters.tokenizers_tiny import clip_word_tokenizer, t5_word_tokenizer

    torch.manual_seed(seed)
    tok = clip_word_tokenizer(words, spec.text_len)
    tok_2 = clip_word_tokenizer(words, spec.text_len)
    tok_3 = t5_word_tokenizer(words, spec.text_len)
    clips = []
    for _ in range(2):
        cfg = CLIPTextConfig(
            vocab_size=len(tok),
            hidden_size=spec.clip_hidden,
            intermediate_size=4 * spec.clip_hidden,
            num_hidden_layers=spec.text_layers,
            num_attention_heads=max(1, spec.clip_hidden // 16),
            max_position_embeddings=spec.text_len,
            projection_dim=spec.clip_hidden,
            hidden_act="gelu",
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        clips.append(CLIPTextModelWithProjection(cfg))
    t5 = T5EncoderModel(
        T5Config(
            vocab_size=len(tok_3),
            d_model=spec.t5_d_model,
            d_kv=16,
            d_ff=2 * spec.t5_d_model,
            num_layers=spec.text_layers,
            num_heads=max(1, spec.t5_d_model // 16),
            relative_attention_num_buckets=8,
            relative_attention_max_distance=spec.text_len,
            feed_forward_proj="gated-gelu",
            pad_token_id=tok_3.pad_token_id,
            eos_token_id=tok_3.eos_token_id,
            decoder_start_token_id=0,
        )
    )
    check_model_spec(spec)
    latent = spec.image_size // 2**spec.vae_downsample
    transformer = SD3Transformer2DModel(
        sample_size=latent,
        patch_size=spec.patch_size,
        in_channels=spec.latent_channels,
        num_layers=spec.layers,
        attention_head_dim=spec.head_dim,
        num_attention_heads=spec.heads,
        joint_attention_dim=spec.t5_d_model,
        caption_projection_dim=spec.heads * spec.head_dim,
        pooled_projection_dim=2 * spec.clip_hidden,
        out_channels=spec.latent_channels,
        pos_embed_max_size=latent // spec.patch_size,
        qk_norm="rms_norm",
    )
    blocks = 1 + spec.vae_downsample
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * blocks,
        up_block_types=("UpDecoderBlock2D",) * blocks,
        block_out_channels=(spec.vae_channels,) * blocks,
        layers_per_block=1,
        latent_channels=spec.latent_channels,
        norm_num_groups=min(8, spec.vae_channels),
        sample_size=spec.image_size,
        mid_block_add_attention=False,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )
    return {
        "transformer": transformer,
        "vae": vae,
        "scheduler": FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0),
        "text_encoder": clips[0],
        "tokenizer": tok,
        "text_encoder_2": clips[1],
        "tokenizer_2": tok_2,
        "text_encoder_3": t5,
        "tokenizer_3": tok_3,
    }


def save_toy_sd3(components: dict[str, Any], path: Path) -> Path:
    """``StableDiffusion3Pipeline(**components).save_pretrained(path)`` (safetensors)."""
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline(**components)
    path.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(path, safe_serialization=True)
    return path


# ------------------------------------------------------------------ the world's batches
def _world_batch(
    rng: np.random.Generator,
    split: str,
    n: int,
    size: int,
    seed_base: int,
    task_weights: dict[str, float] | None = None,
) -> tuple[list[str], torch.Tensor]:
    """``n`` captions of ``split`` (task types drawn by ``task_weights``, uniform when None)
    and their renders (seeds ``seed_base + i``) as a float tensor (n, 3, size, size) in
    [-1, 1]."""
    from omni_rewards import shapes

    caps = [
        shapes.format_caption(shapes.sample_caption(rng, split, task_weights)) for _ in range(n)
    ]
    imgs = np.stack([np.asarray(shapes.render(c, seed_base + i, size)) for i, c in enumerate(caps)])
    x = torch.from_numpy(imgs).permute(0, 3, 1, 2).float() / 127.5 - 1.0
    return caps, x


def _lr_at(step: int, stage: FlowStage) -> float:
    """Linear warmup over ``warmup_steps``, constant, then a linear fall to 0 over the last
    ``decay_steps`` (warmup-stable-decay)."""
    if stage.warmup_steps and step < stage.warmup_steps:
        return stage.lr * (step + 1) / stage.warmup_steps
    left = stage.steps - step
    if stage.decay_steps and left <= stage.decay_steps:
        return stage.lr * left / stage.decay_steps
    return stage.lr


def ema_update(
    ema: list[torch.Tensor], params: list[torch.Tensor], decay: float, step: int
) -> None:
    """One step of the weights' exponential moving average, in place:
    ``ema <- d ema + (1 - d) p`` with ``d = min(decay, (1 + step) / (10 + step))``, the
    warm-up that keeps the first steps from holding on to the random initialisation
    (the schedule of TensorFlow's ``ExponentialMovingAverage`` with ``num_updates``)."""
    d = min(decay, (1 + step) / (10 + step))
    with torch.no_grad():
        for e, p in zip(ema, params):
            e.lerp_(p.detach(), 1.0 - d)


@contextlib.contextmanager
def _weights_swapped(params: list[torch.Tensor], ema: list[torch.Tensor] | None):
    """Inside the block the parameters hold the moving average (when there is one), so a
    save writes it; the trained weights come back after."""
    if ema is None:
        yield
        return
    kept = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, e in zip(params, ema):
            p.copy_(e)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, k in zip(params, kept):
                p.copy_(k)


def _train_vae(vae, cfg: PretrainConfig, log) -> list[float]:
    from tqdm.auto import tqdm

    st = cfg.vae
    rng = np.random.default_rng([cfg.seed, 1])
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + 1)
    opt = torch.optim.AdamW(vae.parameters(), lr=st.lr, weight_decay=0.0)
    vae.train().requires_grad_(True)
    losses = []
    bar = tqdm(range(st.steps), desc="vae", unit="step", dynamic_ncols=True)
    for step in bar:
        _, x = _world_batch(
            rng, cfg.split, st.batch_size, cfg.model.image_size, 10**7 + step * 1000
        )
        post = vae.encode(x).latent_dist
        z = post.mean + post.std * torch.randn(post.mean.shape, generator=gen)
        rec = vae.decode(z).sample
        mse = torch.nn.functional.mse_loss(rec, x)
        l1 = (rec - x).abs().mean()
        kl = post.kl().mean() / z[0].numel()
        loss = mse + st.l1_weight * l1 + st.kl_weight * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(mse.detach()))
        log({"stage": "vae", "step": step + 1, "mse": mse.item(), "kl": kl.item()})
        bar.set_postfix(mse=f"{mse.item():.4f}")
    vae.eval().requires_grad_(False)
    # SD3 normalises its latents: shift = mean, scale = 1 / std over the data
    _, x = _world_batch(rng, cfg.split, 256, cfg.model.image_size, 10**7 - 1000)
    with torch.no_grad():
        z = vae.encode(x).latent_dist.mean
    shift, std = float(z.mean()), float(z.std())
    vae.register_to_config(shift_factor=shift, scaling_factor=1.0 / max(std, 1e-6))
    # how well the world survives the autoencoder: the shapes reward on reconstructions of
    # held-out renders (the flow model cannot draw better than its decoder)
    from omni_rewards import load_reward

    caps, x = _world_batch(rng, "heldout", 64, cfg.model.image_size, 10**7 - 2000)
    with torch.no_grad():
        rec = vae.decode(vae.encode(x).latent_dist.mean).sample
    img = ((rec / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1)
    acc = float(load_reward("shapes")(images=img.numpy(), prompts=caps).scores.mean())
    log({"stage": "vae_done", "step": st.steps, "reconstruction_accuracy": acc})
    print(f"VAE: shapes accuracy of reconstructions of held-out renders {acc:.3f}", flush=True)
    return losses


def _flow_loss(adapter, x: torch.Tensor, caps: list[str], cfg: PretrainConfig, gen) -> torch.Tensor:
    """Rectified-flow loss of one batch (module docstring)."""
    vae = adapter.components["vae"]
    st = cfg.train
    with torch.no_grad():
        post = vae.encode(x).latent_dist
        z = post.mean + post.std * torch.randn(post.mean.shape, generator=gen)
        x0 = (z - vae.config.shift_factor) * vae.config.scaling_factor
    b = x0.shape[0]
    if st.timestep_sampling == "logit_normal":
        t = torch.sigmoid(torch.randn(b, generator=gen))
    else:
        t = torch.rand(b, generator=gen)
    shift = st.timestep_shift
    t = shift * t / (1 + (shift - 1) * t)
    eps = torch.randn(x0.shape, generator=gen)
    tb = t.view(b, 1, 1, 1)
    xt = (1 - tb) * x0 + tb * eps
    drop = torch.rand(b, generator=gen) < st.caption_dropout
    prompts = ["" if d else c for c, d in zip(caps, drop.tolist())]
    cond = adapter.encode_prompts(prompts)
    v = adapter.transformer_forward(xt, t, cond, None)
    return torch.nn.functional.mse_loss(v.float(), eps - x0)


# ------------------------------------------------------------------ sampling
@torch.no_grad()
def sample_images(
    adapter,
    prompts: list[str],
    seeds: list[int],
    *,
    num_steps: int = 20,
    guidance_scale: float = 1.0,
) -> np.ndarray:
    """Deterministic Euler ODE samples ``x <- x + (s' - s) v`` (uint8 (B, H, W, 3)), one per
    (prompt, seed), through the adapter's `Denoiser` methods (as the rollout engine runs)."""
    from diffusion_rollout import SamplingParams

    size = int(adapter.component_config("vae").sample_size)
    params = SamplingParams(
        height=size, width=size, num_steps=num_steps, guidance_scale=guidance_scale, sde_kind="ode"
    )
    gens = [torch.Generator().manual_seed(int(s)) for s in seeds]
    x = adapter.init_latents(len(prompts), params, gens)
    cond = adapter.encode(list(prompts))
    sig = adapter.sigmas(params)
    for i in range(num_steps):
        v = adapter.velocity(x, sig[i].expand(len(prompts)), cond, params)
        x = x + (sig[i + 1] - sig[i]) * v
    return adapter.decode(x).numpy()


def heldout_accuracy(
    model_path: str | Path,
    prompts: list[str],
    *,
    per_prompt: int = 1,
    seed: int = 0,
    num_steps: int = 20,
    guidance_scale: float = 1.0,
    batch: int = 64,
) -> tuple[dict[str, Any], np.ndarray, list[str], np.ndarray]:
    """Sample ``per_prompt`` images of each prompt (seed ``seed + k``) from the saved model
    and score them with the `shapes` reward. Returns (summary, images, prompts of the rows,
    scores); the summary has ``accuracy``, ``n``, ``per_task`` (task type -> accuracy) and
    ``per_part`` (count, object, colour, position: the mean of each part's 0/1 verdict, NaN
    parts left out)."""
    import omni_adapters
    from omni_rewards import load_reward
    from omni_rewards.shapes import task_types

    adapter = omni_adapters.from_pretrained(model_path)
    rows = [p for p in prompts for _ in range(per_prompt)]
    seeds = [seed + k for k in range(len(rows))]
    imgs = np.concatenate(
        [
            sample_images(
                adapter,
                rows[i : i + batch],
                seeds[i : i + batch],
                num_steps=num_steps,
                guidance_scale=guidance_scale,
            )
            for i in range(0, len(rows), batch)
        ]
    )
    out = load_reward("shapes")(images=imgs, prompts=rows)
    scores = out.scores
    parts = {
        k: float(np.nanmean(out.details[k])) for k in ("count", "object", "colour", "position")
    }
    tasks = task_types(rows)
    per_task = {
        t: float(np.mean([s for s, tt in zip(scores, tasks) if tt == t]))
        for t in sorted(set(tasks))
    }
    summary = {"accuracy": float(scores.mean()), "n": len(rows), "per_task": per_task,
               "per_part": parts}  # fmt: skip
    return summary, imgs, rows, scores


# ------------------------------------------------------------------ the command
def _plot_losses(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    from .plots import save_figure

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), dpi=100)
    for ax, stage, key in ((axes[0], "vae", "mse"), (axes[1], "flow", "loss")):
        pts = [(r["step"], r[key]) for r in rows if r.get("stage") == stage]
        if pts:
            s, v = zip(*pts)
            ax.plot(s, v, lw=0.6, alpha=0.4)
            k = max(1, len(v) // 30)
            smooth = np.convolve(v, np.ones(k) / k, mode="valid")
            ax.plot(s[k - 1 :], smooth, lw=1.5)
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_title(f"{stage} {key}")
        ax.grid(alpha=0.3)
    save_figure(fig, path)


def pretrain(cfg: PretrainConfig, *, progress: bool = True) -> Path:
    """Run both stages (module docstring) into ``cfg.output_dir``; returns the model folder."""
    from tqdm.auto import tqdm

    from omni_adapters import adapter_for
    from omni_rewards import shapes

    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.output_dir)
    if (out / "model").exists():
        raise RecipeError(f"output_dir: {out} already holds a model/; choose another folder")
    out.mkdir(parents=True, exist_ok=True)
    (out / "pretrain.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    rows: list[dict[str, Any]] = []

    def log(row: dict[str, Any]) -> None:  # line by line, so a stopped run keeps its rows
        rows.append(row)
        with (out / "metrics.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")

    (out / "metrics.jsonl").write_text("")

    comps = build_toy_sd3(cfg.model, shapes.vocabulary(), cfg.seed)
    t0 = time.time()
    _train_vae(comps["vae"], cfg, log)
    adapter = adapter_for("StableDiffusion3Pipeline")(comps)
    trainable = [
        comps[k] for k in ("transformer", "text_encoder", "text_encoder_2", "text_encoder_3")
    ]
    params = [p for m in trainable for p in m.parameters()]
    for m in trainable:
        m.train().requires_grad_(True)
    st = cfg.train
    opt = torch.optim.AdamW(params, lr=st.lr, weight_decay=st.weight_decay)
    rng = np.random.default_rng([cfg.seed, 2])
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + 2)
    weights = st.task_weights or None  # None keeps the uniform draw (and its random stream)
    ema = [p.detach().clone() for p in params] if st.ema_decay else None
    bar = tqdm(range(st.steps), desc="flow", unit="step", dynamic_ncols=True, disable=not progress)
    for step in bar:
        caps, x = _world_batch(
            rng, cfg.split, st.batch_size, cfg.model.image_size, step * 1000, weights
        )
        loss = _flow_loss(adapter, x, caps, cfg, gen)
        if not torch.isfinite(loss):
            raise NonFiniteError(
                f"flow loss is {loss.item()} at step {step + 1}; lower train.lr or raise "
                "train.warmup_steps"
            )
        lr = _lr_at(step, st)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(params, st.grad_clip)
        opt.step()
        if ema is not None:
            ema_update(ema, params, st.ema_decay, step)
        log({"stage": "flow", "step": step + 1, "loss": loss.item(), "grad_norm": float(gnorm),
             "lr": lr, "elapsed_s": round(time.time() - t0, 1)})  # fmt: skip
        bar.set_postfix(loss=f"{loss.item():.4f}")
        if st.save_every and (step + 1) % st.save_every == 0 and step + 1 < st.steps:
            for m in trainable:
                m.eval()
            with _weights_swapped(params, ema):
                save_toy_sd3(comps, out / "checkpoints" / f"step_{step + 1}")
            for m in trainable:
                m.train()
    for m in trainable:
        m.eval().requires_grad_(False)
    with _weights_swapped(params, ema):  # the saved model is the moving average
        model_dir = save_toy_sd3(comps, out / "model")
    _plot_losses(rows, out / "loss_curve.png")
    if cfg.sample.prompts:
        evaluate(model_dir, cfg.sample, out)
    return model_dir


def evaluate(
    model_dir: str | Path,
    sample: SampleStage,
    out_dir: str | Path,
    prompts: list[str] | None = None,
) -> dict[str, Any]:
    """Held-out accuracy of a saved model: ``sample.per_prompt`` ODE samples of each prompt
    (default: ``sample.prompts`` held-out captions drawn with ``sample.seed``), scored by the
    `shapes` reward. Writes ``out_dir/eval.json`` (the returned summary) and
    ``out_dir/samples.png`` (a block per prompt, each image labelled ok / x)."""
    from omni_rewards import shapes

    from .plots import save_prompt_grid

    if prompts is None:
        prng = np.random.default_rng(sample.seed)
        prompts = [
            shapes.format_caption(shapes.sample_caption(prng, "heldout"))
            for _ in range(sample.prompts)
        ]
    summary, imgs, rows, scores = heldout_accuracy(
        model_dir,
        prompts,
        per_prompt=sample.per_prompt,
        seed=sample.seed,
        num_steps=sample.num_steps,
        guidance_scale=sample.guidance_scale,
    )
    summary["model"] = str(model_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps(summary, indent=2) + "\n")
    save_prompt_grid(
        imgs,
        out / "samples.png",
        rows[:: sample.per_prompt],
        sample.per_prompt,
        labels=["ok" if s else "x" for s in scores],
    )
    return summary
