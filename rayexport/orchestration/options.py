"""The export's options: one plain dataclass shared by the CLI, `export()`, `export_remote()`
and the manifest. Each field carries its default, help text, group and command-line form
(`option(...)`); the CLI's parser is built from the fields (`add_option_arguments`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any

from rayexport.common.errors import ExportError
from rayexport.common.levels import AUTO, LEVELS
from rayexport.layouts import LAYOUT_NAMES
from rayexport.orchestration.placement import is_whole
from rayexport.plan.cost import Rates
from rayexport.plan.formats import FORMATS, ON_DISK
from rayexport.verification.serving import ENGINES, ServeRequest, serve_request

BACKENDS = ("auto", "gloo", "nccl")
DTYPES = ("auto", "bfloat16", "float16", "float32")
LORA_MODES = ("merge", "adapter", "both")
# The --help groups, in the order a user meets them.
SOURCE, OUTPUT, CLUSTER, LORA, VERIFICATION, SAFETY = (
    "source", "output", "cluster", "LoRA", "verification", "safety",
)
GROUPS = (SOURCE, OUTPUT, CLUSTER, LORA, VERIFICATION, SAFETY)
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)


def parse_size(value: int | str) -> int:
    """Bytes from an int or a string like '1GiB', '5GB', '500MB' (GB = 10^9, GiB = 2^30)."""
    if isinstance(value, int):
        return value
    match = _SIZE.match(value)
    if not match:
        raise ExportError(f"cannot read size {value!r}; use e.g. 5GB or 512MiB")
    number, unit, binary = match.groups()
    base = 1024 if binary else 1000
    return int(float(number) * base ** " KMGT".index(unit.upper() or " "))


def option(
    default: Any = None,
    help: str = "",
    *,
    group: str,
    flag: str | None = None,
    choices: tuple[str, ...] | None = None,
    metavar: str | None = None,
    recorded: bool = False,
    default_factory: Any = None,
    required: bool = False,
) -> Any:
    """A field of `ExportOptions` with what the CLI needs: `help` (the default is appended to
    it unless None or False), its `group` in --help, its `flag` (default: from the field's
    name), `choices`, `metavar`; `recorded`: stored in the manifest (the options that decide
    the export's bytes); `required`: no default (the CLI then defaults to None and checks)."""
    metadata = {
        "help": help, "group": group, "flag": flag, "choices": choices, "metavar": metavar, "recorded": recorded,
    }
    if required:
        return field(metadata=metadata)
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class ExportOptions:
    """Everything one export needs to know. Sizes accept ints or strings like '1GiB'."""

    src: str = option(help="checkpoint prefix (local path, file://, s3://, any fsspec URI)", group=SOURCE,
                      metavar="URI", required=True)
    dst: str = option(help="where the Hugging Face model is written", group=OUTPUT, metavar="URI", required=True)
    layout: str = option("auto", "a Megatron-Core torch_dist checkpoint (verl's Megatron backend, Megatron-LM), "
                         "verl rank files, a PyTorch DCP directory (torchtitan's: its names mapped as its "
                         "to_hf does), an accelerate checkpoint folder or torch's sharded HF safetensors "
                         "(auto: from the files present)", group=SOURCE, choices=LAYOUT_NAMES)
    hf_config: str | None = option(help="HF folder with config.json and tokenizer when SRC has no huggingface/",
                                   group=SOURCE, metavar="URI")
    dcp_prefix: str | None = option(help="key prefix of the model in a DCP state dict (default: detected)",
                                    group=SOURCE, metavar="PREFIX", recorded=True)
    step: int | None = option(help="the iteration of a Megatron-LM save folder to export (default: the one its "
                              "latest_checkpointed_iteration.txt names)", group=SOURCE, metavar="N", recorded=True)
    tag: str | None = option(help="the tag folder of a DeepSpeed save to export, e.g. global_step100 (default: "
                             "the one its 'latest' file names)", group=SOURCE, metavar="TAG", recorded=True)
    storage_options: dict[str, Any] = option(
        help='fsspec/s3fs options for SRC and DST, e.g. \'{"endpoint_url": "http://..."}\'',
        group=SOURCE, metavar="JSON", default_factory=dict,
    )
    dtype: str = option("auto", "output dtype of floating tensors (auto: the dtype the model is published in: "
                        "the config's, but bfloat16 for a float32 training config)",
                        group=OUTPUT, choices=DTYPES, recorded=True)
    format: str = option(ON_DISK, "tensor names and layout: the model's on-disk format, as save_pretrained writes "
                         "it (per-expert MoE tensors, the Hub's names), or transformers 5's in-memory layout "
                         "(fused experts)", group=OUTPUT, choices=FORMATS, recorded=True)
    max_shard_size: int | str = option("5GB", "largest safetensors file", group=OUTPUT, metavar="SIZE", recorded=True)
    untie: bool = option(False, "tied tensors whose saved values differ: keep both and untie the config",
                         group=OUTPUT, recorded=True)
    force: bool = option(False, "replace a committed export at DST", group=OUTPUT)
    sha256: bool = option(False, "also record each file's SHA-256 in the manifest (what sha256sum and the Hub's "
                          "LFS pointers use; the checks compare a fast 128-bit digest either way)", group=OUTPUT)
    workers: int | None = option(help="worker actors (default: min(world size, cluster CPUs))", group=CLUSTER,
                                 metavar="N")
    writers: int | None = option(
        help="workers that each write a disjoint share of the output files (default: every worker, on a local "
        "DST every worker on its node; an export of at least K GiB is written as at least K files of about "
        "equal size, so that each writer has its share)", group=CLUSTER, metavar="K",
    )
    backend: str = option(
        "auto", "nccl (a whole GPU per worker) or gloo (CPUs); auto: nccl only when every worker finds a whole "
        "free GPU at the start, else gloo (the log says why)", group=CLUSTER, choices=BACKENDS,
    )
    bucket_size: int | str = option("1GiB", "bytes gathered per step; a worker holds at most two buckets",
                                    group=CLUSTER, metavar="SIZE")
    num_cpus_per_worker: float = option(1.0, "Ray CPUs each worker reserves", group=CLUSTER, metavar="N")
    # None: one per worker when the backend is (or `auto` picks) nccl, none with gloo
    num_gpus_per_worker: float | None = option(
        help="GPUs each worker reserves (default: 1 when the backend is nccl, 0 with gloo; 0 keeps the export "
        "off the GPUs; nccl needs a whole number)", group=CLUSTER, metavar="N",
    )
    placement_timeout_s: float = option(
        60.0, "seconds to wait for the cluster to place the workers before failing with what is missing "
        "(raise it where nodes are added on demand)", group=CLUSTER, flag="--placement-timeout", metavar="S",
    )
    timeout_s: float = option(1800.0, "seconds each distributed step and the verification may take",
                              group=CLUSTER, flag="--timeout", metavar="S")
    deadline_s: float = option(86400.0, "seconds the whole export may take, start to commit",
                               group=CLUSTER, flag="--deadline", metavar="S")
    rates: str = option(
        "", "the rates the estimate assumes, per worker, e.g. read=200,gather=1000,write=150,verify=400,reload=500 "
        "(MB/s) and fixed=10 (seconds); unnamed ones keep this project's measured defaults (docs/usage.md, --dry-run)",
        group=CLUSTER, metavar="NAME=N,...",
    )
    pool: str | None = option(help="keep the worker actors alive in the warm pool NAME for the next export",
                              group=CLUSTER, metavar="NAME")
    log_level: str = option("INFO", "logging level of the driver and the workers", group=CLUSTER,
                            choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    lora: str = option("merge", "LoRA checkpoints: merge into the base, write the adapter, or both",
                       group=LORA, choices=LORA_MODES, recorded=True)
    base_model: str | None = option(help="HF model folder with the base weights of a LoRA-only checkpoint",
                                    group=LORA, metavar="URI", recorded=True)
    lora_alpha: float | None = option(help="LoRA alpha when lora_train_meta.json lacks it", group=LORA,
                                      metavar="ALPHA", recorded=True)
    lora_rslora: bool | None = option(help="the adapter was trained with rsLoRA", group=LORA, recorded=True)
    verify: str = option(
        AUTO, "checks before commit: full (every byte re-read, reload and forward pass; a model larger "
        "than --bucket-size allows is streamed through the forward pass), quick (headers and a sample, keys "
        "only), none; auto = full", group=VERIFICATION, choices=LEVELS, recorded=True,
    )
    serve_check: str = option(
        "none", "also load the export in a serving engine before commit: vllm builds it and generates from fixed "
        "prompts, and each token must be transformers' top choice on the same prefix", group=VERIFICATION,
        choices=("none", *ENGINES),
    )
    vllm_python: str | None = option(
        help="the Python that runs the vLLM check (default: this one); vLLM pins its own torch and transformers, "
        "so it often has a virtualenv of its own", group=VERIFICATION, metavar="PATH",
    )
    serve_check_gpus: float = option(1.0, "GPUs the serve check asks Ray for where the cluster has GPUs",
                                     group=VERIFICATION, metavar="N")
    strict: bool = option(False, "fail on NaN/Inf weights instead of warning (they are then scanned before "
                          "anything is written)", group=SAFETY, recorded=True)
    trust_remote_code: bool = option(False, "allow the model's own code to run (plan and reload)",
                                     group=SAFETY, recorded=True)
    unsafe_pickle: bool = option(False, "load rank files with the full unpickler (runs code in them; trusted "
                                 "files only)", group=SAFETY)

    def __post_init__(self) -> None:
        for item in dataclasses.fields(self):
            allowed = item.metadata["choices"]
            if allowed and getattr(self, item.name) not in allowed:
                raise ExportError(f"{cli_flag(item)} must be one of {', '.join(allowed)}, not {getattr(self, item.name)!r}")
        self.bucket_size = parse_size(self.bucket_size)
        self.max_shard_size = parse_size(self.max_shard_size)
        if self.workers is not None and self.workers < 1:
            raise ExportError(f"--workers must be at least 1, not {self.workers}")
        if self.timeout_s <= 0 or self.deadline_s <= 0 or self.placement_timeout_s <= 0:
            raise ExportError("--timeout, --deadline and --placement-timeout must be positive")
        gpus = self.num_gpus_per_worker
        if gpus is not None and gpus < 0:
            raise ExportError(f"--num-gpus-per-worker must not be negative, not {gpus:g}")
        if self.backend == "nccl" and gpus is not None and not is_whole(gpus):
            why = "gives it none" if gpus == 0 else "is not a whole number (NCCL refuses two ranks on one device)"
            raise ExportError(f"--backend nccl needs a whole GPU per worker; --num-gpus-per-worker {gpus:g} {why}")
        if self.writers is not None and self.writers < 1:
            raise ExportError(f"--writers must be at least 1, not {self.writers}")
        if self.bucket_size < 1:
            raise ExportError("--bucket-size must be positive")
        Rates.parse(self.rates)  # a bad rate is one line before anything starts
        self.serve  # refuses a serve check's Python without the check
        if self.serve_check_gpus < 0:
            raise ExportError(f"--serve-check-gpus must not be negative, not {self.serve_check_gpus:g}")

    @property
    def memory_bound_bytes(self) -> int:
        """The most memory any process of the export may hold above its start-up footprint: the
        two buckets a worker holds, and 1 GiB for everything else (the reload check keeps to it)."""
        return 2 * self.bucket_size + 2**30

    @property
    def serve(self) -> ServeRequest | None:
        """The serve check asked for, if any."""
        return serve_request(self.serve_check, self.vllm_python, self.serve_check_gpus)

    def recorded(self) -> dict[str, Any]:
        """The options that decide the export's bytes, as stored in the manifest (no secrets)."""
        return {item.name: getattr(self, item.name) for item in dataclasses.fields(self) if item.metadata["recorded"]}


def cli_flag(item: dataclasses.Field) -> str:
    """The command-line flag of an `ExportOptions` field."""
    return item.metadata["flag"] or "--" + item.name.replace("_", "-")


def add_option_arguments(parser: argparse.ArgumentParser) -> None:
    """One argument per `ExportOptions` field, in its --help group; bools are switches, sizes
    and URIs strings, `storage_options` JSON. Defaults come from the fields."""
    groups = {name: parser.add_argument_group(f"{name} options") for name in GROUPS}
    for item in dataclasses.fields(ExportOptions):
        meta = item.metadata
        if item.default_factory is not dataclasses.MISSING:
            default = item.default_factory()
        else:
            default = None if item.default is dataclasses.MISSING else item.default
        shown = f"{default:g}" if isinstance(default, float) else default
        help_text = meta["help"] + (f" (default: {shown})" if default not in (None, False, {}) else "")
        kwargs: dict[str, Any] = {"dest": item.name, "default": default, "help": help_text}
        if item.type in ("bool", "bool | None"):
            kwargs["action"] = "store_true"
        else:
            kwargs["type"] = _ARGUMENT_TYPES.get(item.type, str)
            kwargs["choices"] = meta["choices"]
            kwargs["metavar"] = meta["metavar"]
        groups[meta["group"]].add_argument(cli_flag(item), **kwargs)


def options_from_arguments(arguments: argparse.Namespace) -> dict[str, Any]:
    """The `ExportOptions` fields a parsed command line set, `src` and `dst` included."""
    return {item.name: getattr(arguments, item.name) for item in dataclasses.fields(ExportOptions)}


# argparse types by annotation (this module's annotations are strings); the rest are read as text
_ARGUMENT_TYPES = {
    "int | None": int, "int": int, "float": float, "float | None": float, "dict[str, Any]": json.loads,
}


def option_reference() -> str:
    """docs/options.md: every `ExportOptions` field, by --help group, as Markdown tables: its
    flag, its keyword in `export()` and `export_remote()`, its default and its help. Made from
    the same fields as the command line's parser, so the page cannot drift from the code
    (`tests/test_docs.py` checks it is what this returns)."""
    lines = [
        "# Options",
        "",
        "Every option of an export, as `python -m rayexport.run` takes it and as a keyword of `rayexport.export()`",
        "and `rayexport.export_remote()`. This page is generated from `rayexport.orchestration.options.ExportOptions`",
        "(`python -m rayexport.orchestration.options > docs/options.md`); a test fails when the two differ.",
    ]
    for group in GROUPS:
        lines += ["", f"## {group[:1].upper()}{group[1:]}", "", "| option | keyword | default | meaning |", "| --- | --- | --- | --- |"]
        for item in dataclasses.fields(ExportOptions):
            if item.metadata["group"] != group:
                continue
            meta = item.metadata
            flag = cli_flag(item) + (f" {meta['metavar']}" if meta["metavar"] else "")
            choices = f"one of {', '.join(f'`{choice}`' for choice in meta['choices'])}: " if meta["choices"] else ""
            required = " (required)" if item.default is dataclasses.MISSING and item.default_factory is dataclasses.MISSING else ""
            lines.append(f"| `{flag}`{required} | `{item.name}` | {_shown_default(item)} | {choices}{meta['help']} |")
    return "\n".join(lines) + "\n"


def _shown_default(item: dataclasses.Field) -> str:
    default = item.default if item.default_factory is dataclasses.MISSING else item.default_factory()
    if default is dataclasses.MISSING or default is None or default == {}:
        return ""
    if default is False:
        return "off"
    return f"`{default:g}`" if isinstance(default, float) else f"`{default}`"


if __name__ == "__main__":
    print(option_reference(), end="")
