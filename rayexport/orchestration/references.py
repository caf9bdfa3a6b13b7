"""The verification's reference, taken before the gather: each source piece's digest after the
planned cast, computed by the worker that holds it. A piece of a LoRA-merged weight is merged
there first, with its adapter's halves, which the driver reads from their holders (never from
the gather), a batch at a time."""

from __future__ import annotations

from typing import Any

from rayexport.common.dtypes import nbytes
from rayexport.orchestration.group import WorkerGroup
from rayexport.plan.naming import TensorPlan, TensorPlanning
from rayexport.plan.pieces import Piece
from rayexport.plan.schedule import group_by_bytes
from rayexport.transport.assembly import assemble

# The LoRA halves the driver holds at once while the workers record merged pieces' digests.
LORA_REFERENCE_BYTES = 64 << 20


def source_pieces(group: WorkerGroup, planning: TensorPlanning, worker_of_rank: dict[int, int]) -> dict[str, list[dict]]:
    """Per output tensor, where each source piece goes and its digest, as the worker holding it
    read it, after the planned cast (`lora` in the record of a merged piece)."""
    plans = planning.tensors + planning.adapters
    pieces = _piece_digests(group, [(plan, None) for plan in plans if plan.lora is None], worker_of_rank)
    merged = [plan for plan in plans if plan.lora is not None]
    for batch in group_by_bytes(merged, _adapter_bytes, LORA_REFERENCE_BYTES):
        halves = [half for plan in batch for half in (plan.lora.a, plan.lora.b)]
        read = _read_pieces(group, [piece for half in halves for piece in half.pieces], worker_of_rank)
        adapters = [
            (assemble(plan.lora.a, read), assemble(plan.lora.b, read), plan.lora.scale, plan.lora.fan_in_fan_out)
            for plan in batch
        ]
        pieces.update(_piece_digests(group, list(zip(batch, adapters)), worker_of_rank))
    return {name: sorted(records, key=lambda record: record["offset"]) for name, records in sorted(pieces.items())}


def _adapter_bytes(plan: TensorPlan) -> int:
    """The bytes of a LoRA-merged weight's A and B, as saved."""
    return sum(nbytes(half.shape, half.source_dtype) for half in (plan.lora.a, plan.lora.b))


def _piece_digests(
    group: WorkerGroup, requested: list[tuple[TensorPlan, tuple | None]], worker_of_rank: dict[int, int]
) -> dict[str, list[dict]]:
    """The records of `source_pieces` for these plans, each with its adapter or None."""
    requests: dict[int, list[tuple[Piece, str, tuple | None]]] = {}
    names: dict[int, list[str]] = {}
    for plan, adapter in requested:
        for piece in plan.pieces:
            worker = worker_of_rank[piece.rank]
            requests.setdefault(worker, []).append((piece, plan.dtype, adapter))
            names.setdefault(worker, []).append(plan.name)
    answers = group.ask("source_digests", {worker: (asked,) for worker, asked in requests.items()})
    pieces: dict[str, list[dict]] = {}
    for worker, digests in answers.items():
        for (piece, _, adapter), name, digest in zip(requests[worker], names[worker], digests):
            pieces.setdefault(name, []).append({
                "rank": piece.rank, "source_key": piece.source_key,
                "offset": list(piece.offset), "shape": list(piece.shape), "sha256": digest,
                **({"lora": True} if adapter is not None else {}),
            })
    return pieces


def _read_pieces(group: WorkerGroup, pieces: list[Piece], worker_of_rank: dict[int, int]) -> dict[Piece, Any]:
    """Each piece's values, as the worker holding it read it."""
    by_worker: dict[int, list[Piece]] = {}
    for piece in pieces:
        by_worker.setdefault(worker_of_rank[piece.rank], []).append(piece)
    answers = group.ask("read_pieces", {worker: (asked,) for worker, asked in by_worker.items()})
    return {piece: tensor for worker, tensors in answers.items() for piece, tensor in zip(by_worker[worker], tensors)}
