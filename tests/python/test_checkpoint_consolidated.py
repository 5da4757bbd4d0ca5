"""Consolidated checkpoints written by Python load into a sharded libfsdp model (CTest labels: checkpoint,
large_model).

Python's `safetensors.torch.save_file` writes the test model's weights as one model.safetensors (fp32), and as a
split Hugging Face layout (model-0000K-of-0000N.safetensors + model.safetensors.index.json, bf16); libfsdp's
dcp::load reads them into the sharded test model on 2 and 3 ranks (real processes under fsdprun), each rank only
its rows; the gathered model equals the file's tensors (bf16 widened exactly to fp32).

The C++ side is build/bin/checkpoint_interop `load` (tests/checkpoint_interop.cpp). FSDP_BUILD_DIR is the CMake
build directory (default: <repo>/build). Every subprocess has a timeout.
"""

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("FSDP_BUILD_DIR", REPO / "build"))
FSDPRUN = BUILD / "bin" / "fsdprun"
INTEROP = BUILD / "bin" / "checkpoint_interop"

LAUNCHER_VARS = re.compile(r"^(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|GROUP_WORLD_SIZE|ROLE_\w+"
                           r"|MASTER_ADDR|MASTER_PORT|TORCHELASTIC_\w+|PET_\w+|FSDP_TIMEOUT_S)$")

# The test model's FQNs and shapes (tests/fsdp_test_model.h): uneven and empty shards on 2 and 3 ranks.
SHAPES = {"wte.weight": (11, 6), "head.weight": (2, 6), "head.bias": (2,)}
for b in range(2):
    SHAPES.update({f"blocks.{b}.norm.weight": (6,), f"blocks.{b}.norm.bias": (6,), f"blocks.{b}.fc1.weight": (5, 6),
                   f"blocks.{b}.fc1.bias": (5,), f"blocks.{b}.fc2.weight": (6, 5), f"blocks.{b}.fc2.bias": (6,),
                   f"blocks.{b}.scale": (1,)})


@pytest.fixture(scope="module", autouse=True)
def binaries():
    for b in (FSDPRUN, INTEROP):
        assert b.is_file(), f"{b} is missing: build it with `cmake --build {BUILD} --target {b.name}`"


def load_with_libfsdp(nproc, ckpt, out):
    """dcp::load of `ckpt` into the sharded test model on `nproc` ranks; rank 0 writes the gathered model to `out`."""
    env = {k: v for k, v in os.environ.items() if not LAUNCHER_VARS.match(k)}
    env.update({"OMP_NUM_THREADS": "1", "FSDPRUN_GRACE_S": "2", "FSDP_TIMEOUT_S": "60"})
    cmd = [FSDPRUN, "--standalone", "--nproc-per-node", nproc, "--", INTEROP, "load", "--dir", ckpt, "--out", out,
           "--prefix", ""]
    p = subprocess.run([str(c) for c in cmd], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, f"rc={p.returncode}\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    return load_file(out)


def weights(dtype):
    g = torch.Generator().manual_seed(5)
    return {k: torch.randn(s, generator=g).to(dtype) for k, s in SHAPES.items()}


@pytest.mark.parametrize("nproc", [2, 3])
def test_python_single_file_loads_into_sharded_model(tmp_path, nproc):
    ckpt = tmp_path / "hf"
    ckpt.mkdir()
    ref = weights(torch.float32)
    save_file(ref, ckpt / "model.safetensors", metadata={"format": "pt"})
    got = load_with_libfsdp(nproc, ckpt, tmp_path / "out.safetensors")
    assert sorted(got) == sorted(ref)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


@pytest.mark.parametrize("nproc", [2, 3])
def test_python_split_bf16_layout_loads_into_fp32_sharded_model(tmp_path, nproc):
    ckpt = tmp_path / "hf"
    ckpt.mkdir()
    ref = weights(torch.bfloat16)
    keys = sorted(ref)
    parts = [keys[0::3], keys[1::3], keys[2::3]]
    weight_map = {}
    for i, part in enumerate(parts):
        name = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        save_file({k: ref[k] for k in part}, ckpt / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in part})
    total = sum(t.numel() * t.element_size() for t in ref.values())
    (ckpt / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    got = load_with_libfsdp(nproc, ckpt, tmp_path / "out.safetensors")
    for k in keys:
        assert got[k].dtype == torch.float32, k
        assert torch.equal(got[k], ref[k].to(torch.float32)), k
