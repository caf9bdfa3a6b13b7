"""rayexport.plan.megatron_tables: the tables of rows, by architecture, that name each Hugging Face
tensor's Megatron-Core parameter. Checked here as data (every row well formed, its wildcards the
same on both sides, its kind one rayexport cuts or one it refuses by name); tests/test_megatron_bridge.py
checks that the JSON file is what tools/megatron_bridge_tables.py makes of Megatron-Bridge's own
registries, and that the rows cut its saves into its exports."""

import re

import pytest

from rayexport.common.errors import ExportError
from rayexport.plan.megatron_cuts import _CUTS
from rayexport.plan.megatron_tables import MBRIDGE_TABLES, architectures, bridge_tables, table

# Megatron-Bridge mapping kinds no tested architecture needs, which rayexport refuses by name.
REFUSED_KINDS = {
    "_HCAlphaMapping", "_HCAlphaSecondaryMapping", "_MTPFlatteningMapping",
    "_MTPFlatteningQKVMapping", "_ConcatBiasMapping", "_OffsetGatedMLPMapping", "_OffsetRowParallelMapping",
    "StackedExpertAutoMapping", "StackedExpertGatedMLPMapping", "QKVGMapping", "KVMapping",
}
WILDCARDS = re.compile(r"\{layers\+mtp\}|\{mtp\}|\*\*|\*")


def all_rows():
    for name, rows in bridge_tables()["tables"].items():
        yield from ((name, row) for row in rows)
    for name, rows in MBRIDGE_TABLES.items():
        yield from ((name, row) for row in rows)


def test_every_row_names_a_kind_and_the_same_wildcards_on_both_sides():
    """A row's Hugging Face patterns take the Megatron pattern's wildcards in order (an MTP
    layer's by its own token); a fused tensor of every expert has one fewer, the expert's. (The
    rows of kinds rayexport refuses follow their own rules.)"""
    for name, (kind, megatron, hf, options) in all_rows():
        assert kind in _CUTS or kind in REFUSED_KINDS, (name, kind)
        assert isinstance(options, dict)
        if kind in REFUSED_KINDS:
            continue
        wanted = [token.replace("{layers+mtp}", "{mtp}") for token in WILDCARDS.findall(megatron)]
        for pattern in hf.values() if isinstance(hf, dict) else [hf]:
            found = [token.replace("{layers+mtp}", "{mtp}") for token in WILDCARDS.findall(pattern)]
            if "{mtp}" in wanted and "{mtp}" not in found:  # one MTP layer, which Hugging Face gives no number
                found.insert(wanted.index("{mtp}"), "{mtp}")
            fused = kind.startswith("fused") or kind.startswith("gpt_oss") or kind.startswith("Stacked")
            assert found == wanted or (fused and found == wanted[:-1]), (name, megatron, pattern)
            assert not ("**" in found and "*" in found), (name, pattern)


def test_architectures_are_megatron_bridges_and_mbridges():
    names = architectures()
    assert {"Qwen3ForCausalLM", "Qwen3VLMoeForConditionalGeneration", "Qwen3NextForCausalLM", "NemotronHForCausalLM",
            "MixtralForCausalLM", "Qwen2MoeForCausalLM"} <= set(names)
    assert bridge_tables()["megatron_bridge"] == "0.6.2" and not bridge_tables()["unbuilt"]


def test_a_critic_or_reward_model_takes_its_causal_lms_rows_and_a_score_head():
    causal = table({"architectures": ["Qwen3ForCausalLM"]})
    critic = table({"architectures": ["Qwen3ForTokenClassification"]})
    assert critic[3:] == causal and [row[2] for row in critic[:3]] == ["score.weight", "score.bias", "score.bias"]
    assert table({"architectures": ["Qwen2_5_VLForConditionalGeneration"]})[-1] == MBRIDGE_TABLES["Qwen2_5_VLForConditionalGeneration"][-1]


def test_an_architecture_without_a_table_is_refused_by_name():
    with pytest.raises(ExportError, match=r"architecture 'BertModel' \(model type 'bert'\) are not mapped"):
        table({"architectures": ["BertModel"], "model_type": "bert"})
