"""Flow-matching reverse steps with log-probabilities, and SDE-window placement.

Conventions (see docs/interfaces.md): sigmas are flow-matching noise levels in [0, 1],
``x_sigma = (1 - sigma) x0 + sigma eps`` and the velocity is ``v = eps - x0``, so the ODE step
is ``x_next = x + (sigma_next - sigma) v``. Steps go from high to low sigma, so
``dt = sigma_next - sigma <= 0``.

Every computation runs in ``max(float32, input dtype)``: bfloat16/float16 inputs are computed
in float32, float64 inputs (used by gradient checks) stay float64.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "SDE_KINDS",
    "SDEStep",
    "mix_grpo_window",
    "sample_windows",
    "step",
]

SDE_KINDS = ("sde", "cps", "dance", "ode")

_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


@dataclass
class SDEStep:
    """Result of one reverse step.

    Attributes:
        prev_sample: the next (less noisy) sample, shape of the input, compute dtype.
        log_prob: per-element log-density of ``prev_sample`` averaged over all non-batch
            dims, shape (B,).
        mean: the mean of the step's Gaussian, shape of the input.
        std: the kind's noise scale ``s`` (see :func:`step`), shape (B,).
        sqrt_dt: ``sqrt(sigma - sigma_next)``, shape (B,).
    """

    prev_sample: Tensor
    log_prob: Tensor
    mean: Tensor
    std: Tensor
    sqrt_dt: Tensor


def _compute_dtype(*tensors: Tensor) -> torch.dtype:
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    if not dtype.is_floating_point or dtype in (torch.float16, torch.bfloat16):
        dtype = torch.float32
    return dtype


def _per_row(value: float | Tensor, name: str, batch: int, dtype: torch.dtype, device) -> Tensor:
    """A float, 0-d tensor or (B,) tensor as a (B,) tensor in the compute dtype."""
    if isinstance(value, Tensor):
        if value.ndim == 0 or (value.ndim == 1 and value.shape[0] == 1 and batch != 1):
            return value.reshape(()).to(device=device, dtype=dtype).expand(batch)
        if value.ndim != 1 or value.shape[0] != batch:
            raise ValueError(
                f"{name} must be a float or a tensor of shape ({batch},) (one per row); "
                f"got shape {tuple(value.shape)}"
            )
        return value.to(device=device, dtype=dtype)
    if isinstance(value, (int, float)):
        return torch.full((batch,), float(value), dtype=dtype, device=device)
    raise TypeError(f"{name} must be a float or a tensor, got {type(value).__name__}")


def _bcast(row: Tensor, ndim: int) -> Tensor:
    return row.reshape(row.shape[0], *([1] * (ndim - 1)))


def _draw_noise(
    sample: Tensor,
    generator: torch.Generator | Sequence[torch.Generator] | None,
    dtype: torch.dtype,
) -> Tensor:
    """Standard normal noise of ``sample``'s shape.

    A list of generators gives row ``b`` the draw
    ``torch.randn(sample.shape[1:], generator=generator[b], dtype=float32)`` on the generator's
    device, moved to ``sample.device``: a row's noise never depends on its batch neighbours.
    """
    if generator is None:
        noise = torch.randn(sample.shape, dtype=torch.float32, device=sample.device)
    elif isinstance(generator, torch.Generator):
        noise = torch.randn(
            sample.shape, generator=generator, dtype=torch.float32, device=generator.device
        )
    else:
        gens = list(generator)
        if len(gens) != sample.shape[0]:
            raise ValueError(
                f"generator: got a list of {len(gens)} generators for a batch of "
                f"{sample.shape[0]} rows (one generator per row is required)"
            )
        noise = torch.stack(
            [
                torch.randn(sample.shape[1:], generator=g, dtype=torch.float32, device=g.device).to(
                    sample.device
                )
                for g in gens
            ]
        )
    return noise.to(device=sample.device, dtype=dtype)


def _gaussian_log_prob(prev: Tensor, mean: Tensor, step_std: Tensor) -> Tensor:
    """Per-row mean over non-batch dims of log N(prev; mean, step_std^2).

    ``step_std`` is (B,). Rows with ``step_std == 0`` are deterministic steps: log_prob 0.
    """
    nd = prev.ndim
    zero = step_std <= 0
    safe = torch.where(zero, torch.ones_like(step_std), step_std)
    s = _bcast(safe, nd)
    lp = -((prev.detach() - mean) ** 2) / (2.0 * s**2) - torch.log(s) - _LOG_SQRT_2PI
    lp = lp.mean(dim=tuple(range(1, nd))) if nd > 1 else lp
    return torch.where(zero, torch.zeros_like(lp), lp)


def step(
    sample: Tensor,
    velocity: Tensor,
    sigma: float | Tensor,
    sigma_next: float | Tensor,
    *,
    noise_level: float,
    kind: str = "sde",
    prev_sample: Tensor | None = None,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    sigma_max: float | Tensor | None = None,
) -> SDEStep:
    r"""One reverse step from ``sigma`` to ``sigma_next`` with the log-density of the result.

    With x the sample, v the velocity, dt = sigma_next - sigma (<= 0) and eta = noise_level:

    - ``"sde"`` (Flow-GRPO, Liu et al. 2025, arXiv 2505.05470; the reverse SDE with the
      marginals of the flow ODE):
      ``s = eta sqrt(sigma / (1 - sigma'))`` with ``sigma' = sigma_max`` where ``sigma == 1``
      (else ``sigma``); ``mean = x (1 + s^2 dt / (2 sigma)) + v (1 + s^2 (1 - sigma) /
      (2 sigma)) dt``; ``prev = mean + s sqrt(-dt) eps``; Gaussian log-density with std
      ``s sqrt(-dt)`` and its normaliser. ``std`` returns ``s``. ``sigma_max`` defaults to
      ``sigma_next``, which is Flow-GRPO's choice (``sigmas[1]``) for the first step.
    - ``"cps"`` (coefficients-preserving sampling, Wang & Yu 2025, arXiv 2509.05952):
      ``s = sigma_next sin(eta pi / 2)``; ``x0 = x - sigma v``; ``eps_hat = x + (1 - sigma) v``;
      ``mean = x0 (1 - sigma_next) + eps_hat sqrt(sigma_next^2 - s^2)``;
      ``prev = mean + s eps``; ``log_prob = -mean_dims (prev - mean)^2`` (no variance scaling,
      no normaliser: the convention Flow-GRPO-CPS tunes its clip range to). ``std`` returns ``s``.
    - ``"dance"`` (DanceGRPO, Xue et al. 2025, arXiv 2505.07818):
      ``x0 = x - sigma v``; ``score = -(x - x0 (1 - sigma)) / sigma^2``;
      ``mean = x + dt v - eta^2 score dt / 2``; ``s = eta sqrt(sigma - sigma_next)``;
      ``prev = mean + s eps``; Gaussian log-density with std ``s`` and normaliser.
      ``std`` returns ``s``.
    - ``"ode"``: ``mean = prev = x + v dt``, ``log_prob = 0``, ``std = 0``.

    With ``noise_level == 0`` every kind is the ODE step and draws no noise. A row whose step
    std is 0 (noise level 0, ``sigma == sigma_next``, or ``cps`` at ``sigma_next == 0``) is
    deterministic; the Gaussian kinds give it ``log_prob = 0``.

    Args:
        sample: x at ``sigma``, shape (B, ...).
        velocity: the model's velocity at (x, sigma), same shape.
        sigma, sigma_next: a float or a per-row tensor of shape (B,).
        noise_level: eta above (>= 0).
        kind: one of ``"sde"``, ``"cps"``, ``"dance"``, ``"ode"``.
        prev_sample: if given, nothing is sampled: the log-density of this sample is returned
            (the trainer's replay of a stored step). Gradients flow through ``mean`` only.
        generator: one ``torch.Generator`` (one draw of the full shape) or a list of one
            generator per row (row b draws ``torch.randn(sample.shape[1:], generator=g[b])``
            in float32 on the generator's device). None uses the global RNG.
        sigma_max: ``sigma'`` for rows with ``sigma == 1`` (kind ``"sde"`` only).

    Returns:
        ``SDEStep(prev_sample, log_prob, mean, std, sqrt_dt)``; ``log_prob``, ``std`` and
        ``sqrt_dt`` have shape (B,). Computed in ``max(float32, input dtype)``.
    """
    if kind not in SDE_KINDS:
        raise ValueError(f"kind must be one of {SDE_KINDS}, got {kind!r}")
    if not isinstance(sample, Tensor) or not isinstance(velocity, Tensor):
        raise TypeError("sample and velocity must be tensors")
    if sample.ndim < 1:
        raise ValueError("sample must have a batch dimension, got a 0-d tensor")
    if velocity.shape != sample.shape:
        raise ValueError(
            f"velocity shape {tuple(velocity.shape)} != sample shape {tuple(sample.shape)}"
        )
    if prev_sample is not None and prev_sample.shape != sample.shape:
        raise ValueError(
            f"prev_sample shape {tuple(prev_sample.shape)} != sample shape {tuple(sample.shape)}"
        )
    noise_level = float(noise_level)
    if not math.isfinite(noise_level) or noise_level < 0:
        raise ValueError(f"noise_level must be a finite number >= 0, got {noise_level}")

    dtype = _compute_dtype(sample, velocity)
    device = sample.device
    batch, nd = sample.shape[0], sample.ndim
    x = sample.to(dtype)
    v = velocity.to(dtype)
    sig = _per_row(sigma, "sigma", batch, dtype, device)
    sig_n = _per_row(sigma_next, "sigma_next", batch, dtype, device)
    if bool((sig_n > sig).any()):
        raise ValueError(
            "sigma_next must be <= sigma (steps go from noise to data); got "
            f"sigma={sig.tolist()} sigma_next={sig_n.tolist()}"
        )
    if kind in ("sde", "dance") and noise_level > 0 and bool((sig <= 0).any()):
        raise ValueError(f"sigma must be > 0 for kind {kind!r}, got {sig.tolist()}")

    dt_row = sig_n - sig
    sqrt_dt_row = torch.sqrt(-dt_row)
    dt = _bcast(dt_row, nd)
    sb = _bcast(sig, nd)
    sb_n = _bcast(sig_n, nd)

    if kind == "ode" or noise_level == 0.0:
        mean = x + v * dt
        std_row = torch.zeros(batch, dtype=dtype, device=device)
        prev = mean if prev_sample is None else prev_sample.to(dtype)
        log_prob = torch.zeros(batch, dtype=dtype, device=device)
        return SDEStep(prev, log_prob, mean, std_row, sqrt_dt_row)

    if kind == "sde":
        if sigma_max is None:
            sig_max = sig_n
        else:
            sig_max = _per_row(sigma_max, "sigma_max", batch, dtype, device)
        sig_p = torch.where(sig == 1, sig_max, sig)
        if bool((sig_p >= 1).any()):
            raise ValueError(
                "kind 'sde' needs sigma_max < 1 for rows with sigma == 1 "
                f"(got sigma={sig.tolist()}, sigma_max={sig_max.tolist()})"
            )
        std_row = noise_level * torch.sqrt(sig / (1 - sig_p))
        s = _bcast(std_row, nd)
        mean = x * (1 + s**2 / (2 * sb) * dt) + v * (1 + s**2 * (1 - sb) / (2 * sb)) * dt
        step_std = std_row * sqrt_dt_row
    elif kind == "cps":
        std_row = sig_n * math.sin(noise_level * math.pi / 2)
        s = _bcast(std_row, nd)
        x0 = x - sb * v
        eps_hat = x + (1 - sb) * v
        mean = x0 * (1 - sb_n) + eps_hat * torch.sqrt(torch.clamp(sb_n**2 - s**2, min=0))
        step_std = std_row
    else:  # dance
        x0 = x - sb * v
        score = -(x - x0 * (1 - sb)) / sb**2
        mean = x + dt * v - 0.5 * noise_level**2 * score * dt
        std_row = noise_level * sqrt_dt_row
        step_std = std_row

    if prev_sample is None:
        noise = _draw_noise(sample, generator, dtype)
        prev = mean + _bcast(step_std, nd) * noise
    else:
        prev = prev_sample.to(dtype)

    if kind == "cps":
        diff2 = (prev.detach() - mean) ** 2
        log_prob = -(diff2.mean(dim=tuple(range(1, nd))) if nd > 1 else diff2)
    else:
        log_prob = _gaussian_log_prob(prev, mean, step_std)
    return SDEStep(prev, log_prob, mean, std_row, sqrt_dt_row)


def sample_windows(
    generators: Sequence[torch.Generator],
    num_steps: int,
    size: int | None = None,
    low: int = 0,
    high: int | None = None,
) -> list[tuple[int, int]]:
    """One contiguous SDE window ``(start, end)`` (end exclusive) of ``size`` steps per row.

    Row ``b``'s start is ``torch.randint(low, high - size + 1, (1,), generator=generators[b])``,
    i.e. uniform in ``[low, high - size]``, so a row's window depends only on its own
    generator (Flow-GRPO-Fast / MixGRPO-style partial SDE sampling; steps outside the window
    are ODE steps). ``size=None`` means every step but the last, ``(0, num_steps - 1)``, and
    draws nothing. ``high`` defaults to ``num_steps``.
    """
    num_steps = int(num_steps)
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if size is None:
        return [(0, max(num_steps - 1, 1))] * len(generators)
    high = num_steps if high is None else int(high)
    low, size = int(low), int(size)
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    if not 0 <= low < high <= num_steps:
        raise ValueError(
            f"need 0 <= low < high <= num_steps, got low={low} high={high} num_steps={num_steps}"
        )
    if high - low < size:
        raise ValueError(f"size={size} does not fit in the range [low={low}, high={high})")
    out = []
    for g in generators:
        start = int(torch.randint(low, high - size + 1, (1,), generator=g).item())
        out.append((start, start + size))
    return out


def mix_grpo_window(
    global_step: int,
    num_steps: int,
    size: int,
    *,
    placement: str = "progressive",
    seed: int = 0,
    shift_interval: int = 25,
    stride: int = 1,
    low: int = 0,
    high: int | None = None,
) -> tuple[int, int]:
    """MixGRPO's window placement (Li et al. 2025, arXiv 2507.21802): one window shared by the
    whole batch at a given training step.

    - ``"progressive"``: the sliding window of MixGRPO. It starts at ``low`` and moves by
      ``stride`` steps every ``shift_interval`` training steps, stopping at ``high - size``:
      ``start = min(low + (global_step // shift_interval) * stride, high - size)``.
    - ``"random"``: a shared random window, start uniform in ``[low, high - size]`` drawn
      from ``torch.Generator().manual_seed(seed + global_step)``.

    Returns ``(start, end)`` with ``end = start + size`` (exclusive).
    """
    high = num_steps if high is None else int(high)
    if size < 1 or high - low < size or not 0 <= low < high <= num_steps:
        raise ValueError(
            f"bad MixGRPO window: size={size} low={low} high={high} num_steps={num_steps}"
        )
    if global_step < 0:
        raise ValueError(f"global_step must be >= 0, got {global_step}")
    if placement == "progressive":
        if shift_interval < 1 or stride < 0:
            raise ValueError(
                f"shift_interval must be >= 1 and stride >= 0, got {shift_interval}, {stride}"
            )
        start = min(low + (global_step // shift_interval) * stride, high - size)
    elif placement == "random":
        g = torch.Generator().manual_seed(int(seed) + int(global_step))
        start = int(torch.randint(low, high - size + 1, (1,), generator=g).item())
    else:
        raise ValueError(f"placement must be 'progressive' or 'random', got {placement!r}")
    return (start, start + size)
