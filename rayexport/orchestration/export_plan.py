"""The export's first step, on the driver before any worker starts: where from and where to
(on a cluster whose nodes have disks of their own, the union of the nodes' files and the one node a
local destination is written on), the checkpoint as its layout describes it, and what the
destination already holds."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, ContextManager

from rayexport.common.errors import ExportError
from rayexport.layouts.base import Checkpoint, SourceSettings
from rayexport.layouts.registry import find_checkpoint
from rayexport.orchestration.nodes import ClusterNodes, RayOnNode, ask_nodes, cluster_nodes, first_reader_node
from rayexport.orchestration.options import ExportOptions
from rayexport.orchestration.placement import reading_node
from rayexport.orchestration.progress import ExportProgress
from rayexport.orchestration.report import timed_stage
from rayexport.storage.nodes import PinnedStore, spread_store
from rayexport.storage.settings import storage_options_from_env
from rayexport.storage.store import Store
from rayexport.transport.manifest import read_manifest

log = logging.getLogger(__name__)


@dataclass
class ExportPlan:
    """What the driver knows before any worker reads: where from and to, the checkpoint as its
    layout describes it, the options, the deadline, and each stage's seconds so far."""

    options: ExportOptions
    destination: Store
    checkpoint: Checkpoint
    base_model: Store | None
    job_deadline: float
    existing: dict[str, Any] | None = None  # the manifest of an export already at DST
    seconds: dict[str, float] = field(default_factory=dict)
    cluster: ClusterNodes | None = None  # the nodes, where local paths differ between them
    export_node: str | None = None  # the node a local destination is written on, of several
    progress: ExportProgress | None = None  # the driver's bar, while the workers run the export

    @property
    def source(self) -> Store:
        return self.checkpoint.store

    def stage(self, name: str) -> ContextManager[dict[str, int]]:
        """Time the stage `name` into `seconds` (`timed_stage`), shown as the progress bar's
        phase while the export has one up (`progress`)."""
        if self.progress is not None:
            self.progress.phase(name)
        return timed_stage(self.seconds, name)


def plan_export(options: ExportOptions, seconds: dict[str, float] | None = None) -> ExportPlan:
    """The driver's first step: find the checkpoint (its layout) and what DST already holds;
    refuse a destination inside the source, or a committed export of other options without
    --force. `seconds`: the stages timed before this one, which the plan's continue."""
    job_deadline = time.monotonic() + options.deadline_s
    storage_options = storage_options_from_env(options.storage_options)
    source = Store(options.src, storage_options)
    destination = Store(options.dst, storage_options)
    seconds = seconds if seconds is not None else {}
    with timed_stage(seconds, "plan"):
        _check_destination(source, destination)
        cluster = cluster_nodes(options) if source.is_local or destination.is_local else None
        if cluster is not None and source.is_local:
            source = spread_store(source, ask_nodes(source.path(), cluster), RayOnNode())
        checkpoint = find_checkpoint(source, options.layout, SourceSettings(options.dcp_prefix, options.unsafe_pickle, options.step, options.tag))
        export_node = None
        if cluster is not None and destination.is_local:
            export_node = _export_node(checkpoint, cluster, options)
            destination = PinnedStore(destination.uri, destination.options, export_node, cluster.labels[export_node], RayOnNode())
            log.info("a local --dst on a cluster of %d nodes: the whole export is written on node %s",
                     len(cluster.labels), cluster.labels[export_node])
        existing = read_manifest(destination)
        if existing is not None and not options.force and not _same_export(existing, checkpoint, options):
            raise ExportError(
                f"'{destination.uri}' already holds a committed export of "
                f"{existing.get('source')} with other options; pass --force to replace it"
            )
    base_model = Store(options.base_model, storage_options) if options.base_model else None
    return ExportPlan(options, destination, checkpoint, base_model, job_deadline, existing, seconds, cluster, export_node)


def _export_node(checkpoint: Checkpoint, cluster: ClusterNodes, options: ExportOptions) -> str:
    """The node a local destination is written on: where worker 0 reads the first of the
    checkpoint's files spread over nodes, else this one, if a worker fits on it, else the first
    node where one does (the GPUs are not chosen yet: by CPUs alone)."""
    bundle = {"CPU": options.num_cpus_per_worker}
    if checkpoint.store.nowhere() is not None:  # spread over the nodes
        return first_reader_node(checkpoint, cluster, bundle)
    nodes = tuple([cluster.here] + sorted((node for node in cluster.labels if node != cluster.here), key=cluster.labels.get))
    return reading_node(nodes, cluster.capacity(bundle), checkpoint.store.uri, cluster.labels)


def _check_destination(source: Store, destination: Store) -> None:
    if type(source.fs) is type(destination.fs) and (
        destination.root == source.root or destination.root.startswith(source.root.rstrip("/") + "/")
    ):
        raise ExportError(f"destination '{destination.uri}' is inside source '{source.uri}'")


def _same_export(manifest: dict[str, Any], checkpoint: Checkpoint, options: ExportOptions) -> bool:
    return manifest.get("source") == checkpoint.uri and manifest.get("options") == options.recorded()
