"""The source scan: one pass over every source piece, by the worker that holds it, that checks
its values for NaN/Inf and takes the verification's reference, the piece's digest after the
planned cast.

Most pieces are scanned in the transfer itself, as the worker reads them to send or write them
(`scanned_in_transfer`), so the source's bytes are read from storage once. What must be known
before anything is written is scanned ahead, in a stage of its own (`scan_ahead`): every piece
with `--strict`, which refuses NaN/Inf before a byte is written, and the pieces of LoRA-merged
weights, merged there with their adapter's halves, which the driver reads from their holders
(never from the gather) a batch at a time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from rayexport.common.digests import FAST
from rayexport.common.dtypes import nbytes
from rayexport.common.errors import ExportError
from rayexport.orchestration.group import WorkerGroup
from rayexport.plan.naming import TensorPlan
from rayexport.plan.pieces import Piece
from rayexport.plan.schedule import group_by_bytes
from rayexport.transport.assembly import assemble

log = logging.getLogger(__name__)

# The LoRA halves the driver holds at once while the workers record merged pieces' digests.
LORA_REFERENCE_BYTES = 64 << 20


@dataclass
class SourceScan:
    """What the scan found: per output tensor, where each source piece goes and its digest
    (none without digests), and the source keys whose values hold NaN or Inf."""

    pieces: dict[str, list[dict]] = field(default_factory=dict)
    non_finite: list[str] = field(default_factory=list)

    def joined(self, other: "SourceScan") -> "SourceScan":
        """Both scans' findings, each tensor's pieces in offset order."""
        pieces = {name: list(found) for name, found in self.pieces.items()}
        for name, found in other.pieces.items():
            pieces.setdefault(name, []).extend(found)
        records = {name: sorted(found, key=lambda record: record["offset"]) for name, found in sorted(pieces.items())}
        return SourceScan(records, sorted(set(self.non_finite + other.non_finite)))


def check_finite(bad: list[str], strict: bool) -> bool:
    """NaN or Inf in the weights (`bad`: their source keys): a warning naming them, or with
    `strict` the end (with --strict, every piece is scanned ahead of the transfer, so this is
    before anything is written). Returns whether every weight is finite."""
    if not bad:
        return True
    message = f"tensor '{bad[0]}' holds NaN or Inf" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")
    if strict:
        raise ExportError(message + " (--strict)")
    log.warning("%s; exporting anyway (--strict refuses)", message)
    return False


def scanned_ahead(plans: list[TensorPlan], strict: bool) -> list[TensorPlan]:
    """The tensors whose pieces are scanned before the transfer: all of them with `strict`,
    else the LoRA-merged ones (their reference needs the adapter's halves)."""
    return [plan for plan in plans if strict or plan.lora is not None]


def scanned_in_transfer(plans: list[TensorPlan], strict: bool, digests: bool) -> dict[Piece, str | None]:
    """The pieces the transfer scans as it reads them, each with the dtype its digest is taken
    in (None without `digests`): every piece `scanned_ahead` leaves."""
    ahead = {plan.name for plan in scanned_ahead(plans, strict)}
    return {
        piece: plan.dtype if digests else None for plan in plans if plan.name not in ahead for piece in plan.pieces
    }


def transfer_scan(plans: list[TensorPlan], results: dict[Piece, tuple[bool, str | None]], digests: bool) -> SourceScan:
    """The transfer's scan results (each piece's finiteness and digest) as a `SourceScan`."""
    found = [(plan, piece, *results[piece], None) for plan in plans for piece in plan.pieces if piece in results]
    return _records(found, digests)


def scan_ahead(
    group: WorkerGroup, plans: list[TensorPlan], worker_of_rank: dict[int, int], digests: bool = True,
) -> SourceScan:
    """Scan every source piece of `plans`, as the worker holding it read it; with `digests`,
    record each piece's digest after the planned cast (`lora` in the record of a merged piece)."""
    scan = _scan_pieces(group, [(plan, None) for plan in plans if plan.lora is None], worker_of_rank, digests)
    merged = [plan for plan in plans if plan.lora is not None]
    for batch in group_by_bytes(merged, _adapter_bytes, LORA_REFERENCE_BYTES):
        halves = [half for plan in batch for half in (plan.lora.a, plan.lora.b)]
        read = _read_pieces(group, [piece for half in halves for piece in half.pieces], worker_of_rank)
        adapters = [
            (assemble(plan.lora.a, read), assemble(plan.lora.b, read), plan.lora.scale, plan.lora.fan_in_fan_out)
            for plan in batch
        ]
        scan = scan.joined(_scan_pieces(group, list(zip(batch, adapters)), worker_of_rank, digests))
    return scan


def _adapter_bytes(plan: TensorPlan) -> int:
    """The bytes of a LoRA-merged weight's A and B, as saved."""
    return sum(nbytes(half.shape, half.source_dtype) for half in (plan.lora.a, plan.lora.b))


def _scan_pieces(
    group: WorkerGroup, requested: list[tuple[TensorPlan, tuple | None]], worker_of_rank: dict[int, int], digests: bool,
) -> SourceScan:
    """`scan_ahead` for these plans, each with its adapter or None."""
    requests: dict[int, list[tuple[Piece, str | None, tuple | None]]] = {}
    asked: dict[int, list[TensorPlan]] = {}
    for plan, adapter in requested:
        for piece in plan.pieces:
            worker = worker_of_rank[piece.rank]
            requests.setdefault(worker, []).append((piece, plan.dtype if digests else None, adapter))
            asked.setdefault(worker, []).append(plan)
    answers = group.ask("scan_ahead", {worker: (pieces,) for worker, pieces in requests.items()})
    found = [
        (plan, piece, finite, digest, adapter)
        for worker, results in answers.items()
        for (piece, _, adapter), plan, (finite, digest) in zip(requests[worker], asked[worker], results)
    ]
    return _records(found, digests)


def _records(found: list[tuple[TensorPlan, Piece, bool, str | None, Any]], digests: bool) -> SourceScan:
    """A `SourceScan` from (plan, piece, finite, digest, adapter) findings: the pieces' records
    only with `digests`."""
    pieces: dict[str, list[dict]] = {}
    for plan, piece, _, digest, adapter in found if digests else ():
        pieces.setdefault(plan.name, []).append({
            "rank": piece.rank, "source_key": piece.source_key,
            "offset": list(piece.offset), "shape": list(piece.shape), FAST: digest,
            **({"steps": list(piece.placement_steps)} if piece.placement_steps else {}),
            **({"lora": True} if adapter is not None else {}),
        })
    non_finite = [piece.source_key for _, piece, finite, _, _ in found if not finite]
    return SourceScan().joined(SourceScan(pieces, non_finite))


def _read_pieces(group: WorkerGroup, pieces: list[Piece], worker_of_rank: dict[int, int]) -> dict[Piece, Any]:
    """Each piece's values, as the worker holding it read it."""
    by_worker: dict[int, list[Piece]] = {}
    for piece in pieces:
        by_worker.setdefault(worker_of_rank[piece.rank], []).append(piece)
    answers = group.ask("read_pieces", {worker: (asked,) for worker, asked in by_worker.items()})
    return {piece: tensor for worker, tensors in answers.items() for piece, tensor in zip(by_worker[worker], tensors)}
