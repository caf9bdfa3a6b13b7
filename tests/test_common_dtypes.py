"""rayexport.common.dtypes: sizes come from the safetensors codes, without torch, and agree with torch."""

from __future__ import annotations

import subprocess
import sys

import torch

from rayexport.common.dtypes import SAFETENSORS_DTYPES, itemsize, nbytes


def test_every_dtype_has_the_size_torch_gives_it():
    assert {name: itemsize(name) for name in SAFETENSORS_DTYPES} == {
        name: getattr(torch, name).itemsize for name in SAFETENSORS_DTYPES
    }
    assert nbytes((3, 5), "bfloat16") == 30 and nbytes((), "float32") == 4


def test_the_command_line_reads_its_options_without_importing_torch():
    """`python -m rayexport.run` starts Ray while torch and transformers load in a thread: its
    options, the layouts' names and planning's formats must not pull torch in first."""
    code = "import sys, rayexport.run; print('torch' in sys.modules, 'transformers' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split() == ["False", "False"]
