"""The one exception type for things a user can get wrong, and how a command ends on one.

The CLI turns a `UserError` into a single line on stderr and exit status 2;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable


class UserError(Exception):
    """A mistake in the user's input: the message names the problem and the fix."""


class RunFailed(Exception):
    """A run that stopped on a failure that is not the user's input (e.g. an XLA runtime
    error): the CLI prints the one-line message and exits with status 1."""


def reported(name: str, run: Callable[[], int | None]) -> int:
    """`run()`'s status; a UserError instead ends in one line on stderr and status 2, a
    RunFailed in one line and 1, Ctrl-C in one line and 130 (`plait` and the benchmark
    scripts, `name` leading the line)."""
    try:
        return run() or 0
    except UserError as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return 2
    except RunFailed as e:
        print(f"{name}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        print(f"{name}: interrupted" + (f"; {e}" if str(e) else ""), file=sys.stderr)
        return 130
