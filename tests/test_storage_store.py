"""Storage against the S3 server over HTTP and the local filesystem: an object appears only
when its write finishes, unfinished uploads can be aborted, failures name the object."""

from __future__ import annotations

import os
import pickle

import boto3
import pytest

from rayexport.common.errors import ExportError
from rayexport.storage import reads, s3 as storage_s3
from rayexport.storage.settings import storage_options_from_env
from rayexport.storage.store import Store
from support.fault_proxy import FaultProxy
from support.helpers import BUCKET, s3_exists

MiB = 2**20


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path, s3_prefix):
    if request.param == "local":
        return Store(str(tmp_path / "out"))
    # 5 MiB blocks (S3's smallest part) so that a 6 MiB write really opens a multipart upload
    return Store(s3_prefix, storage_options_from_env({"default_block_size": 5 * 2**20}))


def test_write_then_read(store):
    store.write_json("a/b.json", {"x": 1})
    assert store.read_json("a/b.json") == {"x": 1}
    assert store.exists("a/b.json") and store.list("a") == ["b.json"]


def test_failed_write_publishes_nothing(store):
    with pytest.raises(RuntimeError):
        with store.writer("partial.bin") as handle:
            handle.write(b"x" * (6 * 2**20))  # on S3, past the block size: one part is uploaded
            raise RuntimeError("the exporter died mid-file")
    assert not store.exists("partial.bin")
    assert store.abort_uploads() == []  # the discard aborted the multipart upload too


def test_read_range(store):
    store.write_bytes("a.bin", bytes(range(100)))
    assert store.read_range("a.bin", 10, 13) == bytes([10, 11, 12])
    assert store.read_range("a.bin", 0, 100) == bytes(range(100))
    assert store.read_range("a.bin", 7, 7) == b""
    # as a file read: short where the object ends, empty past it (S3 answers 416 there)
    assert store.read_range("a.bin", 90, 120) == bytes(range(90, 100))
    assert store.read_range("a.bin", 100, 108) == store.read_range("a.bin", 150, 160) == b""
    store.write_bytes("empty.bin", b"")
    assert store.read_range("empty.bin", 0, 8) == b""
    for start, end in ((5, 6), (3, 3)):
        with pytest.raises(ExportError, match=f"^not found: '{store.display('missing.bin')}'$"):
            store.read_range("missing.bin", start, end)


def _through(proxy: FaultProxy, prefix: str, **options) -> Store:
    """A store of 5 MiB parts (S3's smallest) whose requests pass through `proxy`."""
    return Store(prefix, storage_options_from_env({"endpoint_url": proxy.endpoint, "default_block_size": 5 * MiB, **options}))


def test_a_large_write_uploads_equal_parts_a_few_at_a_time(proxy, s3_prefix):
    data = os.urandom(33 * MiB + 123)
    proxy.reset()
    with _through(proxy, s3_prefix).writer("big.bin") as handle:
        for start in range(0, len(data), 3 * MiB + 7):  # writes that never line up with parts
            handle.write(data[start:start + 3 * MiB + 7])
    assert 1 < proxy.most_in_flight <= storage_s3.UPLOAD_PARTS_IN_FLIGHT
    client = boto3.client("s3")
    key = f"{s3_prefix.removeprefix(f's3://{BUCKET}/')}/big.bin"
    parts = [client.head_object(Bucket=BUCKET, Key=key, PartNumber=number)["ContentLength"] for number in range(1, 8)]
    assert parts == [5 * MiB] * 6 + [3 * MiB + 123]
    assert Store(s3_prefix, storage_options_from_env()).read_bytes("big.bin") == data


def test_a_small_write_is_one_request(proxy, s3_prefix):
    proxy.reset()
    _through(proxy, s3_prefix).write_bytes("small.json", b"{}")
    assert proxy.count == 1  # a PUT, where a multipart upload takes three


def test_a_failed_part_fails_the_write_and_publishes_nothing(proxy, s3_prefix):
    store = _through(proxy, s3_prefix, config_kwargs={"retries": {"max_attempts": 0}})  # no retry
    proxy.reset({3: "500"})  # 1 starts the upload; 2 and on are its parts
    with pytest.raises(ExportError, match=f"storage write failed for '{s3_prefix}/big.bin'"):
        with store.writer("big.bin") as handle:
            handle.write(os.urandom(30 * MiB))
    assert proxy.injected[0][2] == "PUT"
    assert not store.exists("big.bin")
    assert store.abort_uploads() == []  # every part ended before the upload was aborted


def test_a_large_local_write_reaches_the_file_whole(tmp_path, monkeypatch):
    """A local file is written a tensor at a time, not in its handle's 8 KiB `blocksize`: after
    a safetensors header nothing lines up with a disk block, and the kernel zeroed the partial
    blocks of every 8 KiB write (a sixth of a 12 GB export's CPU went there)."""
    from fsspec.implementations.local import LocalFileOpener

    sizes = []
    write = LocalFileOpener.write
    monkeypatch.setattr(LocalFileOpener, "write", lambda self, data: sizes.append(len(data)) or write(self, data))
    data = os.urandom(24 * MiB + 5)
    with Store(str(tmp_path)).writer("model.safetensors") as handle:
        handle.write(data[:13])  # a header's length: every later byte is off the block boundaries
        handle.write(data[13:])
    assert sizes == [13, len(data) - 13]
    assert (tmp_path / "model.safetensors").read_bytes() == data


def test_download_fetches_a_few_ranges_at_a_time(proxy, s3_prefix, tmp_path, monkeypatch):
    monkeypatch.setattr(reads, "DOWNLOAD_BLOCK", MiB)
    data = os.urandom(9 * MiB + 5)
    store = _through(proxy, s3_prefix)
    store.write_bytes("rank.pt", data)
    store.write_bytes("empty.pt", b"")
    proxy.reset()
    store.download("rank.pt", str(tmp_path / "rank.pt"))
    assert (tmp_path / "rank.pt").read_bytes() == data
    assert 1 < proxy.most_in_flight <= reads.DOWNLOAD_RANGES_IN_FLIGHT
    assert proxy.count == 1 + 10  # a HEAD opens it, then one GET per range
    store.download("empty.pt", str(tmp_path / "empty.pt"))
    assert (tmp_path / "empty.pt").read_bytes() == b""
    with pytest.raises(ExportError, match=f"^not found: '{s3_prefix}/missing.pt'$"):
        store.download("missing.pt", str(tmp_path / "missing.pt"))


def test_a_read_whose_answer_breaks_off_is_read_again(proxy, s3_prefix, tmp_path, monkeypatch):
    monkeypatch.setattr(reads, "DOWNLOAD_BLOCK", MiB)
    data = os.urandom(3 * MiB + 5)
    store = _through(proxy, s3_prefix)
    store.write_bytes("rank.pt", data)
    proxy.reset({2: "cut-answer"})  # the first range (1 is the HEAD that opens the object)
    store.download("rank.pt", str(tmp_path / "rank.pt"))
    assert (tmp_path / "rank.pt").read_bytes() == data
    assert [(fault, method) for _, fault, method, _ in proxy.injected] == [("cut-answer", "GET")]
    proxy.reset({1: "cut-answer"})
    assert store.read_range("rank.pt", 10, 2 * MiB) == data[10:2 * MiB]
    assert len(proxy.injected) == 1

    proxy.reset(from_request=(1, "cut-answer"))
    with pytest.raises(ExportError, match=f"storage read failed for '{s3_prefix}/rank.pt'"):
        store.read_range("rank.pt", 10, 2 * MiB)
    assert proxy.count == reads.READ_ATTEMPTS  # each read once: its requests all succeeded


def test_a_persistent_fault_fails_a_call_after_botocores_attempts_alone(proxy, s3_prefix):
    """s3fs ran botocore's whole retry ladder 5 times over (25 for reads): a call that can
    never succeed took minutes to fail."""
    attempts = 2
    store = _through(proxy, s3_prefix, config_kwargs={"retries": {"total_max_attempts": attempts}})
    store.write_bytes("a.json", b"{}")
    pickled = pickle.dumps(store)
    type(store.fs).clear_instance_cache()  # as in a Ray worker's process
    store = pickle.loads(pickled)
    calls = {
        "read_range": lambda: store.read_range("a.json", 0, 1),
        "read_bytes": lambda: store.read_bytes("a.json"),
        "size": lambda: store.size("a.json"),
        "write_bytes": lambda: store.write_bytes("b.json", b"{}"),
    }
    # aiohttp sends an idempotent request (GET, HEAD, PUT) again, once, on a dropped connection
    for fault, requests_per_attempt in (("500", 1), ("cut", 2)):
        for name, call in calls.items():
            proxy.reset(from_request=(1, fault))
            with pytest.raises(ExportError, match=f"failed for '{s3_prefix}/[ab].json'"):
                call()
            assert proxy.count == attempts * requests_per_attempt, (fault, name)


def test_abort_uploads_left_by_a_killed_export(s3_prefix):
    client = boto3.client("s3")
    key_prefix = s3_prefix.removeprefix(f"s3://{BUCKET}/")
    for name in ("model-00001-of-00002.safetensors", "sub/x"):
        upload = client.create_multipart_upload(Bucket=BUCKET, Key=f"{key_prefix}/{name}")
        client.upload_part(Bucket=BUCKET, Key=f"{key_prefix}/{name}", UploadId=upload["UploadId"], PartNumber=1, Body=b"x")
    elsewhere = client.create_multipart_upload(Bucket=BUCKET, Key=f"{key_prefix}-other/keep")
    store = Store(s3_prefix, storage_options_from_env())
    assert store.abort_uploads() == [f"{key_prefix}/model-00001-of-00002.safetensors", f"{key_prefix}/sub/x"]
    left = [upload["Key"] for upload in client.list_multipart_uploads(Bucket=BUCKET).get("Uploads", [])]
    assert left == [f"{key_prefix}-other/keep"]
    client.abort_multipart_upload(Bucket=BUCKET, Key=f"{key_prefix}-other/keep", UploadId=elsewhere["UploadId"])
    assert not s3_exists(f"{s3_prefix}/model-00001-of-00002.safetensors")


def test_errors_name_the_object(s3_endpoint):
    with pytest.raises(ExportError, match="not found: 's3://rayexport-tests/nothing/x.json'"):
        Store("s3://rayexport-tests/nothing", storage_options_from_env()).read_bytes("x.json")
    with pytest.raises(ExportError, match="s3://no-such-bucket-x/out/a.bin"):
        Store("s3://no-such-bucket-x/out", storage_options_from_env()).write_bytes("a.bin", b"1")
    with pytest.raises(ExportError, match="cannot open storage URI 'nosuchscheme://x'"):
        Store("nosuchscheme://x")


def test_options_from_environment_and_flags(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    options = storage_options_from_env({"key": "override"})
    assert options["endpoint_url"] == "http://127.0.0.1:9" and options["key"] == "override"
    assert options["secret"] == "secret"
    assert "secret" not in repr(Store("/tmp", options))


def test_a_users_client_setting_keeps_the_retry_defaults(s3_prefix):
    """`--storage-options '{"config_kwargs": {"read_timeout": 7}}'` changes that one setting of
    the S3 client; it used to replace them all, dropping the 5 standard-mode retries."""
    store = Store(s3_prefix, storage_options_from_env({"config_kwargs": {"read_timeout": 7}}))
    store.exists("anything")  # connects the client
    config = store.fs.s3.meta.config
    assert config.read_timeout == 7 and config.connect_timeout == 20
    assert config.retries["mode"] == "standard"
    assert config.retries["total_max_attempts"] == 6  # botocore's count: the call and 5 retries


def test_a_stores_retries_are_its_own_after_other_stores(s3_prefix):
    """botocore rewrites the retry settings it is given in place; a default store used to
    leave S3_DEFAULTS saying 6 attempts, outranking every later store's own max_attempts."""
    Store(s3_prefix, storage_options_from_env()).exists("anything")
    store = Store(s3_prefix, storage_options_from_env({"config_kwargs": {"retries": {"max_attempts": 2}}}))
    store.exists("anything")
    assert store.fs.s3.meta.config.retries["total_max_attempts"] == 3


def test_a_stores_parent_stops_at_the_root_and_at_the_bucket(s3_endpoint):
    assert Store("/data/run/step-5").parent().uri == "/data/run"
    assert Store("/data").parent() is None
    assert Store("s3://bucket/run/step-5").parent().uri == "s3://bucket/run"
    assert Store("s3://bucket/run").parent().uri == "s3://bucket"
    assert Store("s3://bucket").parent() is None


def test_a_local_export_loads_no_s3_client(tmp_path):
    """A store on local disk imports neither s3fs nor its client (about a second of start-up in
    each of an export's processes); an S3 store does."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from rayexport.storage.store import Store\n"
        f"store = Store({str(tmp_path)!r})\n"
        "store.write_bytes('a', b'1')\n"
        "assert store.read_range('a', 0, 1) == b'1'\n"
        "print(sorted(name for name in ('s3fs', 'botocore', 'aiohttp') if name in sys.modules))\n"
        "Store('s3://bucket/prefix')\n"
        "print(sorted(name for name in ('s3fs', 'botocore', 'aiohttp') if name in sys.modules))\n"
    )
    lines = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.splitlines()
    assert lines == ["[]", "['aiohttp', 'botocore', 's3fs']"]
