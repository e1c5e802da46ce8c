"""``python -m fedlightning.sweep SWEEP.yaml [--out DIR] [--runs N] [--seed S] [--dry-run]``.

Ctrl-C or SIGTERM (which the runner turns into ``KeyboardInterrupt`` after stopping the run in progress) ends the
process with one last line instead of a traceback, and exit status 130 (Ctrl-C) or 143 (SIGTERM), the shell's
statuses for those signals."""

import signal
import sys

from fedlightning.sweep.runner import main

__all__ = []

try:
    code = main()
except KeyboardInterrupt as err:
    terminated = str(err) == f"signal {int(signal.SIGTERM)}"
    sys.stderr.write(
        f"stopped: the sweep {'received SIGTERM' if terminated else 'was interrupted (Ctrl-C)'}; the run in progress "
        "was stopped and runs again, under its name, when the same command is given again\n"
    )
    code = 143 if terminated else 130
sys.exit(code)
