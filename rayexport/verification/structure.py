"""The structure check: the export's index and shards agree with each other and with what was
recorded, and `conclude`, which puts every writer's file checks together with it."""

from __future__ import annotations

import json
from typing import Any

from huggingface_hub.constants import SAFETENSORS_INDEX_FILE, SAFETENSORS_SINGLE_FILE

from rayexport.common.dtypes import nbytes
from rayexport.storage.store import Store
from rayexport.verification import VerificationError
from rayexport.verification.expected import ExpectedExport
from rayexport.verification.files import FileCheck
from rayexport.verification.reading import SHARD_NAME, is_weights_file

STAGES = ("structure", "integrity", "fidelity")  # the order problems are reported in


def index_shards(store: Store) -> list[str]:
    """The weight files the export's index (or its single file) names, after checking the names."""
    if not store.exists(SAFETENSORS_INDEX_FILE):
        if not store.exists(SAFETENSORS_SINGLE_FILE):
            raise VerificationError(f"structure: neither {SAFETENSORS_INDEX_FILE} nor {SAFETENSORS_SINGLE_FILE} exists")
        return [SAFETENSORS_SINGLE_FILE]
    weight_map = _index(store)["weight_map"]
    names = sorted(set(weight_map.values()))
    for name in names:
        if not isinstance(name, str) or not SHARD_NAME.match(name):
            raise VerificationError(f"structure: index names an invalid shard file {name!r}")
    return names


def _index(store: Store) -> dict[str, Any]:
    try:
        index = json.loads(store.read_bytes(SAFETENSORS_INDEX_FILE))
        if not isinstance(index["weight_map"], dict):
            raise TypeError("weight_map is not an object")
    except (ValueError, KeyError, TypeError) as error:
        raise VerificationError(f"structure: {SAFETENSORS_INDEX_FILE} is not a valid index: {error}") from None
    return index


def check_structure(store: Store, checks: list[FileCheck], expected: ExpectedExport) -> list[str]:
    """The problems of the export's layout, from its index and the headers the file checks
    read: every shard the index names exists, no tensor is in two shards, the index maps each
    tensor to the shard holding it, total_size is right, no stray weight file lies beside the
    shards, and no recorded tensor is missing."""
    by_name = {check.name: check for check in checks}
    names = index_shards(store)
    problems = [
        f"structure: shard {name} named by the index is missing" for name in names if name not in by_name or by_name[name].missing
    ]
    seen: dict[str, str] = {}
    for name in names:
        for key in by_name[name].tensors if name in by_name else ():
            if key in seen:
                problems.append(f"structure: tensor '{key}' is in both {seen[key]} and {name}")
            seen.setdefault(key, name)
    if store.exists(SAFETENSORS_INDEX_FILE):
        index = _index(store)
        weight_map = index["weight_map"]
        if set(weight_map) != set(seen) or any(seen[key] != shard for key, shard in weight_map.items()):
            key = sorted(set(weight_map) ^ set(seen) or weight_map)[0]
            problems.append(f"structure: index and shards disagree about tensor '{key}'")
        total = sum(nbytes(by_name[seen[key]].tensors[key][1], by_name[seen[key]].tensors[key][0]) for key in seen)
        if index.get("metadata", {}).get("total_size") != total:
            problems.append(
                f"structure: index total_size {index.get('metadata', {}).get('total_size')} != {total} bytes of tensors"
            )
    stray = sorted(name for name in store.list() if name.endswith((".safetensors", ".bin", ".pt")) and name not in names)
    problems += [f"structure: stray weight file {name}" for name in stray[:1]]
    held = {key for check in checks for key in check.tensors}
    problems += [f"integrity: tensor '{key}' is missing from the export" for key in sorted(set(expected.tensors) - held)[:1]]
    return problems


def conclude(store: Store, checks: list[FileCheck], expected: ExpectedExport) -> dict[str, Any]:
    """Put the file checks of every writer together with the structure check: raise
    VerificationError with the first problem, structure before integrity before fidelity, else
    return each check's numbers."""
    problems = [problem for check in checks for problem in check.problems] + check_structure(store, checks, expected)
    problems.sort(key=lambda problem: STAGES.index(problem.split(":", 1)[0]))  # stable: a file's own first
    if problems:
        raise VerificationError(problems[0])
    weights = [check for check in checks if is_weights_file(check.name)]
    return {
        "structure": {
            "shards": len(index_shards(store)), "tensors": sum(len(check.tensors) for check in weights),
            "bytes": sum(nbytes(shape, dtype) for check in weights for dtype, shape in check.tensors.values()),
        },
        "files": {"files": len(checks), "bytes_read": sum(check.bytes_read for check in checks)},
        "tensors": {"tensors": sum(len(check.tensors) for check in weights), "digests_checked": sum(check.digests_checked for check in checks)},
        "fidelity": {"pieces_checked": sum(check.pieces_checked for check in checks)},
    }
