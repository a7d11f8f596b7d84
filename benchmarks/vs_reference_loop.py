"""Our FlowGRPO step against a plain reference loop at equal work, measured side by side.

Two sides train the same SD3 (same weights, same LoRA: rank 8, alpha 16, the attention
projections), on the same N samples (P prompts x n), S denoising steps, T = S - 1 trained
timesteps, one optimizer step per RL step, brightness reward:

- ``ours``: the real omni-train path (`omni_train.backends.make_ports` + `DiffusionLoop`,
  local backend, embedded engine, `trainer.mode: sync`, `reward.overlap` on), timings from
  the loop's own ``timing/*`` metrics.
- ``reference``: a loop written here the way the published FlowGRPO implementation
  (github.com/yifan123/flow_grpo: ``pipeline_with_logprob``, ``sde_step_with_logprob``,
  ``train_sd3.py``) does it: diffusers' ``StableDiffusion3Pipeline`` with a peft LoRA left
  unmerged, fixed batches of B samples, every sample's prompt encoded on its own row, the
  SDE step on every step, images decoded per batch, the reward after the whole rollout, and
  the update replaying one timestep at a time (per-row shuffled timesteps) with gradients
  accumulated into one optimizer step. The code is ours; the formulas are the paper's
  (Flow-GRPO, Liu et al. 2025, eq. 9 and the clipped ratio objective).

``--ours-batch K`` lets ours pack K rows into one forward in the rollout
(`rollout.max_num_seqs`) and in the replay (`algorithm.rows_per_forward`, several window
steps per forward) while the reference keeps its fixed batch; the rows forwarded per step
stay equal (printed).

``--sides ours,reference,ours-thread`` adds ours with the waves in the engine's scheduler
thread, as the engine ran them before (the thread penalty, docs/performance.md).
``--sides ours,reference,ours-reuse`` adds ours with ``algorithm.reuse_rollout_forward``: the
rollout keeps the autograd graph of its trained steps (on the learner's unmerged weights; its
other forwards on the merged copy) and the update back-propagates through it instead of
replaying those forwards; the same samples, timesteps and gradient, with one forward per
trained step fewer (the rows line shows it). It is what a recipe with the defaults runs (the
key's `auto`, and `rows_per_forward` null); ``ours`` is the replay.
``--sides ours,ours-base`` adds ours without the LoRA (``lora.enabled: false``, so the update
trains every weight): its rollout forwards the base model, and the rollout ratio
ours-base / ours tells what the LoRA costs our rollout (merged into the rollout copy's
weights, it should cost nothing).

``--device cuda --dtype bfloat16`` runs both sides on a GPU in bf16 (ours through the
recipe's ``model.device`` / ``model.dtype``); ``--models sd35-medium`` is the released
SD3.5-Medium transformer at full size with random weights (GPU only:
benchmarks/device/vs_reference_sd35.sh).

Each side runs in its OWN process (`--child`), repeats interleaved in rotating order; a child trains ``--warmup`` + ``--steps`` RL steps and reports the median of the
measured steps per phase (rollout, reward, update, step), plus the time inside the model
(transformer, VAE decoder, text encoders forwards, and ``backward``). The parent prints
the median over repeats, the ratios other / ours (> 1: ours is faster) and the share
of each step spent outside the model. Load average before and after is printed: the machine
may be shared.

    uv run python benchmarks/vs_reference_loop.py                          # tiny + cpu, 3 sides
    bash benchmarks/device/vs_reference_sd35.sh                            # H200, sd35-medium
    uv run python benchmarks/vs_reference_loop.py --models tiny,cpu,cpu-large --repeats 3
    uv run python benchmarks/vs_reference_loop.py --models tiny --sides ours,ours-thread
    uv run python benchmarks/vs_reference_loop.py --models cpu --sides ours,ours-base
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

PROMPTS = [
    "a red fox in the snow",
    "a bowl of ramen, studio light",
    "an astronaut riding a horse",
    "a lighthouse at dusk",
    "two cats on a sofa",
    "a watercolor of a city street",
    "a green apple on a table",
    "a castle on a hill",
]
# transformer shapes on top of the tiny SD3's text encoders and VAE (omni_adapters.tiny); a
# string names a released model of omni_adapters.published, built at full size (random weights)
MODELS: dict[str, dict[str, int] | str | None] = {
    "tiny": None,  # 2 MMDiT blocks of width 32
    "cpu": {"num_layers": 4, "num_attention_heads": 4, "attention_head_dim": 32},  # width 128
    "cpu-large": {"num_layers": 8, "num_attention_heads": 4, "attention_head_dim": 64},  # 256
    "sd35-medium": "sd35_medium",  # the released transformer (2.47B), GPU only
}
RANK, ALPHA, LR, CLIP, NOISE = 8, 16.0, 1e-4, 1e-4, 0.7
# the full-size pipeline's text encoders: the released widths (T5 d_model 4096 = the
# transformer's joint_attention_dim, CLIP projections 768 + 1280 = its pooled_projection_dim)
# and token lengths (77 CLIP, 256 T5 tokens: 333 text tokens per sample, as released), but
# TEXT_LAYERS layers each: the transformer is what the benchmark measures, and the 24-layer
# T5-XXL (4.7B) would only add load time.
TEXT_LAYERS = 2
CLIP_TOKENS, T5_TOKENS = 77, 256


# --------------------------------------------------------------------------- models
def build_models(
    root: Path, names: list[str], device: str = "cpu", dtype: str = "float32"
) -> dict[str, Path]:
    """The tiny SD3, copies of it with a wider/deeper transformer, and full-size pipelines
    (random weights; ``device``/``dtype``: where and in what a full-size one is built)."""
    import torch
    from diffusers import SD3Transformer2DModel

    from omni_adapters import tiny

    base = tiny.build("sd3", root / "tiny", seed=0)
    out = {}
    for name in names:
        shape = MODELS[name]
        if shape is None:
            out[name] = base
            continue
        path = root / name
        if isinstance(shape, str):
            out[name] = build_full_size(path, shape, device=device, dtype=dtype)
            continue
        shutil.copytree(base, path)
        cfg = SD3Transformer2DModel.load_config(base / "transformer")
        cfg = {k: v for k, v in cfg.items() if not k.startswith("_")}
        cfg.update(shape)
        cfg["caption_projection_dim"] = shape["num_attention_heads"] * shape["attention_head_dim"]
        torch.manual_seed(1)
        shutil.rmtree(path / "transformer")
        SD3Transformer2DModel(**cfg).save_pretrained(path / "transformer")
        out[name] = path
    return out


def full_size_pipeline(
    published_name: str,
    device: str = "cpu",
    text_layers: int = TEXT_LAYERS,
    transformer_overrides: dict[str, Any] | None = None,
):
    """A ``StableDiffusion3Pipeline`` with the released transformer, VAE and scheduler
    configs of ``omni_adapters.published`` (``transformer_overrides`` replace config values,
    e.g. fewer layers for a CPU check), text encoders of the released widths with
    ``text_layers`` layers, and character tokenizers (``omni_adapters.tokenizers_tiny``) of
    the released lengths; random weights, made on ``device`` (``meta``: no memory at all)."""
    import torch
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from omni_adapters import published
    from omni_adapters.tokenizers_tiny import clip_tokenizer, t5_tokenizer

    files = published.load(published_name).files

    def config(rel: str, **overrides: Any) -> dict[str, Any]:
        cfg = {k: v for k, v in files[rel].items() if not k.startswith("_")}
        cfg.pop("architectures", None)
        cfg.pop("model_type", None)
        return {**cfg, **overrides}

    toks = [clip_tokenizer(CLIP_TOKENS), clip_tokenizer(CLIP_TOKENS), t5_tokenizer(T5_TOKENS)]
    # this tokenizer's ids (vocab, bos/eos/pad): the released CLIP configs' eos id 2 would
    # make transformers pool at the argmax id instead of at the end-of-text token
    ids = [
        {
            "vocab_size": len(t),
            "bos_token_id": t.bos_token_id,
            "eos_token_id": t.eos_token_id,
            "pad_token_id": t.pad_token_id,
        }
        for t in toks
    ]
    ids[2].pop("bos_token_id")
    with torch.device(device):  # built where it runs: no slow CPU init of billions
        clips = [
            CLIPTextModelWithProjection(
                CLIPTextConfig(**config(rel, num_hidden_layers=text_layers, **ids[i]))
            ).eval()
            for i, rel in enumerate(("text_encoder/config.json", "text_encoder_2/config.json"))
        ]
        t5 = T5EncoderModel(
            T5Config(
                **config(
                    "text_encoder_3/config.json",
                    num_layers=text_layers,
                    decoder_start_token_id=0,
                    **ids[2],
                )
            )
        ).eval()
        transformer = SD3Transformer2DModel(
            **config("transformer/config.json", **(transformer_overrides or {}))
        )
        vae = AutoencoderKL(**config("vae/config.json"))
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=FlowMatchEulerDiscreteScheduler(**config("scheduler/scheduler_config.json")),
        vae=vae,
        text_encoder=clips[0],
        tokenizer=toks[0],
        text_encoder_2=clips[1],
        tokenizer_2=toks[1],
        text_encoder_3=t5,
        tokenizer_3=toks[2],
    )


def build_full_size(path: Path, published_name: str, device: str, dtype: str) -> Path:
    """:func:`full_size_pipeline` built on ``device``, cast to ``dtype`` and saved (safetensors,
    the diffusers pipeline layout) under ``path``, for both sides' ``from_pretrained``."""
    import torch

    torch.manual_seed(1)
    pipe = full_size_pipeline(published_name, device=device)
    pipe.to(getattr(torch, dtype))
    pipe.save_pretrained(path, safe_serialization=True)
    del pipe
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return path


# --------------------------------------------------------------------------- model timer
class ModelTimer:
    """Seconds inside model forwards (forward hooks on the given modules) and inside
    ``Tensor.backward`` (the backward runs through the transformer). On a GPU each of these
    marks waits for the device first (``sync``), or it would time kernel launches, not
    kernels; the same hooks on both sides, so both pay the same extra waits."""

    def __init__(self, modules: list, transformers: list, sync=lambda: None) -> None:
        import torch

        self.sync = sync
        self.seconds = 0.0
        self.backward_s = 0.0  # the part of `seconds` inside Tensor.backward
        self.rows = 0  # transformer rows (batch entries) forwarded: the equal-work check
        self._t0: dict[int, float] = {}
        for m in modules:
            m.register_forward_pre_hook(self._pre)
            m.register_forward_hook(self._post)
        for m in transformers:
            m.register_forward_pre_hook(self._count, with_kwargs=True)
        backward = torch.Tensor.backward

        def timed_backward(tensor, *args, **kwargs):
            self.sync()
            t0 = time.perf_counter()
            try:
                return backward(tensor, *args, **kwargs)
            finally:
                self.sync()
                self.seconds += time.perf_counter() - t0
                self.backward_s += time.perf_counter() - t0

        torch.Tensor.backward = timed_backward

    def _count(self, module, args, kwargs) -> None:
        x = kwargs.get("hidden_states", args[0] if args else None)
        self.rows += int(x.shape[0])

    def _pre(self, module, args) -> None:
        self.sync()
        self._t0[id(module)] = time.perf_counter()

    def _post(self, module, args, output) -> None:
        self.sync()
        self.seconds += time.perf_counter() - self._t0.pop(id(module))


def device_sync(device: str):
    """A function that waits for the GPU's queued work (``torch.cuda.synchronize``) on a CUDA
    device, and does nothing on the CPU."""
    import torch

    if device.startswith("cuda"):
        return torch.cuda.synchronize
    return lambda: None


def peak_gib(device: str) -> float:
    """Peak GPU memory the process's tensors took (``torch.cuda.max_memory_allocated``), GiB;
    0 on the CPU."""
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else 0.0


# --------------------------------------------------------------------------- ours
def run_ours(a: argparse.Namespace) -> list[dict[str, float]]:
    from omni_train.backends import make_ports
    from omni_train.loops import DiffusionLoop
    from omni_train.recipe import recipe_from_dict

    tmp = Path(tempfile.mkdtemp(prefix="vsref-ours-"))
    recipe = recipe_from_dict(
        {
            "experiment": "vs_reference",
            "model": {"path": a.model, "device": a.device, "dtype": a.dtype},
            "data": {"prompts": PROMPTS[: a.prompts], "prompts_per_step": a.prompts},
            "rollout": {
                "n": a.n,
                "height": a.size,
                "width": a.size,
                "num_steps": a.num_steps,
                "noise_level": NOISE,
                "sde_window_size": a.num_steps - 1,
                "sde_window_range": [0, a.num_steps - 1],
                "max_num_seqs": a.ours_batch or a.batch,
            },
            # the overlap on, as docs/performance.md's tables were measured (its default,
            # `auto`, leaves it off where the rollout runs on a CPU; brightness costs little)
            "reward": {"name": "brightness", "overlap": True},
            # ours-reuse: the update back-propagates through the rollout's own forwards
            "algorithm": {"name": "flow_grpo", "clip_range": CLIP, "reuse_rollout_forward": True}
            if a.child == "ours-reuse"
            # ours: the packed replay (a recipe's default, `auto`, reuses when it can)
            else {
                "name": "flow_grpo",
                "clip_range": CLIP,
                "rows_per_forward": _replay_rows(a),
                "reuse_rollout_forward": False,
            },
            # ours-base: the base model's rollout (the update then trains every weight)
            "lora": {"enabled": False}
            if a.child == "ours-base"
            else {"rank": RANK, "alpha": ALPHA},
            "optimizer": {"lr": LR},
            "trainer": {
                "steps": a.warmup + a.steps,
                "output_dir": str(tmp / "run"),
                "progress": False,
                "sample_every": 0,
                "threads": a.threads or "auto",
            },
        }
    )
    ports = make_ports(recipe)
    if not a.kl_metric:  # monitoring the reference loop does not do (see --kl-metric)
        ctx = ports.learner.ctx
        ctx.settings = dataclasses.replace(ctx.settings, measure_kl_ref=False)
    if a.child == "ours-thread":
        scheduler_thread_waves(ports.rollout)
    sync = device_sync(a.device)
    if a.device.startswith("cuda"):
        end_phases_with_sync(ports.rollout, sync)
    comps = ports.learner.adapter.components
    mods = model_modules(comps)
    transformers = [comps["transformer"]]
    rollout_tr = ports.rollout.denoiser.components["transformer"]
    if rollout_tr is not comps["transformer"]:  # the merged-LoRA rollout copy
        mods.append(rollout_tr)
        transformers.append(rollout_tr)
    timer = ModelTimer(mods, transformers, sync)
    loop = DiffusionLoop(recipe, ports, tmp / "run")
    marks: list[float] = []
    step = loop.train_step

    def marked(*args, **kwargs):
        marks.append(timer.seconds)
        rows0, bw0 = timer.rows, timer.backward_s
        row = step(*args, **kwargs)
        row["model_s"] = timer.seconds - marks[-1]
        row["transformer_rows"] = timer.rows - rows0
        row["backward_s"] = timer.backward_s - bw0
        return row

    loop.train_step = marked
    try:
        rows = loop.train()
    finally:
        ports.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return [
        {
            "rollout": r["timing/rollout_s"],
            "reward": r["timing/reward_s"],
            "update": r["timing/update_s"],
            # the three phases: timing/step_s also holds the final checkpoint's save
            "step": r["timing/rollout_s"] + r["timing/reward_s"] + r["timing/update_s"],
            "model": r["model_s"],
            "threads": r["perf/torch_threads"],
            "rows": r["transformer_rows"],
            "backward": r["backward_s"],
            "reward_mean": r["reward/mean"],
            "peak_gib": peak_gib(a.device),
        }
        for r in rows
    ]


def end_phases_with_sync(engine, sync) -> None:
    """On a GPU, our ``timing/rollout_s`` and ``timing/update_s`` end where
    ``generate_many`` and ``update_weights`` (the weight sync into the rollout copy, the
    update phase's last work) return, and the GPU may still be running their kernels then.
    Wait for it at those two ends, as the reference loop does at the end of each phase."""
    generate_many, update_weights = engine.generate_many, engine.update_weights

    def synced_generate_many(*args, **kwargs):
        out = generate_many(*args, **kwargs)
        sync()
        return out

    def synced_update_weights(*args, **kwargs):
        out = update_weights(*args, **kwargs)
        sync()
        return out

    engine.generate_many = synced_generate_many
    engine.update_weights = synced_update_weights


def scheduler_thread_waves(engine) -> None:
    """The engine as it was before waves ran in the caller's thread: `generate_many` queues
    the requests for the engine's scheduler thread and waits (``on_ready`` per finished wave),
    while the update runs in the main thread: two OpenMP thread teams in one process."""
    import concurrent.futures

    def generate_many(requests, *, progress=False, on_ready=None):
        futs = engine.submit_many(requests)
        pending = set(range(len(futs)))
        while pending:
            concurrent.futures.wait(
                [futs[i] for i in pending], return_when=concurrent.futures.FIRST_COMPLETED
            )
            ready = sorted(i for i in pending if futs[i].done())
            pending.difference_update(ready)
            if on_ready is not None:
                on_ready(ready, [futs[i].result() for i in ready])
        return [f.result() for f in futs]

    engine.generate_many = generate_many


def model_modules(comps: dict) -> list:
    """The transformer, the VAE decoder and the text encoders of an SD3 pipeline."""
    mods = [comps["transformer"], comps["vae"].decoder]
    mods += [
        comps[k]
        for k in ("text_encoder", "text_encoder_2", "text_encoder_3")
        if comps.get(k) is not None
    ]
    return mods


# --------------------------------------------------------------------------- reference
def sde_logprob(x, v, sigma, sigma_next, sigma_max, prev=None, generator=None):
    """One Flow-GRPO SDE step (x_{t-dt} from x_t and velocity v) and its Gaussian log-prob,
    averaged over non-batch dims. ``sigma``/``sigma_next``: (B, 1, 1, 1).

        std = noise * sqrt(sigma / (1 - sigma'))      (sigma' = sigma_max where sigma == 1)
        mean = x (1 + std^2 dt / (2 sigma)) + v (1 + std^2 (1 - sigma) / (2 sigma)) dt
        x_next = mean + std sqrt(-dt) eps,            dt = sigma_next - sigma < 0
    """
    import torch

    dt = sigma_next - sigma
    std = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * NOISE
    mean = x * (1 + std**2 / (2 * sigma) * dt) + v * (1 + std**2 * (1 - sigma) / (2 * sigma)) * dt
    scale = std * torch.sqrt(-dt)
    if prev is None:
        eps = torch.randn(x.shape, generator=generator, dtype=x.dtype, device=x.device)
        prev = mean + scale * eps
    lp = -((prev.detach() - mean) ** 2) / (2 * scale**2) - torch.log(scale)
    lp = lp - 0.5 * math.log(2 * math.pi)
    return prev, lp.mean(dim=tuple(range(1, lp.ndim)))


def run_reference(a: argparse.Namespace) -> list[dict[str, float]]:
    import numpy as np
    import torch
    from diffusers import StableDiffusion3Pipeline
    from peft import LoraConfig

    from omni_adapters.families.sd3 import SD3_LORA_TARGETS  # the LoRA targets ours uses

    if a.threads:
        torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    # the weights in --dtype, as ours loads them (model.dtype); the LoRA that add_adapter
    # injects follows the base layers' dtype, as omni-adapters' add_lora (the same peft
    # inject_adapter_in_model), so both sides train LoRA tensors of the same dtype
    pipe = StableDiffusion3Pipeline.from_pretrained(a.model, torch_dtype=getattr(torch, a.dtype))
    pipe.to(dev)
    pipe.set_progress_bar_config(disable=True)
    tr = pipe.transformer
    for m in (tr, pipe.vae, pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3):
        m.requires_grad_(False)
    tr.add_adapter(
        LoraConfig(
            r=RANK, lora_alpha=ALPHA, init_lora_weights=True, target_modules=list(SD3_LORA_TARGETS)
        )
    )
    params = [p for p in tr.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR)
    sync = device_sync(a.device)  # phases end once the GPU is done (ours: end_phases_with_sync)
    timer = ModelTimer(model_modules(pipe.components), [tr], sync)
    sched = pipe.scheduler
    sched.set_timesteps(a.num_steps)
    sigmas = sched.sigmas.float().to(dev)  # S + 1 values, the last 0
    timesteps = sched.timesteps.float().to(dev)
    sigma_max = sigmas[1].item()
    T = a.num_steps - 1
    prompts = [p for p in PROMPTS[: a.prompts] for _ in range(a.n)]  # each prompt n times
    N, B = len(prompts), a.batch
    vae = pipe.vae
    c = 16  # SD3 latent channels
    lat_hw = a.size // pipe.vae_scale_factor
    # the T5 tokens ours uses (omni_adapters' SD3 t5_max_length): equal sequence lengths
    t5_len = min(256, int(pipe.tokenizer_3.model_max_length))

    def velocity(x, t, emb, pooled):
        # latents and the SDE in float32, the transformer in its dtype: as ours does
        # (omni-adapters' DiffusionAdapter.velocity / SD3Adapter.transformer_forward)
        dt = tr.dtype
        return tr(
            hidden_states=x.to(dt),
            timestep=t.to(dt),
            encoder_hidden_states=emb.to(dt),
            pooled_projections=pooled.to(dt),
            return_dict=False,
        )[0].float()

    rows = []
    for step in range(a.warmup + a.steps):
        model0, rows0, bw0 = timer.seconds, timer.rows, timer.backward_s
        t0 = time.perf_counter()
        # ---- rollout: fixed batches of B, every sample's prompt encoded on its own row
        samples = []
        with torch.no_grad():
            for k in range(0, N, B):
                batch = prompts[k : k + B]
                emb, _, pooled, _ = pipe.encode_prompt(
                    batch,
                    batch,
                    batch,
                    do_classifier_free_guidance=False,
                    max_sequence_length=t5_len,
                )
                g = torch.Generator(dev).manual_seed(step * 100_000 + k)
                x = torch.randn(len(batch), c, lat_hw, lat_hw, generator=g, device=dev)
                lats, lps = [x], []
                for i in range(a.num_steps):
                    v = velocity(x, timesteps[i].expand(len(batch)), emb, pooled)
                    s = sigmas[i].view(1, 1, 1, 1)
                    sn = sigmas[i + 1].view(1, 1, 1, 1)
                    x, lp = sde_logprob(x, v, s, sn, sigma_max, generator=g)
                    lats.append(x)
                    lps.append(lp)
                z = x / vae.config.scaling_factor + vae.config.shift_factor
                img = vae.decode(z.to(vae.dtype), return_dict=False)[0].float()
                img = ((img / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
                samples.append(
                    {
                        "emb": emb,
                        "pooled": pooled,
                        "lat": torch.stack(lats, 1),
                        "lp": torch.stack(lps, 1),
                        "img": img,
                    }
                )
        sync()
        t1 = time.perf_counter()
        # ---- reward after the whole rollout, then group-relative advantages
        rewards = torch.cat([s["img"].float().mean(dim=(1, 2, 3)) / 255 for s in samples])
        r = rewards.double().cpu().numpy().reshape(a.prompts, a.n)
        adv = (r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-4)
        adv = torch.from_numpy(np.clip(adv, -5, 5).reshape(-1)).float().to(dev)
        sync()
        t2 = time.perf_counter()
        # ---- update: one timestep at a time, gradients accumulated into one step
        gen = torch.Generator().manual_seed(step)
        lat = torch.cat([s["lat"] for s in samples])
        old = torch.cat([s["lp"] for s in samples])
        emb = torch.cat([s["emb"] for s in samples])
        pooled = torch.cat([s["pooled"] for s in samples])
        order = torch.randperm(N, generator=gen)
        times = torch.stack([torch.randperm(T, generator=gen) for _ in range(N)])
        for k in range(0, N, B):
            rows_k = order[k : k + B]
            for j in range(T):
                ti = times[rows_k, j]  # per-row timestep index (shuffled per sample)
                x = lat[rows_k, ti]
                s = sigmas[ti].view(-1, 1, 1, 1)
                sn = sigmas[ti + 1].view(-1, 1, 1, 1)
                v = velocity(x, timesteps[ti], emb[rows_k], pooled[rows_k])
                _, lp = sde_logprob(x, v, s, sn, sigma_max, prev=lat[rows_k, ti + 1])
                ratio = torch.exp(lp - old[rows_k, ti])
                ad = adv[rows_k]
                loss = torch.maximum(-ad * ratio, -ad * ratio.clamp(1 - CLIP, 1 + CLIP)).mean()
                (loss * len(rows_k) / (N * T)).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        t3 = time.perf_counter()
        rows.append(
            {
                "rollout": t1 - t0,
                "reward": t2 - t1,
                "update": t3 - t2,
                "step": t3 - t0,
                "model": timer.seconds - model0,
                "threads": torch.get_num_threads(),
                "rows": timer.rows - rows0,
                "backward": timer.backward_s - bw0,
                "reward_mean": float(rewards.mean()),
                "peak_gib": peak_gib(a.device),
            }
        )
    return rows


# --------------------------------------------------------------------------- driver
PHASES = (
    "rollout",
    "reward",
    "update",
    "step",
    "model",
    "threads",
    "rows",
    "backward",
    "peak_gib",
)
SIDES = ("ours", "reference", "ours-thread", "ours-base", "ours-reuse")


def child(a: argparse.Namespace) -> None:
    rows = (run_reference if a.child == "reference" else run_ours)(a)
    kept = rows[a.warmup :]
    print(json.dumps({k: statistics.median(r[k] for r in kept) for k in PHASES}))


def _replay_rows(a: argparse.Namespace) -> int | str:
    """Ours: algorithm.rows_per_forward (--ours-replay: a number or `auto`)."""
    if a.ours_replay == "auto":
        return "auto"
    return int(a.ours_replay or a.ours_batch or a.batch)


def spawn(side: str, model: Path, a: argparse.Namespace) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--child", side, "--model", str(model)]
    keys = (
        "prompts",
        "n",
        "num_steps",
        "size",
        "batch",
        "ours_batch",
        "warmup",
        "steps",
        "threads",
    )
    for k in (*keys, "device", "dtype"):
        cmd += [f"--{k.replace('_', '-')}", str(getattr(a, k))]
    if a.ours_replay:
        cmd += ["--ours-replay", a.ours_replay]
    if a.kl_metric:
        cmd.append("--kl-metric")
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"{side} child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="tiny,cpu", help="of: " + ", ".join(MODELS))
    ap.add_argument("--prompts", type=int, default=6, help="prompts per step (default 6)")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt (default 8: N=48)")
    ap.add_argument("--num-steps", type=int, default=8, help="denoising steps (default 8)")
    ap.add_argument("--size", type=int, default=32, help="image side in pixels (default 32)")
    ap.add_argument("--batch", type=int, default=16, help="fixed batch B (default 16)")
    ap.add_argument(
        "--ours-batch",
        type=int,
        default=0,
        help="ours: rows per forward in the rollout (rollout.max_num_seqs) and the replay "
        "(algorithm.rows_per_forward); 0: --batch. The work (rows forwarded) stays equal: the "
        "engine packs requests and the replay packs window steps into fewer, larger forwards",
    )
    ap.add_argument(
        "--ours-replay",
        default=None,
        help="ours: algorithm.rows_per_forward alone, a number or `auto` (chosen by memory "
        "after the first update, which --warmup leaves unmeasured); default: --ours-batch",
    )
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured RL steps per child")
    ap.add_argument("--steps", type=int, default=3, help="measured RL steps per child")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved child pairs")
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads of every side (0: each side's default: ours trainer.threads auto, "
        "the reference torch's default)",
    )
    ap.add_argument(
        "--sides",
        default="ours,reference,ours-reuse",
        help="of: ours, reference, ours-thread (ours with the waves in the engine's scheduler "
        "thread, as before: the thread penalty), ours-base (ours without the LoRA: its "
        "rollout is the base model's), ours-reuse (ours with algorithm.reuse_rollout_forward: "
        "the update back-propagates through the rollout's forwards instead of replaying them)",
    )
    ap.add_argument(
        "--kl-metric",
        action="store_true",
        help="keep our policy/kl_to_ref metric (two no-grad passes over 4 rows x the window "
        "steps after each update; off by default: the reference computes no such metric)",
    )
    ap.add_argument("--device", default="cpu", help="torch device of both sides (cpu, cuda)")
    ap.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="weights dtype of both sides (ours: model.dtype; LoRA follows the weights)",
    )
    ap.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        child(a)
        return 0
    names = [m.strip() for m in a.models.split(",") if m.strip()]
    unknown = sorted(set(names) - set(MODELS))
    if unknown:
        ap.error(f"--models: unknown {unknown} (known: {', '.join(MODELS)})")
    full = [m for m in names if isinstance(MODELS[m], str)]
    if full and not a.device.startswith("cuda"):
        ap.error(f"--models: {full} are full size (billions of parameters): --device cuda")
    sides = [x.strip() for x in a.sides.split(",") if x.strip()]
    if "ours" not in sides or set(sides) - set(SIDES):
        ap.error(f"--sides: 'ours' and any of {', '.join(SIDES)}")
    others = [x for x in sides if x != "ours"]
    load0 = os.getloadavg()
    results = {}
    with tempfile.TemporaryDirectory(prefix="vsref-") as tmp:
        t0 = time.perf_counter()
        paths = build_models(Path(tmp), names, a.device, a.dtype)
        # progress on stderr: a run cut off by a timeout still shows how far it got
        print(f"built {names} in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        for name in names:
            got: dict[str, list[dict[str, float]]] = {side: [] for side in sides}
            for rep in range(a.repeats):
                k = rep % len(sides)  # rotate the order every repeat
                for side in sides[k:] + sides[:k]:
                    t0 = time.perf_counter()
                    got[side].append(spawn(side, paths[name], a))
                    took = time.perf_counter() - t0
                    print(
                        f"{name} {side} round {rep + 1}: {took:.0f} s", file=sys.stderr, flush=True
                    )
            results[name] = {
                side: {k: statistics.median(r[k] for r in runs) for k in PHASES}
                for side, runs in got.items()
            }
    load1 = os.getloadavg()
    print(
        f"N={a.prompts * a.n} ({a.prompts} prompts x {a.n}), {a.num_steps} steps, "
        f"{a.num_steps - 1} trained timesteps, {a.size}x{a.size}, batch {a.batch} "
        f"(ours {a.ours_batch or a.batch} rows per forward, replay "
        f"{a.ours_replay or a.ours_batch or a.batch}), LoRA r{RANK}; "
        f"{a.device}, {a.dtype}; "
        f"threads {a.threads or 'default'}, {os.cpu_count()} CPUs; median of {a.repeats} "
        f"interleaved process rounds x {a.steps} steps; policy/kl_to_ref "
        f"{'on' if a.kl_metric else 'off'}; load average "
        f"{load0[0]:.1f} before, {load1[0]:.1f} after"
    )
    print()
    head = " | ".join(f"{x} s | {x} / ours" for x in others)
    print(f"| model | phase | ours s | {head} |")
    print("|---|---|---|" + "---|---|" * len(others))
    for name, res in results.items():
        o = res["ours"]
        for ph in ("rollout", "reward", "update", "step"):
            cells = []
            for x in others:
                ratio = res[x][ph] / o[ph] if o[ph] > 0 else float("inf")
                cells.append(f"{res[x][ph]:.3f} | {ratio:.2f}x")
            print(f"| {name} | {ph} | {o[ph]:.3f} | {' | '.join(cells)} |")
    print()
    print("Share of the step outside model forwards/backward (transformer, VAE decoder, text")
    print("encoders):")
    print()
    print("| model | " + " | ".join(sides) + " |\n|---|" + "---|" * len(sides))
    for name, res in results.items():
        shares = [f"{1 - res[x]['model'] / res[x]['step']:.0%}" for x in sides]
        print(f"| {name} | " + " | ".join(shares) + " |")
    print()

    def per_side(label: str, key: str, fmt: str) -> None:
        cells = (
            f"{name}: " + ", ".join(f"{x} {format(res[x][key], fmt)}" for x in sides)
            for name, res in results.items()
        )
        print(f"{label}: " + "; ".join(cells))

    if "reference" in sides:  # each of our sides against the reference, per step
        for name, res in results.items():
            ref = res["reference"]["step"]
            cells = ", ".join(f"{x} {ref / res[x]['step']:.2f}x" for x in sides if x != "reference")
            print(f"reference / ours per step, {name}: {cells}")
        print()
    per_side("seconds per step inside backward()", "backward", ".3f")
    per_side("transformer rows forwarded per step (equal work)", "rows", "g")
    if a.device.startswith("cuda"):
        per_side(
            "peak GPU memory per process, GiB (torch.cuda.max_memory_allocated)", "peak_gib", ".1f"
        )
    per_side("torch threads (median)", "threads", "g")
    return 0


if __name__ == "__main__":
    sys.exit(main())
