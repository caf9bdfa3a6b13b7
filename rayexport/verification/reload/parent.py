"""The reload's parent side: the export's tensor table, the mode, the folder the child reads,
running the child without credentials while answering its tensor requests, and what its result
says (see the package's docstring)."""

from __future__ import annotations

import json
import os
import posixpath
import re
import subprocess
import sys
import tempfile
import threading
from typing import Any

from rayexport.dtypes import TORCH_NAME_OF_CODE
from rayexport.errors import one_line
from rayexport.levels import loads_weights
from rayexport.lora import ADAPTER_DIR
from rayexport.storage import Store
from rayexport.verification import VerificationError
from rayexport.verification.expected import ExpectedExport
from rayexport.verification.reading import read_header
from rayexport.verification.reload.protocol import (
    KEY_FIELDS, KEYS_ONLY, LOADED_IN_MEMORY, STREAMED, TensorServer, converse,
)
from rayexport.verification.structure import index_shards

# Variables that carry storage credentials; never passed to the process that imports remote code.
SECRET_ENV = re.compile(r"^(AWS_|GOOGLE_|AZURE_|GCS_|S3_|HF_TOKEN|HUGGING_FACE_HUB_TOKEN)")
TABLE_FILE = "tensors.json"
CHILD_MODULE = "rayexport.verification.reload.child"


def check_reload(destination: Store, expected: ExpectedExport, timeout_s: float, memory_bound_bytes: int) -> dict[str, Any]:
    """transformers loads the export at `destination` in a clean process: no missing or
    unexpected keys, tied tensors share memory, a forward pass gives finite logits, peft loads
    the adapter and AutoTokenizer the tokenizer. With `quick`, only the keys and shapes are
    compared with the model built on the meta device (the tokenizer still loads). The export is
    never copied whole: see the package's docstring for the modes; `mode` in the result says
    which ran (with `reason` when the streamed reload declined), `startup_rss_bytes` and
    `peak_rss_bytes` the child's memory after its imports and at its peak."""
    table = tensor_table(destination)
    mode = reload_mode(expected.level, sum(entry["end"] - entry["start"] for entry in table.values()), memory_bound_bytes)
    env = {key: value for key, value in os.environ.items() if not SECRET_ENV.match(key)}
    with tempfile.TemporaryDirectory(prefix="rayexport-reload-") as scratch:
        modules = os.path.join(scratch, "modules")
        os.mkdir(modules)
        env.update(HF_MODULES_CACHE=modules, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        shards = {entry["file"] for entry in table.values()} if mode != LOADED_IN_MEMORY else set()
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
    """`keys-only` where the level loads no weights (quick); else `in-memory` when the weights
    fit the bound (the faster reload), `streamed` when they do not."""
    if not loads_weights(level):
        return KEYS_ONLY
    return LOADED_IN_MEMORY if tensor_bytes <= memory_bound_bytes else STREAMED


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
        sys.executable, "-m", CHILD_MODULE, folder, "--tensors", table_path, "--mode", mode,
        "--format", expected.format, "--memory-bound", str(memory_bound_bytes),
    ]
    command += ["--trust-remote-code"] if expected.trust_remote_code else []
    command += ["--from-parent"] if from_parent else []
    for canonical, alias in expected.tied:
        command += ["--tied", f"{canonical}={alias}"]
    command += ["--adapter", os.path.join(folder, ADAPTER_DIR)] if expected.adapter and mode != KEYS_ONLY else []
    return command


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
