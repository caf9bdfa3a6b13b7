"""A worker's memory while it exports its share of a DCP checkpoint, and what re-reading costs.

    python benchmarks/dcp_memory.py                       # 400 MB float32, world size 4, 2 workers
    python benchmarks/dcp_memory.py --mb 1000 --s3        # also read in place from a moto S3 server

One invocation writes a DCP checkpoint with FSDP2 gloo ranks (tests/support/checkpoints.py), then:
  1. exports it through a local Ray with `--workers` workers and `--bucket-mib` buckets, from
     local disk and (--s3) from S3, and reports each worker's working memory (its peak resident
     memory above what it held before loading) beside its share of the saved chunks, the largest
     chunk and the window (two buckets; a tensor larger than --bucket-size travels alone);
  2. in this process, times mapping every chunk in place (`dcp_chunks.read_in_place`: each
     record found and checked), one pass over the mapped chunks as the transfer makes it, and
     one pass of torch's own DCP reads of the same tensors.
It prints markdown tables; nothing here asserts a number. Times on a busy machine vary: run it
with OMP_NUM_THREADS=1, as Ray runs its workers.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # support: the tests' FSDP2 checkpoint writers

MiB = 2**20
S3_ENV = {"AWS_ACCESS_KEY_ID": "bench-key", "AWS_SECRET_ACCESS_KEY": "bench-secret", "AWS_DEFAULT_REGION": "us-east-1"}


def write_checkpoint(folder: str, megabytes: int, world_size: int) -> str:
    """A float32 Llama-shaped DCP checkpoint of about `megabytes` MB, flat keys."""
    from support.checkpoints import write_dcp_checkpoint
    from support.models import sized_llama_config

    config = sized_llama_config(megabytes * 10**6, hidden_size=1024, vocab_size=16384, dtype="float32")
    path = os.path.join(folder, "dcp")
    write_dcp_checkpoint(config, path, world_size=world_size, prefix="")
    return path


def largest(path: str) -> tuple[int, int]:
    """Bytes of the largest tensor, and of the largest chunk any rank saved."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entries = [
        entry for entry in FileSystemReader(path).read_metadata().state_dict_metadata.values()
        if isinstance(entry, TensorStorageMetadata)
    ]
    return (
        max(math.prod(entry.size) * entry.properties.dtype.itemsize for entry in entries),
        max(math.prod(chunk.sizes) * entry.properties.dtype.itemsize for entry in entries for chunk in entry.chunks),
    )


def worker_shares(path: str, workers: int) -> dict[str, int]:
    """Bytes of saved chunks each worker reads (an untied model: no ties to keep together)."""
    from rayexport.layouts.dcp import find_dcp_checkpoint
    from rayexport.layouts.dcp_chunks import list_chunks, share_chunks
    from rayexport.layouts.dcp_metadata import read_metadata
    from rayexport.storage.store import Store

    store = Store(path)
    checkpoint = find_dcp_checkpoint(store)
    shares = share_chunks(list_chunks(checkpoint.tensors, read_metadata(store), store.uri), workers, {})
    return {f"worker{worker}": sum(chunk.nbytes for chunk in chunks) for worker, chunks in shares.items()}


def start_s3() -> str:
    """A moto S3 server in this process, with a bucket 'bench'; its endpoint."""
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    endpoint = "http://{}:{}".format(*server.get_host_and_port())
    os.environ.update(S3_ENV, AWS_ENDPOINT_URL=endpoint)
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
    return endpoint


def upload(path: str) -> str:
    import s3fs

    s3fs.S3FileSystem().put(path + "/", "bench/dcp/", recursive=True)
    return "s3://bench/dcp"


def export_memory(source: str, out: str, workers: int, bucket: int) -> dict[str, int]:
    """Working memory of each worker exporting `source`."""
    from rayexport.orchestration.job import export

    report = export(
        source, out, workers=workers, bucket_size=bucket, max_shard_size="64MB", verify="none", dtype="float32",
    )
    return report.working_memory_bytes


def read_times(path: str) -> dict[str, float]:
    """Seconds to map every saved chunk in place, to make one pass over the mapped chunks
    (copied out, pages given back), and to read the same tensors with torch's DCP instead."""
    import torch.distributed.checkpoint as dcp

    from rayexport.layouts.dcp import find_dcp_checkpoint
    from rayexport.layouts.dcp_chunks import list_chunks, read_in_place, slot_chunks
    from rayexport.layouts.dcp_metadata import read_metadata
    from rayexport.layouts.mapped import release_pages
    from rayexport.storage.store import Store

    store = Store(path)
    checkpoint = find_dcp_checkpoint(store)
    shapes = {key: tensor.shape for key, tensor in checkpoint.tensors.items()}
    started = time.perf_counter()
    slots = slot_chunks(list_chunks(checkpoint.tensors, read_metadata(store), store.uri), {})
    mapped = list(read_in_place(store, dict(enumerate(slots)), shapes).values())
    in_place = time.perf_counter() - started
    ranges = mapped[0].mapped_ranges()
    started = time.perf_counter()
    for tensors in mapped:
        for key in tensors:
            tensors[key].clone()
            release_pages(ranges)
    one_pass = time.perf_counter() - started
    started = time.perf_counter()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        for tensor in checkpoint.tensors.values():  # a tensor at a time, as re-reads for a bucket would be
            dtype = getattr(torch, tensor.dtype)
            dcp.load({tensor.key: torch.empty(tensor.shape, dtype=dtype)}, checkpoint_id=path, no_dist=True)
    reread = time.perf_counter() - started
    return {"map every chunk in place": in_place, "one pass over the mapped chunks": one_pass, "torch's DCP reads": reread}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=400, help="checkpoint size in MB (default 400)")
    parser.add_argument("--world-size", type=int, default=4, help="ranks that save it (default 4)")
    parser.add_argument("--workers", type=int, default=2, help="export workers (default 2)")
    parser.add_argument("--bucket-mib", type=int, default=8, help="--bucket-size in MiB (default 8)")
    parser.add_argument("--s3", action="store_true", help="also export it from a moto S3 server")
    args = parser.parse_args()
    import ray

    with tempfile.TemporaryDirectory(prefix="rayexport-dcp-bench-") as scratch:
        path = write_checkpoint(scratch, args.mb, args.world_size)
        sources = {"local": path}
        if args.s3:
            start_s3()
            sources["s3"] = upload(path)
        ray.init(num_cpus=max(4, args.workers), num_gpus=0, include_dashboard=False, logging_level="WARNING")
        size = sum(os.path.getsize(os.path.join(path, name)) for name in os.listdir(path) if name.endswith(".distcp"))
        tensor, chunk = largest(path)
        print(f"checkpoint {size / MiB:.0f} MiB in {args.world_size} rank files, largest tensor {tensor / MiB:.1f} MiB, "
              f"largest chunk {chunk / MiB:.1f} MiB; window 2 x {args.bucket_mib} MiB\n")
        shares = worker_shares(path, args.workers)
        print("| source | worker | share | working memory |")
        print("| --- | --- | --- | --- |")
        for name, source in sources.items():
            memory = export_memory(source, os.path.join(scratch, f"out-{name}"), args.workers, args.bucket_mib * MiB)
            for worker, growth in sorted(memory.items()):
                print(f"| {name} | {worker} | {shares[worker] / MiB:.0f} MiB | {growth / MiB:.0f} MiB |")
        ray.shutdown()
        print("\n| reading the whole checkpoint in one process | seconds |")
        print("| --- | --- |")
        for step, seconds in read_times(path).items():
            print(f"| {step} | {seconds:.2f} |")


if __name__ == "__main__":
    main()
