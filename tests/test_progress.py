"""The long jobs' progress bars (sglang_ext/progress.py): on stderr, hidden by TQDM_DISABLE=1 or
by the job's own switch, and quiet in log files."""

from __future__ import annotations

import io
import os
import subprocess
import sys

from sglang_ext.progress import NON_TTY_MININTERVAL, counting, progress


def test_a_bar_goes_to_stderr_and_redraws_rarely_without_a_terminal(monkeypatch, capsys):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    monkeypatch.delenv("TQDM_MININTERVAL", raising=False)
    assert list(progress(range(3), desc="work")) == [0, 1, 2]
    out, err = capsys.readouterr()
    assert out == "" and "work" in err and "3/3" in err
    bar = progress(range(3), file=io.StringIO())  # not a terminal
    assert bar.mininterval == NON_TTY_MININTERVAL
    bar.close()


def test_tqdm_disable_hides_every_bar():
    """tqdm reads TQDM_* when it is imported: a fresh process. A job's own switch on (the
    default) must not override it, which an explicit disable=False would."""
    code = ("from sglang_ext.progress import progress\n"
            "assert list(progress(range(3), desc='work')) == [0, 1, 2]\n"
            "assert list(progress(range(3), desc='work', enabled=True)) == [0, 1, 2]\n")
    env = {**os.environ, "TQDM_DISABLE": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=60)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    env.pop("TQDM_DISABLE")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=60)
    assert out.returncode == 0 and "work" in out.stderr


def test_a_job_can_hide_its_bar(monkeypatch, capsys):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    list(progress(range(3), desc="work", enabled=False))
    assert capsys.readouterr().err == ""


def test_counting_advances_one_bar_over_nested_loops(monkeypatch):
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    bar = progress(total=6, file=io.StringIO())
    seen = []
    for i in range(3):
        for j in counting(bar, range(2)):
            if j == 0:
                continue  # a skipped case still counts
            seen.append((i, j))
    assert seen == [(0, 1), (1, 1), (2, 1)] and bar.n == 6
