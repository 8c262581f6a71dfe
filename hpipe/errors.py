"""The one exception type hpipe shows to users.

Anything raised as `HpipeError` is printed by the CLI as a single line (`hpipe: error: ...`) with
a non-zero exit and no traceback. The message should say what is wrong, where, and what to change.
"""


class HpipeError(Exception):
    """A user-facing error: bad input, a missing file, a model or plan that does not fit."""
