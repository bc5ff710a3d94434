"""Errors that speculum raises for a user's mistake.

The CLI turns a :class:`SpeculumError` into a one-line message and exit status 2, never a traceback.
"""


class SpeculumError(ValueError):
    """Bad input from the user: unknown model or method, invalid parameter, prompt too long, ..."""
