"""Storage against the S3 server over HTTP and the local filesystem: an object appears only
when its write finishes, unfinished uploads can be aborted, failures name the object."""

from __future__ import annotations

import boto3
import pytest

from helpers import BUCKET, s3_exists
from rayexport.errors import ExportError
from rayexport.storage import Store, storage_options_from_env


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
