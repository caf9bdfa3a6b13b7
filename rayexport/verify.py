"""`python -m rayexport.verify URI`: re-run the export checks on an existing export.

Exit 0 only when URI holds a committed export (its manifest) and every check passes.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from rayexport.common.errors import ExportError, print_error
from rayexport.common.levels import FULL, QUICK
from rayexport.orchestration.options import parse_size
from rayexport.storage.settings import storage_options_from_env
from rayexport.storage.store import Store
from rayexport.transport.manifest import MANIFEST_NAME, read_manifest
from rayexport.verification.expected import ExpectedExport
from rayexport.verification.outcome import verify_export
from rayexport.verification.serving import ENGINES, ServeRequest, serve_request

# What an export with the default --bucket-size (1 GiB) allows: two buckets and 1 GiB.
DEFAULT_MEMORY_BOUND = "3GiB"


def verify_uri(
    uri: str, level: str | None = None, storage_options: dict | None = None, timeout_s: float = 1800,
    memory_bound: int | str = DEFAULT_MEMORY_BOUND, serve: ServeRequest | None = None,
) -> dict:
    """Check the committed export at `uri` against its manifest; raise ExportError naming the
    first problem, else return each check's numbers. The reload stays within `memory_bound`
    bytes above its start-up footprint, streaming the weights of a larger model; `serve` adds
    a serving engine's check (vLLM, on this machine's GPU where torch finds one)."""
    store = Store(uri, storage_options_from_env(storage_options))
    manifest = read_manifest(store)
    if manifest is None:
        raise ExportError(f"'{uri}' is not a committed export (no {MANIFEST_NAME})")
    try:
        expected = replace(ExpectedExport.from_manifest(manifest, level), serve=serve)
    except (KeyError, TypeError, AttributeError) as error:
        raise ExportError(f"'{store.display(MANIFEST_NAME)}' is not a rayexport manifest: missing {error}") from None
    return verify_export(store, expected, timeout_s, parse_size(memory_bound))


def main(argv: list[str] | None = None) -> int:
    """The command line: 0 when URI verifies, 1 with the first problem's line."""
    parser = argparse.ArgumentParser(prog="python -m rayexport.verify", description=__doc__.splitlines()[0])
    parser.add_argument("uri", help="an export's location (any fsspec URI)")
    parser.add_argument("--level", choices=(FULL, QUICK), help="default: the level the export was verified at")
    parser.add_argument("--storage-options", type=json.loads, default={}, metavar="JSON")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--memory-bound", default=DEFAULT_MEMORY_BOUND, metavar="SIZE",
                        help=f"most memory the reload may hold above its start-up (default {DEFAULT_MEMORY_BOUND})")
    parser.add_argument("--serve-check", choices=ENGINES, help="also have a serving engine build the export and "
                        "generate from it, each token transformers' top choice on the same prefix")
    parser.add_argument("--vllm-python", metavar="PATH", help="the Python that runs the vLLM check (default: this one)")
    parser.add_argument("--json", action="store_true", help="print the checks' numbers as JSON")
    args = parser.parse_args(argv)
    try:
        serve = serve_request(args.serve_check, args.vllm_python)
        result = verify_uri(args.uri, args.level, args.storage_options, args.timeout, args.memory_bound, serve)
    except ExportError as error:
        return print_error(error)
    print(json.dumps(result, indent=2) if args.json else f"verified {args.uri} ({result['level']}): "
          + ", ".join(result["checks"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
