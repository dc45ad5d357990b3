"""Entry points into PyTorch: SDPA routing (and, later, the provider hook, Hugging Face, distributed)."""
