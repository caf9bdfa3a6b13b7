#!/usr/bin/env bash
# The NCCL path on a GPU machine, in a few minutes, printing one line: "gpu_check: PASS|FAIL ...".
# Needs torch with CUDA, transformers, peft, safetensors, fsspec and huggingface_hub; not Ray,
# s3fs or moto (pass --ray to run the exports on a local Ray where it is installed). The full
# log goes to $GPU_CHECK_LOG (default /tmp/gpu_check.log); on FAIL its tail follows the line.
set -uo pipefail
cd "$(dirname "$0")/.."
log="${GPU_CHECK_LOG:-/tmp/gpu_check.log}"
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" timeout 540 "${PYTHON:-python3}" benchmarks/gpu_check.py "$@" 2>"$log"
status=$?
if [ "$status" -ne 0 ]; then
    [ "$status" -eq 124 ] && echo "gpu_check: FAIL timed out after 540 s"
    tail -n 20 "$log" >&2
fi
exit "$status"
