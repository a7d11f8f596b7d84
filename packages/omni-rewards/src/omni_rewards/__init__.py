"""omni_rewards."""
