"""What S3 needs beyond fsspec's generic file: client defaults (retries, timeouts), the client's
errors for a body that breaks off, a multipart file that uploads several parts at once, and
the unfinished uploads under a prefix."""

from __future__ import annotations

import asyncio
import concurrent.futures
import io
import threading
from typing import Any

from aiobotocore.response import AioReadTimeoutError
from aiohttp import ClientPayloadError
from botocore.exceptions import ResponseStreamingError
from s3fs.core import S3File

# Transient S3 faults (500, 502, 503 SlowDown, 504, dropped connections, timeouts) are retried
# with exponential backoff and jitter (botocore's standard mode) this many times (botocore's
# max_attempts counts retries; they wait at most 1 + 2 + 4 + 8 + 16 s in all); a persistent
# one then fails the call, naming the object, in bounded time. No call can hang:
# connecting and each read have their own timeouts. `--storage-options` can override all three.
S3_DEFAULTS: dict[str, Any] = {
    "config_kwargs": {"retries": {"max_attempts": 5, "mode": "standard"}, "connect_timeout": 20, "read_timeout": 120},
}

# One S3 writer keeps this many parts uploading while the next is filled, so a worker's large
# file moves at its link's rate rather than one part's round trip at a time. Memory: these parts
# and the buffer being filled (under 2 parts), under (4 + 2) x default_block_size per writer
# (300 MiB at s3fs's 50 MiB default; a worker writes one file at a time).
UPLOAD_PARTS_IN_FLIGHT = 4

# The S3 client's errors for a response whose body breaks off after its request succeeded.
BODY_ERRORS = (ResponseStreamingError, AioReadTimeoutError, ClientPayloadError)


def unfinished_uploads(fs: Any, root: str) -> list[dict[str, Any]]:
    """The multipart uploads (each with its `Key` and `UploadId`) begun but neither completed
    nor aborted under `root`, "bucket/key-prefix" on the S3 filesystem `fs`."""
    bucket, _, key_prefix = root.partition("/")
    folder = key_prefix.rstrip("/") + "/"
    return [
        upload for upload in fs.list_multipart_uploads(bucket)
        if upload["Key"] == key_prefix or upload["Key"].startswith(folder)
    ]


class ConcurrentPartsFile(S3File):
    """s3fs's S3 file, written with autocommit=False, with up to UPLOAD_PARTS_IN_FLIGHT parts
    uploading while the next one fills (s3fs's own file uploads one part at a time).

    Every part is one block long but the last (as S3-compatible stores that require fixed part
    sizes need). `close()` returns once every part is up, raising the first part that failed;
    `commit()` then completes the upload, and `discard()` aborts it. An object of one block or
    less is PUT whole on commit: one request where s3fs's file makes three."""

    def __init__(self, fs: Any, path: str) -> None:
        extra = fs.s3_additional_kwargs
        super().__init__(
            fs, path, "wb", block_size=fs.default_block_size, acl=extra.get("ACL") or extra.get("acl") or False,
            s3_additional_kwargs=dict(extra), autocommit=False, requester_pays=fs.requester_pays,
        )
        self._slots = threading.Semaphore(UPLOAD_PARTS_IN_FLIGHT)
        self._uploads: list[concurrent.futures.Future] = []

    def _initiate_upload(self) -> None:
        # fsspec asks for an upload on the first full block, or when closing with none sent
        # (`forced`): then the buffer holds the whole object, and commit() PUTs it
        if not self.forced:
            super()._initiate_upload()

    def _upload_chunk(self, final: bool = False) -> bool:
        if self.mpu is None:
            return False  # keep the buffer for commit()'s one-shot PUT
        with self.buffer.getbuffer() as data:
            sent = len(data) if final else len(data) - len(data) % self.blocksize
            for start in range(0, sent, self.blocksize):
                self._wait_for_a_slot()
                self._start_part(bytes(data[start:start + self.blocksize]))
            rest = bytes(data[sent:])
        self.offset += sent
        self.buffer = io.BytesIO()
        self.buffer.write(rest)
        if final:
            self.parts = [upload.result() for upload in self._uploads]
        return False  # fsspec: the buffer is already what is left to send

    def _wait_for_a_slot(self) -> None:
        """Block until fewer than UPLOAD_PARTS_IN_FLIGHT parts are uploading; a part that
        failed meanwhile ends the write here."""
        self._slots.acquire()
        for upload in self._uploads:
            if upload.done() and upload.exception() is not None:
                raise upload.exception()

    def _start_part(self, data: bytes) -> None:
        """Upload `data` as the next part, in the filesystem's event loop; its slot frees when
        it ends."""
        number = len(self._uploads) + 1
        upload = asyncio.run_coroutine_threadsafe(self._upload_part(self.mpu["UploadId"], number, data), self.fs.loop)
        upload.add_done_callback(lambda _: self._slots.release())
        self._uploads.append(upload)

    async def _upload_part(self, upload_id: str, number: int, data: bytes) -> dict:
        out = await self.fs._call_s3(
            "upload_part", self.s3_additional_kwargs, self._request_payer_kw,
            Bucket=self.bucket, Key=self.key, UploadId=upload_id, PartNumber=number, Body=data,
        )
        part = {"PartNumber": number, "ETag": out["ETag"]}
        if "ChecksumSHA256" in out:  # an upload made with checksums completes only with them
            part["ChecksumSHA256"] = out["ChecksumSHA256"]
        return part

    def discard(self) -> None:
        """Abort the upload once every part has ended: S3 may keep a part that finishes after
        its upload's abort."""
        concurrent.futures.wait(self._uploads)
        super().discard()
