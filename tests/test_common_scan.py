"""rayexport.common.scan: the finiteness check every loaded tensor goes through, and the tied-copy
comparison, both a bounded chunk at a time."""

import pytest
import torch

from rayexport.common.scan import is_finite, max_abs_difference
from rayexport.plan.shards import describe_tensor


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
    assert is_finite(tensor) and describe_tensor(tensor, 0).finite
    tensor.view(torch.uint8).view(-1)[777] = 0x7F  # NaN in both float8 formats
    assert not is_finite(tensor, elements=64)
    assert not describe_tensor(tensor, 0).finite


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
