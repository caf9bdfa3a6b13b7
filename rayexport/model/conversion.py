"""A model's on-disk format, learnt from transformers' own save conversion.

transformers 5 holds some models under other names and shapes than it saves them in (fused
MoE experts, VLM submodules), and `core_model_loading.revert_weight_conversion` is what
`save_pretrained` applies to turn the one into the other. Running it on meta tensors under a
dispatch mode that follows every aten op gives, for each on-disk tensor, the exact tiles of
in-memory tensors it is made of; so a model transformers adds later needs no change here, and
an op that is not a pure move of elements is refused by name.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from rayexport.common.dtypes import dtype_name, dtype_of
from rayexport.common.errors import ExportError, one_line
from rayexport.plan import tiles as tiling
from rayexport.plan.formats import ModelFormats, Naming
from rayexport.plan.tiles import Tile


def model_formats(
    meta_model: torch.nn.Module, expected: dict[str, tuple[tuple[int, ...], str]], aliases: dict[str, str]
) -> ModelFormats:
    """The model's in-memory naming (`expected`, `aliases`: its state-dict names, shapes, dtypes
    and tie aliases) and the on-disk naming `save_pretrained` writes, with the tiles relating them."""
    return ModelFormats.from_tiles(Naming(expected, aliases), trace_save_conversion(meta_model, expected))


def trace_save_conversion(
    model: torch.nn.Module, expected: dict[str, tuple[tuple[int, ...], str]]
) -> dict[str, tuple[tuple[int, ...], str, tuple[Tile, ...]]]:
    """Each on-disk name `save_pretrained` writes for the in-memory tensors `expected` (name:
    shape, dtype), with its shape, dtype and the tiles of in-memory tensors it is made of.
    transformers 4 saves the names it holds, except VLMs' renaming (4.52+), which is refused."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        if getattr(model, "_checkpoint_conversion_mapping", None):
            raise ExportError(
                f"transformers 4 renames {type(model).__name__}'s tensors on save (_checkpoint_conversion_mapping); "
                f"exporting it needs transformers>=5"
            ) from None
        return {name: (shape, dtype, (tiling.whole(name, shape),)) for name, (shape, dtype) in expected.items()}
    return trace(lambda state: revert_weight_conversion(model, state), expected, "transformers' save conversion")


def trace(
    convert: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
    expected: dict[str, tuple[tuple[int, ...], str]],
    what: str,
) -> dict[str, tuple[tuple[int, ...], str, tuple[Tile, ...]]]:
    """Run `convert` on meta tensors of `expected` (name: shape, dtype) and return each tensor
    it produces: shape, dtype and the tiles of the inputs it is made of. `what` names the
    conversion in errors."""
    inputs = {name: torch.empty(shape, dtype=dtype_of(dtype), device="meta") for name, (shape, dtype) in expected.items()}
    tracer = _TileTracer(inputs, what)
    try:
        with tracer:
            converted = convert(dict(inputs))
    except Exception as error:  # noqa: BLE001 - conversion code raises anything
        raise ExportError(f"{what} failed on the meta device: {one_line(error)}") from None
    return {
        name: (tuple(tensor.shape), dtype_name(tensor.dtype), tracer.tiles_of(name, tensor))
        for name, tensor in converted.items()
    }


class _TileTracer(TorchDispatchMode):
    """Follows every aten op on the traced tensors, keeping the tiles of each result."""

    def __init__(self, inputs: dict[str, torch.Tensor], what: str):
        super().__init__()
        self.what = what
        # keyed by id(); each entry keeps its tensor alive so that id is never reused mid-trace
        self.traced: dict[int, tuple[torch.Tensor, tuple[Tile, ...] | str]] = {
            id(tensor): (tensor, (tiling.whole(name, tuple(tensor.shape)),)) for name, tensor in inputs.items()
        }

    def tiles_of(self, name: str, tensor: torch.Tensor) -> tuple[Tile, ...]:
        found = self.traced.get(id(tensor))
        if found is None or found[0] is not tensor:
            raise ExportError(f"{self.what} makes '{name}' from no tensor of the model")
        tiles = found[1]
        if isinstance(tiles, str):
            raise ExportError(
                f"{self.what} makes '{name}' with {tiles}, which is not a move of elements rayexport can "
                f"plan; export with --format in-memory"
            )
        if sum(tile.numel for tile in tiles) != tensor.numel():
            raise ExportError(f"{self.what} makes '{name}' from overlapping or missing regions")
        return tiles

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        traced_inputs = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor) and id(leaf) in self.traced]
        if not traced_inputs:
            return result
        outputs = [leaf for leaf in tree_leaves(result) if isinstance(leaf, torch.Tensor)]
        rule = _RULES.get(func.overloadpacket.__name__)
        try:
            if rule is None:
                raise _Untraceable
            traced = rule(self._tiles, _bind(func, args, kwargs), outputs)
        except _Untraceable:
            traced = [str(func)] * len(outputs)
        for tensor, tiles in zip(outputs, traced):
            self.traced[id(tensor)] = (tensor, tiles)
        return result

    def _tiles(self, tensor: Any) -> tuple[Tile, ...]:
        found = self.traced.get(id(tensor)) if isinstance(tensor, torch.Tensor) else None
        if found is None or isinstance(found[1], str):
            raise _Untraceable
        return found[1]


class _Untraceable(Exception):
    pass


def _bind(func, args: tuple, kwargs: dict) -> dict[str, Any]:
    """An aten op's arguments by name, defaults filled in."""
    bound = {}
    for position, argument in enumerate(func._schema.arguments):
        if position < len(args):
            bound[argument.name] = args[position]
        elif argument.name in kwargs:
            bound[argument.name] = kwargs[argument.name]
        elif argument.has_default_value():
            bound[argument.name] = argument.default_value
    return bound


TilesOf = Callable[[Any], tuple[Tile, ...]]


def _same(tiles_of: TilesOf, bound: dict, outputs: list) -> list:
    return [tiles_of(bound["self"])]


def _slice(tiles_of: TilesOf, bound: dict, outputs: list) -> list:
    tensor = bound["self"]
    dim = bound.get("dim", 0) % tensor.dim()
    size = tensor.shape[dim]
    if bound.get("step", 1) != 1:
        raise _Untraceable
    start, end = bound.get("start"), bound.get("end")
    start = 0 if start is None else (start + size if start < 0 else start)
    end = size if end is None else (end + size if end < 0 else end)
    start, end = min(max(start, 0), size), min(max(end, 0), size)
    return [tiling.narrow(tiles_of(tensor), dim, start, max(end - start, 0))]


def _narrow(tiles_of: TilesOf, bound: dict, outputs: list) -> list:
    tensor = bound["self"]
    return [tiling.narrow(tiles_of(tensor), bound["dim"] % tensor.dim(), bound["start"] % tensor.shape[bound["dim"]], bound["length"])]


def _select(tiles_of: TilesOf, bound: dict, outputs: list) -> list:
    tensor = bound["self"]
    dim = bound["dim"] % tensor.dim()
    index = bound["index"] % tensor.shape[dim]
    return [tiling.drop_axis(tiling.narrow(tiles_of(tensor), dim, index, 1), dim)]


def _split(tiles_of: TilesOf, bound: dict, outputs: list) -> list:
    tensor = bound["self"]
    dim = bound.get("dim", 0) % tensor.dim()
    tiles, start, parts = tiles_of(tensor), 0, []
    for output in outputs:
        length = output.shape[dim]
        parts.append(tiling.narrow(tiles, dim, start, length))
        start += length
    return parts


def _unbind(tiles_of: TilesOf, bound: dict, outputs: list) -> list:
    tensor = bound["self"]
    dim = bound.get("dim", 0) % tensor.dim()
    tiles = tiles_of(tensor)
    return [tiling.drop_axis(tiling.narrow(tiles, dim, index, 1), dim) for index in range(len(outputs))]


def _squeeze(tiles_of: TilesOf, bound: dict, outputs: list) -> list:
    tensor = bound["self"]
    dims = bound.get("dim", range(tensor.dim()))
    dims = [dims] if isinstance(dims, int) else list(dims)
    tiles = tiles_of(tensor)
    for dim in sorted({dim % tensor.dim() for dim in dims if tensor.shape[dim] == 1}, reverse=True):
        tiles = tiling.drop_axis(tiles, dim)
    return [tiles]


def _unsqueeze(tiles_of: TilesOf, bound: dict, outputs: list) -> list:
    tensor = bound["self"]
    return [tiling.insert_axis(tiles_of(tensor), bound["dim"] % (tensor.dim() + 1))]


def _transpose(tiles_of: TilesOf, bound: dict, outputs: list) -> list:
    tensor = bound["self"]
    order = list(range(tensor.dim()))
    first, second = bound.get("dim0", 0) % max(tensor.dim(), 1), bound.get("dim1", 1) % max(tensor.dim(), 1)
    order[first], order[second] = order[second], order[first]
    return [tiling.permute(tiles_of(tensor), tuple(order))]


def _permute(tiles_of: TilesOf, bound: dict, outputs: list) -> list:
    tensor = bound["self"]
    return [tiling.permute(tiles_of(tensor), tuple(dim % tensor.dim() for dim in bound["dims"]))]


def _cat(tiles_of: TilesOf, bound: dict, outputs: list) -> list:
    tensors = bound["tensors"]
    dim = bound.get("dim", 0) % outputs[0].dim()
    return [tiling.concatenate([(tiles_of(tensor), tensor.shape[dim]) for tensor in tensors], dim)]


def _stack(tiles_of: TilesOf, bound: dict, outputs: list) -> list:
    tensors = bound["tensors"]
    dim = bound.get("dim", 0) % outputs[0].dim()
    return [tiling.concatenate([(tiling.insert_axis(tiles_of(tensor), dim), 1) for tensor in tensors], dim)]


def _reshape(tiles_of: TilesOf, bound: dict, outputs: list) -> list:
    """A reshape is a move of elements only when it adds or removes unit axes."""
    tensor, shape = bound["self"], tuple(outputs[0].shape)
    if [size for size in tensor.shape if size != 1] != [size for size in shape if size != 1]:
        raise _Untraceable
    tiles = tiles_of(tensor)
    for dim in reversed([dim for dim, size in enumerate(tensor.shape) if size == 1]):
        tiles = tiling.drop_axis(tiles, dim)
    for dim in [dim for dim, size in enumerate(shape) if size == 1]:
        tiles = tiling.insert_axis(tiles, dim)
    return [tiles]


def _expand(tiles_of: TilesOf, bound: dict, outputs: list) -> list:
    if tuple(outputs[0].shape) != tuple(bound["self"].shape):
        raise _Untraceable  # a real broadcast repeats elements
    return _same(tiles_of, bound, outputs)


_RULES = {
    **dict.fromkeys(("clone", "alias", "detach", "_to_copy", "lift_fresh", "contiguous"), _same),
    "slice": _slice, "narrow": _narrow, "select": _select,
    "split": _split, "split_with_sizes": _split, "chunk": _split, "unbind": _unbind,
    "squeeze": _squeeze, "unsqueeze": _unsqueeze,
    "transpose": _transpose, "t": _transpose, "permute": _permute,
    "cat": _cat, "stack": _stack,
    **dict.fromkeys(("view", "_unsafe_view", "reshape"), _reshape),
    "expand": _expand,
}
