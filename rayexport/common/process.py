"""Ending a process that is done: its exit handlers run and its output is flushed, but the
interpreter's teardown of its modules (torch's and transformers' take a second or two) is
skipped, since nothing after it depends on it."""

from __future__ import annotations

import atexit
import logging
import os
import sys


def exit_without_teardown(code: int) -> None:
    """Exit with `code` once every exit handler has run and the output is flushed."""
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
