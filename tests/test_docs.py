"""The user docs stay what they promise: a short README without history, every flag in its
table, and links that lead somewhere."""

from __future__ import annotations

import glob
import os
import re

import pytest

from sglang_ext.config import _FLAGS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(REPO, "README.md")
DOCS = sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))
README_MAX_LINES = 300
# A commit hash: 7 to 40 hex digits holding at least one digit and one letter.
COMMIT_LIKE = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _read(path: str) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def test_readme_is_short() -> None:
    lines = _read(README).count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES})"


@pytest.mark.parametrize("path", [README, *DOCS], ids=os.path.basename)
def test_no_history_words(path: str) -> None:
    text = _read(path)
    assert not re.search(r"\bsession\b", text, re.IGNORECASE), f"{path} says 'session'"


def test_readme_names_no_commit() -> None:
    found = COMMIT_LIKE.findall(_read(README))
    assert not found, f"commit-like hashes in README.md: {found}"


def test_commit_pattern_matches_hashes_only() -> None:
    assert COMMIT_LIKE.findall("at c77ed96 and 05f529e7") == ["c77ed96", "05f529e7"]
    assert not COMMIT_LIKE.findall("fp8_e4m3 decade 1234567 deadbeef")


def test_readme_flag_table_has_every_flag() -> None:
    text = _read(README)
    rows = [line for line in text.splitlines() if line.startswith("| `--sparse-")]
    missing = [flag for _, flag, _, _ in _FLAGS if not any(f"`{flag}`" in row for row in rows)]
    assert not missing, f"flags missing from README.md's flag table: {missing}"


@pytest.mark.parametrize("path", [README, *DOCS], ids=os.path.basename)
def test_relative_links_resolve(path: str) -> None:
    base = os.path.dirname(path)
    broken = [target for target in LINK.findall(_read(path))
              if "://" not in target and not target.startswith("mailto:")
              and not os.path.exists(os.path.normpath(os.path.join(base, target)))]
    assert not broken, f"{os.path.relpath(path, REPO)} links to missing files: {broken}"
