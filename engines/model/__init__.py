"""Llama-family transformer with a paged KV pool and layer-range execution."""
