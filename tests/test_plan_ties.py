"""rayexport.plan.ties: tie aliases by Parameter identity on real (tiny) transformers models, and
how a checkpoint's names are resolved against them (BRIEF 1.1, 1.3)."""

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from rayexport.common.errors import ExportError
from rayexport.plan.ties import check_tied_values, find_tie_aliases, resolve_tied_names
from support.models import tiny_config

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def meta_model(kind):
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(tiny_config(kind))


def raise_on_tie():
    raise RuntimeError("remote code cannot tie")


def test_tied_model_maps_head_to_embedding():
    model = meta_model("qwen2-tied")
    assert find_tie_aliases(model) == {HEAD: EMBED}


def test_untied_model_has_no_aliases():
    """The untied Llama still declares `_tied_weights_keys`; the declaration alone is not a tie."""
    model = meta_model("llama-untied")
    assert isinstance(model._tied_weights_keys, dict) and HEAD in model._tied_weights_keys
    assert find_tie_aliases(model) == {}


def test_untied_model_with_equal_values_has_no_aliases():
    model = AutoModelForCausalLM.from_config(tiny_config("llama-untied", num_hidden_layers=1))
    with torch.no_grad():
        model.lm_head.weight.copy_(model.model.embed_tokens.weight)
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    assert find_tie_aliases(model) == {}


def test_tie_weights_is_called_before_looking_at_identity():
    """A tied model whose head was replaced by a separate Parameter is re-tied first."""
    model = meta_model("qwen2-tied")
    model.lm_head.weight = torch.nn.Parameter(torch.empty(model.lm_head.weight.shape, device="meta"))
    assert find_tie_aliases(model) == {HEAD: EMBED}
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_tie_weights_raising_still_returns_identity_ties(caplog):
    model = meta_model("qwen2-tied")
    model.tie_weights = raise_on_tie
    with caplog.at_level(logging.WARNING, logger="rayexport.plan.ties"):
        assert find_tie_aliases(model) == {HEAD: EMBED}
    assert "remote code cannot tie" in caplog.text


def test_tie_weights_raising_falls_back_to_the_declared_ties():
    """A tied config whose tie_weights() fails leaves two Parameters in memory; transformers
    will still tie them on reload, so the declared map decides (and values get compared)."""
    model = meta_model("qwen2-tied")
    model.lm_head.weight = torch.nn.Parameter(torch.empty(model.lm_head.weight.shape, device="meta"))
    model.tie_weights = raise_on_tie
    assert find_tie_aliases(model) == {HEAD: EMBED}


def test_declared_source_is_canonical_whatever_the_registration_order():
    """A model that registers its head before its embedding still keeps the embedding's name."""
    model = meta_model("qwen2-tied")
    model.all_tied_weights_keys = {EMBED: HEAD}
    assert find_tie_aliases(model) == {EMBED: HEAD}


def test_encoder_decoder_ties_form_one_group():
    from transformers import AutoModelForSeq2SeqLM, T5Config

    config = T5Config(vocab_size=64, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2, tie_word_embeddings=True)
    with torch.device("meta"):
        model = AutoModelForSeq2SeqLM.from_config(config)
    assert find_tie_aliases(model) == {
        "encoder.embed_tokens.weight": "shared.weight",
        "decoder.embed_tokens.weight": "shared.weight",
        "lm_head.weight": "shared.weight",
    }


def test_plain_module_sharing_a_parameter():
    """No transformers, no tie_weights(): identity alone decides; the first name is canonical."""
    model = torch.nn.ModuleDict({"b": torch.nn.Linear(2, 2), "a": torch.nn.Linear(2, 2)})
    model["a"].weight = model["b"].weight
    assert find_tie_aliases(model) == {"a.weight": "b.weight"}


def test_resolve_both_present_drops_alias_and_compares():
    resolution = resolve_tied_names([EMBED, "model.norm.weight", HEAD], {HEAD: EMBED})
    assert resolution.sources == {EMBED: EMBED, "model.norm.weight": "model.norm.weight"}
    assert resolution.dropped == [HEAD]
    assert resolution.to_compare == [(EMBED, HEAD)]
    assert resolution.promoted == {}


def test_resolve_only_alias_present_promotes_it():
    resolution = resolve_tied_names([HEAD, "model.norm.weight"], {HEAD: EMBED})
    assert resolution.sources == {EMBED: HEAD, "model.norm.weight": "model.norm.weight"}
    assert resolution.promoted == {HEAD: EMBED}
    assert resolution.dropped == [] and resolution.to_compare == []


def test_resolve_only_canonical_present_needs_no_alias():
    """BRIEF 1.3: a tied checkpoint that holds only the embedding must not raise KeyError."""
    resolution = resolve_tied_names([EMBED, "model.norm.weight"], {HEAD: EMBED})
    assert resolution.sources == {EMBED: EMBED, "model.norm.weight": "model.norm.weight"}
    assert HEAD not in resolution.sources
    assert resolution.dropped == [] and resolution.promoted == {} and resolution.to_compare == []


SHARED, ENCODER, DECODER = "shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight"
T5_TIES = {ENCODER: SHARED, DECODER: SHARED}


def test_resolve_two_aliases_without_their_canonical_keeps_one_and_compares_the_other():
    """A three-name tie group (T5) saved without the canonical: the first alias is promoted,
    the second is dropped only after its values are compared with it."""
    resolution = resolve_tied_names([ENCODER, "lm_head.weight", DECODER], T5_TIES)
    assert resolution.sources == {SHARED: ENCODER, "lm_head.weight": "lm_head.weight"}
    assert resolution.promoted == {ENCODER: SHARED}
    assert resolution.dropped == [DECODER]
    assert resolution.to_compare == [(ENCODER, DECODER)]


def test_resolve_all_three_names_compares_both_aliases_with_the_canonical():
    resolution = resolve_tied_names([DECODER, SHARED, ENCODER], T5_TIES)
    assert resolution.sources == {SHARED: SHARED}
    assert sorted(resolution.to_compare) == [(SHARED, DECODER), (SHARED, ENCODER)]


def test_resolve_without_aliases_is_identity():
    resolution = resolve_tied_names([EMBED, HEAD], {})
    assert resolution.sources == {EMBED: EMBED, HEAD: HEAD}
    assert resolution.dropped == [] and resolution.promoted == {}


def test_check_tied_values_passes_at_zero():
    check_tied_values({(EMBED, HEAD): 0.0})
    check_tied_values({})


def test_check_tied_values_rejects_a_difference():
    with pytest.raises(ExportError) as raised:
        check_tied_values({("a.weight", "b.weight"): 0.0, (EMBED, HEAD): 0.25})
    message = str(raised.value)
    assert EMBED in message and HEAD in message and "0.25" in message
    assert "a.weight" not in message


def test_check_tied_values_rejects_nan_and_infinite_differences():
    for difference in (float("nan"), float("inf")):
        with pytest.raises(ExportError):
            check_tied_values({(EMBED, HEAD): difference})
