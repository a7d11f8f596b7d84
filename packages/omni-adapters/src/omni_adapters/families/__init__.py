"""One module per model family; each registers its adapter and tiny builder."""
