"""Progress bars of the long jobs (calibration, conversion, training, benchmarks): tqdm on stderr.

``TQDM_DISABLE=1`` hides every bar, and a job's own ``--quiet`` / ``--no-progress`` its own.
tqdm reads ``TQDM_*`` variables as the defaults of its arguments, and an argument passed
explicitly wins over them (``disable=False`` would show a bar under ``TQDM_DISABLE=1``), so a
bar that is on passes no ``disable`` at all. Without a terminal (a log file, a captured run) a
bar redraws every 30 s instead of 10 times a second, unless ``TQDM_MININTERVAL`` says otherwise,
so that it does not bury the job's printed output.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Iterable, Iterator, Optional

NON_TTY_MININTERVAL = 30.0  # seconds between redraws when stderr is not a terminal


def progress(iterable: Optional[Iterable] = None, *, enabled: bool = True, **kwargs: Any) -> Any:
    """``tqdm(iterable, **kwargs)`` on stderr; ``enabled=False`` hides it."""
    from tqdm import tqdm

    if not enabled:
        kwargs["disable"] = True
    kwargs.setdefault("file", sys.stderr)
    if "mininterval" not in kwargs and "TQDM_MININTERVAL" not in os.environ:
        stream = kwargs["file"]
        if not (hasattr(stream, "isatty") and stream.isatty()):
            kwargs["mininterval"] = NON_TTY_MININTERVAL
    return tqdm(iterable, **kwargs)


def counting(bar: Any, iterable: Iterable) -> Iterator:
    """Yield ``iterable``'s items, advancing ``bar`` by one as each is done (``continue``
    included): one bar over nested loops. Closes the bar once it reaches its total."""
    for item in iterable:
        yield item
        bar.update(1)
        if bar.total is not None and bar.n >= bar.total:
            bar.close()
