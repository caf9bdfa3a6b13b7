"""rayexport.layouts.shards: the finiteness check every loaded tensor goes through."""

import pytest
import torch

from rayexport.layouts.shards import is_finite


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("position", [0, 777, -1])
def test_one_nan_or_inf_anywhere_is_found(dtype, bad, position):
    tensor = torch.randn(40, 50).to(dtype)
    assert is_finite(tensor)
    tensor.view(-1)[position] = bad
    assert not is_finite(tensor)
    assert not is_finite(tensor[:, :])  # a view, as a memory-mapped shard gives


def test_integers_bools_and_empty_tensors_are_finite():
    assert is_finite(torch.arange(5))
    assert is_finite(torch.tensor([True, False]))
    assert is_finite(torch.empty(0, 3))
