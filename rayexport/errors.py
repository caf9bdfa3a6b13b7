"""The one exception type a user sees."""


class ExportError(Exception):
    """A failure the user can act on; its message is one line naming what is wrong."""


def one_line(error: BaseException | str) -> str:
    """An exception's text on one line, for messages built from another library's error."""
    return " ".join(str(error).split())
