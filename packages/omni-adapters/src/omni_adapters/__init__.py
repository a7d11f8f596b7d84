"""omni_adapters."""
