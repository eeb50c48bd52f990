"""CPU-only stand-ins that let SGLang 0.5.16 import and run on machines without CUDA.

The folder is put on ``sys.path`` (by a ``.pth`` file that ``make setup`` writes into the venv)
only when the real ``sgl_kernel`` cannot be imported, i.e. on CPU-only machines. Python never
imports this package itself: only its ``sgl_kernel`` sub-folder is visible as a top-level module.
"""
