"""rayexport.orchestration.options: the dataclass is the one source of every option's default, help, group and
command-line form; the CLI's parser is built from it."""

import dataclasses

import pytest

from rayexport.common.errors import ExportError
from rayexport.orchestration.options import GROUPS, ExportOptions, cli_flag, options_from_arguments
from rayexport.run import build_parser


def test_every_field_has_a_flag_whose_default_is_the_fields():
    parsed = options_from_arguments(build_parser().parse_args(["--src", "s3://b/ckpt", "--dst", "/tmp/out"]))
    assert parsed == dataclasses.asdict(ExportOptions(src="s3://b/ckpt", dst="/tmp/out")) | {
        "bucket_size": "1GiB", "max_shard_size": "5GB",  # sizes are read when the options are built
    }
    assert ExportOptions(**parsed) == ExportOptions(src="s3://b/ckpt", dst="/tmp/out")


def test_flags_are_read_with_each_fields_type():
    arguments = build_parser().parse_args([
        "--src", "a", "--dst", "b", "--timeout", "5", "--placement-timeout", "2.5", "--workers", "3",
        "--bucket-size", "64MiB", "--lora-rslora", "--storage-options", '{"anon": true}', "--num-gpus-per-worker", "0",
        "--backend", "gloo", "--untie",
    ])
    options = ExportOptions(**options_from_arguments(arguments))
    assert (options.timeout_s, options.placement_timeout_s, options.workers) == (5.0, 2.5, 3)
    assert options.bucket_size == 64 * 2**20
    assert options.lora_rslora is True and options.untie is True
    assert options.storage_options == {"anon": True}
    assert options.num_gpus_per_worker == 0.0 and options.backend == "gloo"


def test_help_shows_the_groups_and_the_defaults():
    text = build_parser().format_help()
    for group in GROUPS:
        assert f"{group} options:" in text
    assert "largest safetensors file (default: 5GB)" in " ".join(text.split())
    assert "--placement-timeout S" in text and "--timeout S" in text


def test_choices_are_checked_with_the_flags_name():
    for item in dataclasses.fields(ExportOptions):
        if item.metadata["choices"]:
            with pytest.raises(ExportError, match=f"^{cli_flag(item)} must be one of"):
                ExportOptions(src="a", dst="b", **{item.name: "no-such-choice"})


def test_the_manifest_records_the_options_that_decide_the_bytes():
    assert set(ExportOptions(src="a", dst="b").recorded()) == {
        "dtype", "max_shard_size", "trust_remote_code", "verify", "lora", "base_model", "lora_alpha",
        "lora_rslora", "untie", "strict", "dcp_prefix", "step", "tag", "format",
    }
