"""The one project error type: the CLI prints it as a one-line `error:` and exits 1."""


class FtError(Exception):
    """A user-facing failure: bad input, a missing file, a target that would not start."""
