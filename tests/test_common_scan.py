"""rayexport.common.scan: the source scan every exported piece goes through (finiteness and its
digest in one pass), and the tied-copy comparison, each a bounded chunk at a time."""

import pytest
import torch

from rayexport.common.digests import digest_of
from rayexport.common.scan import flat_chunks, is_finite, max_abs_difference, scan_and_digest


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("position", [0, 777, -1])
def test_one_nan_or_inf_anywhere_is_found(dtype, bad, position):
    tensor = torch.randn(40, 50).to(dtype)
    assert is_finite(tensor)
    tensor.view(-1)[position] = bad
    assert not is_finite(tensor)
    assert not is_finite(tensor[:, :])  # a view, as a memory-mapped shard gives
    assert not is_finite(tensor, elements=64)  # found in whichever chunk holds it


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_weights_are_scanned(dtype):
    # torch has no aminmax for float8: a float8 checkpoint crashed the load's finiteness scan.
    tensor = torch.randn(40, 50).to(dtype)
    assert is_finite(tensor) and scan_and_digest([tensor], None)[0]
    tensor.view(torch.uint8).view(-1)[777] = 0x7F  # NaN in both float8 formats
    assert not is_finite(tensor, elements=64)
    assert not scan_and_digest([tensor], None)[0]


def test_max_abs_difference_over_chunks():
    first = torch.randn(300, 7)
    second = first.clone()
    assert max_abs_difference(first, second, elements=64) == 0.0
    second[299, 6] += 0.25
    second[5, 0] -= 0.5
    assert max_abs_difference(first, second, elements=64) == pytest.approx(0.5)
    assert max_abs_difference(first.bfloat16(), second.bfloat16(), elements=64) == pytest.approx(0.5, abs=0.02)
    assert max_abs_difference(first, second[:, :6]) == float("inf")


def test_integers_bools_and_empty_tensors_are_finite():
    assert is_finite(torch.arange(5))
    assert is_finite(torch.tensor([True, False]))
    assert is_finite(torch.empty(0, 3))


def test_the_scan_digests_the_cast_bytes_of_strided_and_blocked_values_in_one_pass():
    """The digest a piece is checked against is that of its bytes after the cast, whether the
    piece is a strided region (copied a block of rows at a time), one block or several; the
    same loop finds a NaN, and counts each pass's bytes."""
    full = torch.randn(64, 48)
    region = full[:, 16:40]  # a column block: not contiguous
    expected = digest_of(region.to(torch.bfloat16).contiguous().view(torch.uint8).numpy())
    counts = {}

    def count(kind, nbytes):
        counts[kind] = counts.get(kind, 0) + nbytes

    assert scan_and_digest([region], torch.bfloat16, count, elements=100) == (True, expected)
    assert all(chunk.numel() <= 100 for chunk in flat_chunks(region, elements=100))
    assert counts == {"copied": region.nbytes + region.nbytes // 2, "scanned": region.nbytes, "hashed": region.nbytes // 2}
    blocks = list(region.contiguous().split(10))
    assert scan_and_digest(blocks, torch.bfloat16) == (True, expected)
    assert scan_and_digest([region], None) == (True, None)
    poisoned = region.clone()
    poisoned[63, 23] = float("inf")
    assert scan_and_digest([poisoned], torch.bfloat16, elements=100)[0] is False
    beside = full.clone()
    beside[63, 15] = float("nan")  # next to the region, in the rows it spans: not its value
    assert scan_and_digest([beside[:, 16:40]], None, elements=100)[0] is True
    beside[63, 39] = float("nan")  # the region's last value
    assert scan_and_digest([beside[:, 16:40]], None, elements=100)[0] is False
