"""Object storage through fsspec: one `Store` per URI prefix, with commit-or-discard writes.

Every object is written with `autocommit=False` and committed only after its last byte, so an
exception mid-write never publishes a truncated object (fsspec's plain `with fs.open(..., "wb")`
would commit on `__exit__`). What S3 needs beyond that is `rayexport.storage.s3`'s.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import json
import logging
import mmap
import os
import posixpath
from dataclasses import dataclass, field
from typing import IO, Any, Callable, Iterator

import fsspec
from fsspec.core import url_to_fs
from fsspec.spec import AbstractBufferedFile

from rayexport.common.errors import ExportError, one_line
from rayexport.storage.reads import copy_ranges, read_retrying
from rayexport.storage.settings import merge_options

log = logging.getLogger(__name__)

@dataclass
class Store:
    """A URI prefix on any fsspec filesystem; names passed to its methods are relative to it."""

    uri: str
    options: dict[str, Any] = field(default_factory=dict, repr=False)
    node = None  # the cluster node whose own disk holds it, where only that node reaches it (`PinnedStore`)

    def __post_init__(self) -> None:
        self.uri = self.uri.rstrip("/") or self.uri
        protocol = fsspec.core.split_protocol(self.uri)[0] or "file"
        fs_options = {}
        if protocol in ("s3", "s3a"):  # S3's client is imported only here: 0.7 s for any other store
            from rayexport.storage.s3 import S3_DEFAULTS

            fs_options = merge_options(S3_DEFAULTS, self.options)
        try:
            # a copy: botocore rewrites the retries it is given in place (max_attempts becomes
            # total_max_attempts), which would carry into S3_DEFAULTS and outrank every later
            # store's own max_attempts
            self.fs, self.root = url_to_fs(self.uri, **copy.deepcopy(fs_options))
        except (ValueError, ImportError) as error:
            raise ExportError(f"cannot open storage URI '{self.uri}': {one_line(error)}") from None
        self.is_local = "file" in _protocols(self.fs)
        if "s3" in _protocols(self.fs):
            # One round of s3fs's own retry loop: botocore retries each request (S3_DEFAULTS),
            # and s3fs's 5 rounds ran that whole ladder 5 times over (25 for reads, which nest
            # two loops), so a persistent fault took minutes to fail a call. A body that breaks
            # off is read again by read_retrying.
            self.fs.retries = 1

    def __reduce__(self):
        # Rebuilt from its URI and options where it is unpickled (in a Ray worker): a pickled
        # filesystem comes back from its constructor's arguments alone, without `retries`.
        return Store, (self.uri, self.options)

    def display(self, name: str = "") -> str:
        """The URI of `name`, for messages."""
        return f"{self.uri}/{name}" if name else self.uri

    def path(self, name: str = "") -> str:
        """The filesystem path of `name`, as `self.fs` takes it."""
        return posixpath.join(self.root, name) if name else self.root

    def child(self, name: str) -> "Store":
        """The store for a sub-prefix, sharing options."""
        return Store(self.uri.rstrip("/") + "/" + name.strip("/"), self.options)

    def parent(self) -> "Store | None":
        """The store for the folder above, sharing options; None above a filesystem's root or
        an object store's bucket. A plain store: on a cluster, as the driver's node sees it."""
        protocol, path = fsspec.core.split_protocol(self.uri)
        above = posixpath.dirname(path.rstrip("/"))
        if above in (path, "", "/") or (protocol not in (None, "file") and "/" not in path.strip("/")):
            return None
        return Store(f"{protocol}://{above}" if protocol else above, self.options)

    def exists(self, name: str = "") -> bool:
        """Whether `name` (a file, or a folder) exists."""
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

    def find(self, name: str = "") -> list[str]:
        """Paths of every file below `name`, relative to it, at any depth (empty when it does
        not exist)."""
        root = self.path(name)

        def found() -> list[str]:
            self.fs.invalidate_cache(root)
            try:
                return self.fs.find(root)
            except FileNotFoundError:
                return []

        return sorted(posixpath.relpath(path, root) for path in self._call("list", name, found))

    def holders(self, name: str) -> tuple[str, ...] | None:
        """The cluster nodes that hold the file `name` where only some do (`SpreadStore`);
        None: it reads the same from every node."""
        return None

    def nowhere(self) -> str | None:
        """Where files that were not found were looked for, when that is more than this one
        folder (`SpreadStore`: every node of the cluster); None otherwise."""
        return None

    def size(self, name: str) -> int:
        """The size of one object in bytes."""
        return self._call("stat", name, self.fs.size, self.path(name))

    def version(self, name: str) -> tuple:
        """What changes when the object `name` is written again: its size, and its ETag (S3) or
        modification time (a file)."""
        info = self._call("stat", name, self.fs.info, self.path(name))
        return info.get("size"), str(info.get("ETag") or info.get("mtime") or info.get("LastModified"))

    def read_bytes(self, name: str) -> bytes:
        """The whole of one object."""
        return self._call("read", name, read_retrying, self.fs.cat_file, self.path(name))

    def read_range(self, name: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of one object; as a file read, fewer where the object ends first
        and none from past its end."""
        if not 0 <= start <= end:
            raise ValueError(f"not a byte range: [{start}, {end})")
        path = self.path(name)

        def read() -> bytes:
            if start == end:
                # fsspec would ask S3 for "bytes=start-(start-1)", which it ignores: the whole object
                self.fs.size(path)
                return b""
            try:
                return read_retrying(self.fs.cat_file, path, start=start, end=end)
            except OSError as error:
                # S3 refuses a range that starts at or past the end (416, EINVAL) where a file
                # read ends
                if error.errno != errno.EINVAL or start < self.fs.size(path):
                    raise
                return b""

        return self._call("read", name, read)

    def map_file(self, name: str) -> mmap.mmap | None:
        """A local object memory-mapped read-only (None where it is empty, which cannot be
        mapped), for reading it in place, without copies; only for local stores."""
        if not self.is_local:
            raise ValueError("map_file() is for local stores; use read_range() for remote ones")

        def open_mapped() -> mmap.mmap | None:
            with open(self.path(name), "rb") as handle:
                if os.fstat(handle.fileno()).st_size == 0:
                    return None
                return mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)

        return self._call("read", name, open_mapped)

    def read_json(self, name: str) -> Any:
        """One object, parsed as JSON."""
        data = self.read_bytes(name)
        try:
            return json.loads(data)
        except ValueError as error:
            raise ExportError(f"'{self.display(name)}' is not valid JSON: {one_line(error)}") from None

    def download(self, name: str, local_path: str, progress: Callable[[int], Any] = lambda count: None) -> None:
        """Copy one object to a local file, several ranges at a time; `progress` gets each
        count of bytes copied."""
        if self.is_local:
            # Reading in place keeps a local checkpoint memory-mappable without a copy.
            raise ValueError("download() is for remote stores; use path() for local ones")

        def copy() -> None:
            # Not s3fs's concurrent get_file: a body that breaks off there fails the whole copy.
            # Each range here is read again alone (read_retrying), and on S3 carries the ETag
            # the file was opened at (If-Match): an object replaced mid-copy fails instead of
            # mixing two versions.
            with self.fs.open(self.path(name), "rb", cache_type="none") as source, open(local_path, "wb") as target:
                target.truncate(source.size)
                copy_ranges(source, target.fileno(), progress)

        self._call("download", name, copy)

    def delete(self, name: str) -> None:
        """Remove one object, if it exists."""
        if self.exists(name):
            self._call("delete", name, self.fs.rm_file, self.path(name))

    def abort_uploads(self) -> list[str]:
        """Abort unfinished multipart uploads under this prefix (left by a killed export);
        return their keys. Only S3 has them."""
        if "s3" not in _protocols(self.fs):
            return []
        from rayexport.storage.s3 import unfinished_uploads

        bucket = self.root.partition("/")[0]
        uploads = self._call("list uploads", "", unfinished_uploads, self.fs, self.root)
        for upload in uploads:
            self._call("abort upload", upload["Key"], self.fs.abort_mpu, bucket, upload["Key"], upload["UploadId"])
        return sorted(upload["Key"] for upload in uploads)

    @contextlib.contextmanager
    def writer(self, name: str) -> Iterator[IO[bytes]]:
        """Write one object that appears only if the block finishes without an exception."""
        path = self.path(name)
        if self.is_local:
            self._call("create folder for", name, self.fs.makedirs, posixpath.dirname(path), exist_ok=True)
        handle = self._call("write", name, self._open_for_writing, path)
        try:
            yield _CheckedWrites(self, name, handle)
            self._call("write", name, handle.close)
            self._call("commit", name, handle.commit)
        except BaseException:
            _discard(handle)
            raise

    def _open_for_writing(self, path: str) -> IO[bytes]:
        if "s3" in _protocols(self.fs):
            from rayexport.storage.s3 import ConcurrentPartsFile

            return ConcurrentPartsFile(self.fs, path)
        return self.fs.open(path, "wb", autocommit=False)

    def write_bytes(self, name: str, data: bytes) -> None:
        """Write one object holding `data`, published only once all of it is written."""
        with self.writer(name) as handle:
            handle.write(data)

    def write_json(self, name: str, value: Any) -> None:
        """Write `value` as indented JSON with sorted keys."""
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

    Large writes to fsspec's buffered files (s3fs) are passed on one block at a time: those copy
    a whole write into their buffer before uploading it, so a 2 GB tensor would otherwise cost
    2 GB. Any other file (a local one) takes each write whole: a local file's `blocksize` is
    only io's 8 KiB default, and writes of 8 KiB each, unaligned after the safetensors header,
    cost the kernel more in zeroing the partial blocks of each than in copying the bytes."""

    def __init__(self, store: Store, name: str, handle: IO[bytes]) -> None:
        self.store, self.name, self.handle = store, name, handle
        self.block = handle.blocksize if isinstance(handle, AbstractBufferedFile) else 0

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
