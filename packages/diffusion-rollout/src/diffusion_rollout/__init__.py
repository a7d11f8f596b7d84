"""diffusion_rollout."""
