"""What a user installing fasttorch gets: the license, the metadata, types, a light import."""

from __future__ import annotations

import subprocess
import sys
import typing
from pathlib import Path

import pytest

import fasttorch

tomllib = pytest.importorskip("tomllib")  # 3.11+
ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_license_file_and_its_metadata():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text  # the whole text, not a pointer to it
    project = PROJECT["project"]
    assert project["license"] == "Apache-2.0"  # PEP 639's SPDX string, not the old table
    assert project["license-files"] == ["LICENSE"]
    # setuptools reads the SPDX string and license-files from 77 on.
    assert "setuptools>=77" in PROJECT["build-system"]["requires"]


def test_import_fasttorch_leaves_inductor_and_distributed_checkpoint_until_used():
    # Each costs about a second (more on a busy machine) that a script may never need.
    # FSDP2 and DTensor (1.4 s together) are looked up where a program imported them.
    code = (
        "import sys, torch, fasttorch\n"
        "heavy = ('torch._inductor', 'torch._dynamo', 'torch.distributed.checkpoint',\n"
        "         'torch.distributed.fsdp', 'torch.distributed.tensor')\n"
        "print(*(m in sys.modules for m in heavy))\n"
        "fasttorch.checkpoint.save\n"
        "from fasttorch._compile.cpu_gemm import HalfGemmInFloat32\n"
        "from torch._inductor.custom_graph_pass import CustomGraphPass\n"
        "print(isinstance(HalfGemmInFloat32([torch.bfloat16]), CustomGraphPass))\n"
        "print('torch.distributed.checkpoint' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False"] * 5 + ["True", "True"]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="typing.get_overloads is 3.11+")
def test_compiled_keeps_the_type_of_what_it_wraps():
    hints = [typing.get_type_hints(f) for f in typing.get_overloads(fasttorch.compiled)]
    first = hints[0]
    assert (first["step"], first["return"]) == (fasttorch.Step, fasttorch.Step)
    step_type, returned = hints[1]["step"], hints[1]["return"]
    assert isinstance(step_type, typing.TypeVar) and returned is step_type
