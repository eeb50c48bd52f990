"""sglang_ext: two-level sparse decode attention for SGLang 0.5.16, switched on with flags.

Layout: ``selection`` (which tokens to attend: reference torch implementation, calibration),
``attention`` (the SGLang attention backend), ``sglang_ext.kernels`` (GPU kernels, from the
top-level ``kernels/``), ``sglang_ext.patches`` (every SGLang hook, from ``patches/``),
``models`` (local model conversion), ``cpu_shim`` (CPU-only stand-ins for CUDA packages).
"""

__version__ = "0.1.0"
