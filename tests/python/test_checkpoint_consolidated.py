"""Consolidated checkpoints written by Python load into a sharded libfsdp model (CTest labels: checkpoint,
large_model).

Python's `safetensors.torch.save_file` writes the test model's weights as one model.safetensors (fp32), and as a
split Hugging Face layout (model-0000K-of-0000N.safetensors + model.safetensors.index.json, bf16); libfsdp's
dcp::load reads them into the sharded test model on 2 and 3 ranks (real processes under fsdprun), each rank only
its rows; the gathered model equals the file's tensors (bf16 widened exactly to fp32).

The C++ side is build/bin/checkpoint_interop `load` (tests/checkpoint/checkpoint_interop.cpp). FSDP_BUILD_DIR is
the CMake build directory (default: <repo>/build). Every subprocess has a timeout.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from fsdp_testing import FSDPRUN, INTEROP, interop

BINARIES = (FSDPRUN, INTEROP)

# The test model's FQNs and shapes (tests/common/fsdp_test_model.h): uneven and empty shards on 2 and 3 ranks.
SHAPES = {"wte.weight": (11, 6), "head.weight": (2, 6), "head.bias": (2,)}
for b in range(2):
    SHAPES.update({f"blocks.{b}.norm.weight": (6,), f"blocks.{b}.norm.bias": (6,), f"blocks.{b}.fc1.weight": (5, 6),
                   f"blocks.{b}.fc1.bias": (5,), f"blocks.{b}.fc2.weight": (6, 5), f"blocks.{b}.fc2.bias": (6,),
                   f"blocks.{b}.scale": (1,)})


def load_with_libfsdp(nproc, ckpt, out):
    """dcp::load of `ckpt` into the sharded test model on `nproc` ranks; rank 0 writes the gathered model to `out`."""
    p = interop(nproc, "load", "--dir", ckpt, "--out", out, "--prefix", "")
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
