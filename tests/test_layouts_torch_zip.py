"""rayexport.layouts.torch_zip: files `torch.save` wrote, their records read without torch.load."""

import collections
import os

import pytest
import torch

from rayexport.common.errors import ExportError
from rayexport.layouts.torch_zip import StandIn, TensorRef, TorchZip
from rayexport.storage.store import Store


class Foreign:
    """A class a trainer pickles, which the reader builds as a stand-in only where it is named."""

    def __init__(self, value):
        self.value = value


def saved(tmp_path, record) -> Store:
    torch.save(record, os.path.join(tmp_path, "states.pt"))
    return Store(str(tmp_path))


def test_a_record_holds_references_whose_bytes_are_the_tensors(tmp_path):
    weights = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    half = torch.arange(5, dtype=torch.bfloat16)
    store = saved(tmp_path, {"w": weights, "view": weights[1], "h": half, "shape": torch.Size([3, 4]),
                             "ordered": collections.OrderedDict(a=1), "param": torch.nn.Parameter(half.float()),
                             "dtype": torch.float16})
    file = TorchZip(store, "states.pt")
    record = file.record
    assert record["shape"] == (3, 4) and record["ordered"] == {"a": 1} and record["dtype"] == "float16"
    for name, tensor in (("w", weights), ("view", weights[1]), ("h", half), ("param", half.float())):
        reference = record[name]
        assert isinstance(reference, TensorRef) and reference.shape == tuple(tensor.shape) and reference.dtype == str(tensor.dtype)[6:]
        start, end = file.byte_range(reference)
        assert store.read_range("states.pt", start, end) == tensor.contiguous().view(torch.uint8).numpy().tobytes(), name


def test_a_class_outside_the_allow_list_refuses_the_file_and_a_named_one_is_a_stand_in(tmp_path):
    store = saved(tmp_path, {"scaler": Foreign(3)})
    with pytest.raises(ExportError, match=f"refers to '{__name__}.Foreign', which rayexport does not unpickle"):
        TorchZip(store, "states.pt")
    scaler = TorchZip(store, "states.pt", frozenset({f"{__name__}.Foreign"})).record["scaler"]
    assert isinstance(scaler, StandIn) and scaler.fields == {"value": 3}


def test_a_file_torch_save_did_not_write_is_one_line(tmp_path):
    (tmp_path / "states.pt").write_bytes(b"not a zip")
    with pytest.raises(ExportError, match="states.pt' cannot be read"):
        TorchZip(Store(str(tmp_path)), "states.pt")
