"""Megatron-Bridge 0.6.2's own torch_dist saves (on Megatron-Core 0.19.2, what verl's Megatron
backend, NeMo-RL and slime save with), through the CLI and `export_remote`, as a user exports them.

Megatron-Bridge itself writes them (tests/support/megatron_bridge_save.py and, for the models whose
layers exist only as TransformerEngine or CUDA-kernel code, megatron_bridge_registry_save.py: each
says what it stands in), from a tiny Hugging Face model with every tensor random, on gloo CPU ranks
with tensor, pipeline (uneven, virtual), expert and expert-tensor parallelism, beside Megatron-Bridge's
own `export_hf_weights` of the model and the Hugging Face model's logits. Every exported tensor must
equal Megatron-Bridge's, bit for bit, and the export reloaded by transformers compute the model's
logits. The tables rayexport reads are checked to be what tools/megatron_bridge_tables.py makes of
Megatron-Bridge's registries."""

from __future__ import annotations

import json
import os

import pytest
import ray
import torch
from safetensors.torch import load_file

from rayexport import export_remote
from rayexport.plan.megatron_tables import BRIDGE_TABLES
from support.helpers import download, error_lines, exported_tensors, run_main, upload
from support.megatron_bridge_checkpoints import CASES, GENERATED_TABLES, source_of
from support.megatron_bridge_registry_checkpoints import REGISTRY_CASES
from support.models import PROMPT_IDS

pytestmark = pytest.mark.usefixtures("ray_address")

# Gemma 4's Megatron model saves its attention split by layer kind (`self_attention_sliding`,
# `self_attention_global`), which no table row names: refused by name (the last test).
REFUSED = "gemma4-tp2-megatron-lm"
EXPORTED = [case for case in {**CASES, **REGISTRY_CASES} if case != REFUSED]
# float32 saves compute the logits of the model bit for bit; a bfloat16 one's are those of the
# same values, in float32 (the reload's dtype), to float32 rounding
LOGITS_ATOL = 1e-5


def arguments(case: str) -> list[str]:
    return {**CASES, **REGISTRY_CASES}[case]


def assert_equals_megatron_bridges_export_and_the_models_logits(folder: str, out: str) -> None:
    """Every tensor of Megatron-Bridge's export, and only those, bit for bit (a critic's score
    head: the output layer's one row, and zeros for the bias verl's value head has none of); the
    export, reloaded by transformers in float32, computes the Hugging Face model's logits."""
    import transformers

    reference = load_file(os.path.join(folder, "reference", "bridge.safetensors"))
    config = json.loads(open(os.path.join(out, "config.json")).read())
    if config["architectures"][0].endswith("ForTokenClassification") and "score.bias" not in reference:
        reference["score.bias"] = torch.zeros(config.get("num_labels", 1), dtype=reference["score.weight"].dtype)
    exported = exported_tensors(out)
    assert set(exported) == set(reference)
    for key, tensor in reference.items():
        assert exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor), key
    model = getattr(transformers, config["architectures"][0]).from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(PROMPT_IDS)).logits
    expected = load_file(os.path.join(folder, "reference", "logits.safetensors"))["logits"]
    torch.testing.assert_close(logits, expected, rtol=0, atol=LOGITS_ATOL)


@pytest.mark.parametrize("case", EXPORTED)
def test_an_export_equals_megatron_bridges_and_computes_the_models_logits(megatron_bridge_checkpoints, case, tmp_path,
                                                                          warm_pool):
    folder, out, report_path = megatron_bridge_checkpoints[case], str(tmp_path / "out"), tmp_path / "report.json"
    source, extra = source_of(folder)
    dtype = "auto" if "bfloat16" in arguments(case) else "float32"  # float32 saves published in float32, to compare bits
    completed = run_main("--src", source, "--dst", out, "--verify", "full", "--report", str(report_path), "--pool", warm_pool,
                         "--dtype", dtype, *extra)
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["layout"] == "megatron" and report["verification"]["level"] == "full"
    manifest = json.loads((tmp_path / "out" / "export_manifest.json").read_text())
    if "--mtp" in arguments(case):  # MTP layers are exported, and the reload knew transformers leaves them out
        assert manifest["beyond_model"] and all(name in manifest["tensors"] for name in manifest["beyond_model"])
    assert_equals_megatron_bridges_export_and_the_models_logits(folder, out)


# One of each kind of save, as an RL trainer exports each checkpoint: from inside its Ray program,
# S3 to S3: a vision-language MoE, an MTP layer, gated DeltaNet layers, gpt-oss's interleaved experts.
REMOTE_CASES = ["qwen3_vl_moe-ep2", "deepseek_v3-ep2-mtp1", "qwen3_next-tp2-mtp", "gpt_oss-ep2"]


@pytest.mark.parametrize("case", REMOTE_CASES)
def test_export_remote_from_s3_to_s3(megatron_bridge_checkpoints, case, s3_prefix, tmp_path, warm_pool):
    folder = megatron_bridge_checkpoints[case]
    local_source, extra = source_of(folder)
    assert not extra  # saved in verl's layout, its Hugging Face config beside
    source = upload(local_source, f"{s3_prefix}/model")
    report = ray.get(export_remote(source, f"{s3_prefix}/export", workers=2, dtype="float32", pool=warm_pool), timeout=600)
    assert report.verification["passed"]
    assert_equals_megatron_bridges_export_and_the_models_logits(folder, download(f"{s3_prefix}/export", str(tmp_path / "out")))


def test_the_tables_are_what_the_script_makes_of_megatron_bridges_registries(megatron_bridge_checkpoints):
    """rayexport/plan/megatron_bridge_tables.json is tools/megatron_bridge_tables.py's output
    for the Megatron-Bridge the tests run (made beside the saves): never edited by hand, never stale."""
    generated = json.loads(open(megatron_bridge_checkpoints[GENERATED_TABLES]).read())
    assert generated == json.loads(open(BRIDGE_TABLES).read())


def export_workers_ever_started() -> set[str]:
    """The ids of every rayexport worker actor this session's Ray has had, ended ones included."""
    from ray._private import state

    return {actor_id for actor_id, actor in state.actors().items() if actor["ActorClassName"] == "ExportWorkerActor"}


def test_a_save_no_table_row_places_is_refused_by_name_before_any_worker_starts(megatron_bridge_checkpoints, tmp_path):
    """Gemma 4's attention, saved by layer kind, has no row: the one line names the tensor the
    table looks for, from `.metadata` alone."""
    source, extra = source_of(megatron_bridge_checkpoints[REFUSED])
    before = export_workers_ever_started()
    completed = run_main("--src", source, "--dst", str(tmp_path / "out"), *extra)
    lines = error_lines(completed)
    assert completed.returncode == 1 and len(lines) == 1, completed.stderr[-2000:]
    assert "has no tensor 'decoder.layers.self_attention.linear_qkv.weight', which 'model.layers.0.self_attn.q_proj.weight'" in lines[0]
    assert export_workers_ever_started() == before
    assert not os.path.exists(tmp_path / "out")
