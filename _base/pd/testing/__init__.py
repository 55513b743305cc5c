"""Tiny checkpoints for tests and benchmarks: written by transformers (`hf.py`, the parity
matrix) or directly in the checkpoint format (`tiny.py`, with an MTP layer)."""
