"""Reload an export with transformers, in a process of its own.

Run as `python -m rayexport.reload_check DIR [--trust-remote-code] [--keys-only] [--tied CANONICAL=ALIAS ...]`
by the verification step, with storage credentials removed from its environment and an empty
module cache, because remote code executes on import. Loads the tokenizer too, when the export
carries one. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
from typing import Any

import torch

from rayexport.dtypes import dtype_name
from rayexport.errors import one_line
from rayexport.lora import ADAPTER_DIR, ADAPTER_WEIGHTS
from rayexport.verification import ExpectedExport, VerificationError

# Variables that carry storage credentials; never passed to the process that imports remote code.
SECRET_ENV = re.compile(r"^(AWS_|GOOGLE_|AZURE_|GCS_|S3_|HF_TOKEN|HUGGING_FACE_HUB_TOKEN)")
PROMPT_IDS = [1, 2, 3, 4, 5, 6, 7, 8]
# Files whose presence means the export carries a tokenizer for AutoTokenizer to load.
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model")


def auto_dtype() -> dict[str, str]:
    """from_pretrained's argument that loads the weights in the dtype config.json states:
    `dtype` from transformers 4.56, `torch_dtype` before it (which keeps an unknown `dtype` in
    the config without a word and loads float32)."""
    import transformers
    from packaging.version import Version

    return {"dtype": "auto"} if Version(transformers.__version__).release >= (4, 56) else {"torch_dtype": "auto"}


def load_tokenizer(path: str, trust_remote_code: bool) -> dict:
    """AutoTokenizer loads the export's tokenizer, when it carries one: `tokenizer` (the class
    loaded) or `tokenizer_error` (one line naming the file and class). The class that
    tokenizer_config.json declares must exist in the installed transformers, which from version
    5 would otherwise load a stand-in class without a word."""
    present = [name for name in TOKENIZER_FILES if os.path.exists(os.path.join(path, name))]
    if not present:
        return {}
    from transformers import AutoTokenizer, __version__
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    settings = {}
    if "tokenizer_config.json" in present:
        try:
            with open(os.path.join(path, "tokenizer_config.json")) as handle:
                settings = json.load(handle)
        except ValueError as error:
            return {"tokenizer_error": f"tokenizer_config.json is not valid JSON: {one_line(error)}"}
    declared = settings.get("tokenizer_class")
    where = f"tokenizer_config.json's tokenizer_class '{declared}'" if declared else ", ".join(present)
    if declared and "auto_map" not in settings and not (
        tokenizer_class_from_name(declared) or tokenizer_class_from_name(declared + "Fast")
    ):
        return {"tokenizer_error": f"{where} is not a tokenizer class of transformers {__version__}"}
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as error:  # noqa: BLE001 - tokenizer code raises anything
        return {"tokenizer_error": f"AutoTokenizer cannot load {where}: {type(error).__name__}: {one_line(error)}"}
    return {"tokenizer": type(tokenizer).__name__}


def compare_keys(path: str, trust_remote_code: bool, tied: list[tuple[str, str]], export_format: str) -> dict:
    """Without loading weights: the export's tensor names and shapes against the model built
    from its config on the meta device, in `export_format` as transformers' conversion rules
    give it (for exports too large to load in the check). `tied` are in-memory names."""
    from safetensors import safe_open
    from transformers import AutoConfig

    from rayexport.conversion import model_formats
    from rayexport.model import expected_tensors, model_class
    from rayexport.verification import shard_names

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = model_class(config).build(config, trust_remote_code)
    formats = model_formats(model, expected_tensors(model), {alias: canonical for canonical, alias in tied})
    naming = formats.naming(export_format)
    wanted = {name: tuple(shape) for name, (shape, _) in naming.expected.items() if name not in naming.aliases}
    found = {}
    for name in shard_names(path):
        with safe_open(f"{path}/{name}", framework="pt") as handle:
            found.update({key: tuple(handle.get_slice(key).get_shape()) for key in handle.keys()})
    return {
        "class": type(model).__name__,
        "missing_keys": sorted(set(wanted) - set(found)),
        "unexpected_keys": sorted(set(found) - set(wanted)),
        "mismatched_keys": sorted(key for key in set(wanted) & set(found) if wanted[key] != found[key]),
        "untied": [],
        "logits_finite": None,
    }


def reload_and_probe(path: str, trust_remote_code: bool, tied: list[tuple[str, str]], adapter: str | None) -> dict:
    """Load the export, report the dtype it loaded in, missing/unexpected keys, tie sharing, a
    forward pass, and which adapter tensors peft failed to load."""
    from transformers import AutoConfig

    from rayexport.model import model_class

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    model, info = model_class(config).load(path, trust_remote_code, output_loading_info=True, **auto_dtype())
    parameters = dict(model.named_parameters(remove_duplicate=False))
    result = {
        "class": type(model).__name__,
        "dtype": dtype_name(model.dtype),
        "missing_keys": sorted(info.get("missing_keys", [])),
        "unexpected_keys": sorted(info.get("unexpected_keys", [])),
        "mismatched_keys": sorted(str(item) for item in info.get("mismatched_keys", [])),
        "untied": [
            f"{canonical}={alias}"
            for canonical, alias in tied
            if canonical not in parameters
            or alias not in parameters
            or parameters[canonical].data_ptr() != parameters[alias].data_ptr()
        ],
    }
    vocab = getattr(config, "vocab_size", None) or max(PROMPT_IDS) + 1
    input_ids = torch.tensor([[token % vocab for token in PROMPT_IDS]])
    inputs = {"input_ids": input_ids}
    if getattr(config, "is_encoder_decoder", False):
        inputs["decoder_input_ids"] = input_ids
    with torch.no_grad():
        output = model(**inputs)
    logits = getattr(output, "logits", None)
    result["logits_finite"] = bool(torch.isfinite(logits).all()) if logits is not None else None
    if adapter:
        result["adapter_missing"] = _adapter_missing(model, adapter)
    return result


def _adapter_missing(model: torch.nn.Module, adapter: str) -> list[str]:
    """Adapter tensors in the adapter file that the PeftModel does not hold with equal values."""
    from peft import PeftModel
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    loaded = get_peft_model_state_dict(PeftModel.from_pretrained(model, adapter))
    saved = load_file(os.path.join(adapter, os.path.basename(ADAPTER_WEIGHTS)))
    return sorted(
        name for name, tensor in saved.items()
        if name not in loaded or not torch.equal(loaded[name].to(tensor.dtype), tensor)
    )


def check_reload(local_dir: str, expected: ExpectedExport, timeout_s: float) -> dict[str, Any]:
    """transformers loads the export in a clean process: no missing or unexpected keys, tied
    tensors share memory, a forward pass gives finite logits, peft loads the adapter and
    AutoTokenizer the tokenizer. With `quick`, only the keys and shapes are compared with the
    model built on the meta device (the tokenizer still loads)."""
    env = {key: value for key, value in os.environ.items() if not SECRET_ENV.match(key)}
    with tempfile.TemporaryDirectory(prefix="rayexport-modules-") as modules:
        env.update(HF_MODULES_CACHE=modules, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        command = [sys.executable, "-m", "rayexport.reload_check", local_dir]
        command += ["--trust-remote-code"] if expected.trust_remote_code else []
        command += ["--keys-only", "--format", expected.format] if expected.level == "quick" else []
        for canonical, alias in expected.tied:
            command += ["--tied", f"{canonical}={alias}"]
        command += ["--adapter", os.path.join(local_dir, ADAPTER_DIR)] if expected.adapter and expected.level != "quick" else []
        try:
            completed = subprocess.run(
                command, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=modules
            )
        except subprocess.TimeoutExpired:
            raise VerificationError(f"reload: transformers did not load the export in {timeout_s:.0f} s") from None
    if completed.returncode != 0:
        lines = [line for line in completed.stderr.strip().splitlines() if line.strip()]
        raise VerificationError(f"reload: transformers cannot load the export: {lines[-1] if lines else 'no output'}")
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    for field_name in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        if result[field_name]:
            raise VerificationError(f"reload: {field_name.replace('_', ' ')} {result[field_name][:3]}")
    if result["untied"]:
        raise VerificationError(f"reload: tied tensors do not share memory: {result['untied'][0]}")
    if result["logits_finite"] is False and expected.source_finite:
        raise VerificationError("reload: the forward pass gives non-finite logits")
    if result.get("adapter_missing"):
        raise VerificationError(f"reload: peft did not load adapter tensor '{result['adapter_missing'][0]}'")
    if result.get("tokenizer_error"):
        raise VerificationError(f"reload: {result['tokenizer_error']}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rayexport.reload_check")
    parser.add_argument("path")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--tied", action="append", default=[], metavar="CANONICAL=ALIAS")
    parser.add_argument("--adapter", help="a LoRA adapter folder to load onto the model with peft")
    parser.add_argument("--keys-only", action="store_true", help="compare names and shapes; load nothing")
    parser.add_argument("--format", default="on-disk", choices=["on-disk", "in-memory"], help="the format --keys-only expects")
    args = parser.parse_args(argv)
    tied = [tuple(item.split("=", 1)) for item in args.tied]
    if args.keys_only:
        result = compare_keys(args.path, args.trust_remote_code, tied, args.format)
    else:
        result = reload_and_probe(args.path, args.trust_remote_code, tied, args.adapter)
    result.update(load_tokenizer(args.path, args.trust_remote_code))
    result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux counts KiB
    json.dump(result, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
