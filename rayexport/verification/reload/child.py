"""The reload process: `python -m rayexport.verification.reload.child DIR --tensors TABLE
--mode MODE ...`, started by `parent.check_reload` without storage credentials. It runs one
mode (keys-only and in-memory here, streamed in `streamed`), loads the tokenizer, and sends its
result to the parent over the channel of `protocol`."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from rayexport.common.dtypes import dtype_name
from rayexport.common.errors import one_line
from rayexport.common.process import exit_without_teardown
from rayexport.common.memory import peak_rss_bytes, rss_bytes
from rayexport.plan.formats import FORMATS, ON_DISK, Format
from rayexport.plan.lora import ADAPTER_WEIGHTS
from rayexport.verification.reload.probes import (
    build_skeleton, key_differences, model_formats_of, probe, table_shapes, untied_pairs,
)
from rayexport.verification.reload.protocol import (
    KEYS_ONLY, LOADED_IN_MEMORY, MODES, WAIT_FOR_ARGUMENTS, parent_reader, private_channel, read_arguments, send_result,
)
from rayexport.verification.reload.streamed import MappedFiles, stream_and_probe

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


def compare_keys(path: str, trust_remote_code: bool, tied: list[tuple[str, str]], export_format: Format, found: dict) -> dict:
    """The keys-only mode, without loading weights: the export's tensor names and shapes
    (`found`, from its headers) against the model built from its config on the meta device, in
    `export_format` as transformers' conversion rules give it. `tied` are in-memory names."""
    _, model = build_skeleton(path, trust_remote_code)
    naming = model_formats_of(model, tied).naming(export_format)
    return {"class": type(model).__name__, **key_differences(naming, found), "untied": [], "logits_finite": None}


def reload_and_probe(path: str, trust_remote_code: bool, tied: list[tuple[str, str]], adapter: str | None) -> dict:
    """The in-memory mode: load the export, report the dtype it loaded in, missing/unexpected
    keys, tie sharing, a forward pass, and which adapter tensors peft failed to load."""
    from transformers import AutoConfig

    from rayexport.model.description import model_class

    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    model, info = model_class(config).load(path, trust_remote_code, output_loading_info=True, **auto_dtype())
    result = {
        "class": type(model).__name__,
        "dtype": dtype_name(model.dtype),
        "missing_keys": sorted(info.get("missing_keys", [])),
        "unexpected_keys": sorted(info.get("unexpected_keys", [])),
        "mismatched_keys": sorted(str(item) for item in info.get("mismatched_keys", [])),
        "untied": untied_pairs(model, tied),
        **probe(model, config),
    }
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


def parse_arguments(argv: list[str] | None) -> argparse.Namespace:
    """The reload process's command line (`parent.child_arguments` writes it)."""
    parser = argparse.ArgumentParser(prog="python -m rayexport.verification.reload.child")
    parser.add_argument("path", help="the export's folder (its small files at least)")
    parser.add_argument("--tensors", required=True, help="JSON: each tensor's file, dtype, shape and byte range")
    parser.add_argument("--mode", required=True, choices=MODES)
    parser.add_argument("--format", default=ON_DISK, choices=FORMATS, help="the tensor names the export holds")
    parser.add_argument("--memory-bound", type=int, default=0, help="bytes the streamed reload may hold above start-up")
    parser.add_argument("--from-parent", action="store_true", help="read tensor bytes from the parent, not from PATH")
    parser.add_argument("--trust-remote-code", action="store_true")
    parser.add_argument("--tied", action="append", default=[], metavar="CANONICAL=ALIAS")
    parser.add_argument("--adapter", help="a LoRA adapter folder to load onto the model with peft")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run the reload the command line asks for (with WAIT_FOR_ARGUMENTS: the one the parent
    sends once the imports are done) and send its result to the parent."""
    requests, answers = private_channel()
    import accelerate.hooks  # noqa: F401 - the libraries every mode needs count as start-up, not as the reload
    import transformers.modeling_utils  # noqa: F401

    startup, ready_at = rss_bytes(), time.time()
    argv = sys.argv[1:] if argv is None else argv
    if argv == [WAIT_FOR_ARGUMENTS]:
        argv = read_arguments(answers)
        if argv is None:
            return 0
    asked_at = time.time()
    args = parse_arguments(argv)
    tied = [tuple(item.split("=", 1)) for item in args.tied]
    with open(args.tensors) as handle:
        table = json.load(handle)
    if args.mode == KEYS_ONLY:
        result = compare_keys(args.path, args.trust_remote_code, tied, args.format, table_shapes(table))
    elif args.mode == LOADED_IN_MEMORY:
        result = reload_and_probe(args.path, args.trust_remote_code, tied, args.adapter)
    else:
        read = parent_reader(requests, answers) if args.from_parent else MappedFiles(args.path, table)
        result = stream_and_probe(
            args.path, args.trust_remote_code, tied, args.format, table, read, startup + args.memory_bound, args.adapter
        )
    result.setdefault("mode", args.mode)
    result.update(load_tokenizer(args.path, args.trust_remote_code))
    peak = peak_rss_bytes()
    result.update(startup_rss_bytes=startup, peak_rss_bytes=peak, ready_at=ready_at, asked_at=asked_at)
    send_result(requests, result)
    return 0


if __name__ == "__main__":
    exit_without_teardown(main())  # the parent has the result: the modules' teardown would only delay it
