"""The Ray cluster's nodes, for local paths on a cluster whose nodes each have a disk of their
own: joining the cluster, asking every node which files it holds under a path (a task pinned to
it), and running a `Store` call on a given node (`RayOnNode`, what `rayexport.storage.nodes`
is handed)."""

from __future__ import annotations

import logging
import os
import socket
import sys
from dataclasses import dataclass
from typing import Any

from rayexport.common.errors import ExportError
from rayexport.layouts.base import Checkpoint
from rayexport.orchestration.options import ExportOptions
from rayexport.orchestration.placement import reading_node, worker_capacity
from rayexport.orchestration.session import ensure_ray
from rayexport.orchestration.waits import cancel_unfinished
from rayexport.storage.nodes import NodeFiles, node_labels
from rayexport.storage.store import Store

log = logging.getLogger(__name__)

# How long a node may take to list a checkpoint folder, or to run one storage call.
NODE_CALL_S = 120.0


@dataclass(frozen=True)
class ClusterNodes:
    """The cluster's alive nodes: how messages name each (by id), each one's total resources,
    and the node this process runs on."""

    labels: dict[str, str]
    resources: dict[str, dict[str, float]]
    here: str

    def capacity(self, bundle: dict[str, float]) -> dict[str, int]:
        """How many workers of `bundle` each node can hold, by its total resources."""
        return {node: worker_capacity(resources, bundle) for node, resources in self.resources.items()}


def first_reader_node(checkpoint: Checkpoint, cluster: ClusterNodes, bundle: dict[str, float]) -> str:
    """The node where worker 0 reads the first of the checkpoint's files (rank 0's), for a
    checkpoint whose files are spread over the nodes: the first node holding it with room for a
    worker of `bundle`. Both the export's node and the workers' placement follow it."""
    first = next(iter(checkpoint.read_files()))
    store = checkpoint.store
    return reading_node(store.holders(first), cluster.capacity(bundle), store.display(first), cluster.labels)


def cluster_nodes(options: ExportOptions) -> ClusterNodes | None:
    """The alive nodes of the cluster this export joins, when that is an existing cluster of
    more than one node (a Ray started here has one); None otherwise. Joins it now."""
    if "ray" not in sys.modules and not os.environ.get("RAY_ADDRESS"):
        return None  # a process that never imported Ray belongs to none (gpu_check's runs without Ray installed)
    import ray

    if not ray.is_initialized() and not os.environ.get("RAY_ADDRESS"):
        return None
    ensure_ray(options.log_level)
    alive = [node for node in ray.nodes() if node.get("Alive")]
    if len(alive) < 2:
        return None
    labels = node_labels({node["NodeID"]: node["NodeManagerAddress"] for node in alive})
    resources = {node["NodeID"]: dict(node.get("Resources", {})) for node in alive}
    return ClusterNodes(labels, resources, ray.get_runtime_context().get_node_id())


def known_nodes() -> tuple[dict[str, dict], dict[str, str]]:
    """Every node the cluster has known, alive or not, as `ray.nodes()` reports it, and how
    messages name each (`node_labels`)."""
    import ray

    nodes = {node["NodeID"]: node for node in ray.nodes()}
    return nodes, node_labels({node: info["NodeManagerAddress"] for node, info in nodes.items()})


def node_is_lost(info: dict | None) -> bool:
    """Whether the node `info` (from `known_nodes`) has left the cluster: Ray says so, or its
    raylet accepts no connection (Ray takes some 15 s to notice a node that was killed)."""
    if not info or not info.get("Alive"):
        return True
    try:
        socket.create_connection((info["NodeManagerAddress"], info["NodeManagerPort"]), timeout=2).close()
    except OSError:
        return True
    return False


def files_below(path: str) -> dict[str, int]:
    """Every file under the local folder `path` (relative path -> size); empty when there is none."""
    found = {}
    for folder, _, names in os.walk(path):
        for name in names:
            full = os.path.join(folder, name)
            if os.path.isfile(full):
                found[os.path.relpath(full, path)] = os.path.getsize(full)
    return found


def ask_nodes(path: str, nodes: ClusterNodes) -> list[NodeFiles]:
    """What each node holds under the local folder `path`, asked of all at once by a task
    pinned to each; a node that does not answer in NODE_CALL_S is named in the error."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0)(files_below)
    ids = sorted(nodes.labels, key=lambda node: nodes.labels[node])
    references = [
        task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(path) for node in ids
    ]
    ready, _ = ray.wait(references, num_returns=len(references), timeout=NODE_CALL_S)
    silent = [node for node, reference in zip(ids, references) if reference not in ready]
    if silent:
        cancel_unfinished(references)
        raise ExportError(
            f"node(s) {', '.join(nodes.labels[node] for node in silent)} did not list '{path}' within {NODE_CALL_S:.0f} s"
        )
    answers = []
    for node, reference in zip(ids, references):
        try:
            answers.append(NodeFiles(node, nodes.labels[node], ray.get(reference)))
        except ray.exceptions.RayError as error:  # the node left the cluster since it was counted
            raise ExportError(f"node {nodes.labels[node]} could not list '{path}': {type(error).__name__}") from None
    for answer in answers:
        log.info("node %s holds %d file(s) under %s", answer.label, len(answer.files), path)
    return answers


def _call(store: Store, method: str, *args: Any) -> Any:
    return getattr(store, method)(*args)


class RayOnNode:
    """Runs a `Store` call on a given node with a Ray task pinned there (not soft): how a
    `SpreadStore` or a `PinnedStore` reaches a node's own disk."""

    def here(self) -> str | None:
        """This process's node, when it is a Ray worker (which sees its node's files); None in
        a driver, which may see another filesystem than the node it joined through (a client,
        a container, a namespace of its own)."""
        import ray

        context = ray.get_runtime_context()
        return context.get_node_id() if context.worker.mode == ray.WORKER_MODE else None

    def call(self, node: str, store: Store, method: str, *args: Any) -> Any:
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        task = ray.remote(num_cpus=0, max_retries=0)(_call)
        reference = task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(
            store, method, *args
        )
        try:
            return ray.get(reference, timeout=NODE_CALL_S)
        except ray.exceptions.GetTimeoutError:
            cancel_unfinished([reference])
            raise ExportError(f"node {node[:8]} did not answer {method} of '{store.uri}' within {NODE_CALL_S:.0f} s") from None
        except ray.exceptions.RayTaskError as error:
            if isinstance(error.cause, ExportError):  # the store's own one line, as if called here
                raise ExportError(str(error.cause)) from None
            raise
