"""One large object's S3 throughput: s3fs's whole-file calls (the floor) against `Store`'s
streaming writer and its download, old (one part or range at a time) and new (a few in flight).

    python benchmarks/s3_throughput.py                 # a 1 GiB object, each case twice
    python benchmarks/s3_throughput.py --size-mb 256 --repeats 1

It starts its own moto S3 server (a subprocess on a port the OS picks, ended by its pid) and times, on
the same bytes from one local file:
  upload:   s3fs `put_file` (10 parts in flight, its default; and 4), the old writer (an s3fs
            file opened "wb" with autocommit=False: one part at a time), `Store.writer`;
  download: s3fs `get_file` (10 ranges of 50 MiB in flight; and 4), the old download (an s3fs
            file read 16 MiB at a time, which its readahead fetches 32 MiB per request),
            `Store.download` (4 ranges of 16 MiB in flight).
Every case is checked (the object's size, the downloaded bytes' digest) and reported in MB/s
(10**6 bytes per second; the best of the repeats), with the CPU seconds the client and the
server spent in it. Nothing here asserts a speed.

On loopback moto, not the link, limits: it handles every request in Python, and answers each
range GET by reading the whole object under the object's lock, so a download costs it the
number of its ranges times the object's size (S3 serves a range in proportion to the range). `--per-connection-mb-s N` puts a
relay (its own process, ended by its pid) between the client and moto that lets each TCP
connection carry at most N MB/s each way, as a real link does per connection (S3 gives one
connection some tens of MB/s): what parts and ranges in flight are for.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import multiprocessing
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

import psutil
from export_bench import start_moto_server

from rayexport.storage.reads import DOWNLOAD_BLOCK
from rayexport.storage.settings import storage_options_from_env
from rayexport.storage.store import Store

BUCKET = "throughput"
MiB = 2**20
S3_ENV = {"AWS_ACCESS_KEY_ID": "bench-key", "AWS_SECRET_ACCESS_KEY": "bench-secret", "AWS_DEFAULT_REGION": "us-east-1"}
WRITE_PIECE = 64 * MiB  # what the writers are handed per call, as an exporter hands them tensors


@dataclass
class Timing:
    case: str
    seconds: float
    client_cpu_s: float
    server_cpu_s: float


def relay(upstream_port: int, rate: float, listening) -> None:
    """Forward a port of 127.0.0.1 that the OS picks, sent once bound through the pipe end
    `listening`, to upstream_port, each connection at most `rate` bytes/s each way (run in a
    process of its own)."""

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        free_at = time.monotonic()  # when this direction may send again; idle time earns no credit
        try:
            while data := await reader.read(256 * 1024):
                writer.write(data)
                await writer.drain()
                free_at = max(free_at, time.monotonic()) + len(data) / rate
                await asyncio.sleep(free_at - time.monotonic())
        except ConnectionError:
            pass
        finally:
            writer.close()

    async def connect(client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", upstream_port)
        await asyncio.gather(pipe(client_reader, upstream_writer), pipe(upstream_reader, client_writer))

    async def serve() -> None:
        server = await asyncio.start_server(connect, "127.0.0.1", 0)
        listening.send(server.sockets[0].getsockname()[1])
        await server.serve_forever()

    asyncio.run(serve())


def start_relay(upstream: str, mb_s: float) -> tuple[multiprocessing.Process, str]:
    ours, theirs = multiprocessing.Pipe()
    process = multiprocessing.Process(target=relay, args=(int(upstream.rsplit(":", 1)[1]), mb_s * 1e6, theirs), daemon=True)
    process.start()
    if not ours.poll(30):
        process.terminate()
        raise RuntimeError("the relay did not start listening")
    return process, f"http://127.0.0.1:{ours.recv()}"


def pieces(path: str, size: int = WRITE_PIECE):
    """The local file's bytes, `size` at a time."""
    with open(path, "rb") as handle:
        while data := handle.read(size):
            yield data


def old_writer(store: Store, name: str, source: str) -> None:
    """The writer before parts went concurrent: s3fs's own file, one part at a time."""
    handle = store.fs.open(store.path(name), "wb", autocommit=False)
    for data in pieces(source):
        view = memoryview(data)
        for start in range(0, len(view), handle.blocksize):
            handle.write(view[start:start + handle.blocksize])
    handle.close()
    handle.commit()


def new_writer(store: Store, name: str, source: str) -> None:
    with store.writer(name) as handle:
        for data in pieces(source):
            handle.write(data)


def old_download(store: Store, name: str, target: str) -> None:
    """The download before ranges went concurrent: one 16 MiB range at a time."""
    with store.fs.open(store.path(name), "rb", block_size=DOWNLOAD_BLOCK) as source, open(target, "wb") as out:
        shutil.copyfileobj(source, out, DOWNLOAD_BLOCK)


def timed(case: str, server: psutil.Process, action: Callable[[], None]) -> Timing:
    client = psutil.Process()
    client_before, server_before = client.cpu_times(), server.cpu_times()
    started = time.perf_counter()
    action()
    seconds = time.perf_counter() - started
    client_after, server_after = client.cpu_times(), server.cpu_times()
    return Timing(case, seconds, _cpu(client_after) - _cpu(client_before), _cpu(server_after) - _cpu(server_before))


def _cpu(times) -> float:
    return times.user + times.system


def digest(path: str) -> str:
    hasher = hashlib.sha256()
    for data in pieces(path):
        hasher.update(data)
    return hasher.hexdigest()


def upload_cases(store: Store, source: str) -> dict[str, Callable[[str], None]]:
    """Each upload by its label, given the object's name."""
    fs = store.fs
    return {
        "s3fs put_file, 10 in flight (floor)": lambda name: fs.put_file(source, store.path(name)),
        "s3fs put_file, 4 in flight": lambda name: fs.put_file(source, store.path(name), max_concurrency=4),
        "old Store.writer, 1 part at a time": lambda name: old_writer(store, name, source),
        "new Store.writer, 4 parts in flight": lambda name: new_writer(store, name, source),
    }


def download_cases(store: Store, name: str) -> dict[str, Callable[[str], None]]:
    """Each download of the object `name` by its label, given the local target."""
    fs = store.fs
    return {
        "s3fs get_file, 10 in flight (floor)": lambda target: fs.get_file(store.path(name), target),
        "s3fs get_file, 4 in flight": lambda target: fs.get_file(store.path(name), target, max_concurrency=4),
        "old Store.download, 1 range at a time": lambda target: old_download(store, name, target),
        "new Store.download, 4 ranges in flight": lambda target: store.download(name, target),
    }


def run(size: int, repeats: int, workdir: str, server: psutil.Process) -> tuple[list[Timing], list[Timing]]:
    store = Store(f"s3://{BUCKET}/bench", storage_options_from_env())
    source = os.path.join(workdir, "source.bin")
    with open(source, "wb") as handle:
        for start in range(0, size, WRITE_PIECE):
            handle.write(os.urandom(min(WRITE_PIECE, size - start)))
    expected = digest(source)
    uploads, downloads = [], []
    for _ in range(repeats):
        for label, upload in upload_cases(store, source).items():
            uploads.append(timed(label, server, lambda: upload("up.bin")))
            assert store.size("up.bin") == size, label
            store.delete("up.bin")
    store.fs.put_file(source, store.path("down.bin"))
    target = os.path.join(workdir, "target.bin")
    for _ in range(repeats):
        for label, download in download_cases(store, "down.bin").items():
            downloads.append(timed(label, server, lambda: download(target)))
            assert digest(target) == expected, label
            os.remove(target)
    store.delete("down.bin")
    return uploads, downloads


def table(title: str, timings: list[Timing], size: int) -> str:
    """Each case's best run in MB/s, with the CPU seconds of that run."""
    best: dict[str, Timing] = {}
    for timing in timings:
        if timing.case not in best or timing.seconds < best[timing.case].seconds:
            best[timing.case] = timing
    lines = [f"| {title} | MB/s | s | client CPU s | moto CPU s |", "|---|---:|---:|---:|---:|"]
    for timing in best.values():
        lines.append(
            f"| {timing.case} | {size / 1e6 / timing.seconds:.0f} | {timing.seconds:.1f} "
            f"| {timing.client_cpu_s:.1f} | {timing.server_cpu_s:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=1024, help="object size in MiB (default 1024)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each case; the best is reported")
    parser.add_argument("--per-connection-mb-s", type=float, default=0,
                        help="relay every connection at most this fast each way (default: straight to moto)")
    args = parser.parse_args()
    size = args.size_mb * MiB
    server, endpoint = start_moto_server()
    relayed = None
    try:
        if args.per_connection_mb_s:
            relayed, endpoint = start_relay(endpoint, args.per_connection_mb_s)
        os.environ.update(S3_ENV, AWS_ENDPOINT_URL=endpoint)
        import boto3

        boto3.client("s3").create_bucket(Bucket=BUCKET)
        with tempfile.TemporaryDirectory(prefix="s3-throughput-") as workdir:
            uploads, downloads = run(size, args.repeats, workdir, psutil.Process(server.pid))
    finally:
        if relayed is not None:
            relayed.terminate()
            relayed.join()
        server.terminate()
        server.wait()
    link = f", each connection relayed at {args.per_connection_mb_s:g} MB/s" if args.per_connection_mb_s else ""
    print(f"{size / 1e6:.0f} MB object, moto S3 on 127.0.0.1{link}, {os.cpu_count()} CPUs, best of {args.repeats}\n")
    print(table("upload", uploads, size) + "\n")
    print(table("download", downloads, size))


if __name__ == "__main__":
    main()
