"""Shared bits of every benchmark's results file: commit, GPU name, JSON layout."""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git_commit() -> str:
    """The commit measured. The device machine gets a copy of the tree without .git, so the
    caller passes the commit in $SGLANG_EXT_COMMIT there."""
    env = os.environ.get("SGLANG_EXT_COMMIT")
    if env:
        return env
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, timeout=10)
        if out.returncode == 0:
            return out.stdout.strip()
    except OSError:
        pass
    return "unknown"


def gpu_name() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return "none"


def write_results(path: str, rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({**meta, "rows": rows}, f, indent=1)
        f.write("\n")
