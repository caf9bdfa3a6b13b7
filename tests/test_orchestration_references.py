"""rayexport.orchestration.references: which pieces are scanned ahead of the transfer and which as
the transfer reads them, and how their findings become the verification's reference. The scans
themselves run on real workers in test_end_to_end.py (the passes), test_run.py (--strict) and
test_end_to_end_lora.py (merged weights)."""

import logging

import pytest

from rayexport.common.digests import FAST
from rayexport.common.errors import ExportError
from rayexport.orchestration.references import (
    SourceScan, check_finite, scanned_ahead, scanned_in_transfer, transfer_scan,
)
from rayexport.plan.naming import LoraMerge, TensorPlan
from rayexport.plan.pieces import Piece


def rows_plan(name: str, rows_per_rank: int, ranks: int = 2, dtype: str = "bfloat16") -> TensorPlan:
    """A (ranks * rows_per_rank, 4) float32 tensor split by rows over `ranks`."""
    pieces = tuple(Piece(rank, name, (rank * rows_per_rank, 0), (rows_per_rank, 4), "float32") for rank in range(ranks))
    return TensorPlan(name, name, (ranks * rows_per_rank, 4), "float32", dtype, pieces)


def merged_plan(name: str) -> TensorPlan:
    base = rows_plan(name, 2)
    a, b = rows_plan(f"{name}.lora_A", 1), rows_plan(f"{name}.lora_B", 2)
    return TensorPlan(base.name, base.source_key, base.shape, base.source_dtype, base.dtype, base.pieces, LoraMerge(a, b, 2.0))


def test_only_strict_runs_and_lora_merges_scan_ahead_of_the_transfer():
    plain, merged = rows_plan("w", 2), merged_plan("q")
    assert scanned_ahead([plain, merged], strict=False) == [merged]
    assert scanned_ahead([plain, merged], strict=True) == [plain, merged]
    # the transfer scans the rest, with the dtype each digest is taken in, or none at --verify none
    assert scanned_in_transfer([plain, merged], strict=False, digests=True) == dict.fromkeys(plain.pieces, "bfloat16")
    assert scanned_in_transfer([plain, merged], strict=False, digests=False) == dict.fromkeys(plain.pieces)
    assert scanned_in_transfer([plain, merged], strict=True, digests=True) == {}


def test_the_transfers_findings_become_each_tensors_pieces_in_offset_order():
    first, second = rows_plan("a", 2), rows_plan("b", 3)
    results = {
        first.pieces[1]: (True, "a1"), first.pieces[0]: (True, "a0"),
        second.pieces[0]: (False, "b0"), second.pieces[1]: (True, "b1"),
    }
    scan = transfer_scan([first, second], results, digests=True)
    assert [record[FAST] for record in scan.pieces["a"]] == ["a0", "a1"]
    assert scan.pieces["b"][0] == {"rank": 0, "source_key": "b", "offset": [0, 0], "shape": [3, 4], FAST: "b0"}
    assert scan.non_finite == ["b"]
    # without digests there is no reference, only the NaN/Inf finding
    assert transfer_scan([first, second], results, digests=False) == SourceScan({}, ["b"])


def test_a_scan_ahead_and_the_transfers_scan_join():
    ahead = SourceScan({"a": [{"offset": [2, 0], FAST: "late"}]}, ["x"])
    during = SourceScan({"a": [{"offset": [0, 0], FAST: "early"}], "b": [{"offset": [0], FAST: "b"}]}, ["x", "c"])
    joined = ahead.joined(during)
    assert [record[FAST] for record in joined.pieces["a"]] == ["early", "late"]
    assert list(joined.pieces) == ["a", "b"] and joined.non_finite == ["c", "x"]
    assert ahead.pieces["a"] == [{"offset": [2, 0], FAST: "late"}]  # neither scan is changed


def test_non_finite_weights_are_named_in_a_warning_or_refused_under_strict(caplog):
    assert check_finite([], strict=True)
    with caplog.at_level(logging.WARNING, logger="rayexport"):
        assert not check_finite(["model.norm.weight", "lm_head.weight"], strict=False)
    assert "tensor 'model.norm.weight' holds NaN or Inf (and 1 more); exporting anyway" in caplog.text
    with pytest.raises(ExportError, match=r"^tensor 'model.norm.weight' holds NaN or Inf \(--strict\)$"):
        check_finite(["model.norm.weight"], strict=True)
