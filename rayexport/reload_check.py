"""Reload an export with transformers, in a process of its own, within a memory bound.

`check_reload` (the parent) reads the export's safetensors headers by byte range and starts
`python -m rayexport.reload_check DIR --tensors TABLE --mode MODE ...` with storage credentials
removed from its environment and an empty module cache, because remote code executes on import.
DIR holds the export's small files (the export itself when it is local); weight bytes reach the
child as it asks for them. The child runs one of three modes:

- `keys-only`: names and shapes against the model built on the meta device;
- `in-memory`: `from_pretrained` and a forward pass, for an export that fits the bound;
- `streamed`: the model built on the meta device, each module's tensors read just before its
  forward and dropped after it (accelerate's offload hooks), so memory stays at the largest
  module's tensors. It reads a local export's files itself; a remote export's bytes come from
  the parent over the child's stdin/stdout: the child writes `{"tensor": NAME}` lines, the
  parent answers each with `{"bytes": N}` (or `{"error": ...}`) and N bytes.

The child ends with `{"result": {...}}` on that same channel and loads the tokenizer too, when
the export carries one. What libraries print goes to its stderr.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import mmap
import os
import posixpath
import re
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any, Callable, Iterator, Mapping

import torch

from rayexport.dtypes import TORCH_NAME_OF_CODE, dtype_name, dtype_of
from rayexport.errors import one_line
from rayexport.lora import ADAPTER_DIR, ADAPTER_WEIGHTS
from rayexport.memory import peak_rss_bytes, rss_bytes
from rayexport.storage import Store
from rayexport.verification import READ_AHEAD, READ_BLOCK, ExpectedExport, VerificationError, index_shards, read_header

# Variables that carry storage credentials; never passed to the process that imports remote code.
SECRET_ENV = re.compile(r"^(AWS_|GOOGLE_|AZURE_|GCS_|S3_|HF_TOKEN|HUGGING_FACE_HUB_TOKEN)")
PROMPT_IDS = [1, 2, 3, 4, 5, 6, 7, 8]
# Files whose presence means the export carries a tokenizer for AutoTokenizer to load.
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model")
MODES = ("keys-only", "in-memory", "streamed")
KEY_FIELDS = ("missing_keys", "unexpected_keys", "mismatched_keys")
TABLE_FILE = "tensors.json"


# ---------------------------------------------------------------- parent side


def check_reload(destination: Store, expected: ExpectedExport, timeout_s: float, memory_bound_bytes: int) -> dict[str, Any]:
    """transformers loads the export at `destination` in a clean process: no missing or
    unexpected keys, tied tensors share memory, a forward pass gives finite logits, peft loads
    the adapter and AutoTokenizer the tokenizer. With `quick`, only the keys and shapes are
    compared with the model built on the meta device (the tokenizer still loads). The export is
    never copied whole: see the module's docstring for the modes; `mode` in the result says
    which ran (with `reason` when the streamed reload declined), `startup_rss_bytes` and
    `peak_rss_bytes` the child's memory after its imports and at its peak."""
    table = tensor_table(destination)
    mode = reload_mode(expected.level, sum(entry["end"] - entry["start"] for entry in table.values()), memory_bound_bytes)
    env = {key: value for key, value in os.environ.items() if not SECRET_ENV.match(key)}
    with tempfile.TemporaryDirectory(prefix="rayexport-reload-") as scratch:
        modules = os.path.join(scratch, "modules")
        os.mkdir(modules)
        env.update(HF_MODULES_CACHE=modules, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        shards = {entry["file"] for entry in table.values()} if mode != "in-memory" else set()
        folder = stage_export(destination, shards, os.path.join(scratch, "export"))
        with open(os.path.join(scratch, TABLE_FILE), "w") as handle:
            json.dump(table, handle)
        command = child_command(folder, os.path.join(scratch, TABLE_FILE), mode, expected, memory_bound_bytes, not destination.is_local)
        result = run_child(command, env, modules, timeout_s, TensorServer(destination, table))
    return checked(result, expected)


def tensor_table(store: Store) -> dict[str, dict[str, Any]]:
    """Every tensor of the export's weight files, from their headers read by byte range: its
    file, dtype (torch's name), shape and absolute byte range [start, end)."""
    table = {}
    for name in index_shards(store):
        try:
            data_start, header = read_header(store, name)
        except ValueError as error:
            raise VerificationError(f"structure: shard {name} cannot be parsed: {one_line(error)}") from None
        for key, entry in header.items():
            begin, end = entry["data_offsets"]
            table[key] = {
                "file": name, "dtype": TORCH_NAME_OF_CODE[entry["dtype"]], "shape": entry["shape"],
                "start": data_start + begin, "end": data_start + end,
            }
    return table


def reload_mode(level: str, tensor_bytes: int, memory_bound_bytes: int) -> str:
    """`keys-only` at level quick; else `in-memory` when the weights fit the bound (the faster
    reload), `streamed` when they do not."""
    if level == "quick":
        return "keys-only"
    return "in-memory" if tensor_bytes <= memory_bound_bytes else "streamed"


def stage_export(store: Store, shards: set[str], folder: str) -> str:
    """The folder the child reads the export from: a local export itself; for a remote one, a
    copy in `folder` of its files but the weight `shards` (none for the in-memory reload, of an
    export within the bound)."""
    if store.is_local:
        return store.path()
    for name in export_files(store):
        if name not in shards:
            os.makedirs(os.path.dirname(os.path.join(folder, name)), exist_ok=True)
            store.download(name, os.path.join(folder, name))
    return folder


def export_files(store: Store) -> list[str]:
    """Every file under the store's prefix, relative to it."""
    store.fs.invalidate_cache(store.path())
    return sorted(posixpath.relpath(path, store.path()) for path in store.fs.find(store.path()))


def child_command(
    folder: str, table_path: str, mode: str, expected: ExpectedExport, memory_bound_bytes: int, from_parent: bool
) -> list[str]:
    """The command line of the reload process."""
    command = [
        sys.executable, "-m", "rayexport.reload_check", folder, "--tensors", table_path, "--mode", mode,
        "--format", expected.format, "--memory-bound", str(memory_bound_bytes),
    ]
    command += ["--trust-remote-code"] if expected.trust_remote_code else []
    command += ["--from-parent"] if from_parent else []
    for canonical, alias in expected.tied:
        command += ["--tied", f"{canonical}={alias}"]
    command += ["--adapter", os.path.join(folder, ADAPTER_DIR)] if expected.adapter and mode != "keys-only" else []
    return command


class TensorServer:
    """The parent's answers to the child's requests: a tensor of the export's table, read from
    the store a block at a time, a few blocks ahead, so the parent holds at most READ_AHEAD
    blocks whatever the tensor's size."""

    def __init__(self, store: Store, table: dict[str, dict[str, Any]]) -> None:
        self.store, self.table = store, table

    def answer(self, name: str, pipe: IO[bytes]) -> None:
        """Write the tensor `name`'s byte count as a JSON line, then its bytes, to `pipe`."""
        entry = self.table.get(name)
        if entry is None:
            pipe.write(json.dumps({"error": f"tensor '{name}' is not in the export"}).encode() + b"\n")
            pipe.flush()
            return
        pipe.write(json.dumps({"bytes": entry["end"] - entry["start"]}).encode() + b"\n")
        for data in self._blocks(entry):
            pipe.write(data)
        pipe.flush()

    def _blocks(self, entry: dict[str, Any]) -> Iterator[bytes]:
        starts = range(entry["start"], entry["end"], READ_BLOCK)
        with ThreadPoolExecutor(READ_AHEAD) as pool:
            pending: collections.deque = collections.deque()
            for start in starts:
                end = min(start + READ_BLOCK, entry["end"])
                pending.append((end - start, pool.submit(self.store.read_range, entry["file"], start, end)))
                if len(pending) >= READ_AHEAD:
                    yield self._block(entry, *pending.popleft())
            while pending:
                yield self._block(entry, *pending.popleft())

    @staticmethod
    def _block(entry: dict[str, Any], size: int, future) -> bytes:
        data = future.result()
        if len(data) != size:
            raise VerificationError(f"reload: shard {entry['file']} ends before the tensors its header describes")
        return data


def run_child(command: list[str], env: dict[str, str], cwd: str, timeout_s: float, server: TensorServer) -> dict[str, Any]:
    """Run the reload process, answering its tensor requests, until it reports its result;
    VerificationError when it fails or outlives `timeout_s`."""
    with tempfile.TemporaryFile() as errors:
        expired = threading.Event()
        with subprocess.Popen(command, env=env, cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors) as process:
            timer = threading.Timer(timeout_s, lambda: (expired.set(), process.kill()))
            timer.start()
            try:
                result = converse(process, server)
                process.wait()
            finally:
                timer.cancel()
                if process.poll() is None:
                    process.kill()
        if expired.is_set():
            raise VerificationError(f"reload: transformers did not load the export in {timeout_s:.0f} s")
        if process.returncode != 0 or result is None:
            errors.seek(0)
            lines = [line for line in errors.read().decode(errors="replace").splitlines() if line.strip()]
            raise VerificationError(f"reload: transformers cannot load the export: {lines[-1] if lines else 'no output'}")
    return result


def converse(process: subprocess.Popen, server: TensorServer) -> dict[str, Any] | None:
    """Answer the child's requests until it sends its result (None: it ended without one)."""
    for line in process.stdout:
        message = json.loads(line)
        if "result" in message:
            return message["result"]
        try:
            server.answer(message["tensor"], process.stdin)
        except BrokenPipeError:
            return None  # the child died mid-answer; its stderr says why
    return None


def checked(result: dict[str, Any], expected: ExpectedExport) -> dict[str, Any]:
    """The child's result, or VerificationError naming the first check it failed."""
    for field_name in KEY_FIELDS:
        if result[field_name]:
            raise VerificationError(f"reload: {field_name.replace('_', ' ')} {result[field_name][:3]}")
    if result["untied"]:
        raise VerificationError(f"reload: tied tensors do not share memory: {result['untied'][0]}")
    if result["logits_finite"] is False and expected.source_finite:
        raise VerificationError("reload: the forward pass gives non-finite logits")
    if result.get("adapter_missing"):
        raise VerificationError(f"reload: peft did not load adapter tensor '{result['adapter_missing'][0]}'")
    if result.get("tokenizer_error"):
        raise VerificationError(f"reload: {result['tokenizer_error']}")
    return result


# ---------------------------------------------------------------- child side


def auto_dtype() -> dict[str, str]:
    """from_pretrained's argument that loads the weights in the dtype config.json states:
    `dtype` from transformers 4.56, `torch_dtype` before it (which keeps an unknown `dtype` in
    the config without a word and loads float32)."""
    import transformers
    from packaging.version import Version

    return {"dtype": "auto"} if Version(transformers.__version__).release >= (4, 56) else {"torch_dtype": "auto"}


def load_tokenizer(path: str, trust_remote_code: bool) -> dict:
    """AutoTokenizer loads the export's tokenizer, when it carries one: `tokenizer` (the class
    loaded) or `tokenizer_error` (one line naming the file and class). The class that
    tokenizer_config.json declares must exist in the installed transformers, which from version
    5 would otherwise load a stand-in class without a word."""
    present = [name for name in TOKENIZER_FILES if os.path.exists(os.path.join(path, name))]
    if not present:
        return {}
    from transformers import AutoTokenizer, __version__
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    settings = {}
    if "tokenizer_config.json" in present:
        try:
            with open(os.path.join(path, "tokenizer_config.json")) as handle:
                settings = json.load(handle)
        except ValueError as error:
            return {"tokenizer_error": f"tokenizer_config.json is not valid JSON: {one_line(error)}"}
    declared = settings.get("tokenizer_class")
    where = f"tokenizer_config.json's tokenizer_class '{declared}'" if declared else ", ".join(present)
    if declared and "auto_map" not in settings and not (
        tokenizer_class_from_name(declared) or tokenizer_class_from_name(declared + "Fast")
    ):
        return {"tokenizer_error": f"{where} is not a tokenizer class of transformers {__version__}"}
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as error:  # noqa: BLE001 - tokenizer code raises anything
        return {"tokenizer_error": f"AutoTokenizer cannot load {where}: {type(error).__name__}: {one_line(error)}"}
    return {"tokenizer": type(tokenizer).__name__}


def build_skeleton(path: str, trust_remote_code: bool):
    """The export's config and its model in eval mode, every parameter on the meta device (no
    memory) and ties made as `from_pretrained` makes them; buffers are computed for real, since
    a non-persistent one (rotary frequencies) is in no file."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    from rayexport.model import model_class

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with init_empty_weights(include_buffers=False):
        model = model_class(config).build(config, trust_remote_code)
    model.tie_weights()
    return config, model.eval()


def model_formats_of(model: torch.nn.Module, tied: list[tuple[str, str]]):
    """The model's in-memory and on-disk namings (`tied` are in-memory names)."""
    from rayexport.conversion import model_formats
    from rayexport.model import expected_tensors

    return model_formats(model, expected_tensors(model), {alias: canonical for canonical, alias in tied})


def key_differences(naming, found: dict[str, tuple[int, ...]]) -> dict[str, list[str]]:
    """Missing, unexpected and mismatched (shape) keys of the tensors `found` against a naming
    of the model, whose tied aliases the export does not hold."""
    wanted = {name: tuple(shape) for name, (shape, _) in naming.expected.items() if name not in naming.aliases}
    return {
        "missing_keys": sorted(set(wanted) - set(found)),
        "unexpected_keys": sorted(set(found) - set(wanted)),
        "mismatched_keys": sorted(key for key in set(wanted) & set(found) if wanted[key] != found[key]),
    }


def table_shapes(table: dict[str, dict[str, Any]]) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape, from the export's table."""
    return {name: tuple(entry["shape"]) for name, entry in table.items()}


def compare_keys(path: str, trust_remote_code: bool, tied: list[tuple[str, str]], export_format: str, found: dict) -> dict:
    """Without loading weights: the export's tensor names and shapes (`found`, from its headers)
    against the model built from its config on the meta device, in `export_format` as
    transformers' conversion rules give it. `tied` are in-memory names."""
    _, model = build_skeleton(path, trust_remote_code)
    naming = model_formats_of(model, tied).naming(export_format)
    return {"class": type(model).__name__, **key_differences(naming, found), "untied": [], "logits_finite": None}


def untied_pairs(model: torch.nn.Module, tied: list[tuple[str, str]]) -> list[str]:
    """The tied pairs whose two names are not one tensor in `model` (on the meta device, where
    every data pointer is 0, only the same Parameter counts)."""
    parameters = dict(model.named_parameters(remove_duplicate=False))

    def shared(first: torch.Tensor, second: torch.Tensor) -> bool:
        return first is second or (not first.is_meta and first.data_ptr() == second.data_ptr())

    return [
        f"{canonical}={alias}" for canonical, alias in tied
        if canonical not in parameters or alias not in parameters or not shared(parameters[canonical], parameters[alias])
    ]


def probe(model: torch.nn.Module, config) -> dict[str, Any]:
    """A forward pass on PROMPT_IDS: whether the logits are finite, and their sha256 (equal
    digests: the same logits, bit for bit)."""
    vocab = getattr(config, "vocab_size", None) or max(PROMPT_IDS) + 1
    input_ids = torch.tensor([[token % vocab for token in PROMPT_IDS]])
    inputs = {"input_ids": input_ids}
    if getattr(config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = input_ids
    with torch.no_grad():
        output = model(**inputs)
    logits = getattr(output, "logits", None)
    if logits is None:
        return {"logits_finite": None}
    return {
        "logits_finite": bool(torch.isfinite(logits).all()),
        "logits_sha256": hashlib.sha256(logits.float().contiguous().numpy().tobytes()).hexdigest(),
    }


def reload_and_probe(path: str, trust_remote_code: bool, tied: list[tuple[str, str]], adapter: str | None) -> dict:
    """Load the export, report the dtype it loaded in, missing/unexpected keys, tie sharing, a
    forward pass, and which adapter tensors peft failed to load."""
    from transformers import AutoConfig

    from rayexport.model import model_class

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    model, info = model_class(config).load(path, trust_remote_code, output_loading_info=True, **auto_dtype())
    result = {
        "class": type(model).__name__,
        "dtype": dtype_name(model.dtype),
        "missing_keys": sorted(info.get("missing_keys", [])),
        "unexpected_keys": sorted(info.get("unexpected_keys", [])),
        "mismatched_keys": sorted(str(item) for item in info.get("mismatched_keys", [])),
        "untied": untied_pairs(model, tied),
        **probe(model, config),
    }
    if adapter:
        result["adapter_missing"] = _adapter_missing(model, adapter)
    return result


def stream_and_probe(
    path: str, trust_remote_code: bool, tied: list[tuple[str, str]], export_format: str,
    table: dict[str, dict[str, Any]], read: Callable[[str], mmap.mmap], rss_limit: int, adapter: str | None,
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
        return dict(result, mode="keys-only", reason=reason)
    result["untied"] = untied_pairs(model, tied)
    attach_align_device_hook(
        model, execution_device="cpu", offload=True, weights_map=StreamedWeights(sources, table, read), offload_buffers=True
    )
    result.update(probe(model, config))
    if adapter:
        result["adapter_missing"] = _adapter_unloaded(model, adapter)
    return result


def export_sources(formats, export_format: str) -> dict[str, str | None]:
    """Each in-memory state-dict name with the export tensor holding its values: a tied alias
    reads its canonical tensor, a tensor saved whole under another name reads that name, and a
    tensor split or merged on disk has None."""
    from rayexport.plan.formats import IN_MEMORY

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
    and drop them after it)."""

    def __init__(self, sources: dict[str, str], table: dict[str, dict[str, Any]], read: Callable[[str], mmap.mmap]) -> None:
        self.sources, self.table, self.read = sources, table, read

    def __getitem__(self, name: str) -> torch.Tensor:
        source = self.sources[name]  # KeyError for what the model does not hold, as accelerate expects
        entry = self.table[source]
        dtype = dtype_of(entry["dtype"])
        if entry["end"] == entry["start"]:
            return torch.empty(entry["shape"], dtype=dtype)
        return torch.frombuffer(self.read(source), dtype=dtype).view(entry["shape"])

    def __iter__(self) -> Iterator[str]:
        return iter(self.sources)

    def __len__(self) -> int:
        return len(self.sources)


def file_reader(folder: str, table: dict[str, dict[str, Any]]) -> Callable[[str], mmap.mmap]:
    """Reads a tensor's bytes from the export's files in `folder`, by plain reads at its
    offsets (a memory map would keep every page it touched resident)."""
    def read(name: str) -> mmap.mmap:
        entry = table[name]
        with open(os.path.join(folder, entry["file"]), "rb", buffering=0) as handle:
            handle.seek(entry["start"])
            return _read_exactly(handle, entry["end"] - entry["start"], f"tensor '{name}' in {entry['file']}")

    return read


def parent_reader(requests: IO[bytes], answers: IO[bytes]) -> Callable[[str], mmap.mmap]:
    """Reads a tensor's bytes from the parent, which reads them from storage for this process
    (which has no credentials)."""
    def read(name: str) -> mmap.mmap:
        requests.write(json.dumps({"tensor": name}).encode() + b"\n")
        requests.flush()
        header = json.loads(answers.readline() or b'{"error": "the parent closed the channel"}')
        if "error" in header:
            raise OSError(header["error"])
        return _read_exactly(answers, header["bytes"], f"tensor '{name}' from the parent")

    return read


def _read_exactly(handle: IO[bytes], size: int, what: str) -> mmap.mmap:
    # An anonymous map of its own goes back to the system as soon as the tensor is dropped,
    # where malloc would keep freed blocks of a few MiB in its heap, growing from layer to layer.
    buffer = mmap.mmap(-1, size)
    view, filled = memoryview(buffer), 0
    while filled < size:
        count = handle.readinto(view[filled:])
        if not count:
            raise EOFError(f"{what} ends after {filled} of its {size} bytes")
        filled += count
    return buffer


def _adapter_missing(model: torch.nn.Module, adapter: str) -> list[str]:
    """Adapter tensors in the adapter file that the PeftModel does not hold with equal values."""
    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    loaded = get_peft_model_state_dict(PeftModel.from_pretrained(model, adapter))
    saved = load_file(os.path.join(adapter, os.path.basename(ADAPTER_WEIGHTS)))
    return sorted(
        name for name, tensor in saved.items()
        if name not in loaded or not torch.equal(loaded[name].to(tensor.dtype), tensor)
    )


def _adapter_unloaded(model: torch.nn.Module, adapter: str) -> list[str]:
    """Adapter tensors peft does not load onto `model`, whose layers are on the meta device (peft
    moves the adapter there too, so values cannot be compared): the file's tensors that have no
    place in the model, and the model's adapter parameters the file leaves unset."""
    from peft import PeftConfig, PeftModel

    peft_model = PeftModel(model, PeftConfig.from_pretrained(adapter), low_cpu_mem_usage=True)
    loaded = peft_model.load_adapter(adapter, adapter_name="default", low_cpu_mem_usage=True)
    prefix = peft_model.base_model.prefix
    return sorted(loaded.unexpected_keys) + sorted(key for key in loaded.missing_keys if prefix in key)


def private_channel() -> tuple[IO[bytes], IO[bytes]]:
    """This process's stdin and stdout as the channel to the parent (requests out, answers in),
    with fds 0 and 1 pointed elsewhere so nothing a library or remote code prints or reads can
    disturb it."""
    answers = os.fdopen(os.dup(0), "rb")
    requests = os.fdopen(os.dup(1), "wb")
    with open(os.devnull, "rb") as empty:
        os.dup2(empty.fileno(), 0)
    os.dup2(2, 1)
    return requests, answers


def main(argv: list[str] | None = None) -> int:
    requests, answers = private_channel()
    parser = argparse.ArgumentParser(prog="python -m rayexport.reload_check")
    parser.add_argument("path", help="the export's folder (its small files at least)")
    parser.add_argument("--tensors", required=True, help="JSON: each tensor's file, dtype, shape and byte range")
    parser.add_argument("--mode", required=True, choices=MODES)
    parser.add_argument("--format", default="on-disk", choices=["on-disk", "in-memory"], help="the tensor names the export holds")
    parser.add_argument("--memory-bound", type=int, default=0, help="bytes the streamed reload may hold above start-up")
    parser.add_argument("--from-parent", action="store_true", help="read tensor bytes from the parent, not from PATH")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--tied", action="append", default=[], metavar="CANONICAL=ALIAS")
    parser.add_argument("--adapter", help="a LoRA adapter folder to load onto the model with peft")
    args = parser.parse_args(argv)
    import accelerate.hooks  # noqa: F401 - the libraries every mode needs count as start-up, not as the reload
    import transformers.modeling_utils  # noqa: F401

    startup = rss_bytes()
    tied = [tuple(item.split("=", 1)) for item in args.tied]
    with open(args.tensors) as handle:
        table = json.load(handle)
    if args.mode == "keys-only":
        result = compare_keys(args.path, args.trust_remote_code, tied, args.format, table_shapes(table))
    elif args.mode == "in-memory":
        result = reload_and_probe(args.path, args.trust_remote_code, tied, args.adapter)
    else:
        read = parent_reader(requests, answers) if args.from_parent else file_reader(args.path, table)
        result = stream_and_probe(
            args.path, args.trust_remote_code, tied, args.format, table, read, startup + args.memory_bound, args.adapter
        )
    result.setdefault("mode", args.mode)
    result.update(load_tokenizer(args.path, args.trust_remote_code))
    peak = peak_rss_bytes()
    result.update(startup_rss_bytes=startup, peak_rss_bytes=peak)
    requests.write(json.dumps({"result": result}).encode() + b"\n")
    requests.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
