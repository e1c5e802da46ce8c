"""The papers' comparisons on offline data: ``experiments`` (what is run, as data), ``runner`` (run arguments,
in-process runs, the results cache), ``claims`` (verdicts), ``report`` (docs/results.md). Entry point:
``python benchmarks/reproduce.py``."""

import os

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # benchmarks/
ROOT = os.path.dirname(BENCH)  # the repository root
