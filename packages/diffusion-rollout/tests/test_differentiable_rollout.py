"""`generate_many(differentiable=True)`: the trajectories of the no-grad rollout, with
log-probs that carry the autograd graph of each SDE step's own velocity, so a trainer can
back-propagate through the rollout's forwards instead of replaying them.

The gradient is checked against the replay written out here from `omni_algos.sde.step`'s
documented use (``prev_sample=`` the stored sample: gradients through the mean only).
"""

from __future__ import annotations

import torch

from diffusion_rollout import EmbeddedEngine, SamplingParams
from omni_algos import sde

# windows of 2 of 5 steps at per-row starts: at most steps only some rows are inside their
# window, so those rows' forward runs with autograd and the rest without
WINDOWS_OF_2_IN_5 = dict(
    height=32, width=32, num_steps=5, noise_level=0.8, sde_window_size=2,
    sde_window_range=(0, 4), output="latent",
)  # fmt: skip


def grad_mode_of_forwards(den) -> list[tuple[int, bool]]:
    """Record (rows, autograd on?) of every forward of ``den``."""
    seen: list[tuple[int, bool]] = []
    forward = den._forward

    def recording(x, sigma, pooled):
        seen.append((int(x.shape[0]), torch.is_grad_enabled()))
        return forward(x, sigma, pooled)

    den._forward = recording
    return seen


def replayed_gradient(den, trajs, weights) -> dict[str, torch.Tensor]:
    """d/dtheta of sum_b sum_j weights[b, j] * lp_bj, each lp recomputed from the stored
    latents (the trainer's replay)."""
    den.zero_grad(set_to_none=True)
    total = 0.0
    for b, t in enumerate(trajs):
        cond = {k: v[None] for k, v in t.condition.items()}
        for j in range(t.window_size):
            x = t.latents[j][None]
            v = den.velocity(x, t.sigmas[j].reshape(1), cond, t.params)
            lp = sde.step(
                x,
                v,
                t.sigmas[j].reshape(1),
                t.sigmas_next[j].reshape(1),
                noise_level=t.params.noise_level,
                kind=t.params.sde_kind,
                prev_sample=t.latents[j + 1][None],
            ).log_prob
            total = total + weights[b, j] * lp[0]
    total.backward()
    return {k: p.grad.clone() for k, p in den.named_parameters() if p.grad is not None}


def test_differentiable_rollout_gives_the_replay_gradient(toy, make_requests):
    params = SamplingParams(**WINDOWS_OF_2_IN_5, guidance_scale=2.0)
    reqs = make_requests(6, params)
    engine = EmbeddedEngine(toy, max_num_seqs=6)
    plain = engine.generate_many(reqs)
    seen = grad_mode_of_forwards(toy)
    trajs = engine.generate_many(reqs, differentiable=True)
    engine.close()
    assert len({t.window for t in trajs}) > 1  # the split path ran
    assert any(grad for _, grad in seen) and any(not grad for _, grad in seen)
    for a, b in zip(plain, trajs):
        assert a.window == b.window
        torch.testing.assert_close(b.latents, a.latents, rtol=0, atol=1e-6)
        torch.testing.assert_close(b.final_latent, a.final_latent, rtol=0, atol=1e-6)
        torch.testing.assert_close(b.log_probs.detach(), a.log_probs, rtol=0, atol=1e-5)
        assert b.log_probs.requires_grad and not a.log_probs.requires_grad
        assert not b.latents.requires_grad and not b.final_latent.requires_grad

    weights = torch.randn(len(trajs), 2, generator=torch.Generator().manual_seed(3))
    toy.zero_grad(set_to_none=True)
    loss = sum((weights[b] * t.log_probs).sum() for b, t in enumerate(trajs))
    loss.backward()
    through_rollout = {k: p.grad.clone() for k, p in toy.named_parameters() if p.grad is not None}
    replayed = replayed_gradient(toy, plain, weights)
    assert set(through_rollout) == set(replayed)
    assert "proj_out.weight" in replayed and "embed.weight" not in replayed  # encode: no grad
    biggest = max(g.abs().max().item() for g in replayed.values())
    assert biggest > 1e-4
    for k, g in replayed.items():
        assert (through_rollout[k] - g).abs().max().item() <= 1e-5 * biggest, k


def test_ode_requests_build_no_graph(toy, make_requests):
    # validation samples with the ODE: nothing depends on the velocity's graph
    params = SamplingParams(height=32, width=32, num_steps=4, noise_level=0.0, output="both")
    engine = EmbeddedEngine(toy, max_num_seqs=4)
    seen = grad_mode_of_forwards(toy)
    trajs = engine.generate_many(make_requests(4, params), differentiable=True)
    engine.close()
    assert seen and not any(grad for _, grad in seen)
    assert not any(t.log_probs.requires_grad for t in trajs)


def test_differentiable_and_plain_requests_never_share_a_wave(toy, make_requests):
    params = SamplingParams(height=32, width=32, num_steps=3, noise_level=0.7, output="latent")
    engine = EmbeddedEngine(toy, max_num_seqs=8)
    plain = engine.submit_many(make_requests(3, params, prefix="p"))
    seen = grad_mode_of_forwards(toy)
    trajs = engine.generate_many(make_requests(3, params, prefix="d"), differentiable=True)
    done = [f.result(timeout=60) for f in plain]
    engine.close()
    assert all(t.log_probs.requires_grad for t in trajs)
    assert not any(t.log_probs.requires_grad for t in done)
    assert {rows for rows, _ in seen} == {3}  # two waves of 3, never one of 6


def test_grad_denoiser_runs_only_the_autograd_forwards(toy, make_requests):
    """A trainer's merged rollout copy (``denoiser``) beside its unmerged policy
    (``grad_denoiser``): the forwards with autograd run on the policy, every other forward on
    the copy, and the trajectories and the gradient are those of one denoiser doing both."""
    params = SamplingParams(**WINDOWS_OF_2_IN_5)
    reqs = make_requests(6, params)
    policy = type(toy)()
    policy.load_state_dict(toy.state_dict())  # the same weights in another module
    alone = EmbeddedEngine(policy, max_num_seqs=6).generate_many(reqs, differentiable=True)
    weights = torch.randn(len(alone), 2, generator=torch.Generator().manual_seed(5))
    policy.zero_grad(set_to_none=True)
    sum((weights[b] * t.log_probs).sum() for b, t in enumerate(alone)).backward()
    expected = {k: p.grad.clone() for k, p in policy.named_parameters() if p.grad is not None}

    policy.zero_grad(set_to_none=True)
    on_copy, on_policy = grad_mode_of_forwards(toy), grad_mode_of_forwards(policy)
    engine = EmbeddedEngine(toy, max_num_seqs=6, grad_denoiser=policy)
    trajs = engine.generate_many(reqs, differentiable=True)
    engine.close()
    assert on_policy and all(grad for _, grad in on_policy)
    assert on_copy and not any(grad for _, grad in on_copy)
    # 5 steps: the policy runs the rows inside their window, the copy all the others
    assert sum(rows for rows, _ in on_policy) == 6 * 2
    assert sum(rows for rows, _ in on_copy) == 6 * 5 - 6 * 2
    for a, b in zip(alone, trajs):
        assert torch.equal(b.latents, a.latents) and torch.equal(b.final_latent, a.final_latent)
        assert torch.equal(b.log_probs.detach(), a.log_probs.detach())
    sum((weights[b] * t.log_probs).sum() for b, t in enumerate(trajs)).backward()
    got = {k: p.grad for k, p in policy.named_parameters() if p.grad is not None}
    assert set(got) == set(expected) and all(torch.equal(got[k], expected[k]) for k in got)
    assert all(p.grad is None for p in toy.parameters())  # nothing reached the copy
