"""Put the ``sgl_kernel`` stand-in on the venv's path when the real one cannot work here.

Run by ``make setup``. Writes ``sglang_ext_cpu_shim.pth`` into site-packages on machines without
CUDA (or without the real ``sgl_kernel``), and removes it where the real package works.
"""

from __future__ import annotations

import importlib.util
import os
import site
import sys

PTH_NAME = "sglang_ext_cpu_shim.pth"


def needs_shim() -> bool:
    import torch

    if not torch.cuda.is_available():
        return True
    return importlib.util.find_spec("sgl_kernel") is None


def main() -> int:
    shim_dir = os.path.dirname(os.path.abspath(__file__))
    pth = os.path.join(site.getsitepackages()[0], PTH_NAME)
    if needs_shim():
        with open(pth, "w") as f:
            f.write(shim_dir + "\n")
        print(f"cpu_shim: sgl_kernel stand-in enabled ({pth})")
    elif os.path.exists(pth):
        os.remove(pth)
        print("cpu_shim: real sgl_kernel found, stand-in disabled")
    return 0


if __name__ == "__main__":
    sys.exit(main())
