"""The one exception type for things a user can get wrong.

The CLI turns a `UserError` into a single line on stderr and exit status 2;
anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A mistake in the user's input: the message names the problem and the fix."""


class RunFailed(Exception):
    """A run that stopped on a failure that is not the user's input (e.g. an XLA runtime
    error): the CLI prints the one-line message and exits with status 1."""
