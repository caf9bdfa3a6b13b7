"""Orchestration: plan on the driver, run the worker actors, verify in a separate task, commit.

Any failure kills every actor, removes the placement group, and leaves DST without a manifest.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator

from rayexport.errors import ExportError, one_line
from rayexport.dtypes import dtype_of
from rayexport.layouts.dcp import DcpCheckpoint, assign_tensors, find_dcp_checkpoint, is_dcp_checkpoint
from rayexport.layouts.verl import HF_DIR, VerlCheckpoint, find_verl_checkpoint
from rayexport.lora import ADAPTER_DIR, adapter_config
from rayexport.manifest import MANIFEST_NAME, build_manifest, commit, read_manifest
from rayexport.model import (
    build_meta_model, config_dtype, exported_config, expected_tensors, fetch_hf_folder, hf_file_names, load_config,
)
from rayexport.remote_code import auto_map_files, bundle_model_code
from rayexport.options import FULL_VERIFY_LIMIT, ExportOptions
from rayexport.placement import Devices, choose_devices, missing_resources
from rayexport.pool import IdleGroup, get_keeper, group_shape
from rayexport.plan.naming import LoraRequest, TensorPlanning, plan_holdings
from rayexport.plan.pieces import BASE_MODEL_RANK, Piece, holders_from_ranks, needed_ranks
from rayexport.plan.schedule import (
    ShardFile, assign_ranks, TransferPlan, keep_ties_together, plan_shard_files, plan_transfer, safetensors_order,
)
from rayexport.storage import Store, storage_options_from_env
from rayexport.ties import check_tied_values, find_tie_aliases
from rayexport.verification import ADAPTER_WEIGHTS, ExpectedExport, verify_export
from rayexport.workers import ExportWorker, peak_rss_bytes

log = logging.getLogger(__name__)


@dataclass
class ExportReport:
    """What an export did: per-stage seconds, bytes, peak memory per actor, files, verification."""

    source: str
    destination: str
    manifest: str
    layout: str
    world_size: int
    workers: int
    backend: str
    tensor_count: int
    backend_reason: str = ""  # why this backend (and these GPUs): an option, or what was free
    seconds: dict[str, float] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)
    peak_rss_bytes: dict[str, int] = field(default_factory=dict)
    # per worker: its peak memory above what it held before loading (the transfer window)
    working_memory_bytes: dict[str, int | None] = field(default_factory=dict)
    peak_gpu_bytes: dict[str, int] = field(default_factory=dict)  # per GPU worker: its transfer's peak
    files_by_worker: dict[str, list[str]] = field(default_factory=dict)  # which worker wrote what
    placement: dict[str, dict[str, Any]] = field(default_factory=dict)  # each worker's Ray node and process
    warm_start: bool = False  # the workers came from a warm pool
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    verification: dict[str, Any] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)  # checkpoint entries that are not model tensors
    already_committed: bool = False

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    def summary(self) -> str:
        """A few lines for a person."""
        if self.already_committed:
            return f"{self.destination} already holds a committed export of {self.source}; nothing to do"
        total = sum(self.seconds.values())
        written = self.bytes.get("written", 0)
        lines = [
            f"exported {self.source}",
            f"      to {self.destination}",
            f"  {self.tensor_count} tensors in {sum(name.endswith('.safetensors') for name in self.files)} "
            f"safetensors file(s), {written / 1e6:.1f} MB, {self.workers} worker(s) over {self.backend} "
            f"({self.backend_reason})",
            "  stages: " + ", ".join(f"{name} {seconds:.1f}s" for name, seconds in self.seconds.items())
            + f" (total {total:.1f}s)",
            "  peak memory per actor: "
            + ", ".join(f"{name} {size / 2**20:.0f} MiB" for name, size in self.peak_rss_bytes.items()),
            f"  verified ({self.verification.get('level')}): " + ", ".join(self.verification.get("checks", {}))
            if self.verification.get("passed") else "  verification skipped (--verify none)",
            f"  committed: {self.manifest}",
        ]
        return "\n".join(lines)


@contextlib.contextmanager
def _stage(seconds: dict[str, float], name: str) -> Iterator[None]:
    started = time.perf_counter()
    try:
        yield
    finally:
        seconds[name] = round(time.perf_counter() - started, 3)


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
        checkpoint = find_checkpoint(source, options)
        _check_destination(source, destination)
        existing = read_manifest(destination)
        if existing is not None:
            if _same_export(existing, checkpoint, options) and not options.force:
                return _already_committed(options, checkpoint, existing)
            if not options.force:
                raise ExportError(
                    f"'{destination.uri}' already holds a committed export of "
                    f"{existing.get('source')} with other options; pass --force to replace it"
                )
            destination.delete(MANIFEST_NAME)  # uncommit first: a half-rewritten export must not look done
        for key in destination.abort_uploads():
            log.warning("aborted an unfinished upload left by an earlier run: %s", key)
        hf_config = Store(options.hf_config, storage_options) if options.hf_config else None
        hf_source = _hf_folder(source, checkpoint, hf_config, base_model)
        model = _describe_model(hf_source, base_model, options)
        destination.write_bytes(".rayexport-write-probe", b"")
        destination.delete(".rayexport-write-probe")

    group = group_type.for_export(options, checkpoint.world_size, job_deadline)
    num_workers = group.size
    try:
        with _stage(seconds, "start_workers"):
            group.start()
        with _stage(seconds, "load"):
            rank_infos, holders, worker_of_rank = group.load_checkpoint(source, checkpoint, model["aliases"])
            base_infos = group.load_base_model(base_model) if base_model else None
        source_finite = _check_finite(rank_infos, options.strict)
        lora = LoraRequest(options.lora, checkpoint.lora_meta, {"lora_alpha": options.lora_alpha, "use_rslora": options.lora_rslora})

        def plan(aliases: dict[str, str]) -> TensorPlanning:
            return plan_holdings(holders, model["expected"], aliases, options.dtype, model["config_dtype"], lora, base_infos)

        planning, aliases, untied = _plan_ties(plan, model["aliases"], group, options.untie)
        shard_files = plan_shard_files(planning.tensors, options.max_shard_size)
        adapter_files = [ShardFile(ADAPTER_WEIGHTS, tuple(plan.name for plan in safetensors_order(planning.adapters)))] if planning.adapters else []
        by_name = {plan.name: plan for plan in planning.tensors + planning.adapters}
        transfer = plan_transfer(
            shard_files + adapter_files, by_name, worker_of_rank, num_workers, options.bucket_size, options.writers
        )
        level = verify_level(options.verify, sum(plan.nbytes for plan in by_name.values()))
        source_pieces = group.source_pieces(planning, worker_of_rank) if level != "none" else {}
        carried = {**model["carried"], **_generated_files(model["raw_config"], planning, untied, options)}
        with _stage(seconds, "transfer"):
            result, worker_stats = group.transfer(transfer, by_name, shard_files, destination, carried)
    finally:
        group.shutdown()

    tensors = {
        plan.name: {"dtype": plan.dtype, "shape": list(plan.shape), "sha256": result["tensor_digests"][plan.name]}
        for plan in by_name.values()
    }
    expected = ExpectedExport(
        files=result["files"], tensors=tensors, tied=_tied_pairs(aliases, by_name), adapter=bool(planning.adapters),
        pieces=source_pieces, level=level, trust_remote_code=options.trust_remote_code, source_finite=source_finite,
    )
    with _stage(seconds, "verify"):
        verification = group_type.verify(destination, expected, options, job_deadline)
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
        },
        working_memory_bytes={f"worker{stats['worker']}": stats["working_memory_bytes"] for stats in worker_stats},
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


def _plan_ties(plan, aliases: dict[str, str], group: "WorkerGroup", untie: bool) -> tuple[TensorPlanning, dict[str, str], bool]:
    """Plan, then compare every tied pair the checkpoint holds twice: different values stop the
    export, or with `untie` are kept as separate tensors (re-planned without those aliases).
    Returns the planning, the aliases it used, and whether anything was untied."""
    planning = plan(aliases)
    differences = group.tied_differences(planning.tied_key_pairs)
    tied_values = {pair: differences[keys] for pair, keys in zip(planning.resolution.to_compare, planning.tied_key_pairs)}
    untied = {alias for (_, alias), difference in tied_values.items() if difference != 0.0}
    if not (untied and untie):
        check_tied_values(tied_values)
        return planning, aliases, False
    log.warning("untying %s: their saved values differ from the tensors they were tied to", sorted(untied))
    aliases = {alias: canonical for alias, canonical in aliases.items() if alias not in untied}
    return plan(aliases), aliases, True


def find_checkpoint(source: Store, options: ExportOptions) -> VerlCheckpoint | DcpCheckpoint:
    """The checkpoint at `source`, read by the layout `--layout` names or, with `auto`, the one
    its files show (`.metadata`: DCP; rank files: verl)."""
    layout = options.layout
    if layout == "auto":
        dcp_files = is_dcp_checkpoint(source) or any(name.endswith(".distcp") for name in source.list())
        layout = "dcp" if dcp_files else "verl"
    if layout == "dcp":
        return find_dcp_checkpoint(source, options.dcp_prefix, unsafe_pickle=options.unsafe_pickle)
    return find_verl_checkpoint(source)


def _hf_folder(
    source: Store, checkpoint: VerlCheckpoint | DcpCheckpoint, hf_config: Store | None, base_model: Store | None
) -> Store:
    """Where config, tokenizer and code come from: the checkpoint's `huggingface/`, else
    `--hf-config`, else the `--base-model` folder."""
    if checkpoint.has_hf_config:
        return source.child(HF_DIR)
    for folder in (hf_config, base_model):
        if folder is not None:
            if not folder.exists("config.json"):
                raise ExportError(f"missing '{folder.display('config.json')}'")
            return folder
    raise ExportError(
        f"missing '{source.display(HF_DIR + '/config.json')}': pass --hf-config URI (a folder with the "
        f"model's config.json and tokenizer) or --base-model"
    )


def _generated_files(raw_config: dict, planning: TensorPlanning, untie: bool, options: ExportOptions) -> dict[str, bytes]:
    """Files the export writes from what it learnt: config.json (and adapter_config.json)."""
    floating = sorted({plan.dtype for plan in planning.tensors if dtype_of(plan.dtype).is_floating_point})
    config = exported_config(raw_config, floating[0] if len(floating) == 1 else None)
    if untie:
        config["tie_word_embeddings"] = False
    files = {"config.json": _json_bytes(config)}
    if planning.adapters:
        files[f"{ADAPTER_DIR}/adapter_config.json"] = _json_bytes(
            adapter_config(planning.lora, planning.lora_targets, options.base_model)
        )
    return files


def _json_bytes(value: dict) -> bytes:
    return (json.dumps(value, indent=2, sort_keys=True, default=_jsonable) + "\n").encode()


def _jsonable(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    return str(value)


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


def verify_level(requested: str, total_bytes: int) -> str:
    """`auto` is full verification for exports up to FULL_VERIFY_LIMIT bytes, quick above."""
    if requested != "auto":
        return requested
    return "full" if total_bytes <= FULL_VERIFY_LIMIT else "quick"


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


def _describe_model(hf_store: Store, base_model: Store | None, options: ExportOptions) -> dict[str, Any]:
    """Config, meta-model names/shapes and tie aliases, and every file the export carries
    (tokenizer, generation config, remote code), from the checkpoint's HF folder. Remote code
    the folder lacks comes from the base model folder, else from the model's class module."""
    with tempfile.TemporaryDirectory(prefix="rayexport-hf-") as local:
        names = fetch_hf_folder(hf_store, local)
        with open(os.path.join(local, "config.json"), "rb") as handle:
            raw_config = _parse_json(handle.read(), hf_store.display("config.json"))
        code_files = auto_map_files(raw_config)
        if base_model is not None:
            wanted = [name for name in code_files if name not in names]
            available = set(hf_file_names(base_model)) if wanted else set()
            for name in wanted:
                if name in available:
                    with open(os.path.join(local, name), "wb") as handle:
                        handle.write(base_model.read_bytes(name))
        config = load_config(local, raw_config, options.trust_remote_code)
        meta_model = build_meta_model(config, options.trust_remote_code)
        if any(not os.path.exists(os.path.join(local, name)) for name in code_files):
            bundle_model_code(meta_model, local)
        for name in code_files:
            if not os.path.exists(os.path.join(local, name)):
                raise ExportError(f"config.json's auto_map needs {name}, which is neither in '{hf_store.uri}' nor bundled")
        carried = {}
        for folder, _, files in os.walk(local):
            for file in files:
                path = os.path.join(folder, file)
                with open(path, "rb") as handle:
                    carried[os.path.relpath(path, local)] = handle.read()
    return {
        "carried": carried,
        "raw_config": raw_config,
        "config_dtype": config_dtype(config),
        "expected": expected_tensors(meta_model),
        "aliases": find_tie_aliases(meta_model),
    }


def _parse_json(data: bytes, uri: str) -> dict:
    try:
        value = json.loads(data)
    except ValueError as error:
        raise ExportError(f"'{uri}' is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise ExportError(f"'{uri}' is not a JSON object")
    return value


def _bundle_text(bundle: dict[str, float]) -> str:
    return "{" + ", ".join(f"{name}: {amount:g}" for name, amount in bundle.items()) + "}"


def _tied_pairs(aliases: dict[str, str], written: dict[str, Any]) -> list[tuple[str, str]]:
    """The (canonical, alias) pairs the reload must find sharing memory."""
    return sorted((canonical, alias) for alias, canonical in aliases.items() if canonical in written)


def _ensure_ray(options: ExportOptions) -> None:
    import ray

    if ray.is_initialized():
        return
    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, logging_level=options.log_level, log_to_driver=True)
    else:
        ray.init(include_dashboard=False, logging_level=options.log_level, log_to_driver=True)


def _step_limit(options: ExportOptions, job_deadline: float) -> tuple[float, str]:
    """Seconds one step may take: --timeout, or less when the whole job's --deadline is nearer."""
    remaining = job_deadline - time.monotonic()
    deadline = f"--deadline {options.deadline_s:.0f} s for the whole export"
    if remaining <= 0:
        raise ExportError(f"export timed out: past its {deadline}")
    if remaining < options.timeout_s:
        return remaining, deadline
    return options.timeout_s, "--timeout"


def _actor_death(references: list, wait_s: float):
    """The first RayActorError among `references` that arrives within `wait_s`, else None."""
    import ray
    from ray.exceptions import RayActorError

    ready, _ = ray.wait(list(references), num_returns=len(references), timeout=wait_s)
    for reference in ready:
        try:
            ray.get(reference, timeout=0)
        except RayActorError as error:
            return error
        except Exception:  # noqa: BLE001 - other failures are reported by the caller
            continue
    return None


def _get(references: list, limit: tuple[float, str], on_failure) -> list:
    """Wait for every reference; on the first error or when the step's time `limit` (seconds,
    and the option that set it) runs out, call `on_failure` and raise, so one dead worker ends
    the export at once instead of leaving others blocked."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

    timeout_s, source = limit
    deadline = time.monotonic() + timeout_s
    pending = list(references)
    try:
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise GetTimeoutError(f"no answer within {timeout_s:.0f} s ({source})")
            ray.get(ready[0])
        return ray.get(list(references))
    except RayTaskError as error:
        cause = error.cause
        if isinstance(cause, ExportError):
            on_failure()
            raise type(cause)(*cause.args) from None
        # A worker whose peer died fails its collective ("connection closed by peer") and may
        # answer before the dead worker's own error does: name the death when it follows.
        died = _actor_death(references, wait_s=5)
        on_failure()
        if died is not None:
            raise ExportError(f"an export worker died: {died}".splitlines()[0]) from None
        raise ExportError(f"an export worker failed: {type(cause).__name__}: {one_line(cause)}") from None
    except RayActorError as error:
        on_failure()
        raise ExportError(f"an export worker died: {error}".splitlines()[0]) from None
    except GetTimeoutError as error:
        on_failure()
        raise ExportError(f"export timed out: {error}") from None


class WorkerGroup:
    """The export's placement group and actors; `shutdown()` removes both, or with a warm pool
    (`options.pool`) hands a healthy group back to the pool for the next export."""

    @classmethod
    def for_export(cls, options: ExportOptions, world_size: int, job_deadline: float) -> "WorkerGroup":
        """A group sized for the checkpoint and the cluster (joining or starting Ray), on the
        devices `choose_devices` picks from what is free now; not started yet."""
        import ray

        _ensure_ray(options)
        if options.workers is not None:
            size = min(options.workers, world_size)
        else:
            cpus = int(ray.cluster_resources().get("CPU", 1) // max(options.num_cpus_per_worker, 1e-9))
            size = max(1, min(world_size, cpus))
        devices = choose_devices(
            options.backend, options.num_gpus_per_worker, size,
            free_gpus=ray.available_resources().get("GPU", 0.0), total_gpus=ray.cluster_resources().get("GPU", 0.0),
        )
        log.info("%d worker(s) over %s: %s", size, devices.backend, devices.reason)
        return cls(size, devices, options, job_deadline)

    @staticmethod
    def verify(destination: Store, expected: ExpectedExport, options: ExportOptions, job_deadline: float) -> dict[str, Any]:
        """Check the written export in a separate Ray task (see `verify_export`)."""
        if expected.level == "none":
            return {"passed": None, "level": "none"}
        import ray

        task = ray.remote(num_cpus=1, max_retries=0)(verify_export)
        limit = _step_limit(options, job_deadline)
        reference = task.remote(destination, expected, limit[0])
        return _get([reference], limit, on_failure=lambda: ray.cancel(reference, force=True))[0]

    def __init__(self, size: int, devices: Devices, options: ExportOptions, job_deadline: float) -> None:
        self.job_deadline = job_deadline
        self.size = size
        self.devices = devices
        self.options = options
        self.actors: list = []
        self.placement_group = None
        self.keeper = None
        self.reused = False

    @property
    def shape(self) -> str:
        return group_shape(self.size, self.devices.backend, self.options.num_cpus_per_worker, self.devices.gpus_per_worker)

    def start(self) -> None:
        """Take an idle group from the warm pool if there is one of this shape, else start one:
        a placement group, the actors, and their process group."""
        if self.options.pool:
            import ray

            self.keeper = get_keeper(self.options.pool)
            idle = ray.get(self.keeper.take.remote(self.shape), timeout=self.options.timeout_s)
            if idle is not None:
                self.actors, self.placement_group = idle.actors, idle.placement_group
                try:
                    self._get([actor.reset.remote() for actor in self.actors])
                    self.reused = True
                    return
                except ExportError as error:  # a pooled worker died while idle: start afresh
                    log.warning("a pooled worker group of %s is gone (%s); starting a new one", self.options.pool, error)
        self._start_new()

    def _start_new(self) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._place()
        lifetime = {"lifetime": "detached"} if self.options.pool else {}  # outlive this driver or task
        actor_class = ray.remote(ExportWorker)
        for index in range(self.size):
            self.actors.append(
                actor_class.options(
                    num_cpus=self.options.num_cpus_per_worker,
                    num_gpus=self.devices.gpus_per_worker,
                    max_restarts=0,
                    **lifetime,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self.placement_group, placement_group_bundle_index=index
                    ),
                ).remote(index, self.size, self.options.log_level)
            )
        host, port = self._get([self.actors[0].open_rendezvous.remote(self.options.timeout_s)])[0]
        self._get([
            actor.join_group.remote(self.devices.backend, host, port, self.options.timeout_s) for actor in self.actors
        ])

    def _place(self) -> None:
        """Reserve a bundle per worker, waiting at most --placement-timeout. GPUs that `auto`
        saw free but that were taken meanwhile: gloo instead. Otherwise a bundle that cannot be
        placed in time ends the export with one line naming what is missing."""
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        lifetime = {"lifetime": "detached"} if self.options.pool else {}
        gpus = self.devices.gpus_per_worker
        bundle = {"CPU": self.options.num_cpus_per_worker, **({"GPU": gpus} if gpus else {})}
        self.placement_group = placement_group([bundle] * self.size, strategy="PACK", **lifetime)
        wait_s = min(_step_limit(self.options, self.job_deadline)[0], self.options.placement_timeout_s)
        if ray.wait([self.placement_group.ready()], timeout=wait_s)[0]:
            return
        remove_placement_group(self.placement_group)
        self.placement_group = None
        _step_limit(self.options, self.job_deadline)  # past the job's deadline: say that
        if self.devices.fallback:
            self.devices = Devices("gloo", 0.0, f"the free GPUs were taken before the workers were placed ({self.devices.reason} at the start)")
            log.warning("%d worker(s) over gloo: %s", self.size, self.devices.reason)
            return self._place()
        raise ExportError(
            f"the Ray cluster cannot place {self.size} worker(s) of {_bundle_text(bundle)} within {wait_s:.0f} s "
            f"(--placement-timeout): "
            + missing_resources(bundle, self.size, ray.available_resources(), ray.cluster_resources())
        )

    def load(self, source: Store, checkpoint: VerlCheckpoint, ranks_by_worker: dict[int, list[int]]) -> dict:
        references = [
            self.actors[worker].load.remote(source, checkpoint, ranks, self.options.unsafe_pickle)
            for worker, ranks in ranks_by_worker.items() if ranks
        ]
        infos: dict = {}
        for part in self._get(references):
            infos.update(part)
        return infos

    def load_checkpoint(
        self, source: Store, checkpoint: VerlCheckpoint | DcpCheckpoint, aliases: dict[str, str]
    ) -> tuple[dict, dict, dict[int, int]]:
        """Have the workers load their share of the checkpoint. Returns what each (pseudo-)rank
        holds, the same per key, and which worker holds each rank.

        verl: rank 0's file (on worker 0) tells which ranks hold data not found elsewhere (HSDP
        replicas are skipped); those are spread over the workers. DCP: each worker reads a
        byte-balanced share of whole tensors, tied copies together."""
        if isinstance(checkpoint, DcpCheckpoint):
            assignment = keep_ties_together(assign_tensors(checkpoint, self.size), aliases)
            rank_infos = self.load_dcp(source, checkpoint, assignment)
            worker_of_rank = {worker: worker for worker in range(self.size)}
            holders = {key: {rank: infos[key]} for rank, infos in rank_infos.items() for key in infos}
        else:
            rank_infos = self.load(source, checkpoint, {0: [0]})
            ranks = needed_ranks(rank_infos[0], checkpoint.world_size)
            worker_of_rank = assign_ranks(ranks, self.size)
            rest: dict[int, list[int]] = {}
            for rank in ranks[1:]:
                rest.setdefault(worker_of_rank[rank], []).append(rank)
            rank_infos.update(self.load(source, checkpoint, rest))
            holders = holders_from_ranks(rank_infos)
        worker_of_rank[BASE_MODEL_RANK] = 0
        return rank_infos, holders, worker_of_rank

    def load_dcp(self, source: Store, checkpoint: DcpCheckpoint, keys_by_worker: list[list[str]]) -> dict:
        """Each worker reads its share of a DCP checkpoint's tensors; returns their descriptions
        keyed by worker (each worker is the pseudo-rank of what it read)."""
        references = [
            self.actors[worker].load_dcp.remote(source, checkpoint, keys, self.options.unsafe_pickle)
            for worker, keys in enumerate(keys_by_worker) if keys
        ]
        infos: dict = {}
        for part in self._get(references):
            infos.update(part)
        return infos

    def load_base_model(self, base_model: Store) -> dict:
        """The exporter opens the base model's safetensors; returns their descriptions."""
        return self._get([self.actors[0].load_base_model.remote(base_model)])[0]

    def tied_differences(self, pairs: list[tuple[str, str]]) -> dict[tuple[str, str], float]:
        if not pairs:
            return {}
        differences = {pair: 0.0 for pair in pairs}
        for part in self._get([actor.tied_differences.remote(pairs) for actor in self.actors]):
            for pair, value in part.items():
                differences[pair] = max(differences[pair], value)
        return differences

    def source_pieces(self, planning: TensorPlanning, worker_of_rank: dict[int, int]) -> dict[str, list[dict]]:
        """Per output tensor, where each source piece goes and its digest after the planned
        cast, computed by the worker holding it (LoRA-merged tensors have no such pieces)."""
        requests: dict[int, list[tuple[Piece, str, str]]] = {}
        for plan in planning.tensors + planning.adapters:
            if plan.lora is None:
                for piece in plan.pieces:
                    requests.setdefault(worker_of_rank[piece.rank], []).append((piece, plan.dtype, plan.name))
        workers = sorted(requests)
        answers = self._get([
            self.actors[worker].source_digests.remote([(piece, dtype) for piece, dtype, _ in requests[worker]])
            for worker in workers
        ])
        pieces: dict[str, list[dict]] = {}
        for worker, digests in zip(workers, answers):
            for (piece, _, name), digest in zip(requests[worker], digests):
                pieces.setdefault(name, []).append({
                    "rank": piece.rank, "source_key": piece.source_key,
                    "offset": list(piece.offset), "shape": list(piece.shape), "sha256": digest,
                })
        return {name: sorted(records, key=lambda record: record["offset"]) for name, records in sorted(pieces.items())}

    def transfer(
        self, transfer: TransferPlan, plans: dict, index_files: list[ShardFile], destination: Store, carried: dict[str, bytes]
    ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """Run the gather: every worker sends its pieces and writes its files; worker 0 also
        writes the index and the carried files. Returns (every file and tensor digest, stats
        per worker)."""
        results = self._get([
            actor.transfer.remote(transfer, plans, destination, index_files if index == 0 else [], carried if index == 0 else {})
            for index, actor in enumerate(self.actors)
        ])
        merged: dict[str, Any] = {"files": {}, "tensor_digests": {}}
        for result in results:
            result["files_written"] = sorted(result["files"])
            merged["files"].update(result.pop("files"))
            merged["tensor_digests"].update(result.pop("tensor_digests"))
        return merged, results

    def shutdown(self, graceful: bool = True) -> None:
        """Remove the actors (letting them leave the group and drop spooled files when
        `graceful`) and the placement group; with a warm pool, a graceful end instead resets
        the actors and returns the group to the pool."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if graceful and self.keeper is not None and self.actors:
            with contextlib.suppress(ExportError):
                self._get([actor.reset.remote() for actor in self.actors])
                ray.get(self.keeper.give.remote(self.shape, IdleGroup(self.actors, self.placement_group)))
                self.actors, self.placement_group = [], None
                return
        if graceful and self.actors:
            closing = [actor.close.remote() for actor in self.actors]
            ray.wait(closing, num_returns=len(closing), timeout=30)
        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor)
        self.actors = []
        if self.placement_group is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self.placement_group)
            self.placement_group = None

    def _get(self, references: list) -> list:
        return _get(references, _step_limit(self.options, self.job_deadline), on_failure=lambda: self.shutdown(graceful=False))
