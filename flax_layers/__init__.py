"""Flax modules and attention_fn hooks for jax-flash (built by its own issue)."""
