"""``python -m fedlightning.sweep SWEEP.yaml [--out DIR] [--runs N] [--seed S] [--dry-run]``."""

import sys

from fedlightning.sweep.runner import main

__all__ = []

sys.exit(main())
