"""One wave of the rollout: the shared-forward denoising loop with per-row randomness.

Every random draw of a request comes from its own ``torch.Generator("cpu").manual_seed(seed)``,
in the order of docs/interfaces.md:

1. the SDE window start (``omni_algos.sde.sample_windows``),
2. the initial latents (``denoiser.init_latents(..., generators=[g, ...])``, one row per g),
3. the SDE noise of each window step, in step order (``omni_algos.sde.step`` with one
   generator per row). Steps outside a row's window are ODE steps
   ``x_next = x + (sigma_next - sigma) v`` and draw nothing. With
   ``params.ode_stride_after_window = k > 1`` the steps after the last window of the wave
   jump k schedule steps per forward with DPM-Solver++(2M) (`omni_algos.ode`).

Rows of one wave may have different SDE kinds, noise levels and windows: after each shared
forward the rows in their window are grouped by (kind, noise level) for the step. Used by
`EmbeddedEngine` and by the vllm-omni pipeline, so both produce the same trajectories.

Image-conditioned denoisers (``needs_images = True``, e.g. Qwen-Image-Edit) get the requests'
``RolloutRequest.image`` as ``encode(prompts, negatives, images=...)``: one uint8
``(B, H, W, 3)`` tensor when every request has one image of the same size, else a list of
``(H, W, 3)`` tensors (the denoiser resizes them to its condition size); when requests carry
lists of images (Qwen-Image-Edit-Plus), a list with each row's list of ``(H, W, 3)`` tensors.
A wave's requests carry images all or none, and the same number of them.

Each distinct (prompt, negative prompt, condition images) of a wave is encoded once: the n
samples of a prompt share its rows. ``encode`` gets the wave's ``params=``, so a denoiser
can skip the negative branch when guidance is off.

``differentiable=True`` keeps the autograd graph of the SDE steps, for a trainer that
back-propagates through the rollout's own forwards instead of replaying them (one optimizer
step on the rollout's weights: the replay would recompute these very forwards). At a step
where some rows are inside their SDE window (a Gaussian kind with noise level > 0), those
rows' forward runs with autograd and the others' without; the sample is drawn from the
detached velocity, and the log-prob is then computed for that fixed sample, as the replay
computes it (``sde.step(..., prev_sample=...)``): so ``Trajectory.log_probs`` is
differentiable in the denoiser's trainable weights through each step's own velocity only
(every step's input is detached), with the values of the no-grad rollout. Every other
forward (ODE steps, the tail, the encoders) runs without autograd. ``grad_denoiser`` (a
second denoiser with the same weights, e.g. the trainer's unmerged LoRA policy while
``denoiser`` is its merged rollout copy) runs the forwards with autograd, so the gradient
reaches the trainer's own parameters while every other forward keeps the merged weights' cost.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from omni_algos import ode, sde

from .params import RolloutRequest
from .types import Denoiser, Trajectory

__all__ = ["check_images", "denoise_wave"]


def check_images(
    denoiser: Any, requests: Sequence[RolloutRequest], where: str = "requests"
) -> bool:
    """Check the requests' condition images against the denoiser; True when they carry images.

    All or none of ``requests`` may carry ``image``; a denoiser with ``needs_images = True``
    needs them, any other refuses them. Errors are ValueErrors naming ``where`` and the field.
    """
    has = [r.image is not None for r in requests]
    name = type(denoiser).__name__
    if any(has) and not all(has):
        i, j = has.index(True), has.index(False)
        raise ValueError(
            f"{where}: requests[{i}] carries RolloutRequest.image but requests[{j}] does not; "
            "the requests of one wave carry a condition image all or none"
        )
    needs = bool(getattr(denoiser, "needs_images", False))
    if needs and not any(has):
        raise ValueError(
            f"{where}: RolloutRequest.image is required: the denoiser ({name}) is "
            "image-conditioned (needs_images) and needs a uint8 (H, W, 3) condition image per "
            "request"
        )
    if any(has) and not needs:
        raise ValueError(
            f"{where}: RolloutRequest.image was given but the denoiser ({name}) takes no "
            "condition images (it has no needs_images = True)"
        )
    counts = [r.num_images for r in requests]
    if any(c != counts[0] for c in counts):
        i = next(i for i, c in enumerate(counts) if c != counts[0])
        raise ValueError(
            f"{where}: requests[{i}] carries {counts[i]} condition images in RolloutRequest.image "
            f"but requests[0] carries {counts[0]}; the requests of one wave carry the same number"
        )
    return any(has)


def _as_tensor(image: np.ndarray | Tensor) -> Tensor:
    if isinstance(image, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(image))
    return image.detach().cpu()


def _stack_images(requests: Sequence[RolloutRequest]) -> Tensor | list:
    if any(isinstance(r.image, list) for r in requests):
        return [
            [_as_tensor(im) for im in (r.image if isinstance(r.image, list) else [r.image])]
            for r in requests
        ]
    rows = [_as_tensor(r.image) for r in requests]  # type: ignore[arg-type]
    if all(t.shape == rows[0].shape for t in rows):
        return torch.stack(rows)
    return rows


def denoise_wave(
    denoiser: Denoiser,
    requests: Sequence[RolloutRequest],
    *,
    version: int = 0,
    t_start: float | None = None,
    t_submit: Sequence[float] | None = None,
    cancelled: Callable[[int], bool] | None = None,
    differentiable: bool = False,
    grad_denoiser: Denoiser | None = None,
) -> tuple[list[Trajectory | None], int, float]:
    """Denoise one wave of compatible requests; every forward sees all rows.

    Returns ``(trajectories, forwards, step_seconds)``, trajectories in request order. The
    requests must share ``params.compat_key()`` (up to the weights version); see the module
    docstring for the per-request random draws. Run it under ``torch.no_grad()``.

    ``cancelled(i)`` (optional) is asked at every step boundary whether request ``i`` should
    stop; a stopped row leaves the wave there (the rest go on without it, their results
    unchanged) and its trajectory is None.

    ``differentiable``: keep the autograd graph of the SDE steps' log-probs (module
    docstring); autograd is switched on here for them, whatever the caller's grad mode.
    ``grad_denoiser``: the denoiser those autograd forwards run on (default ``denoiser``;
    module docstring).
    """
    if differentiable:
        with torch.enable_grad():
            return _denoise(
                denoiser,
                requests,
                version,
                t_start,
                t_submit,
                cancelled,
                differentiable=True,
                grad_den=grad_denoiser,
            )
    return _denoise(denoiser, requests, version, t_start, t_submit, cancelled)


def _denoise(
    den: Denoiser,
    requests: Sequence[RolloutRequest],
    version: int,
    t_start: float | None,
    t_submit: Sequence[float] | None,
    cancelled: Callable[[int], bool] | None,
    differentiable: bool = False,
    grad_den: Denoiser | None = None,  # the forwards with autograd (default: den)
) -> tuple[list[Trajectory | None], int, float]:
    # without autograd unless `differentiable` asks for it at an SDE step
    no_grad = torch.no_grad if differentiable else contextlib.nullcontext
    reqs = list(requests)
    if not reqs:
        return [], 0, 0.0
    key = reqs[0].params.compat_key()[:-1]
    for i, r in enumerate(reqs):
        if r.params.compat_key()[:-1] != key:
            raise ValueError(
                f"denoise_wave: requests[{i}] is not compatible with requests[0] "
                f"({r.params.compat_key()} vs {reqs[0].params.compat_key()})"
            )
    with_images = check_images(den, reqs, "denoise_wave")
    t_start = time.monotonic() if t_start is None else t_start
    t_submit = [t_start] * len(reqs) if t_submit is None else list(t_submit)
    params = reqs[0].params
    batch = len(reqs)
    num_steps = params.num_steps
    gens = [torch.Generator("cpu").manual_seed(r.seed) for r in reqs]

    # 1. window starts, from each row's own generator (groups of equal window settings).
    windows: list[tuple[int, int]] = [(0, 0)] * batch
    groups: dict[tuple, list[int]] = defaultdict(list)
    for b, r in enumerate(reqs):
        groups[(r.params.sde_window_size, r.params.window_range())].append(b)
    for (size, (low, high)), rows in groups.items():
        got = sde.sample_windows([gens[b] for b in rows], num_steps, size, low, high)
        for b, w in zip(rows, got):
            windows[b] = (int(w[0]), int(w[1]))

    # Rows are packed sorted by (kind, noise level, window size, window start): then at every
    # step the rows inside their window form one contiguous block per (kind, noise level,
    # size), so the step works on views (no gather/scatter); results are returned in the
    # request order. A row's result does not depend on its position in the batch.
    def sort_key(b: int) -> tuple:
        p = reqs[b].params
        s, e = windows[b]
        return (p.sde_kind, p.noise_level, e - s, s)

    order = sorted(range(batch), key=sort_key)
    reqs_s = [reqs[b] for b in order]
    gens_s = [gens[b] for b in order]
    win_s = [windows[b] for b in order]

    # 2. initial latents (row k from gens_s[k]) and the condition.
    t0 = time.monotonic()
    with no_grad():
        x = den.init_latents(batch, params, gens_s)
    if not isinstance(x, Tensor) or x.shape[0] != batch:
        raise ValueError(
            f"denoiser.init_latents returned {getattr(x, 'shape', type(x))}, expected a "
            f"tensor with {batch} rows"
        )
    x = x.to(torch.float32)
    # Encode once per unique (prompt, negative prompt, condition images): the n samples of a
    # prompt share one row of the encoders' output. `cond` has one row per wave row (the
    # forwards need it batch-first); `row_u[k]` is row k's row in `cond_u`, which the
    # trajectories keep (views, so n samples share one copy).
    uniq, row_u = _unique_rows(reqs_s)
    with no_grad():
        cond_u = _encode(den, [reqs_s[k] for k in uniq], params, with_images)
    cond = _expand(cond_u, row_u)
    sig_all = den.sigmas(params).to(device=x.device, dtype=torch.float32)
    if sig_all.shape != (num_steps + 1,):
        raise ValueError(
            f"denoiser.sigmas returned shape {tuple(sig_all.shape)}, expected ({num_steps + 1},)"
        )
    t1 = time.monotonic()

    plan = _step_plan(reqs_s, win_s, num_steps)
    first = min(s for s, _ in win_s)
    last = max(e for _, e in win_s)

    xs: list[Tensor | None] = [None] * (num_steps + 1)  # x at each step inside some window
    lps: list[Tensor | None] = [None] * num_steps  # (batch,) log-probs of each step
    forwards = 0
    step_s = 0.0
    stride = params.ode_stride_after_window
    x0_prev: Tensor | None = None  # DPM-Solver++(2M) history of the tail
    sig_prev: float | None = None
    i = 0
    while i < num_steps:
        # Step boundary: rows whose request was cancelled (client gone, deadline) leave the
        # wave here, so the next forward runs without them. Kept rows stay in sorted order,
        # so the plan's window blocks stay contiguous.
        if cancelled is not None:
            keep = [k for k in range(batch) if not cancelled(order[k])]
            if not keep:
                return [None] * len(reqs), forwards, step_s
            if len(keep) < batch:
                idx = torch.tensor(keep, device=x.device)
                x = x.index_select(0, idx)
                cond = {key: t.index_select(0, idx.to(t.device)) for key, t in cond.items()}
                row_u = [row_u[k] for k in keep]
                xs = [None if t is None else t.index_select(0, idx) for t in xs]
                lps = [None if t is None else t.index_select(0, idx) for t in lps]
                if x0_prev is not None:
                    x0_prev = x0_prev.index_select(0, idx)
                reqs_s = [reqs_s[k] for k in keep]
                gens_s = [gens_s[k] for k in keep]
                win_s = [win_s[k] for k in keep]
                order = [order[k] for k in keep]
                batch = len(keep)
                plan = _step_plan(reqs_s, win_s, num_steps)
        ts = time.monotonic()
        if first <= i <= last:
            xs[i] = x
        if stride > 1 and i >= last:
            # the untrained tail after every row's window: `stride` schedule steps per forward
            j = min(i + stride, num_steps)
            with no_grad():
                v = den.velocity(x, sig_all[i].expand(batch).contiguous(), cond, params)
            forwards += 1
            s_i = float(sig_all[i])
            x, x0_prev = ode.dpm_solver_2m_step(
                x, v.to(torch.float32), s_i, float(sig_all[j]), x0_prev=x0_prev, sigma_prev=sig_prev
            )
            sig_prev = s_i
            step_s += time.monotonic() - ts
            i = j
            continue
        sig, sig_n = sig_all[i], sig_all[i + 1]
        graph_rows = _graph_rows(plan[i]) if differentiable else []
        if graph_rows:
            v = _velocity_with_graph(den, grad_den or den, x, sig, cond, params, graph_rows)
        else:
            with no_grad():
                v = den.velocity(x, sig.expand(batch).contiguous(), cond, params)
            v = v.to(torch.float32)
        forwards += 1
        pieces, lp_pieces = [], []
        for lo, hi, kind, nl in plan[i]:
            xv, vv = (x, v) if hi - lo == batch else (x[lo:hi], v[lo:hi])
            if kind is None:
                pieces.append(xv + (sig_n - sig) * vv)
                lp_pieces.append(None)
            else:
                with no_grad():  # the sample: drawn from the velocity's value
                    out = sde.step(
                        xv,
                        vv.detach(),
                        sig,
                        sig_n,
                        noise_level=nl,
                        kind=kind,
                        generator=gens_s[lo:hi],
                    )
                pieces.append(out.prev_sample)
                if graph_rows and vv.requires_grad:  # its log-prob, through the velocity
                    out = sde.step(
                        xv,
                        vv,
                        sig,
                        sig_n,
                        noise_level=nl,
                        kind=kind,
                        prev_sample=out.prev_sample,
                    )
                lp_pieces.append(out.log_prob)
        x = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        if differentiable:  # the next step starts from the sample, not from its graph
            x = x.detach()
        if any(lp is not None for lp in lp_pieces):
            lps[i] = torch.cat(
                [
                    torch.zeros(hi - lo, dtype=torch.float32, device=x.device)
                    if lp is None
                    else lp.to(torch.float32)
                    for lp, (lo, hi, _, _) in zip(lp_pieces, plan[i])
                ]
            )
        step_s += time.monotonic() - ts
        i += 1
    xs[num_steps] = x
    t2 = time.monotonic()

    media = None
    if params.output in ("pixel", "both"):
        with no_grad():
            media = den.decode(x)
    t3 = time.monotonic()

    # Per-row results are views into per-wave tensors (one stack each, no per-row copies).
    lat_all = torch.stack([xs[j] for j in range(first, last + 1)], dim=1)  # (B, T, ...)
    zeros = torch.zeros(batch, dtype=torch.float32, device=x.device)
    logp_all = torch.stack([zeros if lp is None else lp for lp in lps], dim=1)  # (B, steps)
    sig_own = sig_all.clone()
    trajs: list[Trajectory | None] = [None] * len(reqs)
    for k, r in enumerate(reqs_s):
        s, e = win_s[k]
        b = order[k]
        trajs[b] = Trajectory(
            request_id=r.request_id,
            prompt=r.prompt,
            seed=r.seed,
            window=(s, e),
            latents=lat_all[k, s - first : e - first + 1],
            log_probs=logp_all[k, s:e],
            sigmas=sig_own[s:e],
            sigmas_next=sig_own[s + 1 : e + 1],
            final_latent=None if params.output == "pixel" else x[k],
            media=None if media is None else media[k],
            condition={key: t[row_u[k]] for key, t in cond_u.items()},
            version=version,
            timings={
                "queue_s": t_start - t_submit[b],
                "encode_s": t1 - t0,
                "denoise_s": t2 - t1,
                "decode_s": t3 - t2,
                "total_s": t3 - t_submit[b],
            },
            negative_prompt=r.negative_prompt,
            params=r.params,
        )
    return trajs, forwards, step_s


def _graph_rows(segments: list[tuple[int, int, str | None, float]]) -> list[int]:
    """The rows of a step whose log-prob depends on the velocity: inside an SDE window of a
    Gaussian kind with noise (the ODE kind and noise level 0 have log-prob 0)."""
    return [
        k
        for lo, hi, kind, nl in segments
        if kind is not None and kind != "ode" and nl > 0
        for k in range(lo, hi)
    ]


def _velocity_with_graph(
    den: Denoiser,
    grad_den: Denoiser,
    x: Tensor,
    sigma: Tensor,
    cond: dict[str, Tensor],
    params: Any,
    rows: list[int],
) -> Tensor:
    """The velocity of all rows, with autograd (on ``grad_den``) for ``rows`` only, the
    others on ``den`` (float32, row order)."""
    batch = x.shape[0]
    if len(rows) == batch:
        return grad_den.velocity(x, sigma.expand(batch).contiguous(), cond, params).float()
    graph = torch.as_tensor(rows, device=x.device)
    rest = torch.as_tensor(sorted(set(range(batch)) - set(rows)), device=x.device)

    def forward(model: Denoiser, idx: Tensor) -> Tensor:
        sub = {key: t.index_select(0, idx.to(t.device)) for key, t in cond.items()}
        sig = sigma.expand(len(idx)).contiguous()
        return model.velocity(x.index_select(0, idx), sig, sub, params).float()

    v_graph = forward(grad_den, graph)
    with torch.no_grad():
        v_rest = forward(den, rest)
    inverse = torch.argsort(torch.cat([graph, rest]))
    return torch.cat([v_graph, v_rest]).index_select(0, inverse)


def _image_key(image: Any) -> tuple:
    """A hashable key of one request's condition image(s): shape, dtype and a digest of the
    bytes (equal images give equal keys whichever object carries them)."""
    if image is None:
        return ()
    if isinstance(image, list):
        return tuple(_image_key(im) for im in image)
    arr = _as_tensor(image).contiguous().numpy()
    digest = hashlib.blake2b(arr.tobytes(), digest_size=16).hexdigest()
    return (arr.shape, str(arr.dtype), digest)


def _unique_rows(reqs: Sequence[RolloutRequest]) -> tuple[list[int], list[int]]:
    """``(uniq, row_u)``: the first row of each distinct (prompt, negative prompt, images),
    and for every row the position of its key in ``uniq``."""
    first: dict[tuple, int] = {}
    uniq: list[int] = []
    row_u: list[int] = []
    for k, r in enumerate(reqs):
        key = (r.prompt, r.negative_prompt, _image_key(r.image))
        if key not in first:
            first[key] = len(uniq)
            uniq.append(k)
        row_u.append(first[key])
    return uniq, row_u


def _encode(
    den: Denoiser, reqs: Sequence[RolloutRequest], params: Any, with_images: bool
) -> dict[str, Tensor]:
    """``den.encode`` of the requests' prompts (one row each). ``params`` lets the denoiser
    skip the negative branch when guidance is off; negatives are None (the denoiser's default,
    ``""``) unless a request carries one."""
    negs = None
    if any(r.negative_prompt is not None for r in reqs):
        negs = [r.negative_prompt or "" for r in reqs]
    prompts = [r.prompt for r in reqs]
    if with_images:
        return den.encode(prompts, negs, images=_stack_images(reqs), params=params)
    return den.encode(prompts, negs, params=params)


def _expand(cond_u: dict[str, Tensor], row_u: list[int]) -> dict[str, Tensor]:
    """Batch-first condition with row k = ``cond_u[...][row_u[k]]`` (no copy when the rows
    are already the unique ones in order)."""
    rows = max(row_u) + 1
    for key, t in cond_u.items():
        if t.shape[0] != rows:
            raise ValueError(
                f"denoiser.encode returned {t.shape[0]} rows for {key!r}, expected {rows} "
                "(one per distinct prompt)"
            )
    if row_u == list(range(rows)):
        return dict(cond_u)
    return {
        key: t.index_select(0, torch.tensor(row_u, device=t.device)) for key, t in cond_u.items()
    }


def _step_plan(
    reqs_s: Sequence[RolloutRequest], win_s: Sequence[tuple[int, int]], num_steps: int
) -> list[list[tuple[int, int, str | None, float]]]:
    """Per-step plan, small Python ints only: the step's segments [lo, hi) of the sorted rows,
    each either an ODE segment (kind None) or the SDE block of one (kind, noise level)."""
    batch = len(reqs_s)
    blocks: dict[tuple, list[int]] = defaultdict(list)
    for k, r in enumerate(reqs_s):
        s, e = win_s[k]
        blocks[(r.params.sde_kind, r.params.noise_level, e - s)].append(k)
    plan: list[list[tuple[int, int, str | None, float]]] = []
    for i in range(num_steps):
        sde_segs = []
        for (kind, nl, _), rows in blocks.items():
            inside = [k for k in rows if win_s[k][0] <= i < win_s[k][1]]
            if inside:
                # contiguous by the sort order (equal sizes, ascending starts)
                assert inside[-1] - inside[0] + 1 == len(inside), "window block not contiguous"
                sde_segs.append((inside[0], inside[-1] + 1, kind, nl))
        sde_segs.sort()
        segs, pos = [], 0
        for lo, hi, kind, nl in sde_segs:
            if lo > pos:
                segs.append((pos, lo, None, 0.0))
            segs.append((lo, hi, kind, nl))
            pos = hi
        if pos < batch:
            segs.append((pos, batch, None, 0.0))
        plan.append(segs)
    return plan
