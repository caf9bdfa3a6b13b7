"""The start of an export: plan it, then, while the rest of the planning (the destination made
ready, the model described) runs in a thread, start the worker group. Nothing here imports
torch, nor does the driver's part of the rest (`rayexport.orchestration.job`) unless it handles
tensors itself (a model described afresh, a LoRA merge's reference digests): a command line
joined to a running cluster asks for its workers at once and leaves the CPUs to them and to the
reload's process, which import it."""

from __future__ import annotations

import contextlib
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from rayexport.orchestration.export_plan import ExportPlan, plan_export
from rayexport.orchestration.group import WorkerGroup
from rayexport.orchestration.options import ExportOptions
from rayexport.orchestration.pool import PoolDescriptions
from rayexport.plan.naming import match_names
from rayexport.storage.store import Store
from rayexport.transport.manifest import MANIFEST_NAME

if TYPE_CHECKING:
    from rayexport.model.description import ModelDescription

log = logging.getLogger(__name__)


@dataclass
class Started:
    """An export planned and, unless DST holds it committed already (`group` None), its workers
    started, with the model's description coming (`describing`)."""

    plan: ExportPlan
    describing: Future | None = None
    group: WorkerGroup | None = None


def begin_export(options: ExportOptions, group_type: type[WorkerGroup] | None = None, seconds: dict[str, float] | None = None) -> Started:
    """Plan the export and start its workers (see `rayexport.orchestration.job.run_export` for
    `group_type` and `seconds`)."""
    plan = plan_export(options, seconds)
    if plan.existing is not None and not options.force:
        return Started(plan)
    # The rest of planning runs in a thread while Ray, the actors and their process group
    # start here (Ray's signal handlers need the main thread).
    describing = in_background(prepare, plan)
    with plan.stage("start_workers"):
        group = start_group(group_type or WorkerGroup, plan, describing)
    return Started(plan, describing, group)


def prepare(plan: ExportPlan) -> ModelDescription:
    """Ready the destination (uncommit an export being replaced, abort uploads a killed run
    left, probe that it takes writes) and describe the model the checkpoint holds."""
    destination = plan.destination
    if plan.existing is not None:
        destination.delete(MANIFEST_NAME)  # uncommit first: a half-rewritten export must not look done
    for key in destination.abort_uploads():
        log.warning("aborted an unfinished upload left by an earlier run: %s", key)
    model = describe_source_model(plan)  # first: a model refused leaves no folder behind at DST
    destination.write_bytes(".rayexport-write-probe", b"")
    destination.delete(".rayexport-write-probe")
    return model


def describe_source_model(plan: ExportPlan) -> ModelDescription:
    """The model the checkpoint holds (its module, with transformers' model code, imported here:
    in the planning thread), its names checked against the checkpoint's where the layout lists
    them before reading. Reads, never writes."""
    from rayexport.model.description import describe_model, hf_folder

    options = plan.options
    hf_config = Store(options.hf_config, plan.destination.options) if options.hf_config else None
    folder = hf_folder(plan.checkpoint.hf_folder, hf_config, plan.checkpoint.nearby_hf_folder, plan.base_model)
    trainers = plan.checkpoint.trainer_files if folder is plan.checkpoint.hf_folder else frozenset()
    described = PoolDescriptions(options.pool) if options.pool else None
    model = describe_model(folder, plan.base_model, options.trust_remote_code, trainers, described)
    checkpoint = plan.checkpoint
    if checkpoint.producer_namings is not None:
        producers = checkpoint.producer_namings(model.config, model.formats.disk)
        model = replace(model, formats=model.formats.with_producers(producers))
    keys = checkpoint.known_keys()
    if keys is not None and plan.base_model is None:
        match_names(keys, model.formats)  # what the checkpoint's names lack, before any worker starts
    return model


def in_background(function, *args) -> Future:
    """Run `function(*args)` in a thread of its own; the future gives its result or error."""
    background = ThreadPoolExecutor(1, thread_name_prefix="rayexport-plan")
    future = background.submit(function, *args)
    background.shutdown(wait=False)
    return future


def start_group(group_type: type[WorkerGroup], plan: ExportPlan, describing: Future) -> WorkerGroup:
    """Size and start the worker group; on failure, remove whatever of it had started (and
    report the start's error, not the planning thread's)."""
    try:
        if "ray_start" in plan.seconds:  # the command line started it, or joined, already
            group_type.connect(plan.options)
        else:
            with plan.stage("ray_start"):
                group_type.connect(plan.options)
        group = group_type.for_export(plan.options, plan.checkpoint.world_size, plan.job_deadline)
        if plan.cluster is not None:
            group.place_on_nodes(plan.checkpoint, plan.cluster, plan.export_node)
        if plan.checkpoint.known_keys() is not None:
            describing.result()  # its names are checked against the model's before the workers start
        try:
            group.start()
        except BaseException:
            group.shutdown(graceful=False)
            raise
    except BaseException:
        with contextlib.suppress(BaseException):
            describing.result()
        raise
    return group
