"""What an export will cost, from its plan alone: per worker the bytes it reads, sends, receives
and writes, the files it writes and the staging memory its gather holds, and the seconds that
takes at given rates. `--dry-run` prints it; a real export's report gives it beside what it
measured. Pure functions over the `TransferPlan`.

The time model is deliberately plain: a worker's transfer is its reading, its share of the
gather and its writing one after the other (on a few cores they take turns rather than overlap),
the slowest worker sets the transfer's time, each writer then re-reads what it wrote, the reload
streams the whole export through one process, and a fixed cost covers imports, planning, the
workers' start and the commit. The default rates are this project's own 2.4 GB measurements on
its 2-core development machine (docs/performance.md); a cluster's own come from one real export's
report (`estimate` beside `seconds` and `bytes`), passed back with `--rates`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from rayexport.common.errors import ExportError
from rayexport.plan.schedule import WINDOW, TransferPlan, received_bytes, sent_bytes, staging_bytes

MB = 10**6


@dataclass(frozen=True)
class Rates:
    """Per-worker rates in MB/s (`fixed`: seconds), as `--rates` takes them."""

    read: float = 4000.0  # the source's bytes into a worker (memory-mapped, page cache warm)
    gather: float = 2400.0  # bytes a worker sends and receives over the process group (gloo)
    write: float = 800.0  # a writer's bytes into its files
    verify: float = 2400.0  # a writer re-reading its files
    reload: float = 3000.0  # the reload check streaming the export through one process
    fixed: float = 4.5  # seconds: imports, planning, the workers' start, the commit

    @classmethod
    def parse(cls, text: str) -> "Rates":
        """`read=200,write=150,...` (any subset; MB/s, `fixed` in seconds); '' gives the defaults."""
        values = {}
        names = [item.name for item in fields(cls)]
        for entry in filter(None, (part.strip() for part in text.split(","))):
            name, _, number = entry.partition("=")
            if name.strip() not in names:
                raise ExportError(f"--rates: unknown rate '{name.strip()}' (known: {', '.join(names)})")
            try:
                value = float(number)
            except ValueError:
                raise ExportError(f"--rates: '{entry}' is not NAME=NUMBER") from None
            if value <= 0:
                raise ExportError(f"--rates: {name.strip()} must be positive, not {number.strip()}")
            values[name.strip()] = value
        return cls(**values)


@dataclass(frozen=True)
class WorkerCost:
    """One worker's share of the export."""

    worker: int
    node: str  # where it runs ("" where the cluster places it)
    bytes_read: int
    bytes_sent: int
    bytes_received: int
    files: tuple[str, ...]  # the safetensors files it writes
    bytes_written: int
    staging_bytes: int  # the gather's buffers: the window of its largest bucket on the wire
    seconds: float  # its transfer at the rates


@dataclass(frozen=True)
class ExportCost:
    """The whole export's plan in numbers: each worker's share, the totals, and the seconds
    each phase takes at `rates`."""

    workers: tuple[WorkerCost, ...]
    tensor_count: int
    tensor_bytes: int  # the tensors' bytes, as written
    file_count: int
    memory_bound_bytes: int  # what each process may hold above its start (2 buckets + 1 GiB)
    rates: Rates
    seconds: dict[str, float]  # transfer, verify_files, reload, fixed, and their total

    def to_dict(self) -> dict:
        return asdict(self)

    def over_bound(self) -> list[int]:
        """The workers whose gather buffers alone exceed the bound (a tensor larger than a bucket
        travels alone, in buffers of its size)."""
        return [cost.worker for cost in self.workers if cost.staging_bytes > self.memory_bound_bytes]


def export_cost(
    transfer: TransferPlan, file_bytes: dict[str, int], read_bytes: dict[int, int], nodes: tuple[str, ...],
    tensor_count: int, tensor_bytes: int, memory_bound_bytes: int, rates: Rates, verifies: bool,
) -> ExportCost:
    """The cost of `transfer`: `file_bytes` is each safetensors file's size, `read_bytes` what
    each worker reads of the source, `nodes` each worker's node; `verifies`: the files are
    re-read and the export reloaded before commit (any `--verify` but none)."""
    workers = []
    for worker in range(len(transfer.files)):
        files = tuple(shard.filename for shard in transfer.files[worker])
        read, written = read_bytes.get(worker, 0), sum(file_bytes[name] for name in files)
        sent, received = sent_bytes(transfer.buckets, worker), received_bytes(transfer.buckets, worker)
        seconds = (read / rates.read + (sent + received) / rates.gather + written / rates.write) / MB
        workers.append(WorkerCost(
            worker, nodes[worker] if worker < len(nodes) else "", read, sent, received, files, written,
            WINDOW * staging_bytes(transfer.buckets, worker), round(seconds, 2),
        ))
    phases = {
        "transfer": max((cost.seconds for cost in workers), default=0.0),
        "verify_files": max((cost.bytes_written / rates.verify / MB for cost in workers), default=0.0) if verifies else 0.0,
        "reload": sum(file_bytes.values()) / rates.reload / MB if verifies else 0.0,
        "fixed": rates.fixed,
    }
    seconds = {name: round(value, 2) for name, value in phases.items()}
    seconds["total"] = round(sum(phases.values()), 2)
    return ExportCost(tuple(workers), tensor_count, tensor_bytes, len(file_bytes), memory_bound_bytes, rates, seconds)


def cost_table(cost: ExportCost) -> str:
    """The cost as a person reads it: a line per worker, one per node where there are several,
    the totals and the estimated seconds."""
    def gb(count: int) -> str:
        return f"{count / 1e9:.2f}"

    rows = [("worker", "node", "read GB", "sent GB", "received GB", "files", "written GB", "staging GiB", "transfer s")]
    for item in cost.workers:
        rows.append((
            str(item.worker), item.node or "-", gb(item.bytes_read), gb(item.bytes_sent), gb(item.bytes_received),
            str(len(item.files)), gb(item.bytes_written), f"{item.staging_bytes / 2**30:.2f}", f"{item.seconds:.1f}",
        ))
    nodes = sorted({item.node for item in cost.workers if item.node})
    if len(nodes) > 1:
        for node in nodes:
            on = [item for item in cost.workers if item.node == node]
            rows.append((
                f"{len(on)} on", node, gb(sum(item.bytes_read for item in on)), gb(sum(item.bytes_sent for item in on)),
                gb(sum(item.bytes_received for item in on)), str(sum(len(item.files) for item in on)),
                gb(sum(item.bytes_written for item in on)), "", "",
            ))
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    lines = ["  ".join(cell.rjust(width) for cell, width in zip(row, widths)) for row in rows]
    seconds = cost.seconds
    lines += [
        f"{cost.tensor_count} tensors, {cost.tensor_bytes / 1e9:.2f} GB in {cost.file_count} safetensors file(s); "
        f"each process within {cost.memory_bound_bytes / 2**30:.2f} GiB above its start",
        "estimated seconds: " + ", ".join(f"{name} {value:.1f}" for name, value in seconds.items() if name != "total")
        + f" (total {seconds['total']:.1f}, at " + ", ".join(
            f"{name} {getattr(cost.rates, name):g}" for name in ("read", "gather", "write", "verify", "reload")
        ) + " MB/s per worker)",
    ]
    over = cost.over_bound()
    if over:
        lines.append(
            f"worker(s) {', '.join(map(str, over))}: a tensor larger than --bucket-size travels alone, so the "
            f"gather's buffers exceed the bound"
        )
    return "\n".join(lines)
