"""rayexport.layouts.deepspeed: which tag folder a DeepSpeed save folder's export reads, and the
one line for a folder that names none. Files are made by hand: only their names matter here;
tests/test_deepspeed.py reads DeepSpeed's own saves."""

import pytest
from support.helpers import folder_with

from rayexport.common.errors import ExportError
from rayexport.layouts.deepspeed import read_checkpoint, tag_folder


def test_the_tag_is_the_one_latest_names_or_tag_says_or_the_folder_itself(tmp_path):
    save = folder_with(tmp_path / "checkpoint-4", {
        "latest": b"global_step4\n", "global_step4/mp_rank_00_model_states.pt": b"x", "global_step2/mp_rank_00_model_states.pt": b"x",
    })
    assert tag_folder(save, None)[0].uri.endswith("global_step4")
    assert tag_folder(save, "global_step2")[0].uri.endswith("global_step2")
    folder, beside = tag_folder(save.child("global_step2"), None)
    assert folder.uri.endswith("global_step2") and beside.uri == save.uri


@pytest.mark.parametrize("files,tag,message", [
    ({"latest": b"global_step9"}, None, "save/latest' names tag 'global_step9', but '.*global_step9/' holds no files"),
    ({"latest": b"global_step9"}, "global_step3", "--tag names tag 'global_step3'"),
    ({"global_step4/x": b"x"}, None, "no 'latest' file naming its tag and no model states .tag folders there: global_step4; pass --tag"),
])
def test_a_tag_with_no_folder_is_one_line(tmp_path, files, tag, message):
    with pytest.raises(ExportError, match=message):
        tag_folder(folder_with(tmp_path / "save", files), tag)


def test_a_pipeline_parallel_save_is_refused_by_its_file(tmp_path):
    folder = folder_with(tmp_path / "global_step2", {"layer_01-model_00-model_states.pt": b"x", "mp_rank_00_model_states.pt": b"x"})
    with pytest.raises(ExportError, match="layer_01-model_00-model_states.pt' is a pipeline or tensor parallel DeepSpeed save"):
        read_checkpoint(folder, folder)


def test_16_bit_weights_that_are_views_of_one_flat_buffer_are_read_each_from_its_offset(tmp_path):
    """ZeRO-1/2's model states save each 16-bit weight as a view of one flat buffer: one storage,
    a different offset each."""
    import torch

    from rayexport.layouts.deepspeed import MODEL_STATES_RANK
    from rayexport.storage.store import Store

    flat = torch.arange(10, dtype=torch.float16)
    weights = {"a.weight": flat[:6].view(2, 3), "b.weight": flat[6:]}
    (tmp_path / "global_step2").mkdir()
    torch.save({"module": weights, "param_shapes": [{name: weight.shape for name, weight in weights.items()}],
                "dp_world_size": 1, "buffer_names": []}, tmp_path / "global_step2" / "mp_rank_00_model_states.pt")
    folder = Store(str(tmp_path / "global_step2"))
    checkpoint = read_checkpoint(folder, Store(str(tmp_path)))
    assert checkpoint.layout == "deepspeed-16bit"
    read = checkpoint.read([MODEL_STATES_RANK], str(tmp_path), lambda count: None)[MODEL_STATES_RANK]
    for name, weight in weights.items():
        assert torch.equal(read.tensors[name], weight), name
