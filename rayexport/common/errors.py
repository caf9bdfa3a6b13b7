"""The one exception type a user sees, and the one line every command prints for an error."""

import sys
import traceback


class ExportError(Exception):
    """A failure the user can act on; its message is one line naming what is wrong."""


def one_line(error: BaseException | str) -> str:
    """An exception's text on one line, for messages built from another library's error."""
    return " ".join(str(error).split())


def print_error(error: BaseException, debug: bool = False) -> int:
    """Print `error` as every command does and return its exit code: `rayexport: error: <one
    line>` and 1 for an ExportError, `rayexport: internal error: <type>: <one line>` and 2 for
    anything else; with `debug`, the traceback first."""
    if debug:
        traceback.print_exception(error)
    if isinstance(error, ExportError):
        print(f"rayexport: error: {one_line(error)}", file=sys.stderr)
        return 1
    print(f"rayexport: internal error: {type(error).__name__}: {one_line(error)}", file=sys.stderr)
    return 2
