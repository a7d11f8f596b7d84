"""Per-sample seeds as a pure function of (run seed, step, global sample index).

A sample's seed never depends on which worker or batch it lands in, so the same recipe and
seed give the same trajectories whatever the batching, and a resumed run continues with the
exact seeds an uninterrupted run would have used.

The mixer is SplitMix64's finaliser (Steele, Lea & Flood, "Fast splittable pseudorandom
number generators", OOPSLA 2014):

    z = x + 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    mix(x) = z ^ (z >> 31)                       (all mod 2^64)

and a seed is mix(mix(mix(run_seed) ^ step) ^ index), masked to 63 bits so every
torch.Generator accepts it.
"""

from __future__ import annotations

_M64 = (1 << 64) - 1

# domain tags keep different uses of the same (seed, step) apart
DOMAIN_SAMPLE = 0
DOMAIN_DATA = 1
DOMAIN_VAL = 2
DOMAIN_MINIBATCH = 3
DOMAIN_FORWARD = 4  # (t, eps) draws of the forward-process losses
DOMAIN_DISTILL = 5  # rollouts that fit a latent reward model


def mix64(x: int) -> int:
    """SplitMix64 finaliser: a bijection on 64-bit integers with full avalanche."""
    z = (x + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def derive_seed(run_seed: int, step: int, index: int, domain: int = DOMAIN_SAMPLE) -> int:
    """Mix (run seed, step, index, domain) into one 63-bit seed."""
    h = mix64((run_seed & _M64) ^ (domain * 0xD1B54A32D192ED03 & _M64))
    h = mix64(h ^ (step & _M64))
    h = mix64(h ^ (index & _M64))
    return h & ((1 << 63) - 1)


def sample_seed(run_seed: int, step: int, index: int) -> int:
    """Seed of the `index`-th sample (global over all workers) of training step `step`."""
    return derive_seed(run_seed, step, index, DOMAIN_SAMPLE)
