"""omni_train."""
