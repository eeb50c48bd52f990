"""Shared bits of every benchmark's results file: commit, GPU name, JSON layout."""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any, Callable, Hashable, Mapping, Sequence

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


def merge_rows(path: str, rows: list[dict[str, Any]], key: Callable[[dict[str, Any]], Hashable],
               inherit: Sequence[str] = ("model", "commit"),
               defaults: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
    """The rows already in ``path`` with this run's ``rows`` replacing those of the same
    ``key``, then this run's rows. Old rows are completed first with ``defaults`` and the
    file-level fields named in ``inherit`` that they lack (a row's own value wins): once the
    file's top level describes the new run, each old row still says which commit (model, ...)
    it measured. New rows are keyed with the same completion, so a field they leave out
    matches the file's."""
    if not os.path.exists(path):
        return rows
    with open(path) as f:
        old = json.load(f)
    stamp = {**(defaults or {}), **{name: old.get(name) for name in inherit}}
    new_keys = {key({**stamp, **r}) for r in rows}
    kept = []
    for r in old.get("rows", []):
        r = {**stamp, **r}
        if key(r) not in new_keys:
            kept.append(r)
    return kept + rows
