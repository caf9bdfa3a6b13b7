"""MoE and vision-language models, trained under either naming, exported as a user would
(`rayexport.export()`; the CLI for the one that fails):
the export holds exactly the keys and shapes `save_pretrained` writes, reloads with no missing
or unexpected keys, gives the reference model's logits, and keeps its ties."""

import json
import os
from concurrent.futures import ThreadPoolExecutor, wait

import pytest
import torch
from safetensors import safe_open

from support.checkpoints import write_format_checkpoints
from support.helpers import error_lines, run_main
from support.models import reference_logits

ARCHITECTURES = ["qwen3_moe", "mixtral", "deepseek_v3", "qwen2_vl", "qwen2_5_vl", "qwen3"]
VERL = [(architecture, naming, "verl") for architecture in ARCHITECTURES for naming in ("in-memory", "on-disk")]
DCP = [(architecture, naming, "dcp") for architecture in ("qwen3_moe", "qwen2_5_vl") for naming in ("in-memory", "on-disk")]
MIXED = ("qwen3_moe", "mixed", "verl")
IN_MEMORY = ["qwen3_moe", "mixtral", "deepseek_v3", "qwen2_5_vl"]
TIED = {"qwen2_5_vl": ("model.language_model.embed_tokens.weight", "lm_head.weight"),
        "qwen3": ("model.embed_tokens.weight", "lm_head.weight")}


@pytest.fixture(scope="module")
def format_checkpoints(tmp_path_factory):
    return write_format_checkpoints(str(tmp_path_factory.mktemp("formats")), VERL + DCP + [MIXED])


def exported_shapes(folder):
    shapes = {}
    for name in os.listdir(folder):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), framework="pt") as handle:
                shapes.update({key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()})
    return shapes


@pytest.fixture(scope="module")
def exports(format_checkpoints, tmp_path_factory, warm_pool):
    """Every export this module checks, through `rayexport.export()`, two at a time (one tiny
    export leaves this machine's cores idle much of its time): by its key, a future of the
    export's folder and report (an export that fails fails only the tests that read it)."""
    from rayexport import export

    root = tmp_path_factory.mktemp("format-exports")
    jobs = {("on-disk",) + case: (case, {"dtype": "float32"}) for case in VERL + DCP}
    jobs.update({
        ("in-memory", architecture): ((architecture, "on-disk", "verl"), {"dtype": "float32", "format": "in-memory", "verify": "quick"})
        for architecture in IN_MEMORY
    })
    jobs[("bfloat16",)] = (("qwen3_moe", "in-memory", "verl"), {"verify": "quick"})

    def run(key):
        case, options = jobs[key]
        destination = root / "-".join(key)
        report = export(format_checkpoints[case].path, str(destination), workers=2, log_level="WARNING", pool=warm_pool,
                        **options)
        return destination, json.loads(report.to_json())

    with ThreadPoolExecutor(2) as pool:
        futures = {key: pool.submit(run, key) for key in jobs}
        wait(futures.values())
    return futures


def reload_export(folder, architecture):
    """The export loaded by transformers: its loading info, logits, and whether the tie holds."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    model, info = getattr(transformers, config.architectures[0]).from_pretrained(folder, output_loading_info=True)
    parameters = dict(model.named_parameters(remove_duplicate=False))
    shared = None
    if architecture in TIED:
        canonical, alias = TIED[architecture]
        shared = parameters[canonical].data_ptr() == parameters[alias].data_ptr()
    return info, reference_logits(model.eval()), shared


@pytest.mark.parametrize("case", VERL + DCP, ids="-".join)
def test_export_is_save_pretrained_format_and_reloads_with_the_same_logits(case, format_checkpoints, exports):
    checkpoint = format_checkpoints[case]
    destination, report = exports[("on-disk",) + case].result()
    dense = checkpoint.architecture == "qwen3"  # one naming: the two are the same
    assert (report["naming"], report["format"]) == ("in-memory" if dense else checkpoint.naming, "on-disk")
    assert report["verification"]["passed"] and "reload" in report["verification"]["checks"]

    assert exported_shapes(destination) == checkpoint.saved_shapes
    assert json.loads((destination / "config.json").read_text()) == checkpoint.saved_config
    info, logits, shared = reload_export(str(destination), checkpoint.architecture)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    torch.testing.assert_close(logits, checkpoint.logits, rtol=1e-5, atol=1e-5)
    assert shared in (None, True)


@pytest.mark.parametrize("architecture", IN_MEMORY)
def test_the_in_memory_option_writes_the_state_dict_names(architecture, format_checkpoints, exports):
    """From the on-disk naming: per-expert pieces fused, VLM names nested again."""
    checkpoint = format_checkpoints[(architecture, "on-disk", "verl")]
    destination, report = exports[("in-memory", architecture)].result()
    assert report["format"] == "in-memory" and report["verification"]["passed"]
    assert exported_shapes(destination) == checkpoint.memory_shapes
    info, logits, shared = reload_export(str(destination), architecture)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    torch.testing.assert_close(logits, checkpoint.logits, rtol=1e-5, atol=1e-5)
    assert shared in (None, True)


def test_a_checkpoint_mixing_namings_is_one_line_naming_both_keys(format_checkpoints, tmp_path, ray_address):
    completed = run_main("--src", format_checkpoints[MIXED].path, "--dst", str(tmp_path / "export"))
    assert completed.returncode == 1
    lines = error_lines(completed)
    assert len(lines) == 1 and "mixes transformers' in-memory name 'model.layers.0.mlp.experts." in lines[0]
    assert "on-disk name 'model.layers.1.mlp.experts." in lines[0]
    assert not (tmp_path / "export").exists() or not any((tmp_path / "export").iterdir())


def test_a_float32_training_config_is_published_in_bfloat16(exports):
    destination, report = exports[("bfloat16",)].result()
    config = json.loads((destination / "config.json").read_text())
    assert config["dtype"] == "bfloat16"
    with safe_open(str(destination / "model.safetensors"), framework="pt") as handle:
        assert {handle.get_slice(key).get_dtype() for key in handle.keys()} == {"BF16"}
    assert report["dtype"] == "bfloat16" and "says float32" in report["dtype_reason"]
    assert report["naming"] == "in-memory" and report["format"] == "on-disk"
