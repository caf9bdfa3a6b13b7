"""The command line: `python -m rayexport.run --src URI --dst URI [options]` or `--demo`."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING, Callable

from rayexport.common.errors import ExportError, print_error
from rayexport.common.process import exit_without_teardown
from rayexport.orchestration.options import ExportOptions, add_option_arguments, options_from_arguments
from rayexport.orchestration.session import command_line_session, starts_own_ray
# imported here, before the session's thread imports the rest of the export's modules
from rayexport.orchestration.start import begin_export

if TYPE_CHECKING:
    from rayexport.orchestration.report import ExportReport


def build_parser() -> argparse.ArgumentParser:
    """What the command does (export, --demo, --watch, --cleanup) plus one flag per
    `ExportOptions` field, grouped as --help shows them."""
    parser = argparse.ArgumentParser(
        prog="python -m rayexport.run",
        description="Export a sharded FSDP checkpoint to a verified Hugging Face model.",
    )
    parser.add_argument("--demo", action="store_true", help="export a tiny embedded FSDP2 checkpoint")
    parser.add_argument("--cleanup", metavar="DST", help="abort unfinished multipart uploads under DST, then exit")
    parser.add_argument("--dry-run", action="store_true",
                        help="plan the export from metadata alone: each worker's bytes, files and memory, and the "
                        "estimated seconds at --rates; writes nothing, starts no Ray (joins RAY_ADDRESS's to place workers)")
    parser.add_argument("--report", metavar="PATH|-", help="write the report as JSON to PATH or stdout")
    parser.add_argument("--debug", action="store_true", help="full tracebacks on errors")
    add_option_arguments(parser)
    watch = parser.add_argument_group("scheduled exports (--watch)")
    watch.add_argument("--watch", metavar="PREFIX", help="export every checkpoint under PREFIX not yet exported")
    watch.add_argument("--pattern", default="global_step_*/actor",
                       help="checkpoint glob under PREFIX (default: global_step_*/actor)")
    watch.add_argument("--dst-template", help="destination with {step} and/or {name}")
    watch.add_argument("--once", action="store_true", help="one pass, then exit (for cron)")
    watch.add_argument("--interval", type=float, default=600.0, metavar="S", help="seconds between passes (default: 600)")
    watch.add_argument("--settle", type=float, default=5.0, metavar="S",
                       help="a checkpoint's files must not change for this many seconds (default: 5)")
    return parser


def main(argv: list[str] | None = None, whole_process: bool = False) -> int:
    """The command; `whole_process`: this process is the command itself (`python -m
    rayexport.run`), whose start and imports count in the report's seconds."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    if args.cleanup:
        return cleanup(args.cleanup, args.storage_options)
    options = options_from_arguments(args)
    source, destination = options.pop("src"), options.pop("dst")
    if args.watch:
        if not args.dst_template:
            parser.error("--watch needs --dst-template")
        return watch_command(args, options)
    if not args.demo and not (source and destination):
        parser.error("--src and --dst are required (or --demo, or --cleanup DST)")
    if args.demo:
        options["workers"] = options["workers"] or 2
    if args.dry_run:
        return dry_run_command(args, source, destination, options)
    seconds: dict[str, float] = {}
    try:
        # bad options are one line before Ray starts; the demo's source is written later
        export_options = ExportOptions(src=source or "", dst=destination or "", **options)
        if not args.demo:
            refuse_missing_local_source(source)
        with command_line_session(options["log_level"], seconds, whole_process) as imported:
            if args.demo:
                imported()
                from rayexport.demo import run_demo

                report = run_demo(export_options, seconds=seconds)
            else:
                report = export_started_first(export_options, seconds, imported)
    except Exception as error:  # noqa: BLE001 - one line for anything unexpected, unless --debug
        return print_error(error, args.debug)
    print(report.summary())
    write_report(args.report, report.to_json())
    return 0


def dry_run_command(args: argparse.Namespace, source: str, destination: str, options: dict) -> int:
    """`--dry-run`: print the plan and its cost (and with --report, write it as JSON)."""
    try:
        if args.demo:
            raise ExportError("--dry-run plans an export of --src to --dst; the demo writes its checkpoint as it runs")
        export_options = ExportOptions(src=source, dst=destination, **options)
        refuse_missing_local_source(source)
        from rayexport.orchestration.dry_run import run_dry_run

        result = run_dry_run(export_options)
    except Exception as error:  # noqa: BLE001 - one line for anything unexpected, unless --debug
        return print_error(error, args.debug)
    print(result.summary())
    write_report(args.report, result.to_json())
    return 0


def write_report(path: str | None, text: str) -> None:
    """--report: the JSON to stdout ("-") or a file."""
    if path == "-":
        print(text)
    elif path:
        with open(path, "w") as handle:
            handle.write(text)


def export_started_first(options: ExportOptions, seconds: dict[str, float], imported: Callable[[], None]) -> ExportReport:
    """Plan the export and start its workers, then wait for this process's own imports (torch,
    the export's later steps: `imported`), which load meanwhile, and run the rest."""
    started = begin_export(options, seconds=seconds)
    try:
        imported()
        from rayexport.orchestration.job import run_export
    except BaseException:
        if started.group is not None:
            started.group.shutdown(graceful=False)
        raise
    return run_export(options, seconds=seconds, started=started)


def refuse_missing_local_source(source: str) -> None:
    """Raise for a local `--src` (a path or file://) that does not exist, before the command
    starts its own Ray (seconds) rather than from the reader after it. Not where it joins a
    cluster (RAY_ADDRESS, or a Ray this process belongs to), whose rank files may sit on other
    nodes' own disks; other URIs are the readers' to check."""
    if not starts_own_ray():
        return
    path = source.removeprefix("file://")
    if "://" not in path and not os.path.exists(path):
        raise ExportError(f"source '{source}' does not exist")


def watch_command(args: argparse.Namespace, options: dict) -> int:
    """`--watch PREFIX`: one pass with --once (exit 1 if an export failed), else poll."""
    from rayexport.storage.settings import storage_options_from_env
    from rayexport.watch import watch, watch_once

    storage_options = storage_options_from_env(options.pop("storage_options"))
    try:
        if not args.once:
            watch(args.watch, args.pattern, args.dst_template, options, storage_options, args.interval, args.settle)
        results = watch_once(args.watch, args.pattern, args.dst_template, options, storage_options, args.settle)
    except ExportError as error:
        return print_error(error)
    for result in results:
        print(f"{result['status']}: {result['source']} -> {result['destination']}")
    return 1 if any(result["status"] == "failed" for result in results) else 0


def cleanup(uri: str, storage_options: dict) -> int:
    """`--cleanup DST`: abort the multipart uploads a killed export left under DST."""
    from rayexport.storage.store import Store
    from rayexport.storage.settings import storage_options_from_env

    try:
        aborted = Store(uri, storage_options_from_env(storage_options)).abort_uploads()
    except ExportError as error:
        return print_error(error)
    print(f"aborted {len(aborted)} unfinished upload(s) under {uri}" + "".join(f"\n  {key}" for key in aborted))
    return 0


def cli() -> None:
    """`python -m rayexport.run` and the `rayexport` command: the whole process is the command."""
    exit_without_teardown(main(sys.argv[1:], whole_process=True))


if __name__ == "__main__":
    cli()
