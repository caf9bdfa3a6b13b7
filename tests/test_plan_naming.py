"""rayexport.plan.naming: checkpoint keys to output tensors (ties, missing and unexpected keys,
shards that do not add up), and each output's dtype."""


import pytest

from rayexport.common.errors import ExportError
from rayexport.plan.naming import choose_dtype, output_dtype
from rayexport.plan.shards import ShardInfo

from support.plan_cases import EMBED, HEAD, NORM, TIED, expected_of, fsdp2_ranks, plan_tensors


# --- plan_tensors ---------------------------------------------------------------------------


def test_plan_tensors_dtensor_pieces_and_tied_alias_dropped():
    world = 3
    shapes = {EMBED: (10, 4), NORM: (4,), HEAD: (10, 4), "tiny.bias": (2,)}
    ranks = fsdp2_ranks({"_orig_mod." + EMBED: (10, 4), NORM: (4,), HEAD: (10, 4), "tiny.bias": (2,)}, world)
    planning = plan_tensors(ranks, expected_of(shapes), TIED)

    by_name = {plan.name: plan for plan in planning.tensors}
    assert set(by_name) == {EMBED, NORM, "tiny.bias"}
    assert planning.resolution.dropped == [HEAD] and planning.resolution.to_compare == [(EMBED, HEAD)]
    assert planning.tied_key_pairs == [("_orig_mod." + EMBED, HEAD)]  # the keys to compare values of
    embed = by_name[EMBED]
    assert embed.source_key == "_orig_mod." + EMBED and embed.shape == (10, 4)
    assert [(p.rank, p.offset, p.shape) for p in embed.pieces] == [
        (0, (0, 0), (4, 4)), (1, (4, 0), (4, 4)), (2, (8, 0), (2, 4))
    ]
    assert all(p.source_key == "_orig_mod." + EMBED for p in embed.pieces)
    # 2 rows over 3 ranks: rank 2 holds nothing and contributes no piece
    assert [(p.rank, p.offset, p.shape) for p in by_name["tiny.bias"].pieces] == [(0, (0,), (1,)), (1, (1,), (1,))]


def test_plan_tensors_empty_dtensor_still_has_one_piece():
    plans = plan_tensors(fsdp2_ranks({NORM: (0, 4)}, 2), expected_of({NORM: (0, 4)}), {}).tensors
    assert [(p.rank, p.offset, p.shape) for p in plans[0].pieces] == [(0, (0, 0), (0, 4))]


def test_plan_tensors_promotes_an_alias_whose_canonical_is_missing():
    ranks = fsdp2_ranks({HEAD: (10, 4), NORM: (4,)}, 2)
    expected = expected_of({EMBED: (10, 4), NORM: (4,), HEAD: (10, 4)})
    planning = plan_tensors(ranks, expected, TIED)
    by_name = {plan.name: plan for plan in planning.tensors}
    assert set(by_name) == {EMBED, NORM}
    assert by_name[EMBED].source_key == HEAD
    assert all(piece.source_key == HEAD for piece in by_name[EMBED].pieces)
    assert planning.resolution.promoted == {HEAD: EMBED}
    assert planning.tied_key_pairs == []


def test_plan_tensors_two_aliases_without_their_canonical_are_compared():
    shared, encoder, decoder = "shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight"
    ranks = fsdp2_ranks({encoder: (10, 4), decoder: (10, 4), NORM: (4,)}, 2)
    expected = expected_of({shared: (10, 4), encoder: (10, 4), decoder: (10, 4), NORM: (4,)})
    planning = plan_tensors(ranks, expected, {encoder: shared, decoder: shared})
    assert sorted(plan.name for plan in planning.tensors) == [NORM, shared]  # one copy written
    assert planning.tied_key_pairs == [(encoder, decoder)]  # and the other compared with it


def test_plan_tensors_tied_checkpoint_with_only_the_embedding():
    """BRIEF 1.3: no KeyError for lm_head.weight, nothing reported missing."""
    ranks = fsdp2_ranks({EMBED: (10, 4), NORM: (4,)}, 2)
    expected = expected_of({EMBED: (10, 4), NORM: (4,), HEAD: (10, 4)})
    planning = plan_tensors(ranks, expected, TIED)
    assert sorted(plan.name for plan in planning.tensors) == [EMBED, NORM]
    assert planning.resolution.dropped == [] and planning.resolution.promoted == {}


def test_plan_tensors_untied_model_keeps_both():
    ranks = fsdp2_ranks({EMBED: (10, 4), HEAD: (10, 4)}, 2)
    plans = plan_tensors(ranks, expected_of({EMBED: (10, 4), HEAD: (10, 4)}), {}).tensors
    assert sorted(plan.name for plan in plans) == [HEAD, EMBED]


def test_plan_tensors_plain_fsdp1_tensors():
    """Plain tensors: sharded along dim 0 in rank order, or replicated (0-d, buffers)."""
    local = {
        "_fsdp_wrapped_module." + EMBED: [(4, 4), (4, 4), (2, 4)],
        "_fsdp_wrapped_module.model.rotary.inv_freq": [(8,), (8,), (8,)],
        "_fsdp_wrapped_module.model.scale": [(), (), ()],
        "_fsdp_wrapped_module.model.uneven": [(0, 3), (5, 3), (1, 3)],
    }
    ranks = {
        rank: {key: ShardInfo(local_shape=shapes[rank], dtype="float32") for key, shapes in local.items()}
        for rank in range(3)
    }
    expected = expected_of({EMBED: (10, 4), "model.rotary.inv_freq": (8,), "model.scale": (), "model.uneven": (6, 3)})
    plans = plan_tensors(ranks, expected, {}).tensors
    pieces = {plan.name: [(p.rank, p.offset, p.shape) for p in plan.pieces] for plan in plans}
    assert pieces[EMBED] == [(0, (0, 0), (4, 4)), (1, (4, 0), (4, 4)), (2, (8, 0), (2, 4))]
    assert pieces["model.rotary.inv_freq"] == [(0, (0,), (8,))]
    assert pieces["model.scale"] == [(0, (), ())]
    assert [offset for _, offset, _ in pieces["model.uneven"]] == [(0, 0), (0, 0), (5, 0)]
    assert sum(shape[0] for _, _, shape in pieces["model.uneven"]) == 6


def test_plan_tensors_hsdp_reads_the_first_replica_only():
    def info(rank):
        coordinate = (rank // 2, rank % 2)
        return {EMBED: ShardInfo(
            local_shape=((5, 4), (4, 4))[coordinate[1]], dtype="float32", global_shape=(9, 4),
            placements=("R", "S0"), mesh_shape=(2, 2), mesh_ranks=(0, 1, 2, 3), coordinate=coordinate,
        )}

    plans = plan_tensors({rank: info(rank) for rank in range(4)}, expected_of({EMBED: (9, 4)}), {}).tensors
    assert [(p.rank, p.offset, p.shape) for p in plans[0].pieces] == [(0, (0, 0), (5, 4)), (1, (5, 0), (4, 4))]


def test_plan_tensors_missing_key_is_named():
    ranks = fsdp2_ranks({EMBED: (10, 4)}, 2)
    with pytest.raises(ExportError, match=f"'{NORM}'"):
        plan_tensors(ranks, expected_of({EMBED: (10, 4), NORM: (4,)}), {})


def test_plan_tensors_missing_key_hints_at_base_weights_only_for_adapters_alone():
    expected = expected_of({EMBED: (10, 4), NORM: (4,), "model.q.weight": (4, 4)})
    plain = fsdp2_ranks({EMBED: (10, 4)}, 1)
    with pytest.raises(ExportError, match=f"no tensor '{NORM}' that the config's model needs \\(and 1 more\\)$"):
        plan_tensors(plain, expected, {})
    adapters = fsdp2_ranks({"base_model.model.model.q.lora_A.default.weight": (2, 4), "base_model.model.model.q.lora_B.default.weight": (4, 2)}, 1)
    with pytest.raises(ExportError, match="; for a LoRA-only checkpoint pass --base-model$"):
        plan_tensors(adapters, expected, {})


def test_plan_tensors_unexpected_key_is_named_by_its_source_key():
    ranks = fsdp2_ranks({EMBED: (10, 4), "_fsdp_wrapped_module.extra.bias": (3,)}, 2)
    with pytest.raises(ExportError, match=r"'_fsdp_wrapped_module\.extra\.bias'"):
        plan_tensors(ranks, expected_of({EMBED: (10, 4)}), {})


def test_plan_tensors_rank_files_with_different_keys():
    ranks = fsdp2_ranks({EMBED: (10, 4), NORM: (4,)}, 3)
    del ranks[2][NORM]
    with pytest.raises(ExportError, match=f"disagree.*'{NORM}'") as raised:
        plan_tensors(ranks, expected_of({EMBED: (10, 4), NORM: (4,)}), {})
    assert "rank 0" in str(raised.value)


def test_plan_tensors_two_keys_normalizing_to_one_name():
    ranks = fsdp2_ranks({NORM: (4,), "module." + NORM: (4,)}, 2)
    with pytest.raises(ExportError, match="both name"):
        plan_tensors(ranks, expected_of({NORM: (4,)}), {})


def test_plan_tensors_plain_shards_that_do_not_add_up():
    ranks = {rank: {EMBED: ShardInfo(local_shape=(4, 4), dtype="float32")} for rank in range(3)}
    with pytest.raises(ExportError, match=f"'{EMBED}'.*do not add up.*10, 4"):
        plan_tensors(ranks, expected_of({EMBED: (10, 4)}), {})


def test_plan_tensors_plain_shards_with_wrong_trailing_dims():
    ranks = {0: {EMBED: ShardInfo((5, 4), "float32")}, 1: {EMBED: ShardInfo((5, 3), "float32")}}
    with pytest.raises(ExportError, match="do not add up"):
        plan_tensors(ranks, expected_of({EMBED: (10, 4)}), {})


def test_plan_tensors_global_shape_differs_from_config():
    ranks = fsdp2_ranks({EMBED: (12, 4)}, 2)
    with pytest.raises(ExportError, match=r"global shape \[12, 4\].*expects \[10, 4\]"):
        plan_tensors(ranks, expected_of({EMBED: (10, 4)}), {})


def test_plan_tensors_local_shape_contradicting_placement():
    ranks = fsdp2_ranks({EMBED: (10, 4)}, 2)
    ranks[1][EMBED] = ShardInfo(
        local_shape=(4, 4), dtype="float32", global_shape=(10, 4), placements=("S0",),
        mesh_shape=(2,), mesh_ranks=(0, 1), coordinate=(1,),
    )
    with pytest.raises(ExportError, match="rank 1"):
        plan_tensors(ranks, expected_of({EMBED: (10, 4)}), {})


def test_plan_tensors_dtypes_differ_across_ranks():
    ranks = fsdp2_ranks({NORM: (4,)}, 2)
    ranks[1] = fsdp2_ranks({NORM: (4,)}, 2, {NORM: "bfloat16"})[1]
    with pytest.raises(ExportError, match="different dtypes"):
        plan_tensors(ranks, expected_of({NORM: (4,)}), {})


def test_plan_tensors_dtensor_in_some_ranks_plain_in_others():
    ranks = fsdp2_ranks({NORM: (4,)}, 2)
    ranks[1][NORM] = ShardInfo(local_shape=(2,), dtype="float32")
    with pytest.raises(ExportError, match="DTensor in some"):
        plan_tensors(ranks, expected_of({NORM: (4,)}), {})


def test_plan_tensors_output_dtypes():
    dtypes = {EMBED: "float32", "model.position_ids": "int64", "model.mask": "bool"}
    shapes = {EMBED: (10, 4), "model.position_ids": (6,), "model.mask": (6,)}
    ranks = fsdp2_ranks(shapes, 2, dtypes)
    plans = plan_tensors(ranks, expected_of(shapes, dtypes), {}, "bfloat16").tensors
    assert {plan.name: (plan.source_dtype, plan.dtype) for plan in plans} == {
        EMBED: ("float32", "bfloat16"),
        "model.position_ids": ("int64", "int64"),
        "model.mask": ("bool", "bool"),
    }
    assert {plan.name: plan.nbytes for plan in plans}[EMBED] == 10 * 4 * 2



# --- output_dtype ---------------------------------------------------------------------------


@pytest.mark.parametrize("saved,written", [("float32", "float32"), ("bfloat16", "bfloat16")])
def test_a_tensor_the_model_loads_in_float32_is_not_narrowed(saved, written):
    """DeepSeek-V3's router: transformers loads it in float32 whatever the checkpoint's dtype, so a
    float32 one stays float32 in a bfloat16 export (and a bfloat16 one is not widened)."""
    shapes, dtypes = {EMBED: (10, 4), NORM: (4,)}, {EMBED: "float32", NORM: saved}
    planning = plan_tensors(fsdp2_ranks(shapes, 2, dtypes), expected_of(shapes, dtypes), {}, "bfloat16",
                            float32_names=frozenset({NORM}))
    assert {plan.name: plan.dtype for plan in planning.tensors} == {EMBED: "bfloat16", NORM: written}
    assert planning.kept_float32 == ({NORM} if saved == "float32" else set())


@pytest.mark.parametrize("source", ["int64", "int32", "int8", "uint8", "bool"])
@pytest.mark.parametrize("requested", [None, "bfloat16", "float32"])
def test_output_dtype_never_casts_integers_or_bools(source, requested):
    assert output_dtype(source, requested) == source


def test_output_dtype_casts_floating_tensors_or_keeps_their_own():
    assert output_dtype("float32", "bfloat16") == "bfloat16"
    assert output_dtype("bfloat16", "float32") == "float32"
    assert output_dtype("float16", None) == "float16"


def test_choose_dtype_publishes_a_float32_training_config_in_bfloat16():
    dtype, reason = choose_dtype("auto", "float32")
    assert dtype == "bfloat16" and "says float32" in reason and "--dtype float32" in reason
    assert choose_dtype("auto", None)[0] == "bfloat16"
    assert choose_dtype("auto", "float16") == ("float16", "config.json's dtype float16")
    assert choose_dtype("auto", "bfloat16")[0] == "bfloat16"
    assert choose_dtype("float32", "float32") == ("float32", "--dtype float32")


def test_output_dtype_rejects_what_safetensors_cannot_hold():
    with pytest.raises(ExportError, match="complex64"):
        output_dtype("complex64", None)
