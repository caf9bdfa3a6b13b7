"""The command line: `python -m rayexport.run --src URI --dst URI [options]` or `--demo`."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import traceback

from rayexport.errors import ExportError, one_line
from rayexport.options import BACKENDS, DTYPES, LAYOUTS, LORA_MODES, VERIFY_LEVELS, ExportOptions


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m rayexport.run",
        description="Export a sharded FSDP checkpoint to a verified Hugging Face model.",
    )
    parser.add_argument("--src", help="checkpoint prefix (local path, file://, s3://, any fsspec URI)")
    parser.add_argument("--dst", help="where the Hugging Face model is written")
    parser.add_argument("--demo", action="store_true", help="export a tiny embedded FSDP2 checkpoint")
    parser.add_argument("--cleanup", metavar="DST", help="abort unfinished multipart uploads under DST, then exit")
    parser.add_argument("--watch", metavar="PREFIX", help="export every checkpoint under PREFIX not yet exported")
    parser.add_argument("--pattern", default="global_step_*/actor", help="--watch: checkpoint glob under PREFIX")
    parser.add_argument("--dst-template", help="--watch: destination with {step} and/or {name}")
    parser.add_argument("--once", action="store_true", help="--watch: one pass, then exit (for cron)")
    parser.add_argument("--interval", type=float, default=600.0, help="--watch: seconds between passes")
    parser.add_argument("--settle", type=float, default=5.0,
                        help="--watch: a checkpoint's files must not change for this many seconds")
    parser.add_argument("--layout", choices=LAYOUTS, default="auto",
                        help="verl rank files or a PyTorch DCP directory (auto: from the files present)")
    parser.add_argument("--hf-config", metavar="URI", help="HF folder with config.json/tokenizer when SRC has no huggingface/")
    parser.add_argument("--dcp-prefix", help="key prefix of the model in a DCP state dict (default: detected)")
    parser.add_argument("--workers", type=int, help="worker actors (default: min(world size, cluster CPUs))")
    parser.add_argument("--writers", type=int, default=1,
                        help="workers that each write a disjoint share of the output files (default 1: worker 0)")
    parser.add_argument("--backend", choices=BACKENDS, default="auto",
                        help="nccl (a whole GPU per worker) or gloo (CPUs); auto: nccl only when every worker "
                             "finds a whole free GPU at the start, else gloo (the log says why)")
    parser.add_argument("--bucket-size", default="1GiB", help="bytes gathered per step (default 1GiB)")
    parser.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto", help="output dtype (auto: the config's)")
    parser.add_argument("--storage-options", type=json.loads, default={}, metavar="JSON",
                        help="fsspec/s3fs options, e.g. '{\"endpoint_url\": \"http://...\"}'")
    parser.add_argument("--trust-remote-code", action="store_true", help="allow the model's own code to run")
    parser.add_argument("--verify", choices=VERIFY_LEVELS, default="auto",
                        help="checks before commit: full (every tensor, reload and forward pass), quick "
                             "(a sample, keys only), none; auto = full up to 8 GB, else quick")
    parser.add_argument("--force", action="store_true", help="replace a committed export at DST")
    parser.add_argument("--lora", choices=LORA_MODES, default="merge",
                        help="LoRA checkpoints: merge into the base, write the adapter, or both")
    parser.add_argument("--base-model", metavar="URI", help="HF model folder with the base weights of a LoRA-only checkpoint")
    parser.add_argument("--lora-alpha", type=float, help="LoRA alpha when lora_train_meta.json lacks it")
    parser.add_argument("--lora-rslora", action="store_true", default=None, help="the adapter was trained with rsLoRA")
    parser.add_argument("--untie", action="store_true",
                        help="tied tensors whose saved values differ: keep both and untie the config")
    parser.add_argument("--strict", action="store_true", help="fail on NaN/Inf weights instead of warning")
    parser.add_argument("--unsafe-pickle", action="store_true",
                        help="load rank files with the full unpickler (runs code in them; trusted files only)")
    parser.add_argument("--timeout", type=float, default=1800.0, dest="timeout_s",
                        help="deadline in seconds for each distributed step and the verification")
    parser.add_argument("--deadline", type=float, default=86400.0, dest="deadline_s",
                        help="deadline in seconds for the whole export, start to commit (default 1 day)")
    parser.add_argument("--pool", metavar="NAME",
                        help="keep the worker actors alive in the warm pool NAME for the next export (see README)")
    parser.add_argument("--num-cpus-per-worker", type=float, default=1.0)
    parser.add_argument("--num-gpus-per-worker", type=float,
                        help="GPUs each worker reserves (default: 1 when the backend is nccl, 0 with gloo; "
                             "0 keeps the export off the GPUs; nccl needs a whole number)")
    parser.add_argument("--placement-timeout", type=float, default=60.0, dest="placement_timeout_s", metavar="S",
                        help="seconds to wait for the cluster to place the workers before failing with what "
                             "is missing (default 60; raise it where nodes are added on demand)")
    parser.add_argument("--report", metavar="PATH|-", help="write the report as JSON to PATH or stdout")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("--debug", action="store_true", help="full tracebacks on errors")
    return parser


OPTION_NAMES = (
    "workers", "writers", "backend", "bucket_size", "max_shard_size", "dtype", "storage_options",
    "trust_remote_code", "verify", "force", "timeout_s", "deadline_s", "num_cpus_per_worker", "num_gpus_per_worker",
    "placement_timeout_s", "log_level",
    "lora", "base_model", "lora_alpha", "lora_rslora", "untie", "strict", "unsafe_pickle",
    "layout", "hf_config", "dcp_prefix", "pool",
)


def options_from(args: argparse.Namespace) -> dict:
    """The ExportOptions fields the command line set."""
    return {name: getattr(args, name) for name in OPTION_NAMES}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(levelname)s %(name)s: %(message)s")
    if args.cleanup:
        return cleanup(args.cleanup, args.storage_options)
    if args.watch:
        if not args.dst_template:
            parser.error("--watch needs --dst-template")
        return watch_command(args, options_from(args))
    if not args.demo and not (args.src and args.dst):
        parser.error("--src and --dst are required (or --demo, or --cleanup DST)")
    options = options_from(args)
    try:
        if args.demo:
            from rayexport.demo import run_demo

            options["workers"] = options["workers"] or 2
            report = run_demo(args.dst, **options)
        else:
            from rayexport.job import run_export

            report = run_export(ExportOptions(src=args.src, dst=args.dst, **options))
    except ExportError as error:
        if args.debug:
            traceback.print_exc()
        print(f"rayexport: error: {one_line(error)}", file=sys.stderr)
        return 1
    except Exception as error:  # noqa: BLE001 - one line for anything unexpected, unless --debug
        if args.debug:
            traceback.print_exc()
        print(f"rayexport: internal error: {type(error).__name__}: {one_line(error)}", file=sys.stderr)
        return 2
    print(report.summary())
    if args.report == "-":
        print(report.to_json())
    elif args.report:
        with open(args.report, "w") as handle:
            handle.write(report.to_json())
    return 0


def watch_command(args: argparse.Namespace, options: dict) -> int:
    """`--watch PREFIX`: one pass with --once (exit 1 if an export failed), else poll."""
    from rayexport.storage import storage_options_from_env
    from rayexport.watch import watch, watch_once

    storage_options = storage_options_from_env(options.pop("storage_options"))
    try:
        if not args.once:
            watch(args.watch, args.pattern, args.dst_template, options, storage_options, args.interval, args.settle)
        results = watch_once(args.watch, args.pattern, args.dst_template, options, storage_options, args.settle)
    except ExportError as error:
        print(f"rayexport: error: {one_line(error)}", file=sys.stderr)
        return 1
    for result in results:
        print(f"{result['status']}: {result['source']} -> {result['destination']}")
    return 1 if any(result["status"] == "failed" for result in results) else 0


def cleanup(uri: str, storage_options: dict) -> int:
    """`--cleanup DST`: abort the multipart uploads a killed export left under DST."""
    from rayexport.storage import Store, storage_options_from_env

    try:
        aborted = Store(uri, storage_options_from_env(storage_options)).abort_uploads()
    except ExportError as error:
        print(f"rayexport: error: {error}", file=sys.stderr)
        return 1
    print(f"aborted {len(aborted)} unfinished upload(s) under {uri}" + "".join(f"\n  {key}" for key in aborted))
    return 0


if __name__ == "__main__":
    sys.exit(main())
