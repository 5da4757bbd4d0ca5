"""Checkpoints across processes and across frameworks (CTest label: checkpoint).

1. PyTorch 2.13 loads a libfsdp checkpoint with dcp.load(..., storage_reader=HuggingFaceStorageReader(dir)) into a
   model sharded by its own FSDP2 (gloo, another world size) and gets identical tensors (model and AdamW state).
2. libfsdp loads a sharded checkpoint written by PyTorch's HuggingFaceStorageWriter(save_distributed=True) on
   another world size and gets identical tensors.
3. kill -9 of a rank in the middle of a save (real processes under fsdprun): the previous checkpoint still
   verifies and loads, `latest` still names it.
4. fsdp-ckpt: ls, verify, consolidate (loadable by the `safetensors` package, split with an index), diff.
5. fsdp::dcp::save_file / load_file and the `safetensors` package read each other's single files.

The C++ side is build/bin/checkpoint_interop (tests/checkpoint_interop.cpp) launched by build/bin/fsdprun.
FSDP_BUILD_DIR is the CMake build directory (default: <repo>/build). Every subprocess has a timeout.
"""

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("FSDP_BUILD_DIR", REPO / "build"))
FSDPRUN = BUILD / "bin" / "fsdprun"
INTEROP = BUILD / "bin" / "checkpoint_interop"
CKPT = BUILD / "bin" / "fsdp-ckpt"

LAUNCHER_VARS = re.compile(r"^(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|GROUP_WORLD_SIZE|ROLE_\w+"
                           r"|MASTER_ADDR|MASTER_PORT|TORCHELASTIC_\w+|PET_\w+|FSDP_TIMEOUT_S)$")


@pytest.fixture(scope="module", autouse=True)
def binaries():
    for b in (FSDPRUN, INTEROP, CKPT):
        assert b.is_file(), f"{b} is missing: build it with `cmake --build {BUILD} --target {b.name}`"


def run(cmd, timeout=120, **env):
    e = {k: v for k, v in os.environ.items() if not LAUNCHER_VARS.match(k)}
    e.update({"OMP_NUM_THREADS": "1", "FSDPRUN_GRACE_S": "2", "FSDP_TIMEOUT_S": "60"})
    e.update({k: str(v) for k, v in env.items()})
    return subprocess.run([str(c) for c in cmd], env=e, capture_output=True, text=True, timeout=timeout)


def show(p):
    return f"rc={p.returncode}\n--- stdout ---\n{p.stdout[-4000:]}\n--- stderr ---\n{p.stderr[-4000:]}"


def cpp(nproc, *args, timeout=120):
    """Runs checkpoint_interop on `nproc` ranks under fsdprun."""
    return run([FSDPRUN, "--standalone", "--nproc-per-node", nproc, "--", INTEROP, *args], timeout=timeout)


def assert_same(got: dict, ref: dict, keys=None):
    keys = sorted(ref) if keys is None else keys
    for k in keys:
        assert k in got, f"{k} missing"
        assert got[k].dtype == ref[k].dtype and got[k].shape == ref[k].shape, (k, got[k].shape, ref[k].shape)
        assert torch.equal(got[k], ref[k]), f"{k} differs: max |diff| {(got[k] - ref[k]).abs().max()}"


# ------------------------------------------------------------------------------------------------
# The Python twin of tests/fsdp_test_model.h (same FQNs and shapes).
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(6)
        self.fc1 = nn.Linear(6, 5)
        self.fc2 = nn.Linear(5, 6)
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x)))) * self.scale


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(11, 6)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(6, 2)

    def forward(self, idx):
        x = self.wte(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sharded_net(seed):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = Net()
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    return model


def py_worker(rank, world, port, mode, ckpt, ref, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)
        from torch.distributed.tensor import DTensor

        model = sharded_net(seed=1000 + world)
        if mode == "load":
            # Model weights and AdamW moments, keyed as libfsdp's get_state_dict keys them.
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            msd = get_model_state_dict(model)
            osd = get_optimizer_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
            sd = {"model." + k: v for k, v in msd.items()}
            sd.update({"optim." + k: v for k, v in osd.items()
                       if isinstance(v, DTensor) and k.rsplit(".", 1)[-1] in ("exp_avg", "exp_avg_sq")})
            dcp.load(sd, storage_reader=HuggingFaceStorageReader(ckpt))
            full = {k: v.full_tensor() for k, v in sd.items()}
            if rank == 0:
                save_file(full, out)
        else:
            sd = {k: v for k, v in model.state_dict().items()}
            dcp.save(sd, storage_writer=HuggingFaceStorageWriter(ckpt, save_distributed=True))
            full = {k: v.full_tensor() for k, v in sd.items()}
            if rank == 0:
                save_file(full, ref)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def python_job(world, mode, ckpt, ref="", out=""):
    mp.start_processes(py_worker, args=(world, free_port(), mode, str(ckpt), str(ref), str(out)), nprocs=world,
                       join=True, start_method="spawn")


# ------------------------------------------------------------------------------------------------
# 1. PyTorch reads ours.
def test_pytorch_loads_libfsdp_checkpoint_on_another_world_size(tmp_path):
    ckpt, ref, out = tmp_path / "ck", tmp_path / "ref.safetensors", tmp_path / "py.safetensors"
    p = cpp(3, "save", "--dir", ckpt, "--ref", ref, "--steps", 2)
    assert p.returncode == 0, show(p)
    python_job(2, "load", ckpt, out=out)
    got, want = load_file(out), load_file(ref)
    assert any(k.endswith(".exp_avg_sq") for k in got) and "model.head.weight" in got
    assert_same(got, want, keys=sorted(got))
    assert len(got) == len([k for k in want if k.startswith("model.") or k.endswith(("exp_avg", "exp_avg_sq"))])


# 2. We read PyTorch's.
def test_libfsdp_loads_pytorch_hf_checkpoint_on_another_world_size(tmp_path):
    ckpt, ref, out = tmp_path / "ck", tmp_path / "ref.safetensors", tmp_path / "cpp.safetensors"
    python_job(3, "save", ckpt, ref=ref)
    files = sorted(f.name for f in ckpt.iterdir() if f.suffix == ".safetensors")
    assert files[0] == "shard-00001-model-00001-of-00001.safetensors", files
    p = cpp(2, "load", "--dir", ckpt, "--out", out, "--prefix", "")
    assert p.returncode == 0, show(p)
    assert_same(load_file(out), load_file(ref))
    # The tool reads it too (no libfsdp metadata: everything comes from the headers).
    ls = run([CKPT, "ls", ckpt])
    assert ls.returncode == 0 and "format safetensors" in ls.stdout and "head.weight" in ls.stdout, show(ls)
    v = run([CKPT, "verify", ckpt])
    assert v.returncode == 0 and "no checksums" in v.stdout, show(v)


# ------------------------------------------------------------------------------------------------
# 3. kill -9 in the middle of a save.
@pytest.mark.parametrize("kill_rank,stage", [(1, "write"), (0, "before_metadata"), (0, "before_rename"),
                                             (0, "before_latest")])
def test_kill9_mid_save_leaves_previous_checkpoint(tmp_path, kill_rank, stage):
    parent, ref, out = tmp_path / "ckpts", tmp_path / "ref.safetensors", tmp_path / "loaded.safetensors"
    p = cpp(2, "crash-save", "--parent", parent, "--ref", ref, "--kill-rank", kill_rank, "--kill-stage", stage)
    assert p.returncode != 0, show(p)
    assert f"SIGKILL at {stage}" in p.stderr, show(p)
    assert (parent / "latest").read_text().strip() == "step-1"
    # Before the rename only a DIR.tmp-* folder exists; after it the new folder is complete but not `latest`.
    assert (parent / "step-2").exists() == (stage == "before_latest")
    v = run([CKPT, "verify", parent / "latest"])
    assert v.returncode == 0 and "every checksum matches" in v.stdout, show(v)
    if stage == "before_latest":
        v2 = run([CKPT, "verify", parent / "step-2"])
        assert v2.returncode == 0, show(v2)
    # The previous checkpoint loads (on another world size) and holds the step-1 weights.
    p = cpp(3, "load", "--dir", parent / "latest", "--out", out)
    assert p.returncode == 0, show(p)
    want = load_file(ref)
    assert_same(load_file(out), {k: v for k, v in want.items() if k.startswith("model.")})
    # The next save into step-2 removes the crashed attempt's temporary folder.
    if stage != "before_latest":
        assert any(".tmp-" in f.name for f in parent.iterdir())
        p = cpp(2, "save", "--dir", parent / "step-2", "--ref", tmp_path / "ref2.safetensors")
        assert p.returncode == 0, show(p)
        assert not any(".tmp-" in f.name for f in parent.iterdir()), list(parent.iterdir())
        assert (parent / "latest").read_text().strip() == "step-2"


# ------------------------------------------------------------------------------------------------
# 4. fsdp-ckpt.
@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("tool")
    p = cpp(4, "save", "--dir", d / "ck", "--ref", d / "ref.safetensors", "--steps", 2)
    assert p.returncode == 0, show(p)
    return d


def test_ckpt_ls(saved):
    p = run([CKPT, "ls", "--values", saved / "ck"])
    assert p.returncode == 0, show(p)
    assert "format libfsdp-dcp v1, saved by 4 rank(s), mesh [4] (shard)" in p.stdout, p.stdout
    # wte.weight [11, 6] on 4 ranks: rows 0-3, 3-6, 6-9, 9-11; head.weight [2, 6]: ranks 0 and 1 only.
    assert re.search(r"model\.wte\.weight\s+F32\s+\[11, 6\]\s+4 chunk\(s\): r0\[0:3, 0:6\] r1\[3:6, 0:6\] "
                     r"r2\[6:9, 0:6\] r3\[9:11, 0:6\]", p.stdout), p.stdout
    assert re.search(r"model\.head\.weight\s+F32\s+\[2, 6\]\s+2 chunk\(s\): r0\[0:1, 0:6\] r1\[1:2, 0:6\]",
                     p.stdout), p.stdout
    assert "optim.state.wte.weight.step = 2" in p.stdout


def test_ckpt_verify_detects_damage(saved, tmp_path):
    ok = run([CKPT, "verify", saved / "ck"])
    assert ok.returncode == 0 and ok.stdout.startswith("OK"), show(ok)
    bad = tmp_path / "bad"
    subprocess.run(["cp", "-r", str(saved / "ck"), str(bad)], check=True)
    f = bad / "shard-00003-model-00001-of-00001.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    (bad / "shard-00004-model-00001-of-00001.safetensors").unlink()
    p = run([CKPT, "verify", bad])
    assert p.returncode == 1, show(p)
    assert "checksum mismatch in" in p.stdout and "shard-00003" in p.stdout, p.stdout
    assert "shard-00004-model-00001-of-00001.safetensors is missing" in p.stdout, p.stdout


def test_ckpt_consolidate_single_and_split(saved, tmp_path):
    ref = load_file(saved / "ref.safetensors")
    one = tmp_path / "one"
    p = run([CKPT, "consolidate", saved / "ck", "--out", one])
    assert p.returncode == 0, show(p)
    assert sorted(f.name for f in one.iterdir()) == ["model.safetensors"]
    assert_same(load_file(one / "model.safetensors"), ref)
    # Split, model weights only, Hugging Face names: an index maps every name to its file.
    split = tmp_path / "split"
    p = run([CKPT, "consolidate", saved / "ck", "--out", split, "--max-file-size", "300B", "--prefix", "model.",
             "--strip-prefix"])
    assert p.returncode == 0, show(p)
    index = json.loads((split / "model.safetensors.index.json").read_text())
    files = sorted(f.name for f in split.iterdir() if f.suffix == ".safetensors")
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors", files
    got = {}
    for name in files:
        part = load_file(split / name)
        for k in part:
            assert index["weight_map"][k] == name
        got.update(part)
    want = {k[len("model."):]: v for k, v in ref.items() if k.startswith("model.")}
    assert_same(got, want)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in want.values())


def test_pytorch_consolidates_our_shards(saved, tmp_path):
    """Our DCP_SHARDING_INFO is what PyTorch's own consolidation reads."""
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

    ref = load_file(saved / "ref.safetensors")
    consolidate_safetensors_files(str(saved / "ck"), str(tmp_path), fqn_to_index_mapping={k: 1 for k in ref})
    (out,) = [f for f in tmp_path.iterdir() if f.suffix == ".safetensors"]
    assert_same(load_file(out), ref)


def test_ckpt_diff(saved, tmp_path):
    same = run([CKPT, "diff", saved / "ck", saved / "ck"])
    assert same.returncode == 0 and "identical" in same.stdout, show(same)
    p = cpp(2, "save", "--dir", tmp_path / "other", "--ref", tmp_path / "r.safetensors", "--steps", 3)
    assert p.returncode == 0, show(p)
    d = run([CKPT, "diff", saved / "ck", tmp_path / "other"])
    assert d.returncode == 1, show(d)
    assert re.search(r"differs: model\.wte\.weight: \d+ of 66 elements differ", d.stdout), d.stdout
    assert "differs: optim.state.wte.weight.step: 2 vs 3" in d.stdout, d.stdout


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_save_file_and_load_file_interop_with_safetensors(tmp_path):
    """fsdp::dcp::load_file reads what safetensors.torch.save_file writes, and safetensors.torch.load_file reads
    what fsdp::dcp::save_file writes: every dtype both support, a scalar and an empty tensor, bit for bit, with the
    metadata given (and nothing else) in the header."""
    from safetensors import safe_open
    g = torch.Generator().manual_seed(0)
    f = torch.randn(3, 5, dtype=torch.float64, generator=g) * 1e3
    want = {"f64": f, "f32": f.float(), "bf16": f.bfloat16(), "f16": (f / 1e2).half(),
            "i64": torch.randint(-2**62, 2**62, (4,), dtype=torch.int64, generator=g),
            "i32": torch.randint(-2**30, 2**30, (2, 2), dtype=torch.int32, generator=g),
            "i16": torch.randint(-30000, 30000, (7,), dtype=torch.int16, generator=g),
            "i8": torch.randint(-128, 128, (2, 3, 1), dtype=torch.int8, generator=g),
            "u8": torch.randint(0, 256, (9,), dtype=torch.uint8, generator=g),
            "bool": torch.rand(6, generator=g) > 0.5, "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3)}
    src, out = tmp_path / "python.safetensors", tmp_path / "cpp.safetensors"
    save_file(want, str(src), metadata={"producer": "python"})
    p = run([INTEROP, "copy-file", "--in", src, "--out", out], timeout=60)
    assert p.returncode == 0, show(p)
    assert_same(load_file(str(out)), want)
    with safe_open(str(out), "pt") as f:
        assert f.metadata() == {"producer": "checkpoint_interop"}
    # A file that is not safetensors fails with the path, not a crash.
    (tmp_path / "junk.safetensors").write_bytes(b"\x04" + b"\0" * 7 + b"{no}")
    p = run([INTEROP, "copy-file", "--in", tmp_path / "junk.safetensors", "--out", tmp_path / "x"], timeout=60)
    assert p.returncode == 1 and "dcp::load_file: " in p.stderr and "malformed safetensors header" in p.stderr, show(p)
