"""The vLLM check: `vllm_child.py` run by the Python that has vLLM, on the export's local folder,
without storage credentials; its findings judged by `comparison.compare_sequences`."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from rayexport.storage.store import Store
from rayexport.verification import VerificationError
from rayexport.verification.consumer_check import ConsumerCheck
from rayexport.verification.expected import ExpectedExport
from rayexport.verification.reload.parent import stage_export, without_credentials
from rayexport.verification.serving import VLLM
from rayexport.verification.serving.comparison import GENERATED_TOKENS, compare_sequences, fixed_prompts, model_length

CHILD_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_child.py")
# vLLM's own message for a weight its loader found no tensor for (raised for some weights only:
# vLLM 0.32 leaves a missing linear layer's weight uninitialised without a word).
NOT_LOADED = "Following weights were not initialized from checkpoint:"


class VllmServe(ConsumerCheck):
    """vLLM builds the model from the export as written and generates greedily from fixed
    token-id prompts; transformers, on the same folder, must rank each generated token first on
    its prefix and give it the same logprob, within the tolerance of the dtype vLLM ran in."""

    name = VLLM

    def runs_for(self, expected: ExpectedExport) -> bool:
        """When the user asked for it (`--serve-check vllm`), at any level that verifies."""
        return expected.serve is not None and expected.serve.engine == VLLM

    def gpus(self, expected: ExpectedExport) -> float:
        """The GPUs the user gave the check (one by default), where the cluster has them."""
        return expected.serve.gpus

    def run(
        self, destination: Store, expected: ExpectedExport, timeout_s: float, memory_bound_bytes: int, prepared: Any = None,
    ) -> dict[str, Any]:
        """The check's numbers: the engine and its version, the device and dtype it ran in, the
        prompts and tokens compared, the largest differences, and its seconds and peak memory
        (vLLM's engine and transformers' model, one after the other: outside the export's memory
        bound, which a user asking for this check accepts)."""
        python = expected.serve.python or sys.executable
        if not os.path.exists(python):
            raise VerificationError(f"vllm: the Python '{python}' named to run the check does not exist")
        started = time.perf_counter()
        scratch = tempfile.mkdtemp(prefix="rayexport-vllm-")
        try:
            folder = stage_export(destination, set(), os.path.join(scratch, "export"))  # every file: the engine reads a folder
            outcome = run_child(python, folder, scratch, expected.trust_remote_code, timeout_s)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        if "error" in outcome:
            raise VerificationError(refusal(outcome["error"], python))
        found = outcome["result"]
        compared = compare_sequences(found.pop("sequences"), found["dtype"])
        return {**found, **compared, "seconds": round(time.perf_counter() - started, 3)}


def run_child(python: str, folder: str, scratch: str, trust_remote_code: bool, timeout_s: float) -> dict[str, Any]:
    """Run `vllm_child.py` with `python` on `folder`: its outcome ({"result": ...} or
    {"error": ...}); what it printed goes to a log in `scratch`, whose last line names a crash.
    Isolated (`-I`): the check's Python sees its own packages only, not PYTHONPATH or the
    script's folder."""
    with open(os.path.join(folder, "config.json")) as handle:
        config = json.load(handle)
    text = config.get("text_config", config)
    vocab_size = config.get("vocab_size") or text.get("vocab_size")
    # the dtype the export was written in: vLLM's `auto` would run a float32 export in bfloat16
    dtype = config.get("dtype") or config.get("torch_dtype") or text.get("dtype") or "auto"
    prompts = fixed_prompts(vocab_size)
    result_file, request_file = os.path.join(scratch, "result.json"), os.path.join(scratch, "request.json")
    with open(request_file, "w") as handle:
        json.dump({
            "folder": folder, "prompts": prompts, "tokens": GENERATED_TOKENS, "max_model_len": model_length(prompts), "dtype": dtype,
            "trust_remote_code": trust_remote_code, "result_file": result_file,
        }, handle)
    modules = os.path.join(scratch, "modules")
    os.mkdir(modules)
    env = without_credentials(os.environ)
    env.update(HF_MODULES_CACHE=modules, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    with open(os.path.join(scratch, "child.log"), "w+") as log:
        try:
            subprocess.run([python, "-I", CHILD_SCRIPT, request_file], env=env, cwd=modules, stdout=log, stderr=log, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return {"error": {"stage": "timeout", "message": f"no result in {timeout_s:.0f} s"}}
        if os.path.exists(result_file):
            with open(result_file) as handle:
                return json.load(handle)
        log.seek(0)
        lines = [line.strip() for line in log.read().splitlines() if line.strip()]
    return {"error": {"stage": "crash", "message": lines[-1] if lines else "no output"}}


def refusal(error: dict[str, str], python: str) -> str:
    """The one line for a check that could not run, or an engine that could not build the model."""
    stage, message = error["stage"], error["message"]
    if stage == "import":
        if "No module named 'vllm'" in message:
            return f"vllm: no vLLM in {python} ({message}); name a Python that has it with --vllm-python"
        return f"vllm: vLLM does not import in {python}: {message}"
    if stage == "load" and NOT_LOADED in message:
        names = sorted(re.findall(r"'([^']+)'", message.split(NOT_LOADED, 1)[1]))
        more = f" (and {len(names) - 1} more)" if len(names) > 1 else ""
        return f"vllm: vLLM {error['version']} found no tensor in the export for its weight '{names[0]}'{more}"
    if stage == "load":
        return f"vllm: vLLM {error['version']} cannot build the model from the export: {message}"
    if stage == "generate":
        return f"vllm: vLLM {error['version']} cannot run the export's model: {message}"
    if stage == "score":
        return f"vllm: transformers (in {python}) cannot load the export to compare: {message}"
    return f"vllm: the check's process in {python} failed: {message}"
