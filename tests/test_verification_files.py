"""The file checks' reads: source pieces of any shape are checked as the file streams by."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file


@pytest.mark.parametrize("corrupt", [False, True])
def test_pieces_cut_along_columns_are_checked_across_row_blocks(tmp_path, monkeypatch, corrupt):
    """A source piece that is a block of columns (tensor parallel, a converted tensor) is not one
    byte range: its rows' parts are gathered from each block of rows as the file streams by."""
    tensor = torch.arange(7 * 6, dtype=torch.float32).reshape(7, 6)
    regions = {"left": (0, 0, 7, 2), "right-low": (3, 2, 4, 4), "right-high": (0, 2, 3, 4)}
    pieces = [
        ({"offset": [row, col], "shape": [rows, cols], "rank": index, "source_key": name}, tensor[row:row + rows, col:col + cols])
        for index, (name, (row, col, rows, cols)) in enumerate(regions.items())
    ]
    # with `corrupt`, one element of the right-low piece, in a row block the other pieces also cut
    problems = checked_in_row_blocks(tmp_path, monkeypatch, tensor, pieces, 4 * 6 + 3 if corrupt else None)
    assert problems == (["fidelity: tensor 'w' at offset [3, 2] differs from rank 1's 'right-low'"] if corrupt else [])


def checked_in_row_blocks(tmp_path, monkeypatch, tensor, pieces, corrupt_element) -> list[str]:
    """The file check's problems for a file holding `tensor` as "w", read two rows at a time,
    whose source `pieces` are (record, values) pairs; `corrupt_element`: one element changed."""
    from rayexport.common.digests import FAST, digest_of
    from rayexport.storage.store import Store
    from rayexport.transport.writer import tensor_bytes
    from rayexport.verification import files
    from rayexport.verification.expected import ExpectedExport

    save_file({"w": tensor}, str(tmp_path / "model.safetensors"))
    data = bytearray((tmp_path / "model.safetensors").read_bytes())
    if corrupt_element is not None:
        data[len(data) - tensor.nbytes + corrupt_element * 4] ^= 0x40
        (tmp_path / "model.safetensors").write_bytes(bytes(data))
    records = [dict(record, **{FAST: digest_of(tensor_bytes(values))}) for record, values in pieces]
    expected = ExpectedExport(
        files={"model.safetensors": {"size": len(data), FAST: digest_of(data)}},
        tensors={"w": {"dtype": "float32", "shape": list(tensor.shape), FAST: digest_of(data[-tensor.nbytes:])}},
        pieces={"w": records},
    )
    monkeypatch.setattr(files, "READ_BLOCK", 2 * tensor.shape[1] * 4)  # two rows per read
    [check] = files.check_files(Store(str(tmp_path)), ["model.safetensors"], expected)
    assert check.pieces_checked == len(pieces)
    return check.problems


@pytest.mark.parametrize("algorithm", ["xxh3_128", "sha256"])
@pytest.mark.parametrize("written_together", [False, True])
def test_a_changed_tensor_is_named_whether_or_not_the_files_digest_stands_for_it(tmp_path, written_together, algorithm):
    """In the export's own verification (`written_together`: the writer took the file's and its
    tensors' digests over the same bytes) a matching file digest stands for its tensors' digests;
    a file changed since it was written still names the file, the tensor and its source piece.
    Records of either hash are checked with it: the fast digest, or SHA-256 in a manifest
    written before the fast digest was recorded."""
    import torch

    from rayexport.common.digests import digest_of

    from rayexport.storage.store import Store
    from rayexport.verification import files
    from rayexport.verification.expected import ExpectedExport
    from rayexport.transport.writer import tensor_bytes

    tensors = {"a": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(2, 4)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    data = (tmp_path / "model.safetensors").read_bytes()
    offset = len(data) - tensors["a"].nbytes - tensors["b"].nbytes  # "a" is first in the file
    expected = ExpectedExport(
        files={"model.safetensors": {"size": len(data), algorithm: digest_of(data, algorithm)}},
        tensors={
            key: {"dtype": "float32", "shape": list(value.shape), algorithm: digest_of(tensor_bytes(value), algorithm)}
            for key, value in tensors.items()
        },
        pieces={key: [{"offset": [0, 0], "shape": list(value.shape), "rank": 0, "source_key": key,
                       algorithm: digest_of(tensor_bytes(value), algorithm)}] for key, value in tensors.items()},
        written_together=written_together, digest=algorithm,
    )
    store = Store(str(tmp_path))
    [intact] = files.check_files(store, ["model.safetensors"], expected)
    assert intact.problems == [] and intact.digests_checked == 2
    changed = bytearray(data)
    changed[offset + 5] ^= 0x01
    (tmp_path / "model.safetensors").write_bytes(bytes(changed))
    [check] = files.check_files(store, ["model.safetensors"], expected)
    assert check.problems == [
        f"integrity: file model.safetensors does not match its recorded {algorithm} digest",
        "integrity: tensor 'a' does not match its recorded digest",
        "fidelity: tensor 'a' at offset [0, 0] differs from rank 0's 'a'",
    ]


@pytest.mark.parametrize("corrupt", [False, True])
def test_runs_of_a_flattened_tensor_are_checked_as_byte_ranges(tmp_path, monkeypatch, corrupt):
    """A ZeRO partition is a run of the flattened tensor, cutting through rows: each is checked as
    its bytes, across the row blocks the file is read in."""
    tensor = torch.arange(7 * 6, dtype=torch.float32).reshape(7, 6)
    runs = [(0, 11), (11, 11), (22, 11), (33, 9)]
    pieces = [({"offset": [start], "shape": [length], "rank": rank, "source_key": "w"}, tensor.view(-1)[start:start + length])
              for rank, (start, length) in enumerate(runs)]
    # with `corrupt`, element 25, in rank 2's run, in the row block holding rows 4 and 5
    problems = checked_in_row_blocks(tmp_path, monkeypatch, tensor, pieces, 25 if corrupt else None)
    assert problems == (["fidelity: tensor 'w' at offset [22] differs from rank 2's 'w'"] if corrupt else [])
