"""Updates on the forward (noising) process: DiffusionNFT and online Diffusion-DPO.

The FlowGRPO family (`LocalTrainer.update`) replays the SDE window and needs each step's
log-probability. These two objectives need none: they take the rollout's clean final latents
``x0`` and noise them again,

    x_t = (1 - t) x0 + t eps,      t ~ U[lo, hi],  eps ~ N(0, I)

(the rectified-flow interpolation; the velocity target is ``eps - x0``), then compare the
policy's velocity at ``(x_t, t)`` with a frozen one:

- ``diffusion_nft`` (Zheng et al. 2025, arXiv 2509.16117): against the rollout policy's own
  velocity (computed once, before the first optimizer step, so it is the sampling policy), with
  each sample's group advantage turned into an optimality probability
  (`omni_algos.losses.diffusion_nft`). Any sampler works for the rollout.
- ``diffusion_dpo`` (Wallace et al. 2023, arXiv 2311.12908), online: per prompt group the
  best- and worst-rewarded samples form a pair (`omni_algos.losses.pair_by_reward`); winner and
  loser share ``t`` and ``eps``; the reference is the base model with the LoRA disabled.

Each clean sample is noised ``algorithm.train_timesteps`` times per pass. ``t`` and ``eps``
are drawn from a generator seeded by (run seed, step), so a resumed run draws what an
uninterrupted run would.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .errors import NonFiniteError, TrainError
from .recipe import FORWARD_PROCESS_LOSSES
from .seeds import DOMAIN_FORWARD, DOMAIN_MINIBATCH, derive_seed

if TYPE_CHECKING:
    from .trainer import LocalTrainer, StepBatch

__all__ = ["FORWARD_PROCESS_LOSSES", "forward_process_update", "noise_to"]


def noise_to(x0: torch.Tensor, t: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """``x_t = (1 - t) x0 + t eps`` with ``t`` of shape (B,) broadcast over the other dims."""
    tt = t.reshape(-1, *([1] * (x0.ndim - 1)))
    return (1 - tt) * x0 + tt * eps


def _draw(
    shape: tuple[int, ...], k: int, t_range: tuple[float, float], generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``k`` draws of (t, eps) for a batch of ``shape``: t (k, B), eps (k, *shape)."""
    lo, hi = t_range
    t = lo + (hi - lo) * torch.rand((k, shape[0]), generator=generator)
    eps = torch.randn((k, *shape), generator=generator)
    return t, eps


def _chunked(fn: Callable[[torch.Tensor], torch.Tensor], n: int, size: int) -> torch.Tensor:
    """``fn(rows)`` over ``range(n)`` in chunks of ``size`` rows (no-grad passes at full size
    would otherwise hold every row's activations at once)."""
    return torch.cat([fn(torch.arange(i, min(i + size, n))) for i in range(0, n, size)])


def forward_process_update(trainer: LocalTrainer, batch: StepBatch, step: int) -> dict[str, float]:
    """One rollout batch's optimizer steps for `diffusion_nft` or `diffusion_dpo`."""
    from diffusion_rollout import stack_conditions

    trajs = batch.trajectories
    if any(t.final_latent is None for t in trajs):
        raise TrainError(
            "rollout: the forward-process losses train on the final latents; the rollout "
            "returned none (SamplingParams.output must be 'latent' or 'both')"
        )
    x0 = torch.stack([t.final_latent for t in trajs]).float()
    cond = stack_conditions([t.condition for t in trajs])
    r = trainer.recipe
    g = torch.Generator().manual_seed(derive_seed(r.trainer.seed, step, 0, DOMAIN_FORWARD))
    if r.algorithm.name == "diffusion_nft":
        return _nft_update(trainer, batch, step, x0, cond, g)
    return _dpo_update(trainer, batch, step, x0, cond, g)


def _rows(cond: dict[str, torch.Tensor], idx: torch.Tensor) -> dict[str, torch.Tensor]:
    return {k: v[idx] for k, v in cond.items()}


class _Steps:
    """Optimizer steps with the loop's checks, metrics accumulated as means."""

    def __init__(self, trainer: LocalTrainer, batch: StepBatch, step: int) -> None:
        self.trainer, self.batch, self.step = trainer, batch, step
        self.params = list(trainer.params_named.values())
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def acc(self, key: str, value: float) -> None:
        self.sums[key] = self.sums.get(key, 0.0) + float(value)
        self.counts[key] = self.counts.get(key, 0) + 1

    def backward(self, out: Any, scale: float, where: str) -> float:
        if not torch.isfinite(out.loss):
            path = self.trainer.save_bad_samples(self.batch, self.step, self.batch.rewards, "loss")
            raise NonFiniteError(
                f"step {self.step}: loss is {float(out.loss)} ({where}); samples saved to {path}"
            )
        (out.loss * scale).backward()
        for name, val in out.metrics.items():
            self.acc(f"actor/{name}", val)
        return float(out.loss.detach()) * scale

    def optimizer_step(self, loss: float) -> None:
        t = self.trainer
        gn = torch.nn.utils.clip_grad_norm_(self.params, t.recipe.optimizer.grad_clip)
        if not torch.isfinite(gn):
            path = t.save_bad_samples(self.batch, self.step, self.batch.rewards, "grad")
            raise NonFiniteError(
                f"step {self.step}: gradient norm is {float(gn)}; samples saved to {path}"
            )
        t.optimizer.step()
        t.optimizer.zero_grad(set_to_none=True)
        if t.ema:
            t.adapter.ema_adapter("default", "ema", t.recipe.optimizer.ema_decay)
        self.acc("loss", loss)
        self.acc("actor/grad_norm", float(gn))

    def metrics(self) -> dict[str, float]:
        return {k: self.sums[k] / self.counts[k] for k in self.sums}


def _minibatches(n: int, trainer: LocalTrainer, step: int, epoch: int) -> list[torch.Tensor]:
    a = trainer.recipe.algorithm
    g = torch.Generator().manual_seed(
        derive_seed(trainer.recipe.trainer.seed, step, epoch, DOMAIN_MINIBATCH)
    )
    perm = torch.randperm(n, generator=g) if a.num_minibatches > 1 else torch.arange(n)
    size = max(1, n // a.num_minibatches)
    return [perm[i * size : (i + 1) * size] for i in range(min(a.num_minibatches, n))]


def _nft_update(
    trainer: LocalTrainer,
    batch: StepBatch,
    step: int,
    x0: torch.Tensor,
    cond: dict[str, torch.Tensor],
    g: torch.Generator,
) -> dict[str, float]:
    from omni_algos.advantages import group_advantages

    r, a, adapter = trainer.recipe, trainer.recipe.algorithm, trainer.adapter
    params, chunk = trainer.params, r.rollout.max_num_seqs
    rewards = torch.as_tensor(batch.rewards, dtype=torch.float32)
    adv = group_advantages(rewards, torch.as_tensor(batch.group_ids), std=a.adv_std)
    B, K = x0.shape[0], a.train_timesteps
    t, eps = _draw(tuple(x0.shape), K, tuple(a.timestep_range), g)
    x_t = torch.stack([noise_to(x0, t[k], eps[k]) for k in range(K)])

    def frozen(k: int) -> torch.Tensor:
        return _chunked(
            lambda i: adapter.velocity(x_t[k][i], t[k][i], _rows(cond, i), params), B, chunk
        )

    with torch.no_grad():  # the rollout policy: the weights before this batch's first step
        old_v = [frozen(k) for k in range(K)]
        ref_v = None
        if float(a.options.get("kl_weight", 0.0)) > 0:
            if not r.lora.enabled:
                raise TrainError("algorithm.options.kl_weight > 0 needs lora.enabled")
            with adapter.disabled_adapters():
                ref_v = [frozen(k) for k in range(K)]

    steps = _Steps(trainer, batch, step)
    trainer.optimizer.zero_grad(set_to_none=True)
    for epoch in range(a.epochs):
        for m, idx in enumerate(_minibatches(B, trainer, step, epoch)):
            loss = 0.0
            for k in range(K):
                v = adapter.replay_velocity(x_t[k][idx], t[k][idx], _rows(cond, idx), params)
                out = trainer.loss_fn(
                    v,
                    old_v[k][idx],
                    x_t[k][idx],
                    x0[idx],
                    t[k][idx],
                    adv[idx],
                    ref_velocity=None if ref_v is None else ref_v[k][idx],
                    adv_clip_max=a.adv_clip_max,
                    **a.options,
                )
                loss += steps.backward(out, 1.0 / K, f"timestep draw {k}, minibatch {m}")
            steps.optimizer_step(loss)
    metrics = steps.metrics()
    metrics["actor/adv_abs_mean"] = float(adv.abs().mean())
    metrics["actor/t_mean"] = float(t.mean())
    return metrics


def _dpo_update(
    trainer: LocalTrainer,
    batch: StepBatch,
    step: int,
    x0: torch.Tensor,
    cond: dict[str, torch.Tensor],
    g: torch.Generator,
) -> dict[str, float]:
    from omni_algos.losses import pair_by_reward

    r, a, adapter = trainer.recipe, trainer.recipe.algorithm, trainer.adapter
    params, chunk = trainer.params, r.rollout.max_num_seqs
    win, lose = pair_by_reward(batch.rewards, batch.group_ids)
    P, K = len(win), a.train_timesteps
    if P == 0:  # every group tied: nothing to prefer, no step
        return {"actor/pairs": 0.0}
    t, eps = _draw((P, *x0.shape[1:]), K, tuple(a.timestep_range), g)
    # winner and loser of a pair share (t, eps): rows [0, P) are winners, [P, 2P) losers
    rows = torch.cat([win, lose])
    x0_pair = x0[rows]
    c_pair = _rows(cond, rows)
    t2 = torch.cat([t, t], dim=1)
    x_t = torch.stack([noise_to(x0_pair, t2[k], torch.cat([eps[k], eps[k]])) for k in range(K)])

    with torch.no_grad(), adapter.disabled_adapters():
        ref_v = [
            _chunked(
                lambda i, k=k: adapter.velocity(x_t[k][i], t2[k][i], _rows(c_pair, i), params),
                2 * P,
                chunk,
            )
            for k in range(K)
        ]

    steps = _Steps(trainer, batch, step)
    trainer.optimizer.zero_grad(set_to_none=True)
    for epoch in range(a.epochs):
        for m, pidx in enumerate(_minibatches(P, trainer, step, epoch)):
            both = torch.cat([pidx, pidx + P])  # the minibatch's winners, then their losers
            n = len(pidx)
            loss = 0.0
            for k in range(K):
                v = adapter.replay_velocity(x_t[k][both], t2[k][both], _rows(c_pair, both), params)
                out = trainer.loss_fn(
                    v[:n],
                    v[n:],
                    ref_v[k][pidx],
                    ref_v[k][pidx + P],
                    x0_pair[pidx],
                    x0_pair[pidx + P],
                    eps[k][pidx],
                    **a.options,
                )
                loss += steps.backward(out, 1.0 / K, f"timestep draw {k}, minibatch {m}")
            steps.optimizer_step(loss)
    metrics = steps.metrics()
    metrics["actor/pairs"] = float(P)
    rw = torch.as_tensor(batch.rewards, dtype=torch.float64)
    metrics["actor/pair_reward_gap"] = float((rw[win] - rw[lose]).mean())
    return metrics
