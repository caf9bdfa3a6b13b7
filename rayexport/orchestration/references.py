"""The source scan, before the gather: one pass over every source piece, by the worker that
holds it, that checks its values for NaN/Inf and takes the verification's reference, the
piece's digest after the planned cast. A piece of a LoRA-merged weight is merged there first,
with its adapter's halves, which the driver reads from their holders (never from the gather),
a batch at a time."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rayexport.common.digests import FAST
from rayexport.common.dtypes import nbytes
from rayexport.orchestration.group import WorkerGroup
from rayexport.plan.naming import TensorPlan, TensorPlanning
from rayexport.plan.pieces import Piece
from rayexport.plan.schedule import group_by_bytes
from rayexport.transport.assembly import assemble

# The LoRA halves the driver holds at once while the workers record merged pieces' digests.
LORA_REFERENCE_BYTES = 64 << 20


@dataclass
class SourceScan:
    """What the scan found: per output tensor, where each source piece goes and its digest
    (empty without `digests`), and the source keys whose values hold NaN or Inf."""

    pieces: dict[str, list[dict]]
    non_finite: list[str]


def scan_source(
    group: WorkerGroup, planning: TensorPlanning, worker_of_rank: dict[int, int], digests: bool = True,
) -> SourceScan:
    """Scan every source piece the export writes, as the worker holding it read it; with
    `digests`, record each piece's digest after the planned cast (`lora` in the record of a
    merged piece)."""
    plans = planning.tensors + planning.adapters
    pieces, non_finite = _scan_pieces(group, [(plan, None) for plan in plans if plan.lora is None], worker_of_rank, digests)
    merged = [plan for plan in plans if plan.lora is not None]
    for batch in group_by_bytes(merged, _adapter_bytes, LORA_REFERENCE_BYTES):
        halves = [half for plan in batch for half in (plan.lora.a, plan.lora.b)]
        read = _read_pieces(group, [piece for half in halves for piece in half.pieces], worker_of_rank)
        adapters = [
            (assemble(plan.lora.a, read), assemble(plan.lora.b, read), plan.lora.scale, plan.lora.fan_in_fan_out)
            for plan in batch
        ]
        more, bad = _scan_pieces(group, list(zip(batch, adapters)), worker_of_rank, digests)
        pieces.update(more)
        non_finite += bad
    records = {name: sorted(found, key=lambda record: record["offset"]) for name, found in sorted(pieces.items())}
    return SourceScan(records if digests else {}, sorted(set(non_finite)))


def _adapter_bytes(plan: TensorPlan) -> int:
    """The bytes of a LoRA-merged weight's A and B, as saved."""
    return sum(nbytes(half.shape, half.source_dtype) for half in (plan.lora.a, plan.lora.b))


def _scan_pieces(
    group: WorkerGroup, requested: list[tuple[TensorPlan, tuple | None]], worker_of_rank: dict[int, int], digests: bool,
) -> tuple[dict[str, list[dict]], list[str]]:
    """The records of `scan_source` for these plans, each with its adapter or None, and the
    source keys found not finite."""
    requests: dict[int, list[tuple[Piece, str | None, tuple | None]]] = {}
    names: dict[int, list[str]] = {}
    for plan, adapter in requested:
        for piece in plan.pieces:
            worker = worker_of_rank[piece.rank]
            requests.setdefault(worker, []).append((piece, plan.dtype if digests else None, adapter))
            names.setdefault(worker, []).append(plan.name)
    answers = group.ask("scan_source", {worker: (asked,) for worker, asked in requests.items()})
    pieces: dict[str, list[dict]] = {}
    non_finite = []
    for worker, results in answers.items():
        for (piece, _, adapter), name, (finite, digest) in zip(requests[worker], names[worker], results):
            if not finite:
                non_finite.append(piece.source_key)
            pieces.setdefault(name, []).append({
                "rank": piece.rank, "source_key": piece.source_key,
                "offset": list(piece.offset), "shape": list(piece.shape), FAST: digest,
                **({"lora": True} if adapter is not None else {}),
            })
    return pieces, non_finite


def _read_pieces(group: WorkerGroup, pieces: list[Piece], worker_of_rank: dict[int, int]) -> dict[Piece, Any]:
    """Each piece's values, as the worker holding it read it."""
    by_worker: dict[int, list[Piece]] = {}
    for piece in pieces:
        by_worker.setdefault(worker_of_rank[piece.rank], []).append(piece)
    answers = group.ask("read_pieces", {worker: (asked,) for worker, asked in by_worker.items()})
    return {piece: tensor for worker, tensors in answers.items() for piece, tensor in zip(by_worker[worker], tensors)}
