"""The reload's parent side: the child process (started ahead, without credentials), the
export's tensor table, the mode, the folder the child reads, answering its tensor requests, and
what its result says (see the package's docstring)."""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Mapping

from rayexport.common.dtypes import TORCH_NAME_OF_CODE
from rayexport.common.errors import one_line
from rayexport.common.levels import loads_weights
from rayexport.plan.lora import ADAPTER_DIR
from rayexport.storage.store import Store
from rayexport.verification import VerificationError
from rayexport.verification.expected import ExpectedExport
from rayexport.verification.reading import read_header
from rayexport.verification.reload.protocol import (
    KEY_FIELDS, KEYS_ONLY, LOADED_IN_MEMORY, STREAMED, WAIT_FOR_ARGUMENTS, TensorServer, converse,
)
from rayexport.verification.structure import index_shards

# Variables that carry storage credentials; never passed to the process that imports remote code.
SECRET_ENV = re.compile(r"^(AWS_|GOOGLE_|AZURE_|GCS_|S3_|HF_TOKEN|HUGGING_FACE_HUB_TOKEN)")
TABLE_FILE = "tensors.json"
CHILD_MODULE = "rayexport.verification.reload.child"
# The child imports torch and transformers while the export's workers read and gather: at a
# lower priority, it takes the CPU time they leave (its check runs once they are done).
IMPORT_NICENESS = 10


def without_credentials(environment: Mapping[str, str]) -> dict[str, str]:
    """`environment` without the variables that carry storage credentials: for a process that
    may import the export's remote code."""
    return {key: value for key, value in environment.items() if not SECRET_ENV.match(key)}


class ReloadProcess:
    """The reload's child, started ahead of the check it runs: without storage credentials, with
    an empty module cache of its own, its imports (torch, transformers) done while the export is
    still being written; it then waits for its command line on the channel. One check each.
    `threads`: torch's threads in it (None: as this process has them)."""

    def __init__(self, threads: int | None = None) -> None:
        self.scratch = tempfile.mkdtemp(prefix="rayexport-reload-")
        modules = os.path.join(self.scratch, "modules")
        os.mkdir(modules)
        env = without_credentials(os.environ)
        env.update(HF_MODULES_CACHE=modules, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        if threads is not None:  # torch's threads in the forward pass (this process's: Ray's limit for one worker)
            env["OMP_NUM_THREADS"] = str(threads)
        self.errors = tempfile.TemporaryFile()
        self.started_at = time.time()
        self.process = subprocess.Popen(
            ["nice", "-n", str(IMPORT_NICENESS), sys.executable, "-m", CHILD_MODULE, WAIT_FOR_ARGUMENTS], env=env, cwd=modules,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.errors,
        )

    def run(self, arguments: list[str], timeout_s: float, server: TensorServer) -> dict[str, Any]:
        """Hand the child its command line and answer its tensor requests until it reports its
        result; VerificationError when it fails or outlives `timeout_s` from now. The result
        gains `imports_s` (the child's start to its imports done) and `waited_s` (how long it
        was ready before the check came: its imports were off the export's path)."""
        expired = threading.Event()
        timer = threading.Timer(timeout_s, lambda: (expired.set(), self.process.kill()))
        timer.start()
        try:
            self.process.stdin.write(json.dumps(arguments).encode() + b"\n")
            self.process.stdin.flush()
            result = converse(self.process, server)
            self.process.wait()
        except BrokenPipeError:
            result = None  # the child died before its command line; its stderr says why
        finally:
            timer.cancel()
            if self.process.poll() is None:
                self.process.kill()
        if expired.is_set():
            raise VerificationError(f"reload: transformers did not load the export in {timeout_s:.0f} s")
        if self.process.wait() != 0 or result is None:
            self.errors.seek(0)
            lines = [line for line in self.errors.read().decode(errors="replace").splitlines() if line.strip()]
            raise VerificationError(f"reload: transformers cannot load the export: {lines[-1] if lines else 'no output'}")
        ready_at, asked_at = result.pop("ready_at"), result.pop("asked_at")
        return {
            **result, "started_at": self.started_at, "imports_s": round(ready_at - self.started_at, 3),
            "waited_s": round(max(0.0, asked_at - ready_at), 3),
        }

    def close(self) -> None:
        """End the child if it still runs and remove its scratch folder."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout, self.errors):
            with contextlib.suppress(OSError):
                pipe.close()
        shutil.rmtree(self.scratch, ignore_errors=True)


def check_reload(
    destination: Store, expected: ExpectedExport, timeout_s: float, memory_bound_bytes: int,
    process: ReloadProcess | None = None,
) -> dict[str, Any]:
    """transformers loads the export at `destination` in a clean process (`process`, started
    ahead, or one started now): no missing or unexpected keys, tied tensors share memory, a
    forward pass gives finite logits, peft loads the adapter and AutoTokenizer the tokenizer.
    With `quick`, only the keys and shapes are compared with the model built on the meta device
    (the tokenizer still loads). The export is never copied whole: see the package's docstring
    for the modes; `mode` in the result says which ran (with `reason` when the streamed reload
    declined), `startup_rss_bytes` and `peak_rss_bytes` the child's memory after its imports
    and at its peak. The process is used up either way."""
    process = process or ReloadProcess()
    try:
        table = tensor_table(destination)
        mode = reload_mode(expected.level, sum(entry["end"] - entry["start"] for entry in table.values()), memory_bound_bytes)
        shards = {entry["file"] for entry in table.values()} if mode != LOADED_IN_MEMORY else set()
        folder = stage_export(destination, shards, os.path.join(process.scratch, "export"))
        table_path = os.path.join(process.scratch, TABLE_FILE)
        with open(table_path, "w") as handle:
            json.dump(table, handle)
        arguments = child_arguments(folder, table_path, mode, expected, memory_bound_bytes, not destination.is_local)
        result = process.run(arguments, timeout_s, TensorServer(destination, table))
    finally:
        process.close()
    return checked(result, expected)


_LAYER = re.compile(r"^.*?layers\.\d+\.")  # a name's layer: `model.layers.61.`, `mtp.layers.0.`


def _starts_in(key: str, prefixes: set[str]) -> bool:
    found = _LAYER.match(key)
    return found is not None and found[0] in prefixes


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


def child_arguments(
    folder: str, table_path: str, mode: str, expected: ExpectedExport, memory_bound_bytes: int, from_parent: bool
) -> list[str]:
    """The reload process's command line, after its module name."""
    arguments = [folder, "--tensors", table_path, "--mode", mode, "--format", expected.format, "--memory-bound", str(memory_bound_bytes)]
    arguments += ["--trust-remote-code"] if expected.trust_remote_code else []
    arguments += ["--from-parent"] if from_parent else []
    for canonical, alias in expected.tied:
        arguments += ["--tied", f"{canonical}={alias}"]
    arguments += ["--adapter", os.path.join(folder, ADAPTER_DIR)] if expected.adapter and mode != KEYS_ONLY else []
    return arguments


def checked(result: dict[str, Any], expected: ExpectedExport) -> dict[str, Any]:
    """The child's result, or VerificationError naming the first check it failed. The tensors
    the export holds beyond the model's class (`ExpectedExport.beyond_model`) are unexpected keys
    transformers is expected to leave out, under their names or, converted on load, under others
    of the same layer (an MTP layer's experts, fused)."""
    beyond = set(expected.beyond_model) | {found[0] for name in expected.beyond_model if (found := _LAYER.match(name))}
    unexpected = [key for key in result["unexpected_keys"] if key not in beyond and not _starts_in(key, beyond)]
    result = dict(result, unexpected_keys=unexpected)
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
