"""Files that `torch.save` wrote (its zip format), read without `torch.load`: the pickled record
(`data.pkl`) unpickled from an allow-list, each tensor in it a `TensorRef` (dtype, shape and where
its bytes are) rather than data, and each tensor's bytes read where a caller asks for them.

Written by hand because torch offers no reader that stops at the record: `torch.load` needs the
whole file local (or in memory) and every class the pickle names importable, and DeepSpeed's
files name DeepSpeed's own classes. Here a remote file is read with a few ranged requests (its
zip directory, the record, each wanted tensor's bytes), and the few foreign classes such a file
may name are built as inert stand-ins (`StandIn`); anything else refuses the file in one line.
"""

from __future__ import annotations

import errno
import io
import math
import pickle
import struct
import zipfile
from dataclasses import dataclass
from typing import Any

from rayexport.common.dtypes import itemsize
from rayexport.common.errors import ExportError
from rayexport.storage.store import Store

# torch's typed storage classes, as pickles name them, and the dtype of each
STORAGE_DTYPES = {
    "FloatStorage": "float32", "DoubleStorage": "float64", "HalfStorage": "float16", "BFloat16Storage": "bfloat16",
    "LongStorage": "int64", "IntStorage": "int32", "ShortStorage": "int16", "CharStorage": "int8",
    "ByteStorage": "uint8", "BoolStorage": "bool",
}
_DTYPE_NAMES = frozenset(STORAGE_DTYPES.values())
_ZIP_LOCAL_HEADER = struct.Struct("<4s5H3L2H")  # a zip member's local header, before its name and extra field


@dataclass(frozen=True)
class TensorRef:
    """A tensor of the record: its storage (`key`, a member `data/<key>` of the zip), its dtype,
    shape and offset in the storage (elements); contiguous, as `torch.save` writes parameters."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    storage_offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class StandIn:
    """An object of a class the record names but nothing here needs (DeepSpeed's loss scaler,
    its ZeRO stage enum, a fragment address): its arguments and state, kept as data."""

    def __new__(cls, *args: Any) -> "StandIn":  # what a pickle's REDUCE and NEWOBJ call
        made = super().__new__(cls)
        made.args = args
        return made

    def __setstate__(self, state: Any) -> None:
        self.state = state

    @property
    def fields(self) -> dict:
        state = getattr(self, "state", None)
        return state if isinstance(state, dict) else {}


class _Refused(Exception):
    pass


class _OrderedDict(dict):
    """`collections.OrderedDict` as a record holds it: a dict that takes the attributes pickled
    with it (a module state dict's `_metadata`)."""


def _rebuild_tensor(storage: tuple[str, str], storage_offset: int, size, stride, *args) -> TensorRef:
    """`torch._utils._rebuild_tensor_v2`, making a reference instead of a tensor."""
    shape = tuple(int(extent) for extent in size)
    expected, step = [], 1
    for extent in reversed(shape):
        expected.insert(0, step)
        step *= max(extent, 1)
    if math.prod(shape) > 1 and tuple(stride) != tuple(expected):
        raise _Refused(f"a tensor with strides {list(stride)} for shape {list(shape)} (not contiguous)")
    return TensorRef(storage[0], storage[1], shape, int(storage_offset))


def _rebuild_from_type(rebuild, tensor_type, arguments, state) -> TensorRef:
    """`torch._tensor._rebuild_from_type_v2`, for a tensor of a subclass (a Parameter): its data."""
    return rebuild(*arguments)


def _rebuild_parameter(data: TensorRef, *arguments) -> TensorRef:
    """`torch._utils._rebuild_parameter`: a Parameter's data."""
    return data


# What torch's own pickles of tensors name, and what a record is made with instead.
_TORCH_GLOBALS = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch.nn.parameter", "Parameter"): StandIn,  # the type a tensor subclass is rebuilt as
    ("torch", "Tensor"): StandIn,
    ("torch", "Size"): tuple,
}


class _RecordUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, stand_ins: frozenset[str], unsafe: bool) -> None:
        super().__init__(io.BytesIO(data))
        self.stand_ins, self.unsafe = stand_ins, unsafe

    def find_class(self, module: str, name: str):
        if module == "torch" and name in STORAGE_DTYPES:
            return STORAGE_DTYPES[name]
        if module == "torch" and name in _DTYPE_NAMES:  # a dtype as a value (fp16 training's loss scaler holds one)
            return name
        if (module, name) in _TORCH_GLOBALS:
            return _TORCH_GLOBALS[module, name]
        if (module, name) == ("collections", "OrderedDict"):
            return _OrderedDict
        if f"{module}.{name}" in self.stand_ins:
            return StandIn
        if self.unsafe:
            return super().find_class(module, name)
        raise _Refused(f"'{module}.{name}'")

    def persistent_load(self, saved_id):
        # ('storage', dtype (from find_class), key, location, numel)
        if not (isinstance(saved_id, tuple) and len(saved_id) >= 3 and saved_id[0] == "storage"):
            raise _Refused(f"a persistent id {saved_id!r:.60}")
        return str(saved_id[2]), saved_id[1] if isinstance(saved_id[1], str) else "uint8"


class _RangeFile(io.RawIOBase):
    """A read-only, seekable file over an object's byte ranges (what `zipfile` needs): all of it,
    or the `length` bytes from byte `start` (a zip held inside a larger file)."""

    def __init__(self, store: Store, name: str, start: int = 0, length: int | None = None) -> None:
        self.store, self.name, self.start, self.position = store, name, start, 0
        self.length = store.size(name) - start if length is None else length

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        position = {io.SEEK_SET: 0, io.SEEK_CUR: self.position, io.SEEK_END: self.length}[whence] + offset
        if position < 0:  # as a file refuses it, which zipfile expects of a file too short to be a zip
            raise OSError(errno.EINVAL, f"seek to byte {position} of '{self.name}'")
        self.position = position
        return position

    def tell(self) -> int:
        return self.position

    def readinto(self, buffer) -> int:
        end = min(self.length, self.position + len(buffer))
        data = self.store.read_range(self.name, self.start + self.position, self.start + end) if end > self.position else b""
        buffer[:len(data)] = data
        self.position += len(data)
        return len(data)


class TorchZip:
    """One `torch.save` zip file of `store`: its record and where each storage's bytes are. With
    `window` (start, length), the zip is those bytes of the object (as DCP's FileSystemWriter
    writes each chunk into a `.distcp` file); every position given back is the object's."""

    def __init__(
        self, store: Store, name: str, stand_ins: frozenset[str] = frozenset(), unsafe: bool = False,
        window: tuple[int, int] | None = None,
    ) -> None:
        self.store, self.name = store, name
        self.start = window[0] if window else 0
        try:
            file = _RangeFile(store, name, *(window or (0, None)))
            self.zip = zipfile.ZipFile(io.BufferedReader(file, buffer_size=64 * 1024))
            pickles = [member for member in self.zip.namelist() if member.endswith("/data.pkl")]
            if len(pickles) != 1:
                raise ExportError(f"'{store.display(name)}' is not a file torch.save wrote (no data.pkl)")
            self.root = pickles[0][:-len("data.pkl")]
            data = self.zip.read(pickles[0])
        except (zipfile.BadZipFile, OSError) as error:  # OSError: a zip whose directory points outside it
            raise ExportError(f"'{store.display(name)}' cannot be read: {error}") from None
        try:
            self.record = _RecordUnpickler(data, stand_ins, unsafe).load()
        except _Refused as refused:
            raise ExportError(
                f"'{store.display(name)}' refers to {refused}, which rayexport does not unpickle "
                "(--unsafe-pickle runs such code: only for trusted checkpoints)"
            ) from None
        except Exception as error:  # noqa: BLE001 - unpickling a damaged record raises many types
            raise ExportError(f"'{store.display(name)}' cannot be unpickled: {type(error).__name__}: {error}") from None

    @property
    def display(self) -> str:
        return self.store.display(self.name)

    def byte_range(self, tensor: TensorRef) -> tuple[int, int]:
        """Where `tensor`'s bytes are in the file: [start, end). torch stores each storage as an
        uncompressed member; its data starts after the member's local header."""
        member = f"{self.root}data/{tensor.key}"
        try:
            info = self.zip.getinfo(member)
        except KeyError:
            raise ExportError(f"'{self.store.display(self.name)}' has no storage '{tensor.key}'") from None
        header_start = self.start + info.header_offset
        header = self.store.read_range(self.name, header_start, header_start + _ZIP_LOCAL_HEADER.size)
        *_, name_length, extra_length = _ZIP_LOCAL_HEADER.unpack(header)
        data_start = header_start + _ZIP_LOCAL_HEADER.size + name_length + extra_length
        start = data_start + tensor.storage_offset * itemsize(tensor.dtype)
        end = start + tensor.numel * itemsize(tensor.dtype)
        if info.compress_type != zipfile.ZIP_STORED or end > data_start + info.file_size:
            raise ExportError(f"storage '{tensor.key}' of '{self.store.display(self.name)}' is not where its tensor says")
        return start, end
