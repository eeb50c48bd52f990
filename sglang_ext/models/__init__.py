"""Model preparation helpers (e.g. turning a GGUF checkpoint into a Hugging Face folder)."""
