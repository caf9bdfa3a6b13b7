"""Writes `rayexport/plan/megatron_bridge_tables.json`: every Hugging Face architecture that
Megatron-Bridge registers a bridge for, and that transformers ships, with the parameter mappings
of that bridge's own `mapping_registry()`, as data. Rerun it when Megatron-Bridge releases:

    <python with Megatron-Bridge> tools/megatron_bridge_tables.py [--out rayexport/plan/megatron_bridge_tables.json]

(the tests' virtualenv has one: `tests/support/megatron_bridge_env.py`). rayexport never imports
Megatron-Bridge; it reads these tables (`rayexport/plan/megatron_tables.py`), which name, for each
Hugging Face tensor, the Megatron-Core parameter it comes from and how (the mapping's kind).

Each bridge's registry is built for a small config of its architecture (transformers' defaults,
many layers, one multi-token-prediction layer where the model has them), so that registries that
depend on the config list everything they can map. The table names an MTP layer as one, whether
the registry names a concrete one or all: Megatron's `mtp.layers.{mtp}.` is MTP layer i, Hugging
Face's `mtp.layers.{mtp}.` the same (Qwen3-Next's, Qwen3.5's naming), and its `layers.{layers+mtp}.`
decoder layer `num_hidden_layers + i` (DeepSeek-V3's and GLM-4.5's).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from megatron_bridge_imports import import_megatron_bridge  # noqa: E402

# A number of decoder layers no registry names by itself, so that the MTP layer after the last
# one (`layers.<LAYERS>.`) is found in the names it gives.
LAYERS = 61
# Where a config keeps its number of multi-token-prediction layers, by model family.
MTP_FIELDS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")

# Each mapping class, by name, as the kind of transform rayexport applies to the tensor saved
# for its parameter. A class Megatron-Bridge adds later, or one whose export is its own, keeps
# its name, which rayexport does not know: the architectures needing it are refused by name.
KINDS = {
    # the tensor itself (its tensor-parallel split is undone by the saved global tensor)
    "AutoMapping": "direct",
    "ReplicatedMapping": "direct",
    "ColumnParallelMapping": "direct",
    "RowParallelMapping": "direct",
    "DirectMapping": "direct",
    # the same export, with checks or broadcasts of their own around it
    "_PPSafeAutoMapping": "direct",
    "_PPSafeReplicatedMapping": "direct",
    "_ReplicatedOptional": "direct",
    "_FullDimQKNormMapping": "direct",
    "_SqueezeBiasMapping": "direct",  # a unit leading axis on export: [N] -> [1, N]
    # q, k and v rows of each query group in turn; MiMo-V2-Flash's v heads are smaller than its
    # q and k heads, and Gemma 4's layers may lack v or k and v, which the q/k/v cut reads from shapes
    "QKVMapping": "qkv",
    "MiMoV2FlashQKVMapping": "qkv",
    "_Gemma4QKVMapping": "qkv",
    "_Gemma4DenseQKVMapping": "qkv",
    "ConcatenatedQKVMapping": "concatenated_qkv",
    "GatedMLPMapping": "gated_mlp",
    "_PPSafeGatedMLPMapping": "gated_mlp",
    "FusedExpertMapping": "fused_experts",
    "FusedGatedExpertMapping": "fused_gated_experts",
    "RMSNorm2ZeroCenteredRMSNormMapping": "zero_centered_norm",
    "GDNLinearMapping": "gdn_in_proj",
    "GDNLinearMappingSeparate": "gdn_in_proj_separate",
    "GDNConv1dMapping": "gdn_conv1d",
    "MambaInProjMapping": "mamba_in_proj",
    "MambaConv1dMapping": "mamba_conv1d",
    "GPTOSSMLPGateUpProjMapping": "gpt_oss_gate_up",
    "GPTOSSMLPDownProjMapping": "gpt_oss_down",
}
# The options of a mapping that change its transform, as the table records them.
OPTIONS = ("permute_dims", "transpose_on_export")


def architectures() -> dict[str, object]:
    """Each Hugging Face architecture (class name) Megatron-Bridge registers that transformers
    ships, with its transformers class."""
    import transformers
    from megatron.bridge.models.conversion.model_bridge import get_model_bridge

    found = {}
    for source in get_model_bridge._exact_types:
        name = source if isinstance(source, str) else source.__name__
        cls = getattr(transformers, name, None)
        if cls is not None:
            found[name] = cls
    return dict(sorted(found.items()))


def small_config(cls):
    """A config of `cls`'s architecture: transformers' defaults, `LAYERS` decoder layers and one
    multi-token-prediction layer."""
    config = cls.config_class()
    config.architectures = [cls.__name__]
    text = getattr(config, "text_config", None) or config
    text.num_hidden_layers = LAYERS
    pattern = getattr(text, "layer_types", None)
    if pattern:  # one kind per layer, for the new number of layers (FalconH1's derives it, and is left)
        try:
            text.layer_types = [pattern[i % len(pattern)] for i in range(LAYERS)]
        except AttributeError:
            pass
    for field in MTP_FIELDS:
        setattr(text, field, 1)
    return config


class FusedExpertKeys:
    """What a bridge sees of a Hugging Face checkpoint whose MoE experts are saved fused, one
    `gate_up_proj` and one `down_proj` per layer (Qwen3-VL-MoE's, Qwen3.5's, and others' as
    transformers 5 saves them): registries that pick their expert mappings by the checkpoint's
    keys (`moe_experts_stored_packed`, GLM's `_uses_fused_experts`) then give the fused ones."""

    def __init__(self) -> None:
        self.keys = [
            f"{prefix}{layer}.mlp.experts.{name}"
            for prefix in ("model.layers.", "model.language_model.layers.") for layer in range(LAYERS)
            for name in ("gate_up_proj", "down_proj")
        ]

    def get_all_keys(self) -> list[str]:
        return self.keys

    def has_glob(self, pattern: str) -> bool:
        return any(fnmatch.fnmatchcase(key, pattern) for key in self.keys)


def with_fused_experts(bridge, config):
    """`bridge` looking at a checkpoint with fused experts (`FusedExpertKeys`)."""
    bridge.hf_pretrained = types.SimpleNamespace(config=config, state=types.SimpleNamespace(source=FusedExpertKeys()))
    return bridge


def generic_mtp(name: str) -> str:
    """`name` with its MTP layer (Megatron's `mtp.layers.0.` or `mtp.layers.*.`, Hugging Face's
    the same or the layer after the last decoder layer) named as one."""
    name = re.sub(r"\bmtp\.layers\.(0|\*)\.", "mtp.layers.{mtp}.", name)
    return name.replace(f"layers.{LAYERS}.", "layers.{layers+mtp}.")


def rows(*registries) -> tuple:
    """The registries' mappings as (kind, Megatron parameter pattern, Hugging Face pattern or
    patterns by part[, options]), in their order, each once."""
    table, seen = [], set()
    for mapping in (mapping for registry in registries for mapping in registry.mappings):
        kind = KINDS.get(type(mapping).__name__, type(mapping).__name__)
        hf = mapping.hf_param
        hf = {part: generic_mtp(name) for part, name in hf.items()} if isinstance(hf, dict) else generic_mtp(hf)
        options = {option: getattr(mapping, option) for option in OPTIONS if getattr(mapping, option, None)}
        row = (kind, generic_mtp(mapping.megatron_param), hf) + ((options,) if options else ())
        if repr(row) not in seen:
            seen.add(repr(row))
            table.append(row)
    return tuple(table)


def tables() -> tuple[dict[str, str], dict[str, tuple], dict[str, str]]:
    """By architecture, its table's name (its bridge's class); the tables; and the
    architectures whose registry could not be built, with why."""
    from megatron.bridge.models.conversion.model_bridge import get_model_bridge

    names, built, failed = {}, {}, {}
    for name, cls in architectures().items():
        try:
            config = small_config(cls)
            bridge = get_model_bridge(cls, hf_config=config)
            fused = with_fused_experts(get_model_bridge(cls, hf_config=config), config)
            table = rows(bridge.mapping_registry(), fused.mapping_registry())
        except Exception as error:  # noqa: BLE001 - recorded in the table, for the reader
            failed[name] = f"{type(error).__name__}: {error}".splitlines()[0][:200]
            continue
        key = type(bridge).__name__
        if key in built and built[key] != table:
            key = f"{key}:{name}"
        built[key], names[name] = table, key
    return names, built, failed


def render(names: dict[str, str], built: dict[str, tuple], failed: dict[str, str], version: str) -> str:
    """The tables as JSON: a row is [kind, Megatron-Core parameter pattern, Hugging Face name
    pattern or patterns by part, options], `*` standing for a number, `**` for any name, `{mtp}`
    for a multi-token-prediction layer and `{layers+mtp}` for the decoder layer after the last
    that Hugging Face names it by."""
    head = {
        "generated_by": "tools/megatron_bridge_tables.py, from each bridge's own mapping_registry(); do not edit",
        "megatron_bridge": version,
        "architectures": dict(sorted(names.items())),
        "unbuilt": dict(sorted(failed.items())),
    }
    tables = ",\n".join(
        f"  {json.dumps(key)}: [\n" + ",\n".join(f"   {json.dumps(list(row) + [{}] * (4 - len(row)))}" for row in table) + "\n  ]"
        for key, table in sorted(built.items())
    )
    return json.dumps(head, indent=1)[:-2] + ',\n "tables": {\n' + tables + "\n }\n}\n"  # a row a line


TABLES_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "rayexport", "plan",
                           "megatron_bridge_tables.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=TABLES_FILE, help="the file to write (default: %(default)s)")
    args = parser.parse_args()
    import logging
    import warnings
    from importlib.metadata import version

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import_megatron_bridge()
    source = render(*tables(), version("megatron-bridge"))  # registries print to stdout: the tables are written apart
    with open(args.out, "w") as f:
        f.write(source)


if __name__ == "__main__":
    main()
