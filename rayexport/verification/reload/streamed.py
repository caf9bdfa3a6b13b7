"""The streamed reload, the child's mode for an export larger than the memory bound: the model
on the meta device, each module's tensors read from the export just before its forward and
dropped after it, so the child holds the largest module's tensors at most."""

from __future__ import annotations

import mmap
import os
from typing import Any, Callable, Iterator, Mapping

import torch

from rayexport.common.dtypes import dtype_name, dtype_of
from rayexport.common.memory import rss_bytes
from rayexport.plan.formats import IN_MEMORY, Format
from rayexport.verification.reload.probes import (
    build_skeleton, key_differences, model_formats_of, probe, table_shapes, untied_pairs,
)
from rayexport.verification.reload.protocol import KEY_FIELDS, KEYS_ONLY


def stream_and_probe(
    path: str, trust_remote_code: bool, tied: list[tuple[str, str]], export_format: Format,
    table: dict[str, dict[str, Any]], read: Callable[[str], Any], rss_limit: int, adapter: str | None,
) -> dict:
    """The streamed reload: the model built on the meta device, its keys checked against the
    export's, then a forward pass during which each module's tensors are read (by `read`, from
    the export `table`) before its forward and dropped after it. Declines to `keys-only`, with
    a one-line `reason`, where a parameter is no single export tensor or where one module's
    tensors would take this process past `rss_limit` bytes of resident memory. With `adapter`,
    peft then loads it onto the model."""
    from accelerate.hooks import attach_align_device_hook

    config, model = build_skeleton(path, trust_remote_code)
    formats = model_formats_of(model, tied)
    result = {
        "class": type(model).__name__, "dtype": dtype_name(model.dtype),
        **key_differences(formats.naming(export_format), table_shapes(table)), "untied": [], "logits_finite": None,
    }
    if any(result[field_name] for field_name in KEY_FIELDS):
        return result
    sources = export_sources(formats, export_format)
    composed = sorted(name for name, source in sources.items() if source is None)
    module, size = largest_module(model)
    left = rss_limit - rss_bytes()
    if composed:
        reason = f"'{composed[0]}' is built from several {export_format} tensors, which the streamed reload does not assemble"
    elif size > left:
        reason = f"module '{module}' alone holds {size} bytes of tensors, more than the {left} bytes left of the memory bound"
    else:
        reason = None
    if reason:
        return dict(result, mode=KEYS_ONLY, reason=reason)
    result["untied"] = untied_pairs(model, tied)
    attach_align_device_hook(
        model, execution_device="cpu", offload=True, weights_map=StreamedWeights(sources, table, read), offload_buffers=True
    )
    result.update(probe(model, config))
    if adapter:
        result["adapter_missing"] = _adapter_unloaded(model, adapter)
    return result


def export_sources(formats, export_format: Format) -> dict[str, str | None]:
    """Each in-memory state-dict name with the export tensor holding its values: a tied alias
    reads its canonical tensor, a tensor saved whole under another name reads that name, and a
    tensor split or merged on disk has None."""
    sources = {}
    for name in formats.memory.expected:
        canonical = formats.memory.aliases.get(name, name)
        sources[name] = canonical if export_format == IN_MEMORY else formats.renamed.get(canonical)
    return sources


def largest_module(model: torch.nn.Module) -> tuple[str, int]:
    """The module whose own parameters and persistent buffers (what one offload hook loads at
    once) take the most bytes, and that count."""
    from accelerate.utils import named_module_tensors

    def own_bytes(module: torch.nn.Module) -> int:
        tensors = named_module_tensors(module, include_buffers=True, remove_non_persistent=True)
        return sum(tensor.numel() * tensor.element_size() for _, tensor in tensors)

    return max(((name, own_bytes(module)) for name, module in model.named_modules()), key=lambda item: item[1])


class StreamedWeights(Mapping):
    """In-memory state-dict names to their values, each read from the export when asked for;
    nothing is kept (accelerate's offload hooks ask for a module's tensors before its forward
    and drop them after it). A request for the next module's tensor first gives back the pages
    of the tensors handed out before it (`read.release`, where the reader maps files)."""

    def __init__(self, sources: dict[str, str], table: dict[str, dict[str, Any]], read: Callable[[str], Any]) -> None:
        self.sources, self.table, self.read = sources, table, read
        self.module: str | None = None

    def __getitem__(self, name: str) -> torch.Tensor:
        source = self.sources[name]  # KeyError for what the model does not hold, as accelerate expects
        module = name.rpartition(".")[0]
        if module != self.module:
            getattr(self.read, "release", lambda: None)()
            self.module = module
        entry = self.table[source]
        dtype = dtype_of(entry["dtype"])
        if entry["end"] == entry["start"]:
            return torch.empty(entry["shape"], dtype=dtype)
        return torch.frombuffer(self.read(source), dtype=dtype).view(entry["shape"])

    def __iter__(self) -> Iterator[str]:
        return iter(self.sources)

    def __len__(self) -> int:
        return len(self.sources)


class MappedFiles:
    """Reads a tensor's bytes from the export's files in `folder` as a view of the file memory-
    mapped, without a copy. Pages a process has touched in a map count in its resident memory
    until it gives them back: `release` does so for every page read so far (they stay in the
    page cache, and a later read maps them in again), as the workers do with their rank files."""

    def __init__(self, folder: str, table: dict[str, dict[str, Any]]) -> None:
        self.folder, self.table = folder, table
        self.maps: dict[str, mmap.mmap] = {}

    def __call__(self, name: str) -> memoryview:
        entry = self.table[name]
        mapped = self._map(entry["file"])
        if entry["end"] > len(mapped):
            raise EOFError(
                f"tensor '{name}' in {entry['file']} ends after {max(0, len(mapped) - entry['start'])} "
                f"of its {entry['end'] - entry['start']} bytes"
            )
        return memoryview(mapped)[entry["start"]:entry["end"]]

    def release(self) -> None:
        for mapped in self.maps.values():
            mapped.madvise(mmap.MADV_DONTNEED)

    def _map(self, file: str) -> mmap.mmap:
        if file not in self.maps:
            with open(os.path.join(self.folder, file), "rb") as handle:
                # a private map is writable, as torch.frombuffer wants, and nothing writes to it
                self.maps[file] = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
        return self.maps[file]


def _adapter_unloaded(model: torch.nn.Module, adapter: str) -> list[str]:
    """Adapter tensors peft does not load onto `model`, whose layers are on the meta device (peft
    moves the adapter there too, so values cannot be compared): the file's tensors that have no
    place in the model, and the model's adapter parameters the file leaves unset."""
    from peft import PeftConfig, PeftModel

    peft_model = PeftModel(model, PeftConfig.from_pretrained(adapter), low_cpu_mem_usage=True)
    loaded = peft_model.load_adapter(adapter, adapter_name="default", low_cpu_mem_usage=True)
    prefix = peft_model.base_model.prefix
    return sorted(loaded.unexpected_keys) + sorted(key for key in loaded.missing_keys if prefix in key)
