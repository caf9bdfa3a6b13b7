"""`--dry-run`: an export's whole plan from metadata alone, and what it will cost.

It runs the export's own planning (`plan_export`, the model's description, the layout's share,
naming, ties, files, the gather) on a `PlannedGroup`: the workers as the export would size and
place them, never started, each "reading" its part from the checkpoint's metadata
(`Checkpoint.describe_part`: DCP's `.metadata`, or the records that place each tensor). Nothing
is written at the destination, no Ray is started (on a cluster it is joined, to size and place
the workers against its nodes), and every refusal the export gives before its workers start is
given here too. Tied tensors' values are not compared: the export does that once it reads them.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from rayexport.common.memory import peak_rss_bytes
from rayexport.layouts.base import Checkpoint, Loaded, Part, count_part_bytes
from rayexport.orchestration.export_plan import ExportPlan, plan_export
from rayexport.orchestration.options import ExportOptions
from rayexport.orchestration.placement import NodePlacement, group_size
from rayexport.orchestration.session import JOINED, ensure_ray, starts_own_ray
from rayexport.plan.cost import ExportCost, cost_table


class PlannedGroup:
    """The export's workers as planned and never started: `size` of them, pinned to `nodes`
    where the cluster's nodes decide, each given its part of the checkpoint described from
    metadata (`Checkpoint.describe_part`)."""

    def __init__(self, size: int, nodes: NodePlacement | None = None, writers_limit: int | None = None) -> None:
        self.size = size
        self.nodes = nodes or NodePlacement((None,) * size)
        self.writers_limit = writers_limit
        self.read_bytes: dict[int, int] = {}

    def load(self, checkpoint: Checkpoint, aliases: dict[str, str]) -> Loaded:
        """Share `checkpoint` as the export's workers would, each part described from metadata."""
        def step(parts: dict[int, Part]) -> dict:
            infos: dict = {}
            for part in parts.values():
                infos.update(checkpoint.describe_part(part))
            count_part_bytes(self.read_bytes, checkpoint, parts)
            return infos

        return checkpoint.share(self.size, aliases, step, self.nodes.file_readers)

    def tied_differences(self, pairs: list[tuple[str, str]]) -> dict[tuple[str, str], float]:
        """Every pair taken as equal: their values are compared by the export, which reads them."""
        return {pair: 0.0 for pair in pairs}


@dataclass
class DryRun:
    """What `--dry-run` found: the export as planned and its cost."""

    source: str
    destination: str
    layout: str
    world_size: int
    workers: int
    naming: str
    format: str
    dtype: str | None
    cost: ExportCost
    tied_pairs: int  # tied copies the export will compare before dropping the alias
    seconds: dict[str, float] = field(default_factory=dict)  # the dry run's own stages
    driver_peak_rss_bytes: int = 0

    def summary(self) -> str:
        """The plan for a person: what would be exported, how, each worker's share, the estimate."""
        planned = sum(self.seconds.values())
        return "\n".join([
            f"dry run: {self.source} ({self.layout}, world size {self.world_size})",
            f"     to {self.destination} (nothing written)",
            f"  {self.workers} worker(s); {self.format} format"
            + (f", converted from {self.naming} names" if self.naming != self.format else "") + f"; {self.dtype} tensors"
            + (f"; {self.tied_pairs} tied pair(s) compared when read" if self.tied_pairs else ""),
            *("  " + line for line in cost_table(self.cost).splitlines()),
            f"  planned in {planned:.1f} s (" + ", ".join(f"{name} {value:.1f}" for name, value in self.seconds.items())
            + f"); driver peak {self.driver_peak_rss_bytes / 2**20:.0f} MiB",
        ])

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)


def dry_run(src: str, dst: str, **options: Any) -> DryRun:
    """Plan the export of `src` to `dst` (options as `export` takes them) from metadata alone,
    and cost it; nothing is written."""
    return run_dry_run(ExportOptions(src=src, dst=dst, **options))


def run_dry_run(options: ExportOptions, seconds: dict[str, float] | None = None) -> DryRun:
    """Plan the export of `options` as `run_export` would, from metadata only, and cost it."""
    from rayexport.orchestration.job import load_source, output_cost, plan_output
    from rayexport.orchestration.start import describe_source_model

    options = dataclasses.replace(options, pool=None)  # a pool's workers change nothing in the plan
    joined = None if starts_own_ray() else ensure_ray(options.log_level)
    try:
        seconds = {} if seconds is None else seconds
        plan = plan_export(options, seconds)
        with plan.stage("describe_model"):
            model = describe_source_model(plan)
        group = planned_group(plan)
        with plan.stage("describe_parts"):  # what the workers' load would report, from metadata
            source = load_source(plan, group, model)
        with plan.stage("plan_files"):
            output = plan_output(plan, group, model, source)
            cost = output_cost(plan, group, output)
    finally:
        if joined == JOINED:
            import ray

            ray.shutdown()
    return DryRun(
        source=plan.checkpoint.uri, destination=plan.destination.uri, layout=plan.checkpoint.layout,
        world_size=plan.checkpoint.world_size, workers=group.size, naming=output.planning.naming,
        format=output.planning.format, dtype=output.dtype, cost=cost,
        tied_pairs=len(output.planning.tied_key_pairs), seconds=dict(plan.seconds), driver_peak_rss_bytes=peak_rss_bytes(),
    )


def planned_group(plan: ExportPlan) -> PlannedGroup:
    """The workers the export would start: on a cluster (joined), sized and pinned to nodes as
    `WorkerGroup` does it; otherwise as many as `--workers` or this machine's CPUs give (what a
    Ray started here would have)."""
    options, checkpoint = plan.options, plan.checkpoint
    if starts_own_ray():
        cpus = os.cpu_count() or 1
        return PlannedGroup(group_size(options.workers, options.num_cpus_per_worker, checkpoint.world_size, cpus))
    from rayexport.orchestration.group import WorkerGroup

    group = WorkerGroup.for_export(options, checkpoint.world_size, plan.job_deadline)
    if plan.cluster is not None:
        group.place_on_nodes(checkpoint, plan.cluster, plan.export_node)
    return PlannedGroup(group.size, group.nodes, group.writers_limit)

