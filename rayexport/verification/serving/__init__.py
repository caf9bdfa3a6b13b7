"""The serve check: a serving engine (vLLM) builds the model from the export as written and
generates from it, and every token it generates must be transformers' top choice on the same
prefix. It is opt-in (`--serve-check vllm`) and runs after the transformers reload, as the
second of the verification's consumer checks (`vllm_check.VllmServe`).

vLLM pins its own torch and transformers, so the check runs in a process of the Python that has
it (`ServeRequest.python`: the cluster's own by default), without storage credentials, on the
export's local folder (a remote export is staged there first and removed after). That process
runs `vllm_child.py`, which imports nothing from rayexport; `comparison` judges what it found.
"""

from __future__ import annotations

from dataclasses import dataclass

from rayexport.common.errors import ExportError

VLLM = "vllm"
ENGINES = (VLLM,)


@dataclass(frozen=True)
class ServeRequest:
    """The serve check a user asked for: the `engine`, the `python` that runs it (None: the
    Python running the check), and the GPUs asked of Ray for it on a cluster that has some."""

    engine: str = VLLM
    python: str | None = None
    gpus: float = 1.0


def serve_request(engine: str | None, python: str | None, gpus: float = 1.0) -> ServeRequest | None:
    """The serve check `--serve-check ENGINE` asks for (None, or "none": no check), run by
    `--vllm-python PYTHON`; a Python named without the check is refused, as every command does."""
    if engine in (None, "none"):
        if python:
            raise ExportError("--vllm-python names the Python of the vLLM check: add --serve-check vllm")
        return None
    return ServeRequest(engine, python, gpus)
