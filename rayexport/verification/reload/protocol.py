"""What the reload's parent and child agree on: the modes the child runs in, the fields of its
result that name key problems, and both ends of the tensor channel over the child's stdin and
stdout (requests as JSON lines, answers as a JSON line and the tensor's bytes)."""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import subprocess
from typing import IO, Any, Callable, Iterator

from rayexport.storage.store import Store
from rayexport.verification import VerificationError
from rayexport.verification.reading import READ_BLOCK, stream_ranges

KEYS_ONLY = "keys-only"
LOADED_IN_MEMORY = "in-memory"
STREAMED = "streamed"
MODES = (KEYS_ONLY, LOADED_IN_MEMORY, STREAMED)
KEY_FIELDS = ("missing_keys", "unexpected_keys", "mismatched_keys")
# The child's only argument when it is started ahead of its check: it reads its command line,
# a JSON list, as the channel's first line.
WAIT_FOR_ARGUMENTS = "--wait-for-arguments"


# ---------------------------------------------------------------- the parent's end


class TensorServer:
    """The parent's answers to the child's requests: a tensor of the export's table, read from
    the store a block at a time (`stream_ranges`), so the parent holds at most READ_AHEAD + 1
    blocks (those in flight and the one being sent) whatever the tensor's size."""

    def __init__(self, store: Store, table: dict[str, dict[str, Any]]) -> None:
        self.store, self.table = store, table

    def answer(self, name: str, pipe: IO[bytes]) -> None:
        """Write the tensor `name`'s byte count as a JSON line, then its bytes, to `pipe`."""
        entry = self.table.get(name)
        if entry is None:
            pipe.write(json.dumps({"error": f"tensor '{name}' is not in the export"}).encode() + b"\n")
            pipe.flush()
            return
        pipe.write(json.dumps({"bytes": entry["end"] - entry["start"]}).encode() + b"\n")
        for data in self._blocks(entry):
            pipe.write(data)
        pipe.flush()

    def _blocks(self, entry: dict[str, Any]) -> Iterator[bytes]:
        ranges = [(start, min(start + READ_BLOCK, entry["end"])) for start in range(entry["start"], entry["end"], READ_BLOCK)]
        with contextlib.closing(stream_ranges(self.store, entry["file"], ranges)) as blocks:
            for (start, end), data in zip(ranges, blocks):
                if len(data) != end - start:
                    raise VerificationError(f"reload: shard {entry['file']} ends before the tensors its header describes")
                yield data


def converse(process: subprocess.Popen, server: TensorServer) -> dict[str, Any] | None:
    """Answer the child's requests until it sends its result (None: it ended without one)."""
    for line in process.stdout:
        message = json.loads(line)
        if "result" in message:
            return message["result"]
        try:
            server.answer(message["tensor"], process.stdin)
        except BrokenPipeError:
            return None  # the child died mid-answer; its stderr says why
    return None


# ---------------------------------------------------------------- the child's end


def private_channel() -> tuple[IO[bytes], IO[bytes]]:
    """This process's stdin and stdout as the channel to the parent (requests out, answers in),
    with fds 0 and 1 pointed elsewhere so nothing a library or remote code prints or reads can
    disturb it."""
    answers = os.fdopen(os.dup(0), "rb")
    requests = os.fdopen(os.dup(1), "wb")
    with open(os.devnull, "rb") as empty:
        os.dup2(empty.fileno(), 0)
    os.dup2(2, 1)
    return requests, answers


def parent_reader(requests: IO[bytes], answers: IO[bytes]) -> Callable[[str], mmap.mmap]:
    """Reads a tensor's bytes from the parent, which reads them from storage for this process
    (which has no credentials)."""
    def read(name: str) -> mmap.mmap:
        requests.write(json.dumps({"tensor": name}).encode() + b"\n")
        requests.flush()
        header = json.loads(answers.readline() or b'{"error": "the parent closed the channel"}')
        if "error" in header:
            raise OSError(header["error"])
        return read_exactly(answers, header["bytes"], f"tensor '{name}' from the parent")

    return read


def read_arguments(answers: IO[bytes]) -> list[str] | None:
    """The command line the parent sends a child started ahead of its check; None when the
    parent closed the channel first (it had no check for this process)."""
    line = answers.readline()
    return json.loads(line) if line else None


def send_result(requests: IO[bytes], result: dict[str, Any]) -> None:
    """The child's last message: its result."""
    requests.write(json.dumps({"result": result}).encode() + b"\n")
    requests.flush()


def read_exactly(handle: IO[bytes], size: int, what: str) -> mmap.mmap:
    """`size` bytes of `handle` (`what` names them in the EOFError when it ends early), in a
    buffer of their own."""
    # An anonymous map of its own goes back to the system as soon as the tensor is dropped,
    # where malloc would keep freed blocks of a few MiB in its heap, growing from layer to layer.
    buffer = mmap.mmap(-1, size)
    view, filled = memoryview(buffer), 0
    while filled < size:
        count = handle.readinto(view[filled:])
        if not count:
            raise EOFError(f"{what} ends after {filled} of its {size} bytes")
        filled += count
    return buffer
