"""Orchestration: plan on the driver, run the worker actors, verify in a separate task, commit.

Any failure kills every actor, removes the placement group, and leaves DST without a manifest.
"""

from __future__ import annotations

import contextlib
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterator

from rayexport.dtypes import nbytes
from rayexport.errors import ExportError
from rayexport.group import WorkerGroup
from rayexport.layouts.dcp import DcpCheckpoint, accelerate_model_folder, find_dcp_checkpoint, is_dcp_checkpoint
from rayexport.layouts.verl import RANK_FILE, VerlCheckpoint, find_verl_checkpoint
from rayexport.manifest import MANIFEST_NAME, build_manifest, commit, read_manifest
from rayexport.memory import peak_rss_bytes
from rayexport.model import describe_model, generated_files, hf_folder
from rayexport.options import ExportOptions
from rayexport.plan.formats import ModelFormats
from rayexport.plan.naming import LoraRequest, TensorPlanning, choose_dtype, plan_holdings
from rayexport.plan.schedule import ShardFile, plan_shard_files, plan_transfer, safetensors_order
from rayexport.report import ExportReport
from rayexport.storage import Store, storage_options_from_env
from rayexport.ties import check_tied_values
from rayexport.lora import ADAPTER_WEIGHTS
from rayexport.verification import ExpectedExport, conclude

log = logging.getLogger(__name__)


@contextlib.contextmanager
def _stage(seconds: dict[str, float], name: str) -> Iterator[dict[str, int]]:
    """Time one stage into `seconds`; the body may set `moved["bytes"]`, and a stage that ends
    well logs one line: its bytes, seconds and rate."""
    started = time.perf_counter()
    moved: dict[str, int] = {}
    try:
        yield moved
    finally:
        seconds[name] = round(time.perf_counter() - started, 3)
    if "bytes" in moved:
        rate = moved["bytes"] / max(seconds[name], 1e-3)
        log.info("%s: %.2f GB in %.1f s (%.0f MB/s)", name, moved["bytes"] / 1e9, seconds[name], rate / 1e6)
    else:
        log.info("%s: %.1f s", name, seconds[name])


def export(src: str, dst: str, **options: Any) -> ExportReport:
    """Export the checkpoint at `src` to a Hugging Face model at `dst`; see `ExportOptions`."""
    return run_export(ExportOptions(src=src, dst=dst, **options))


def run_export(options: ExportOptions, group_type: type[WorkerGroup] | None = None) -> ExportReport:
    """The whole export: plan, gather and write with Ray actors, verify, commit the manifest.

    `group_type` runs the workers and the verification some other way than on Ray (a
    `WorkerGroup` subclass; benchmarks/gpu_check.py uses local processes)."""
    group_type = group_type or WorkerGroup
    seconds: dict[str, float] = {}
    job_deadline = time.monotonic() + options.deadline_s
    storage_options = storage_options_from_env(options.storage_options)
    source = Store(options.src, storage_options)
    destination = Store(options.dst, storage_options)
    base_model = Store(options.base_model, storage_options) if options.base_model else None
    with _stage(seconds, "plan"):
        _check_destination(source, destination)
        trainer_folder = source
        source, checkpoint = find_checkpoint(source, options)
        existing = read_manifest(destination)
        if existing is not None:
            if _same_export(existing, checkpoint, options) and not options.force:
                return _already_committed(options, checkpoint, existing)
            if not options.force:
                raise ExportError(
                    f"'{destination.uri}' already holds a committed export of "
                    f"{existing.get('source')} with other options; pass --force to replace it"
                )
        # The rest of planning runs in a thread while Ray, the actors and their process group
        # start here (Ray's signal handlers need the main thread).
        describing = _in_background(
            _prepare, destination, existing is not None, source, trainer_folder, checkpoint, base_model, options, storage_options
        )
    with _stage(seconds, "start_workers"):
        try:
            group = _start_group(group_type, options, checkpoint.world_size, job_deadline)
        except BaseException:
            with contextlib.suppress(BaseException):  # the start's error is the one to report
                describing.result()
            raise
    num_workers = group.size
    try:
        with _stage(seconds, "describe_model"):  # what is left of it once the workers are up
            model = describing.result()
        formats = model["formats"]
        with _stage(seconds, "load") as moved:
            all_aliases = {**formats.memory.aliases, **formats.disk.aliases}
            rank_infos, holders, worker_of_rank = group.load_checkpoint(source, checkpoint, all_aliases)
            base_infos = group.load_base_model(base_model) if base_model else None
            moved["bytes"] = sum(nbytes(info.local_shape, info.dtype) for infos in rank_infos.values() for info in infos.values())
        source_finite = _check_finite(rank_infos, options.strict)
        lora = LoraRequest(
            options.lora, checkpoint.lora_meta, {"lora_alpha": options.lora_alpha, "use_rslora": options.lora_rslora},
            model["fan_in_fan_out"],
        )
        dtype, dtype_reason = choose_dtype(options.dtype, model["config_dtype"])
        log.info("writing %s tensors: %s", dtype, dtype_reason)

        def plan(untied: frozenset[str]) -> TensorPlanning:
            return plan_holdings(holders, formats, options.format, dtype, lora, base_infos, untied)

        planning, untied = _plan_ties(plan, group, options.untie)
        if planning.naming != planning.format:
            log.info("converting the checkpoint's %s names to the %s format", planning.naming, planning.format)
        shard_files, split = plan_shard_files(planning.tensors, options.max_shard_size)
        adapter_files = [ShardFile(ADAPTER_WEIGHTS, tuple(plan.name for plan in safetensors_order(planning.adapters)))] if planning.adapters else []
        by_name = {plan.name: plan for plan in planning.tensors + planning.adapters}
        transfer = plan_transfer(
            shard_files + adapter_files, by_name, worker_of_rank, num_workers, options.bucket_size, options.writers
        )
        level = "full" if options.verify == "auto" else options.verify
        source_pieces = group.source_pieces(planning, worker_of_rank) if level != "none" else {}
        carried = {**model["carried"], **generated_files(model["config"], planning, bool(untied), options)}
        with _stage(seconds, "transfer") as moved:
            result, worker_stats = group.transfer(transfer, by_name, split, destination, carried)
            moved["bytes"] = sum(record["size"] for record in result["files"].values())
        tensors = {
            plan.name: {"dtype": plan.dtype, "shape": list(plan.shape), "sha256": result["tensor_digests"][plan.name]}
            for plan in by_name.values()
        }
        expected = ExpectedExport(
            files=result["files"], tensors=tensors, tied=_tied_pairs(formats, planning, untied), adapter=bool(planning.adapters),
            pieces=source_pieces, level=level, trust_remote_code=options.trust_remote_code, format=planning.format,
            source_finite=source_finite,
        )
        with _stage(seconds, "verify_files") as moved:
            checks = verify_files(group, destination, expected, worker_stats)
            moved["bytes"] = checks["files"]["bytes_read"] if checks else 0
        for stats, memory in zip(worker_stats, group.memory()):  # the peaks, verification included
            stats.update(memory)
    except BaseException:
        group.shutdown(graceful=False)  # a failed export's workers are removed, never pooled
        raise
    group.shutdown()

    with _stage(seconds, "reload"):
        verification = _with_reload(checks, group_type, destination, expected, options, job_deadline)
    # measurements, not properties of the export: the report has them, the manifest does not
    reload = verification.get("checks", {}).get("reload", {})
    reload_peak, reload_start = reload.pop("peak_rss_bytes", None), reload.pop("startup_rss_bytes", None)
    manifest = build_manifest(
        source=source.uri,
        layout=checkpoint.layout,
        world_size=checkpoint.world_size,
        options=options.recorded(),
        expected=expected.to_manifest(),
        verification=verification,
    )
    with _stage(seconds, "commit"):
        commit(destination, manifest)
    return ExportReport(
        source=source.uri,
        destination=destination.uri,
        manifest=destination.display(MANIFEST_NAME),
        layout=checkpoint.layout,
        world_size=checkpoint.world_size,
        workers=num_workers,
        backend=group.devices.backend,
        backend_reason=group.devices.reason,
        naming=planning.naming,
        format=planning.format,
        dtype=dtype,
        dtype_reason=dtype_reason,
        tensor_count=len(tensors),
        seconds=seconds,
        bytes={
            "read": sum(stats["bytes_read"] for stats in worker_stats),
            "gathered": sum(stats["bytes_received"] for stats in worker_stats),
            "written": sum(record["size"] for record in result["files"].values()),
        },
        peak_rss_bytes={
            "driver": peak_rss_bytes(),
            **{f"worker{stats['worker']}": stats["peak_rss_bytes"] for stats in worker_stats},
            **({"reload": reload_peak} if reload_peak is not None else {}),
        },
        working_memory_bytes={
            **{f"worker{stats['worker']}": stats["working_memory_bytes"] for stats in worker_stats},
            **({"reload": reload_peak - reload_start} if reload_peak is not None and reload_start is not None else {}),
        },
        peak_gpu_bytes={
            f"worker{stats['worker']}": stats["peak_gpu_bytes"] for stats in worker_stats if stats["peak_gpu_bytes"] is not None
        },
        files_by_worker={f"worker{stats['worker']}": stats["files_written"] for stats in worker_stats},
        placement={
            f"worker{stats['worker']}": {"node": stats["node"], "pid": stats["pid"], "device": stats["device"]}
            for stats in worker_stats
        },
        warm_start=group.reused,
        files=result["files"],
        verification=verification,
        skipped=list(getattr(checkpoint, "skipped", [])),
    )


def _prepare(
    destination: Store, replacing: bool, source: Store, trainer_folder: Store, checkpoint, base_model: Store | None,
    options: ExportOptions, storage_options: dict[str, Any],
) -> dict[str, Any]:
    """Ready the destination (uncommit an export being replaced, abort uploads a killed run
    left, probe that it takes writes) and describe the model the checkpoint holds."""
    if replacing:
        destination.delete(MANIFEST_NAME)  # uncommit first: a half-rewritten export must not look done
    for key in destination.abort_uploads():
        log.warning("aborted an unfinished upload left by an earlier run: %s", key)
    hf_config = Store(options.hf_config, storage_options) if options.hf_config else None
    if hf_config is None and source is not trainer_folder and trainer_folder.exists("config.json"):
        hf_config = trainer_folder  # a Trainer checkpoint keeps config and tokenizer beside the model folder
    model = describe_model(hf_folder(source, checkpoint, hf_config, base_model), base_model, options)
    destination.write_bytes(".rayexport-write-probe", b"")
    destination.delete(".rayexport-write-probe")
    return model


def _in_background(function, *args) -> Future:
    """Run `function(*args)` in a thread of its own; the future gives its result or error."""
    background = ThreadPoolExecutor(1, thread_name_prefix="rayexport-plan")
    future = background.submit(function, *args)
    background.shutdown(wait=False)
    return future


def _start_group(group_type: type[WorkerGroup], options: ExportOptions, world_size: int, job_deadline: float) -> WorkerGroup:
    """Size and start the worker group; on failure, remove whatever of it had started."""
    group = group_type.for_export(options, world_size, job_deadline)
    try:
        group.start()
    except BaseException:
        group.shutdown(graceful=False)
        raise
    return group


def _plan_ties(plan, group: WorkerGroup, untie: bool) -> tuple[TensorPlanning, frozenset[str]]:
    """Plan, then compare every tied pair the checkpoint holds twice: different values stop the
    export, or with `untie` are kept as separate tensors (re-planned with those aliases untied).
    Returns the planning and the aliases untied (in the checkpoint's naming)."""
    planning = plan(frozenset())
    differences = group.tied_differences(planning.tied_key_pairs)
    tied_values = {}
    for pair, keys in zip(planning.resolution.to_compare, planning.tied_key_pairs):
        if keys not in differences:
            raise ExportError(
                f"tied tensors '{keys[0]}' and '{keys[1]}' were read by different workers and "
                f"could not be compared; refusing to drop '{keys[1]}' unchecked"
            )
        tied_values[pair] = differences[keys]
    untied = frozenset(alias for (_, alias), difference in tied_values.items() if difference != 0.0)
    if not (untied and untie):
        check_tied_values(tied_values)
        return planning, frozenset()
    log.warning("untying %s: their saved values differ from the tensors they were tied to", sorted(untied))
    return plan(untied), untied


def find_checkpoint(source: Store, options: ExportOptions) -> tuple[Store, VerlCheckpoint | DcpCheckpoint]:
    """The checkpoint at `source`, read by the layout `--layout` names or, with `auto`, the one
    its files show (`.metadata`: DCP; rank files: verl). An accelerate checkpoint folder with no
    checkpoint files of its own is read from its model folder (`pytorch_model_fsdp_0/`).
    Returns the folder the checkpoint is in, and the checkpoint."""
    found = _layout_of_files(source)
    if found is None:
        model_folder = accelerate_model_folder(source)
        if model_folder is not None:
            log.info("reading the model checkpoint '%s'", source.display(model_folder))
            source = source.child(model_folder)
            found = _layout_of_files(source)
    layout = (found or "verl") if options.layout == "auto" else options.layout
    if layout == "dcp":
        return source, find_dcp_checkpoint(source, options.dcp_prefix, unsafe_pickle=options.unsafe_pickle)
    return source, find_verl_checkpoint(source)


def _layout_of_files(source: Store) -> str | None:
    """The layout the files directly under `source` are in, None when they are in neither."""
    files = source.list()
    if is_dcp_checkpoint(source) or any(name.endswith(".distcp") for name in files):
        return "dcp"
    return "verl" if any(RANK_FILE.match(name) for name in files) else None


def _check_finite(rank_infos: dict[int, dict[str, Any]], strict: bool) -> bool:
    """NaN or Inf in the weights: a warning naming the tensors, or with --strict the end.
    Returns whether every weight is finite."""
    bad = sorted({key for infos in rank_infos.values() for key, info in infos.items() if not info.finite})
    if not bad:
        return True
    message = f"tensor '{bad[0]}' holds NaN or Inf" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")
    if strict:
        raise ExportError(message + " (--strict)")
    log.warning("%s; exporting anyway (--strict refuses)", message)
    return False


def verify_files(group: WorkerGroup, destination: Store, expected: ExpectedExport, worker_stats: list[dict]) -> dict[str, Any] | None:
    """Every writer re-reads the files it wrote, all at once; the structure check puts what they
    found together (see `rayexport.verification.conclude`). None with `--verify none`."""
    if expected.level == "none":
        return None
    written = {stats["worker"]: stats["files_written"] for stats in worker_stats}
    return conclude(destination, group.check_files(destination, expected, written), expected)


def _with_reload(
    checks: dict[str, Any] | None, group_type: type[WorkerGroup], destination: Store, expected: ExpectedExport,
    options: ExportOptions, job_deadline: float,
) -> dict[str, Any]:
    """The verification's outcome: the file checks' numbers and the reload's."""
    if checks is None:
        return {"passed": None, "level": "none"}
    reload = group_type.reload(destination, expected, options, job_deadline)
    if reload.get("reason"):
        log.warning("verification: %s", reload["reason"])
    return {"passed": True, "level": expected.level, "checks": {**checks, "reload": reload}}


def _check_destination(source: Store, destination: Store) -> None:
    if type(source.fs) is type(destination.fs) and (
        destination.root == source.root or destination.root.startswith(source.root.rstrip("/") + "/")
    ):
        raise ExportError(f"destination '{destination.uri}' is inside source '{source.uri}'")


def _same_export(manifest: dict[str, Any], checkpoint: VerlCheckpoint | DcpCheckpoint, options: ExportOptions) -> bool:
    return manifest.get("source") == checkpoint.uri and manifest.get("options") == options.recorded()


def _already_committed(
    options: ExportOptions, checkpoint: VerlCheckpoint | DcpCheckpoint, manifest: dict[str, Any]
) -> ExportReport:
    log.info("%s already holds a committed export of %s", options.dst, checkpoint.uri)
    return ExportReport(
        source=checkpoint.uri, destination=options.dst, manifest=f"{options.dst.rstrip('/')}/{MANIFEST_NAME}",
        layout=checkpoint.layout, world_size=checkpoint.world_size, workers=0, backend="none",
        tensor_count=manifest.get("tensor_count", 0), files=manifest.get("files", {}),
        verification=manifest.get("verification", {}), already_committed=True,
    )


def _tied_pairs(formats: ModelFormats, planning: TensorPlanning, untied: frozenset[str]) -> list[tuple[str, str]]:
    """The (canonical, alias) pairs, by in-memory name, that the reload must find sharing memory."""
    untied_in_memory = {formats.memory_name(planning.naming, alias) for alias in untied}
    return sorted(
        (canonical, alias) for alias, canonical in formats.memory.aliases.items() if alias not in untied_in_memory
    )
