"""Attention backends registered into SGLang."""
