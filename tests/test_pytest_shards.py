"""``--shard K/N`` (tests/conftest.py): the GPU suite split over device calls that each fit the
10-minute limit. The slices must cover every collected test exactly once."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _collected(*extra: str) -> tuple[int, list[str]]:
    run = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                          "-p", "no:cacheprovider", "tests/test_flags.py", *extra],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    return run.returncode, [line for line in run.stdout.splitlines() if "::" in line]


def test_the_slices_partition_the_collection() -> None:
    _, everything = _collected()
    slices = [_collected("--shard", f"{k}/3")[1] for k in (1, 2, 3)]
    assert all(slices) and sorted(sum(slices, [])) == sorted(everything)


def test_a_bad_shard_is_a_usage_error() -> None:
    code, _ = _collected("--shard", "4/3")
    assert code == 4  # pytest's usage error
