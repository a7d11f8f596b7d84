"""omni_algos."""
