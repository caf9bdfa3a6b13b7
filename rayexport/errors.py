"""The one exception type a user sees."""


class ExportError(Exception):
    """A failure the user can act on; its message is one line naming what is wrong."""
