"""EmbeddedEngine: packing, per-request determinism, windows, weights, stats."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from diffusion_rollout import (
    EmbeddedEngine,
    RolloutRequest,
    SamplingParams,
    Trajectory,
    stack_conditions,
)
from omni_algos import sde

P = SamplingParams(height=32, width=32, num_steps=6, sde_window_size=2, output="both")


def run(engine, reqs):
    return engine.generate_many(reqs)


def test_trajectory_fields_and_shapes(toy, make_requests):
    with EmbeddedEngine(toy, max_num_seqs=4) as engine:
        (t,) = run(engine, make_requests(1, P))
    assert isinstance(t, Trajectory)
    s, e = t.window
    assert e - s == 2 and s >= 0 and e <= P.num_steps
    assert t.latents.shape == (3, 4, 4, 4)
    assert t.log_probs.shape == (2,) and t.log_probs.dtype == torch.float32
    assert torch.isfinite(t.log_probs).all() and (t.log_probs != 0).all()
    sig = toy.sigmas(P)
    assert torch.equal(t.sigmas, sig[s:e]) and torch.equal(t.sigmas_next, sig[s + 1 : e + 1])
    assert t.final_latent.shape == (4, 4, 4)
    assert t.media.dtype == torch.uint8 and t.media.shape == (4, 4, 3)
    assert set(t.condition) >= {"prompt_embeds", "pooled_prompt_embeds"}
    assert t.condition["prompt_embeds"].shape == (6, 8)
    assert t.version == 0 and t.request_id == "r0" and t.seed == 100
    assert {"queue_s", "encode_s", "denoise_s", "decode_s", "total_s"} <= set(t.timings)


def test_draw_order_matches_interfaces(toy):
    """Window start, then initial latents, then SDE noise per window step, all from one g."""
    req = RolloutRequest("a cat", 7, P, "x")
    with EmbeddedEngine(toy) as engine:
        (t,) = run(engine, [req])
    g = torch.Generator("cpu").manual_seed(7)
    ((s, e),) = sde.sample_windows([g], P.num_steps, 2, 0, P.num_steps)
    x = toy.init_latents(1, P, [g])
    cond = toy.encode(["a cat"])
    sig = toy.sigmas(P)
    with torch.no_grad():
        for i in range(P.num_steps):
            v = toy.velocity(x, sig[i].expand(1), cond, P)
            if s <= i < e:
                if i == s:
                    assert torch.equal(t.latents[0], x[0])
                out = sde.step(x, v, sig[i], sig[i + 1], noise_level=P.noise_level, generator=[g])
                assert torch.allclose(t.log_probs[i - s], out.log_prob[0], atol=1e-6)
                x = out.prev_sample
                assert torch.allclose(t.latents[i - s + 1], x[0], atol=1e-6)
            else:
                x = x + (sig[i + 1] - sig[i]) * v
    assert (s, e) == t.window
    assert torch.allclose(t.final_latent, x[0], atol=1e-6)


def _check_same(ref, got, max_diff, tol=1e-5):
    worst = 0.0
    for a, b in zip(ref, got):
        assert a.request_id == b.request_id and a.window == b.window
        worst = max(worst, max_diff(a, b))
    assert worst <= tol, worst
    return worst


def test_alone_vs_batch_of_16_vs_shuffled(toy, make_requests, max_diff):
    """The headline property: a request's trajectory does not depend on its wave mates."""
    params = SamplingParams(
        height=32,
        width=32,
        num_steps=8,
        sde_window_size=3,
        sde_window_range=(0, 6),
        guidance_scale=3.0,
        output="both",
    )
    reqs = make_requests(16, params)
    with EmbeddedEngine(toy, max_num_seqs=1) as serial:
        alone = run(serial, reqs)
    assert serial.stats()["mean_rows_per_forward"] == 1.0
    with EmbeddedEngine(toy, max_num_seqs=16) as batched:
        packed = run(batched, reqs)
        order = list(range(16))
        random.Random(0).shuffle(order)
        shuffled = run(batched, [reqs[i] for i in order])
    assert batched.stats()["mean_rows_per_forward"] == 16.0
    assert len({t.window for t in alone}) > 1  # different window starts inside one wave
    unshuffled = [None] * 16
    for j, i in enumerate(order):
        unshuffled[i] = shuffled[j]
    d1 = _check_same(alone, packed, max_diff)
    d2 = _check_same(alone, unshuffled, max_diff)
    for a, b in zip(alone, packed):
        assert torch.equal(a.media, b.media) or (a.media.int() - b.media.int()).abs().max() <= 1
    print(f"max |alone - batch16| = {d1:.3g}, max |alone - shuffled| = {d2:.3g}")


def test_mixed_keys_never_share_a_forward(toy):
    p1 = SamplingParams(height=32, width=32, num_steps=4)
    p2 = SamplingParams(height=16, width=16, num_steps=4)
    reqs = [RolloutRequest("a", i, p1 if i % 2 else p2, f"m{i}") for i in range(10)]
    with EmbeddedEngine(toy, max_num_seqs=16) as engine:
        trajs = run(engine, reqs)
    assert [t.request_id for t in trajs] == [r.request_id for r in reqs]
    assert sorted(set(toy.forward_rows)) == [5]  # two waves of 5, never 10
    assert trajs[0].final_latent.shape == (4, 2, 2) and trajs[1].final_latent.shape == (4, 4, 4)
    assert engine.stats()["waves"] == 2


def test_waves_capped_by_max_num_seqs(toy, make_requests):
    with EmbeddedEngine(toy, max_num_seqs=4) as engine:
        trajs = run(engine, make_requests(10, P))
    assert len(trajs) == 10
    assert sorted(toy.forward_rows[:: P.num_steps]) == [2, 4, 4]
    st = engine.stats()
    assert st["waves"] == 3 and st["requests"] == 10 and st["forwards"] == 3 * P.num_steps
    assert st["mean_rows_per_forward"] == pytest.approx(10 / 3)
    assert st["mean_step_s"] > 0 and st["mean_queue_wait_s"] >= 0


def test_different_sde_kinds_and_noise_levels_share_a_wave(toy, max_diff):
    kinds = [("sde", 0.7), ("cps", 0.5), ("dance", 0.3), ("ode", 0.7)]
    reqs = [
        RolloutRequest("p", 5 + i, P.replace(sde_kind=k, noise_level=nl), f"k{i}")
        for i, (k, nl) in enumerate(kinds)
    ]
    with EmbeddedEngine(toy, max_num_seqs=1) as e1:
        alone = run(e1, reqs)
    with EmbeddedEngine(toy, max_num_seqs=8) as e8:
        packed = run(e8, reqs)
    assert e8.stats()["waves"] == 1
    _check_same(alone, packed, max_diff)
    assert torch.equal(packed[3].log_probs, torch.zeros(2))


def test_seed_determines_everything(toy, make_requests):
    reqs = make_requests(3, P)
    with EmbeddedEngine(toy) as engine:
        a = run(engine, reqs)
        b = run(engine, reqs)
        other = run(engine, [RolloutRequest(reqs[0].prompt, 999, P, "o")])[0]
    for x, y in zip(a, b):
        assert torch.equal(x.latents, y.latents) and torch.equal(x.log_probs, y.log_probs)
    assert not torch.equal(a[0].latents[-1], other.latents[-1])


def test_default_window_every_step_but_last(toy):
    p = SamplingParams(height=16, width=16, num_steps=5, output="latent")
    with EmbeddedEngine(toy) as engine:
        (t,) = run(engine, [RolloutRequest("x", 1, p)])
    assert t.window == (0, 4) and t.latents.shape[0] == 5 and t.media is None
    assert t.final_latent is not None


def test_output_pixel_drops_final_latent(toy):
    p = SamplingParams(height=16, width=16, num_steps=3, output="pixel")
    with EmbeddedEngine(toy) as engine:
        (t,) = run(engine, [RolloutRequest("x", 1, p)])
    assert t.final_latent is None and t.media.shape == (2, 2, 3)


def test_video_latents(toy, max_diff):
    p = SamplingParams(
        height=16, width=16, num_frames=3, num_steps=4, sde_window_size=2, output="both"
    )
    reqs = [RolloutRequest(f"clip {i}", 40 + i, p, f"v{i}") for i in range(5)]
    with EmbeddedEngine(toy, max_num_seqs=1) as e1:
        alone = run(e1, reqs)
    with EmbeddedEngine(toy, max_num_seqs=5) as e5:
        packed = run(e5, reqs)
    t = packed[0]
    assert t.latents.shape == (3, 4, 3, 2, 2) and t.final_latent.shape == (4, 3, 2, 2)
    assert t.media.shape == (3, 2, 2, 3) and t.media.dtype == torch.uint8
    _check_same(alone, packed, max_diff)


def test_cfg_packed_branches_equal_two_forwards(toy):
    p = SamplingParams(height=16, width=16, num_steps=3, guidance_scale=4.0)
    x = torch.randn(3, 4, 2, 2, generator=torch.Generator().manual_seed(0))
    sig = torch.full((3,), 0.5)
    cond = toy.encode(["a", "b", "c"], ["n1", "", "n3"])
    with torch.no_grad():
        v = toy.velocity(x, sig, cond, p)
        pos = toy._forward(x, sig, cond["pooled_prompt_embeds"])
        neg = toy._forward(x, sig, cond["negative_pooled_prompt_embeds"])
    assert torch.allclose(v, neg + 4.0 * (pos - neg), atol=1e-5)


def test_negative_prompts_reach_encode(toy, max_diff):
    p = SamplingParams(height=16, width=16, num_steps=3, true_cfg_scale=2.0)
    with EmbeddedEngine(toy) as engine:
        a, b, c = run(
            engine,
            [
                RolloutRequest("x", 1, p, "a", negative_prompt="blurry"),
                RolloutRequest("x", 1, p, "b"),
                RolloutRequest("x", 1, p, "c", negative_prompt=""),
            ],
        )
    assert max_diff(b, c) == 0.0  # None encodes ""
    assert max_diff(a, b) > 1e-4
    assert not torch.equal(
        a.condition["negative_prompt_embeds"], b.condition["negative_prompt_embeds"]
    )


def test_generate_is_async_and_keeps_order(toy, make_requests):
    reqs = make_requests(6, P)

    async def main():
        engine = EmbeddedEngine(toy, max_num_seqs=8, max_wait_ms=50)
        try:
            return await asyncio.gather(*(engine.generate(r) for r in reqs)), engine.stats()
        finally:
            engine.close()

    trajs, st = asyncio.run(main())
    assert [t.request_id for t in trajs] == [r.request_id for r in reqs]
    assert st["waves"] == 1  # max_wait_ms let the stragglers join


def test_stack_conditions_round_trip(toy, make_requests):
    with EmbeddedEngine(toy) as engine:
        trajs = run(engine, make_requests(3, P))
    cond = stack_conditions([t.condition for t in trajs])
    ref = toy.encode([t.prompt for t in trajs])
    for k in ref:
        assert torch.equal(cond[k], ref[k])
    with pytest.raises(ValueError, match="prompt_embeds"):
        stack_conditions([trajs[0].condition, {"prompt_embeds": torch.zeros(1)}])


def test_update_weights_changes_output_and_version(toy, make_requests, max_diff):
    reqs = make_requests(2, P)
    with EmbeddedEngine(toy) as engine:
        before = run(engine, reqs)
        new = {"proj_out.bias": torch.full((4,), 0.5)}
        engine.update_weights(new, version=1)
        after = run(engine, reqs)
        with pytest.raises(ValueError, match="not newer"):
            engine.update_weights(new, version=1)
    assert [t.version for t in before] == [0, 0] and [t.version for t in after] == [1, 1]
    assert max_diff(before[0], after[0]) > 1e-3


def test_runs_without_grad(toy, make_requests):
    with EmbeddedEngine(toy) as engine:
        (t,) = run(engine, make_requests(1, P))
    assert not t.latents.requires_grad and not t.condition["prompt_embeds"].requires_grad
    # not inference tensors: the trainer may use them in autograd replay
    assert not t.latents.is_inference()


_POOL = [
    RolloutRequest(
        f"prompt {i}",
        300 + i,
        SamplingParams(
            height=16,
            width=16,
            num_steps=6,
            sde_window_size=1 + i % 3,
            sde_kind=("sde", "cps", "dance")[i % 3],
            noise_level=(0.7, 0.4)[i % 2],
            guidance_scale=3.0 if i % 4 == 0 else 1.0,
            output="latent",
        ),
        f"pool{i}",
    )
    for i in range(10)
]


@settings(
    max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.permutations(range(10)), st.integers(1, 10))
def test_any_subset_and_order_matches_alone(toy_cls, max_diff, perm, k):
    """Property: any subset of the pool in any pack order gives each request's alone result."""
    toy = toy_cls()
    chosen = [_POOL[i] for i in perm[:k]]
    with EmbeddedEngine(toy, max_num_seqs=16) as engine:
        packed = engine.generate_many(chosen)
        for req, got in zip(chosen, packed):
            (alone,) = engine.generate_many([req])
            assert got.request_id == req.request_id and got.window == alone.window
            assert max_diff(alone, got) <= 1e-5


def test_ode_stride_after_window_skips_forwards_not_the_window(toy):
    """MixGRPO's fast tail: the windows' latents and log-probs are unchanged, the tail takes
    one forward per `stride` schedule steps, and the final latent stays close to Euler's."""
    from omni_algos.ode import dpm_solver_2m_step

    base = SamplingParams(
        height=16,
        width=16,
        num_steps=10,
        sde_window_size=2,
        sde_window_range=(2, 4),
        noise_level=0.7,
        output="latent",
    )
    fast = base.replace(ode_stride_after_window=3)
    assert base.compat_key() != fast.compat_key()  # never in one wave together
    reqs = [RolloutRequest("a red square", s, base) for s in range(3)]
    with EmbeddedEngine(toy) as engine:
        slow = run(engine, reqs)
        toy.forward_rows.clear()
        quick = run(engine, [RolloutRequest(r.prompt, r.seed, fast) for r in reqs])
    # windows end at step 4 at the latest; the tail 4..10 takes ceil(6 / 3) = 2 forwards
    assert len(toy.forward_rows) == 4 + 2
    for a, b in zip(slow, quick):
        assert a.window == b.window
        assert torch.equal(a.latents, b.latents) and torch.equal(a.log_probs, b.log_probs)
        assert (a.final_latent - b.final_latent).abs().max() < 0.2 * a.final_latent.abs().max()
    # the tail is exactly DPM-Solver++(2M) from the last window latent
    t = quick[0]
    sig = toy.sigmas(fast)
    x, x0, s_prev = t.latents[-1][None], None, None
    with torch.no_grad():
        cond = toy.encode([t.prompt])
        for i, j in ((4, 7), (7, 10)):
            v = toy.velocity(x, sig[i].expand(1), cond, fast)
            x, x0_new = dpm_solver_2m_step(
                x, v, float(sig[i]), float(sig[j]), x0_prev=x0, sigma_prev=s_prev
            )
            x0, s_prev = x0_new, float(sig[i])
    torch.testing.assert_close(x[0], t.final_latent, atol=1e-5, rtol=0)
