"""Object storage through fsspec: one `Store` per URI prefix, with commit-or-discard writes.

Every object is written with `autocommit=False` and committed only after its last byte, so an
exception mid-write never publishes a truncated object (fsspec's plain `with fs.open(..., "wb")`
would commit on `__exit__`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import posixpath
import shutil
from dataclasses import dataclass, field
from typing import IO, Any, Iterator

import fsspec
from fsspec.core import url_to_fs

from rayexport.errors import ExportError, one_line

log = logging.getLogger(__name__)

_CREDENTIAL_ENV = {
    "AWS_ACCESS_KEY_ID": "key",
    "AWS_SECRET_ACCESS_KEY": "secret",
    "AWS_SESSION_TOKEN": "token",
}


def storage_options_from_env(explicit: dict[str, Any] | None = None) -> dict[str, Any]:
    """S3 options from the standard AWS variables, overridden by `explicit` (`--storage-options`).

    Workers may run on other nodes with another environment, so the driver resolves the
    endpoint and credentials once and hands them to every actor.
    """
    options: dict[str, Any] = {}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        options["endpoint_url"] = endpoint
    for variable, option in _CREDENTIAL_ENV.items():
        if os.environ.get(variable):
            options[option] = os.environ[variable]
    return merge_options(options, explicit or {})


def merge_options(defaults: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`defaults` with `overrides` applied at every depth: a user's `config_kwargs.read_timeout`
    replaces that one setting and keeps the default retries beside it."""
    merged = dict(defaults)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            value = merge_options(merged[key], value)
        merged[key] = value
    return merged


# Transient S3 faults (500, 502, 503 SlowDown, 504, dropped connections, timeouts) are retried
# with exponential backoff and jitter (botocore's standard mode) up to this many attempts; a
# persistent one then fails the call, naming the object, in bounded time. No call can hang:
# connecting and each read have their own timeouts. `--storage-options` can override all three.
S3_DEFAULTS: dict[str, Any] = {
    "config_kwargs": {"retries": {"max_attempts": 5, "mode": "standard"}, "connect_timeout": 20, "read_timeout": 120},
}


DOWNLOAD_BLOCK = 16 * 2**20


@dataclass
class Store:
    """A URI prefix on any fsspec filesystem; names passed to its methods are relative to it."""

    uri: str
    options: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.uri = self.uri.rstrip("/") or self.uri
        protocol = fsspec.core.split_protocol(self.uri)[0] or "file"
        fs_options = merge_options(S3_DEFAULTS, self.options) if protocol in ("s3", "s3a") else {}
        try:
            self.fs, self.root = url_to_fs(self.uri, **fs_options)
        except (ValueError, ImportError) as error:
            raise ExportError(f"cannot open storage URI '{self.uri}': {one_line(error)}") from None
        self.is_local = "file" in _protocols(self.fs)

    def display(self, name: str = "") -> str:
        """The URI of `name`, for messages."""
        return f"{self.uri}/{name}" if name else self.uri

    def path(self, name: str = "") -> str:
        return posixpath.join(self.root, name) if name else self.root

    def child(self, name: str) -> "Store":
        """The store for a sub-prefix, sharing options."""
        return Store(self.uri.rstrip("/") + "/" + name.strip("/"), self.options)

    def exists(self, name: str = "") -> bool:
        return self._call("check", name, self.fs.exists, self.path(name))

    def list(self, name: str = "") -> list[str]:
        """Names of the files directly under `name` (empty when it does not exist)."""
        return self._entries(name, "file")

    def folders(self, name: str = "") -> list[str]:
        """Names of the folders directly under `name` (empty when it does not exist)."""
        return self._entries(name, "directory")

    def _entries(self, name: str, kind: str) -> list[str]:
        path = self.path(name)

        def entries() -> list[dict]:
            self.fs.invalidate_cache(path)
            try:
                return self.fs.ls(path, detail=True)
            except FileNotFoundError:
                return []

        listed = self._call("list", name, entries)
        return sorted(posixpath.basename(entry["name"].rstrip("/")) for entry in listed if entry.get("type") == kind)

    def size(self, name: str) -> int:
        return self._call("stat", name, self.fs.size, self.path(name))

    def read_bytes(self, name: str) -> bytes:
        return self._call("read", name, self.fs.cat_file, self.path(name))

    def read_json(self, name: str) -> Any:
        data = self.read_bytes(name)
        try:
            return json.loads(data)
        except ValueError as error:
            raise ExportError(f"'{self.display(name)}' is not valid JSON: {one_line(error)}") from None

    def open_read(self, name: str) -> IO[bytes]:
        return self._call("open", name, self.fs.open, self.path(name), "rb")

    def download(self, name: str, local_path: str) -> None:
        """Copy one object to a local file."""
        if self.is_local:
            # Reading in place keeps a local checkpoint memory-mappable without a copy.
            raise ValueError("download() is for remote stores; use path() for local ones")
        # Range reads of one block at a time: s3fs's get_file holds a whole object in memory.
        def copy() -> None:
            with self.fs.open(self.path(name), "rb", block_size=DOWNLOAD_BLOCK) as source, open(local_path, "wb") as target:
                shutil.copyfileobj(source, target, DOWNLOAD_BLOCK)

        self._call("download", name, copy)

    def delete(self, name: str) -> None:
        if self.exists(name):
            self._call("delete", name, self.fs.rm_file, self.path(name))

    def abort_uploads(self) -> list[str]:
        """Abort unfinished multipart uploads under this prefix (left by a killed export);
        return their keys. Only S3 has them."""
        if "s3" not in _protocols(self.fs):
            return []
        bucket, _, key_prefix = self.root.partition("/")
        uploads = self._call("list uploads", "", self.fs.list_multipart_uploads, bucket)
        aborted = []
        for upload in uploads:
            if upload["Key"] == key_prefix or upload["Key"].startswith(key_prefix.rstrip("/") + "/"):
                self._call("abort upload", upload["Key"], self.fs.abort_mpu, bucket, upload["Key"], upload["UploadId"])
                aborted.append(upload["Key"])
        return sorted(aborted)

    @contextlib.contextmanager
    def writer(self, name: str) -> Iterator[IO[bytes]]:
        """Write one object that appears only if the block finishes without an exception."""
        path = self.path(name)
        if self.is_local:
            self._call("create folder for", name, self.fs.makedirs, posixpath.dirname(path), exist_ok=True)
        handle = self._call("write", name, self.fs.open, path, "wb", autocommit=False)
        try:
            yield _CheckedWrites(self, name, handle)
            self._call("write", name, handle.close)
            self._call("commit", name, handle.commit)
        except BaseException:
            _discard(handle)
            raise

    def write_bytes(self, name: str, data: bytes) -> None:
        with self.writer(name) as handle:
            handle.write(data)

    def write_json(self, name: str, value: Any) -> None:
        self.write_bytes(name, (json.dumps(value, indent=2, sort_keys=True) + "\n").encode())

    def create_exclusive(self, name: str, data: bytes) -> bool:
        """Create `name` holding `data` unless it exists; False when it does. Only as exclusive
        as the store: S3 honours it with a conditional write, some compatible stores ignore it
        (`rayexport.watch.exclusive_create_honoured` probes which)."""

        def create() -> bool:
            if self.is_local:
                self.fs.makedirs(self.root, exist_ok=True)
            try:
                with self.fs.open(self.path(name), "xb") as handle:
                    handle.write(data)
            except FileExistsError:
                return False
            return True

        return self._call("create", name, create)

    def _call(self, operation: str, name: str, function, *args, **kwargs):
        try:
            return function(*args, **kwargs)
        except FileNotFoundError as error:
            if operation in _READS:
                raise ExportError(f"not found: '{self.display(name)}'") from None
            raise ExportError(f"storage {operation} failed for '{self.display(name)}': {one_line(error)}") from None
        except ExportError:
            raise
        except Exception as error:  # noqa: BLE001 - storage clients raise many types
            raise ExportError(
                f"storage {operation} failed for '{self.display(name)}': {type(error).__name__}: {one_line(error)}"
            ) from None


_READS = frozenset({"check", "stat", "read", "open", "download"})


class _CheckedWrites:
    """A write handle whose failures name the object being written.

    Large writes are passed on one block at a time: fsspec's buffered files (s3fs) copy a whole
    write into their buffer before uploading it, so a 2 GB tensor would otherwise cost 2 GB."""

    def __init__(self, store: Store, name: str, handle: IO[bytes]) -> None:
        self.store, self.name, self.handle = store, name, handle
        self.block = getattr(handle, "blocksize", None) or 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        step = self.block or len(view) or 1
        for start in range(0, len(view), step):
            self.store._call("write", self.name, self.handle.write, view[start:start + step])
        return len(view)


def _protocols(fs: fsspec.AbstractFileSystem) -> tuple[str, ...]:
    protocol = fs.protocol
    return (protocol,) if isinstance(protocol, str) else tuple(protocol)


def _discard(handle: Any) -> None:
    """Drop an uncommitted object: abort its multipart upload, or remove its local temp file."""
    try:
        local_file = getattr(handle, "f", None)
        if local_file is not None:
            local_file.close()
        handle.discard()
    except Exception as error:  # noqa: BLE001 - best effort while another error propagates
        log.warning("could not discard a partial write: %s", error)
