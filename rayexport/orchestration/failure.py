"""What a failed export on the cluster leaves and loses: the one line naming the worker, or the
node and every worker on it, that was lost, and the removal of the export's spool folders on
each node it ran on, saying which nodes could not do it."""

from __future__ import annotations

import logging
from typing import Any

from rayexport.common.errors import one_line
from rayexport.orchestration import spool
from rayexport.orchestration.nodes import known_nodes, node_is_lost
from rayexport.orchestration.waits import cancel_unfinished

log = logging.getLogger(__name__)

# How long a failed export waits for the tasks that remove its spooled files on each node.
SPOOL_CLEANUP_S = 30.0


def lost_worker_line(error: Any, actors: list, worker_nodes: list[str | None]) -> str:
    """The line for a worker that died or stopped answering (Ray's RayActorError, of one of
    `actors`, placed on `worker_nodes`): which worker, on which node, and, where that node was
    lost, every worker that ran there."""
    worker = next((index for index, actor in enumerate(actors) if actor._actor_id.hex() == error.actor_id), None)
    node = worker_nodes[worker] if worker is not None and worker < len(worker_nodes) else None
    if node is None:
        return str(error).splitlines()[0]
    nodes, labels = known_nodes()
    label = labels.get(node, f"node {node[:8]}")
    if node_is_lost(nodes.get(node)):
        there = [str(index) for index, at in enumerate(worker_nodes) if at == node]
        return f"node {label} was lost mid-export, and with it worker{'s' if len(there) > 1 else ''} {', '.join(there)}"
    return f"worker {worker}{_actor_pid(error)} on node {label}: {_actor_reason(error)}"


def remove_spool_on(nodes: set[str], export_id: str) -> None:
    """Remove export `export_id`'s spool folder on each of `nodes` that is still there, by a
    task pinned to it; log what was removed and, by name, each node that did not do it (lost,
    failing, or not answering in time)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    known, labels = known_nodes()
    missed = {node: "lost" for node in sorted(nodes) if node_is_lost(known.get(node))}
    reachable = sorted(set(nodes) - set(missed))
    task = ray.remote(num_cpus=0, max_retries=0)(spool.remove_export)
    references = [
        task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(export_id)
        for node in reachable
    ]
    done, _ = ray.wait(references, num_returns=len(references), timeout=SPOOL_CLEANUP_S)
    freed = 0
    for node, reference in zip(reachable, references):
        if reference not in done:
            missed[node] = f"no answer within {SPOOL_CLEANUP_S:.0f} s"
            continue
        try:
            freed += ray.get(reference)
        except Exception as error:  # noqa: BLE001 - a failing node's task fails in many ways
            missed[node] = type(error).__name__
    cancel_unfinished(references)
    log.info(
        "removed %d bytes of spooled files on %d of %d node(s)%s", freed, len(nodes) - len(missed), len(nodes),
        "".join(f"; not on {labels.get(node, f'node {node[:8]}')} ({why})" for node, why in missed.items()),
    )


def _actor_pid(error: Any) -> str:
    """` (pid N)` where Ray's text for a dead actor gives its process id; else ""."""
    pids = [line.split(":", 1)[1].strip() for line in str(error).splitlines() if line.strip().startswith("pid:")]
    return f" (pid {pids[0]})" if pids else ""


def _actor_reason(error: Any) -> str:
    """Why Ray says an actor is gone, in its first sentence (a dead process's cause), or that
    it stopped answering (Ray cannot reach it, and may not know why)."""
    causes = [line for line in str(error).splitlines()[1:] if line.strip() and not line.startswith("\t")]
    if not causes:
        return "it stopped answering"
    sentence = one_line(causes[0]).split(". ")[0].rstrip(".")
    return sentence[:1].lower() + sentence[1:]
