"""Verification levels: what each `--verify` level checks before an export commits.

The one place the levels and their meanings are written down; the options, the workers, the
job, `rayexport.verify` and the checks themselves ask these helpers what a level does. It sits
at the bottom of the package (it imports nothing), so every layer can ask it.

- `auto`: what an export runs unless told otherwise: `full`, at any size (the reload streams a
  model larger than the memory bound).
- `full`: every byte of every file re-read once (each file's digest, every tensor's digest and
  its source pieces), and the reload loads the weights and runs a forward pass.
- `quick`: the small files whole, the weight files' headers and a deterministic sample of
  tensors' bytes, and the reload compares names and shapes with the model built on the meta
  device (the tokenizer still loads).
- `none`: no checks; the manifest records the export as unverified.
"""

from __future__ import annotations

from typing import Literal, get_args

Level = Literal["auto", "full", "quick", "none"]
AUTO: Level = "auto"
FULL: Level = "full"
QUICK: Level = "quick"
NONE: Level = "none"
LEVELS: tuple[Level, ...] = get_args(Level)


def resolved(requested: str) -> str:
    """The level an export verifies at when asked for `requested`: `auto` is `full`."""
    return FULL if requested == AUTO else requested


def runs_checks(level: str) -> bool:
    """Whether an export is verified at all before it commits."""
    return level != NONE


def reads_whole_files(level: str) -> bool:
    """Whether the file checks re-read every byte and check every tensor's values, rather than
    the small files, the headers and a sample of tensors."""
    return level != QUICK


def loads_weights(level: str) -> bool:
    """Whether the reload loads the weights and runs a forward pass, rather than comparing the
    tensors' names and shapes with the model built on the meta device."""
    return level != QUICK
