"""Verification: the checks an export must pass before its manifest is written.

Every check reads the destination itself, by byte ranges, streamed; nothing downloads the
export. `files.check_files` re-reads some of the export's files (each writer runs it on the
files it wrote, all of them at once), `structure.conclude` puts what they found together with
the index, and the consumer checks (`consumers.CONSUMER_CHECKS`: the transformers reload, in a
process of its own, see `reload/`) load the export as its users will. `outcome` puts the
results together, and `verify_export` runs all of it from one process. Problems are reported
structure first, then integrity, then fidelity, so the first names the most basic thing wrong.
What each level checks is `rayexport.common.levels`'s.
"""

from __future__ import annotations

from rayexport.common.errors import ExportError


class VerificationError(ExportError):
    """An export failed a check; the message names the check and the tensor or file."""
