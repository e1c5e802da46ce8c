"""Count the hostile-input cases of the test suite (docs/reliability.md).

    python benchmarks/count_error_cases.py

Runs the error-path tests (selected by name, DDP tests left out) with a small pytest plugin that counts every call of
``pytest.raises`` per test file: each call is one bad input checked against its expected message, and a test that
loops over cases counts each case. Prints the count per file and the total.
"""

from __future__ import annotations

import collections
import inspect
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SELECT = (
    "bad or malformed or corrupt or invalid or hostile or reject or error or truncat or missing or unknown or "
    "fault or impossible or wrong or mismatch or raise or clear or fail or refuse or checkpoint or zero or "
    "parquet"
)


class RaisesCounter:
    """pytest plugin: wraps ``pytest.raises`` for the session and counts its calls per calling test file."""

    def __init__(self):
        self.counts = collections.Counter()
        self._original = pytest.raises

    def pytest_sessionstart(self, session):
        def counting(*args, **kwargs):
            self.counts[os.path.basename(inspect.stack()[1].filename)] += 1
            return self._original(*args, **kwargs)

        pytest.raises = counting

    def pytest_sessionfinish(self, session):
        pytest.raises = self._original


def main() -> int:
    counter = RaisesCounter()
    args = [
        os.path.join(ROOT, "tests"),
        "-q",
        "-p",
        "no:warnings",
        "-o",
        "addopts=",
        "--deselect",
        os.path.join(ROOT, "tests", "test_ddp.py"),
        "-k",
        SELECT,
        *sys.argv[1:],
    ]
    rc = pytest.main(args, plugins=[counter])
    for name, n in sorted(counter.counts.items()):
        print(f"{n:4d}  {name}")
    print(f"{sum(counter.counts.values()):4d}  total")
    return int(rc)


if __name__ == "__main__":
    sys.exit(main())
