"""GPU kernels (Triton) for the sparse decode path, each beside its torch reference."""
