"""Orchestration: the export as its steps, around an `ExportPlan`: plan on the driver (while the
workers start), load, plan the output, transfer (scanning the source as it reads it), verify
the files, run the consumer checks (on worker 0, each in a process it started with the group),
commit, report; each phase timed.

Any failure kills every actor, removes the placement group, and leaves DST without a manifest.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Iterator, Protocol

from rayexport.common.digests import FAST
from rayexport.common.passes import summed as summed_passes
from rayexport.common.errors import ExportError
from rayexport.common.levels import resolved, runs_checks
from rayexport.common.memory import peak_rss_bytes
from rayexport.layouts.base import Checkpoint, Loaded
from rayexport.layouts.hf import base_model_folder
from rayexport.model.description import ModelDescription, generated_files
from rayexport.orchestration.export_plan import ExportPlan
from rayexport.orchestration.group import Transferred, WorkerGroup
from rayexport.orchestration.options import ExportOptions
from rayexport.orchestration.placement import NodePlacement
from rayexport.orchestration.progress import shown_progress
from rayexport.orchestration.references import (
    SourceScan, check_finite, scan_ahead, scanned_ahead, scanned_in_transfer, transfer_scan,
)
from rayexport.orchestration.report import ExportReport
from rayexport.orchestration.start import Started, begin_export
from rayexport.orchestration.worker_reports import WorkerStats
from rayexport.plan.cost import ExportCost, Rates, export_cost
from rayexport.plan.formats import ModelFormats
from rayexport.plan.lora import ADAPTER_WEIGHTS
from rayexport.plan.naming import LoraRequest, TensorPlan, TensorPlanning, choose_dtype, plan_holdings
from rayexport.plan.schedule import ShardFile, TransferPlan, plan_shard_files, plan_transfer, safetensors_order
from rayexport.plan.ties import check_tied_values
from rayexport.storage.store import Store
from rayexport.transport.manifest import MANIFEST_NAME, build_manifest, commit
from rayexport.transport.writer import shard_file_size
from rayexport.verification.consumers import consumer_warnings
from rayexport.verification.expected import ExpectedExport
from rayexport.verification.outcome import verification_outcome
from rayexport.verification.structure import conclude

log = logging.getLogger(__name__)


class ReadingGroup(Protocol):
    """The workers as planning sees them: how many, how many may write, how they share and read
    (describe) the checkpoint, and what each was given to read. A `WorkerGroup` reads the
    checkpoint; `--dry-run`'s `rayexport.orchestration.dry_run.PlannedGroup` its metadata only."""

    size: int
    nodes: NodePlacement  # the node each worker is pinned to, where it is
    writers_limit: int | None  # how many of the first workers may write; None: any
    read_bytes: dict[int, int]

    def load(self, checkpoint: Checkpoint, aliases: dict[str, str]) -> Loaded: ...

    def tied_differences(self, pairs: list[tuple[str, str]]) -> dict[tuple[str, str], float]: ...


@dataclass
class Source:
    """The checkpoint as the workers hold it, and the base model folder's tensors (LoRA-only)."""

    loaded: Loaded
    base_infos: dict | None


@dataclass
class OutputPlan:
    """The export's tensors, dtype, files and the gather that writes them."""

    planning: TensorPlanning
    converted: bool  # the checkpoint's tensors were renamed, split or merged into the format written
    untied: frozenset[str]  # tied aliases kept as tensors of their own (--untie)
    dtype: str | None
    dtype_reason: str
    by_name: dict[str, TensorPlan]
    split: Any  # huggingface_hub's StateDictSplit of the model's files, for the index
    transfer: TransferPlan


def export(src: str, dst: str, **options: Any) -> ExportReport:
    """Export the checkpoint at `src` to a Hugging Face model at `dst`; see `ExportOptions`."""
    return run_export(ExportOptions(src=src, dst=dst, **options))


def run_export(
    options: ExportOptions, group_type: type[WorkerGroup] | None = None, seconds: dict[str, float] | None = None,
    started: Started | None = None,
) -> ExportReport:
    """The whole export: plan, gather and write with Ray actors, verify, commit the manifest.

    `group_type` runs the workers and the verification some other way than on Ray (a
    `WorkerGroup` subclass; benchmarks/gpu_check.py uses local processes). `seconds` holds
    what was timed before (the command line's imports and Ray start); the report's stages
    continue it. `started`: what `begin_export` began already (the command line's start)."""
    started = started or begin_export(options, group_type, seconds)
    plan, describing, group = started.plan, started.describing, started.group
    if group is None:
        return _already_committed(plan)
    try:
        with shown_progress(group.progress_counts) as plan.progress:
            with plan.stage("describe_model"):  # what is left of it once the workers are up
                model = describing.result()
            with plan.stage("load") as moved:
                source = load_source(plan, group, model)
                moved["bytes"] = sum(group.read_bytes.values())
            with plan.stage("plan_files"):  # names, ties (compared on the workers), files, the gather
                output = plan_output(plan, group, model, source)
                cost = output_cost(plan, group, output)
            with _not_committed_on_failure():
                expected, written, checks, consumers = _write_and_check(plan, group, model, source, output)
                with plan.stage("reload"):  # what is left of it once the file checks are done
                    verification = _with_consumer_checks(checks, group, consumers, expected)
    except BaseException:
        group.shutdown(graceful=False)  # a failed export's workers are removed, never pooled
        raise
    finally:
        plan.progress = None
    with plan.stage("shutdown"):
        group.shutdown()
    # measurements, not properties of the export: the report has them, the manifest does not
    reload = verification.get("checks", {}).get("reload", {})
    reload_memory = reload.pop("peak_rss_bytes", None), reload.pop("startup_rss_bytes", None)
    reload_process = {name: reload.pop(name) for name in ("started_at", "imports_s", "waited_s") if name in reload}
    manifest = build_manifest(
        source=plan.source.uri, layout=plan.checkpoint.layout, world_size=plan.checkpoint.world_size,
        options=options.recorded(), expected=expected.to_manifest(), verification=verification,
    )
    with plan.stage("commit"), _not_committed_on_failure():
        commit(plan.destination, manifest)
    return _report(plan, group, output, written, verification, reload_memory, reload_process, cost)


def load_source(plan: ExportPlan, group: ReadingGroup, model: ModelDescription) -> Source:
    """The workers read their share of the checkpoint (tied copies together) and, for a
    LoRA-only checkpoint, the exporter the base model's weights."""
    loaded = group.load(plan.checkpoint, model.formats.tie_aliases())
    base_infos = None
    if plan.base_model is not None:
        base = group.load(base_model_folder(plan.base_model), {})
        (base_infos,) = base.rank_infos.values()
        loaded.worker_of_rank.update(base.worker_of_rank)
    return Source(loaded, base_infos)


def plan_output(plan: ExportPlan, group: ReadingGroup, model: ModelDescription, source: Source) -> OutputPlan:
    """Match the checkpoint to the model (names, ties, LoRA, dtype) and plan the files and the
    gather that writes them."""
    options = plan.options
    lora = LoraRequest(
        options.lora, plan.checkpoint.lora_meta, {"lora_alpha": options.lora_alpha, "use_rslora": options.lora_rslora},
        model.fan_in_fan_out,
    )
    dtype, dtype_reason = choose_dtype(options.dtype, model.config_dtype)
    log.info("writing %s tensors: %s", dtype, dtype_reason)

    def plan_tensors(untied: frozenset[str]) -> TensorPlanning:
        return plan_holdings(
            source.loaded.holders, model.formats, options.format, dtype, lora, source.base_infos, untied,
            model.float32_names.get(dtype, frozenset()),
        )

    planning, untied = _plan_ties(plan_tensors, group, options.untie)
    if planning.kept_float32:
        log.info("keeping %d tensor(s) in float32, as the model's class loads them (%s, ...)",
                 len(planning.kept_float32), min(planning.kept_float32))
    converted = model.formats.tiles(planning.naming, planning.format) is not None
    if converted:
        log.info("converting the checkpoint's %s names to the %s format", planning.naming, planning.format)
    writers = options.writers or group.size
    if group.writers_limit is not None and writers > group.writers_limit:
        if options.writers:
            log.info("%d writer(s) instead of --writers %d: a local --dst is written by the workers on its node only",
                     group.writers_limit, writers)
        writers = group.writers_limit
    shard_files, split = plan_shard_files(planning.tensors, options.max_shard_size, writers)
    adapter_files = [
        ShardFile(ADAPTER_WEIGHTS, tuple(tensor.name for tensor in safetensors_order(planning.adapters)))
    ] if planning.adapters else []
    by_name = {tensor.name: tensor for tensor in planning.tensors + planning.adapters}
    transfer = plan_transfer(
        shard_files + adapter_files, by_name, source.loaded.worker_of_rank, group.size, options.bucket_size, writers
    )
    return OutputPlan(planning, converted, untied, dtype, dtype_reason, by_name, split, transfer)


def output_cost(plan: ExportPlan, group: ReadingGroup, output: OutputPlan) -> ExportCost:
    """What the planned export costs (`rayexport.plan.cost`): each worker's bytes and files,
    on its node where the workers are pinned to nodes, and the seconds at `--rates`."""
    shards = [shard for files in output.transfer.files for shard in files]
    file_bytes = {shard.filename: shard_file_size([output.by_name[name] for name in shard.tensors]) for shard in shards}
    labels = plan.cluster.labels if plan.cluster is not None else {}
    nodes = tuple(labels.get(node, "") if node else "" for node in group.nodes.worker_nodes)
    return export_cost(
        output.transfer, file_bytes, group.read_bytes, nodes, len(output.by_name),
        sum(tensor.nbytes for tensor in output.by_name.values()), plan.options.memory_bound_bytes,
        Rates.parse(plan.options.rates), runs_checks(resolved(plan.options.verify)),
    )


def _write_and_check(
    plan: ExportPlan, group: WorkerGroup, model: ModelDescription, source: Source, output: OutputPlan
) -> tuple[ExpectedExport, Transferred, dict[str, Any] | None, Any]:
    """Run the gather that writes every file, scanning the source pieces as it reads them
    (NaN/Inf, and their digests unless --verify none; with --strict, or for LoRA merges, in a
    pass ahead of it), and have each writer re-read what it wrote while worker 0 starts the
    consumer checks. Returns what the export must hold, what was written, the file checks'
    numbers and the consumer checks' call (both None with --verify none)."""
    options, planning = plan.options, output.planning
    level = resolved(options.verify)
    plans, digests = planning.tensors + planning.adapters, runs_checks(level)
    scanned = SourceScan()
    if ahead := scanned_ahead(plans, options.strict):
        with plan.stage("source_scan") as moved:
            scanned = scan_ahead(group, ahead, source.loaded.worker_of_rank, digests)
            moved["bytes"] = sum(piece.nbytes for tensor in ahead for piece in tensor.pieces)
        if options.strict:
            check_finite(scanned.non_finite, strict=True)  # before a byte is written
    carried = {**model.carried, **generated_files(model.config, planning, bool(output.untied), options.base_model)}
    with plan.stage("transfer") as moved:
        written = group.transfer(
            output.transfer, output.by_name, output.split, plan.destination, carried,
            scanned_in_transfer(plans, options.strict, digests),
        )
        moved["bytes"] = written.bytes_written
    scanned = scanned.joined(transfer_scan(plans, written.scanned, digests))
    finite = check_finite(scanned.non_finite, options.strict)
    tensors = {
        tensor.name: {"dtype": tensor.dtype, "shape": list(tensor.shape), FAST: written.tensor_digests[tensor.name]}
        for tensor in output.by_name.values()
    }
    expected = ExpectedExport(
        files=written.files, tensors=tensors, tied=_tied_pairs(model.formats, planning, output.untied),
        adapter=bool(planning.adapters), pieces=scanned.pieces, level=level, trust_remote_code=options.trust_remote_code,
        format=planning.format, source_finite=finite, written_together=True, serve=options.serve,
        beyond_model=sorted(model.formats.beyond_model() & set(tensors)),
    )
    consumers = group.start_consumer_checks(plan.destination, expected) if runs_checks(level) else None
    with plan.stage("verify_files") as moved:
        checks = verify_files(group, plan.destination, expected, written.worker_stats)
        moved["bytes"] = checks["files"]["bytes_read"] if checks else 0
    group.update_memory(written.worker_stats)  # the peaks, verification included
    return expected, written, checks, consumers


def _report(
    plan: ExportPlan, group: WorkerGroup, output: OutputPlan, written: Transferred, verification: dict[str, Any],
    reload_memory: tuple[int | None, int | None], reload_process: dict[str, float], cost: ExportCost,
) -> ExportReport:
    """The run's report: what was exported, how, and what it cost (stage seconds, bytes, memory)."""
    reload_peak, reload_start = reload_memory
    by_worker = {f"worker{stats.worker}": stats for stats in written.worker_stats}
    return ExportReport(
        source=plan.source.uri, destination=plan.destination.uri, manifest=plan.destination.display(MANIFEST_NAME),
        layout=plan.checkpoint.layout, world_size=plan.checkpoint.world_size, workers=group.size,
        backend=group.devices.backend, backend_reason=group.devices.reason,
        naming=output.planning.naming, format=output.planning.format, converted=output.converted, dtype=output.dtype, dtype_reason=output.dtype_reason,
        tensor_count=len(output.by_name), seconds=plan.seconds,
        bytes={
            "read": sum(stats.bytes_read for stats in written.worker_stats),
            "gathered": sum(stats.bytes_received for stats in written.worker_stats),
            "written": written.bytes_written,
        },
        passes=summed_passes(stats.passes for stats in written.worker_stats),
        peak_rss_bytes={
            "driver": peak_rss_bytes(),
            **{worker: stats.peak_rss_bytes for worker, stats in by_worker.items()},
            **({"reload": reload_peak} if reload_peak is not None else {}),
        },
        working_memory_bytes={
            **{worker: stats.working_memory_bytes for worker, stats in by_worker.items()},
            **({"reload": reload_peak - reload_start} if reload_peak is not None and reload_start is not None else {}),
        },
        peak_gpu_bytes={
            worker: stats.peak_gpu_bytes for worker, stats in by_worker.items() if stats.peak_gpu_bytes is not None
        },
        files_by_worker={worker: stats.files_written for worker, stats in by_worker.items()},
        placement={worker: {"node": stats.node, "pid": stats.pid, "device": stats.device} for worker, stats in by_worker.items()},
        warm_start=group.reused, reload_process=reload_process, files=written.files, verification=verification, skipped=list(plan.checkpoint.skipped),
        export_node=plan.cluster.labels[plan.export_node] if plan.export_node else None, estimate=cost.to_dict(),
    )


def _plan_ties(plan, group: ReadingGroup, untie: bool) -> tuple[TensorPlanning, frozenset[str]]:
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


def verify_files(
    group: WorkerGroup, destination: Store, expected: ExpectedExport, worker_stats: list[WorkerStats]
) -> dict[str, Any] | None:
    """Every writer re-reads the files it wrote, all at once; the structure check puts what they
    found together (see `rayexport.verification.structure.conclude`). None with `--verify none`."""
    if not runs_checks(expected.level):
        return None
    written = {stats.worker: stats.files_written for stats in worker_stats}
    return conclude(destination, group.check_files(destination, expected, written), expected)


def _with_consumer_checks(
    checks: dict[str, Any] | None, group: WorkerGroup, consumers: Any, expected: ExpectedExport
) -> dict[str, Any]:
    """The verification's outcome: the file checks' numbers and each consumer check's (none
    run without file checks, with `--verify none`). A file check's failure was raised first."""
    results = group.consumer_results(consumers) if consumers is not None else {}
    for warning in consumer_warnings(results):
        log.warning("verification: %s", warning)
    return verification_outcome(expected.level, checks, results)


@contextlib.contextmanager
def _not_committed_on_failure() -> Iterator[None]:
    """A failure once files are at DST says so: what is there is not a committed export."""
    try:
        yield
    except ExportError as error:
        raise type(error)(f"{error}; the export was not committed") from None


def _already_committed(plan: ExportPlan) -> ExportReport:
    log.info("%s already holds a committed export of %s", plan.options.dst, plan.checkpoint.uri)
    manifest, dst = plan.existing, plan.options.dst
    return ExportReport(
        source=plan.checkpoint.uri, destination=dst, manifest=f"{dst.rstrip('/')}/{MANIFEST_NAME}",
        layout=plan.checkpoint.layout, world_size=plan.checkpoint.world_size, workers=0, backend="none",
        tensor_count=manifest.get("tensor_count", 0), files=manifest.get("files", {}),
        verification=manifest.get("verification", {}), already_committed=True,
    )


def _tied_pairs(formats: ModelFormats, planning: TensorPlanning, untied: frozenset[str]) -> list[tuple[str, str]]:
    """The (canonical, alias) pairs, by in-memory name, that the reload must find sharing memory."""
    untied_in_memory = {formats.memory_name(planning.naming, alias) for alias in untied}
    return sorted(
        (canonical, alias) for alias, canonical in formats.memory.aliases.items() if alias not in untied_in_memory
    )
