"""Checkpoints across processes and across frameworks (CTest label: checkpoint).

1. PyTorch 2.13 loads a libfsdp checkpoint with dcp.load(..., storage_reader=HuggingFaceStorageReader(dir)) into a
   model sharded by its own FSDP2 (gloo, another world size) and gets identical tensors (model and AdamW state).
2. libfsdp loads a sharded checkpoint written by PyTorch's HuggingFaceStorageWriter(save_distributed=True) on
   another world size and gets identical tensors.
3. kill -9 of a rank in the middle of a save (real processes under fsdprun): the previous checkpoint still
   verifies and loads, `latest` still names it.
4. fsdp::dcp::save_file / load_file and the `safetensors` package read each other's single files.
5. PyTorch's default DCP format (FileSystemWriter: .distcp archives and a pickled .metadata), both ways: PyTorch's
   dcp.load reads what libfsdp's dcp::save(storage_format(Distcp)) writes into FSDP2, HSDP and FSDP + TP layouts,
   and round trips PyTorch -> libfsdp -> PyTorch across layouts and world sizes give back every tensor bit for bit
   (model, AdamW moments) and the step counters; a Python object libfsdp cannot represent is refused by name.
6. An Adagrad or RMSprop state saved by libfsdp (3 ranks) loads into PyTorch's optimizer of the same kind (FSDP2, 2
   ranks) under the same keys, and one more step gives the parameters libfsdp's own next step gives.

The C++ side is build/bin/checkpoint_interop (tests/checkpoint/checkpoint_interop.cpp) launched by build/bin/fsdprun.
FSDP_BUILD_DIR is the CMake build directory (default: <repo>/build). Every subprocess has a timeout.
"""

import json
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from fsdp_testing import FSDP_CKPT, FSDPRUN, INTEROP, assert_same, free_port, interop, run_program, show

BINARIES = (FSDPRUN, INTEROP, FSDP_CKPT)


# ------------------------------------------------------------------------------------------------
# The Python twin of tests/common/fsdp_test_model.h (same FQNs and shapes).
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




# The optimizers of tests/common/checkpoint_test_util.h (make_ckpt_optimizer) and the names of their state tensors.
OPTIMIZERS = {
    "adagrad": (lambda ps: torch.optim.Adagrad(ps, lr=5e-2, lr_decay=0.01, weight_decay=0.01,
                                               initial_accumulator_value=0.1), ("sum",)),
    "rmsprop": (lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5, centered=True, weight_decay=0.01),
                ("square_avg", "momentum_buffer", "grad_avg")),
}


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
        if mode.startswith("optim-"):
            # libfsdp's state dict keys are PyTorch's flattened ones: the tensors come from the safetensors files,
            # the step counts and hyper-parameters from libfsdp's metadata (JSON values).
            from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
            make, names = OPTIMIZERS[mode[len("optim-"):]]
            opt = make(model.parameters())
            flat = StateDictOptions(flatten_optimizer_state_dict=True)
            msd = get_model_state_dict(model)
            osd = get_optimizer_state_dict(model, opt, options=flat)
            sd = {"model." + k: v for k, v in msd.items()}
            sd.update({"optim." + k: v for k, v in osd.items()
                       if isinstance(v, DTensor) and k.rsplit(".", 1)[-1] in names})
            dcp.load(sd, storage_reader=HuggingFaceStorageReader(ckpt))
            with open(os.path.join(ckpt, "libfsdp_checkpoint.json")) as f:
                values = json.load(f)["values"]
            used = 0
            for k in list(osd):
                if "optim." + k in values:
                    v = values["optim." + k]
                    osd[k] = torch.tensor(float(v)) if k.endswith(".step") else v
                    used += 1
            assert used == len(values), (used, sorted(values))
            set_model_state_dict(model, {k[len("model."):]: v for k, v in sd.items() if k.startswith("model.")})
            set_optimizer_state_dict(model, opt, osd, options=flat)
            batch = load_file(ref)
            n = batch["batch.idx"].shape[0] // world
            idx, tgt = (batch[k][rank * n:(rank + 1) * n] for k in ("batch.idx", "batch.targets"))
            opt.zero_grad()
            F.cross_entropy(model(idx).reshape(-1, 2), tgt.reshape(-1)).backward()
            opt.step()
            full = {"model." + k: v.full_tensor() for k, v in get_model_state_dict(model).items()}
            if rank == 0:
                save_file(full, out)
        elif mode == "load":
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
# PyTorch's default format: the twin trained and saved with dcp.save(sd, checkpoint_id=DIR) in three layouts.
def build_layout(layout, world, seed):
    """Net under FSDP2 ("fsdp": 1-D mesh), HSDP ("hsdp": (replicate 2, shard world/2)) or FSDP + TP ("tp":
    (dp world/2, tp 2), fc1 colwise and fc2 rowwise: fc1's 5 rows split 3 + 2), and its AdamW."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = Net()
    if layout == "tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        for b in model.blocks:
            # fc1's output stays a DTensor: its uneven split (3 + 2) reaches fc2 with its true global shape.
            parallelize_module(b, mesh["tp"], {"fc1": ColwiseParallel(use_local_output=False), "fc2": RowwiseParallel()})
        shard_mesh = mesh["dp"]
    elif layout == "hsdp":
        shard_mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        shard_mesh = init_device_mesh("cpu", (world,))
    for b in model.blocks:
        fully_shard(b, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_steps(model, opt, steps, seed=99):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(0, 11, (4, 3), generator=g)
        model(idx).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def full_and_values(sd):
    """Full tensors (collective: every rank, in key order) and the JSON-able values of a flat state dict."""
    from torch.distributed.tensor import DTensor
    tensors, values = {}, {}

    def flat(d, prefix=""):  # nested layouts as dcp.save flattens them: "optim.state.w.exp_avg", "...param_groups.0.lr"
        for k, v in d.items():
            if isinstance(v, dict):
                yield from flat(v, f"{prefix}{k}.")
            elif isinstance(v, list) and v and all(isinstance(e, dict) for e in v):
                yield from flat({str(i): e for i, e in enumerate(v)}, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}", v
    for k, v in flat(sd):
        if isinstance(v, DTensor):
            tensors[k] = v.full_tensor()
        elif torch.is_tensor(v):
            tensors[k] = v.detach().clone()
        else:
            values[k] = list(v) if isinstance(v, tuple) else v
    return tensors, values


def write_reference(path, sd):
    import json
    tensors, values = full_and_values(sd)
    if dist.get_rank() == 0:
        save_file(tensors, path)
        with open(path + ".values.json", "w") as f:
            json.dump(values, f)


def distcp_worker(rank, world, port, mode, layout, ckpt, out, extra):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import DefaultLoadPlanner
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict, set_model_state_dict,
                                                             set_optimizer_state_dict)
        # PyTorch's default layout (nested: param_groups.<i>.<hp> and .params) with extra == "nested".
        flat = StateDictOptions(flatten_optimizer_state_dict=extra != "nested")

        def state(model, opt):
            sd = {"model." + k: v for k, v in get_model_state_dict(model).items()}
            sd.update({"optim." + k: v for k, v in get_optimizer_state_dict(model, opt, options=flat).items()})
            return sd

        if mode == "save":
            model, opt = build_layout(layout, world, seed=1000 + world)
            train_steps(model, opt, 2)
            sd = state(model, opt)
            if extra == "pyobj":
                sd["trainer.shape"] = torch.Size([2, 3])  # a Python object without a C++ form
            dcp.save(sd, checkpoint_id=ckpt)
            sd.pop("trainer.shape", None)
            write_reference(out, sd)
        else:
            model, opt = build_layout(layout, world, seed=2000 + world)
            train_steps(model, opt, 1, seed=5)  # other weights and state, all to be replaced
            sd = state(model, opt)
            # libfsdp's AdamW has no foreach/fused/maximize/...: PyTorch keeps its own for those keys.
            dcp.load(sd, checkpoint_id=ckpt, planner=DefaultLoadPlanner(allow_partial_load=True))
            set_model_state_dict(model, {k[6:]: v for k, v in sd.items() if k.startswith("model.")})
            set_optimizer_state_dict(model, opt, {k[6:]: v for k, v in sd.items() if k.startswith("optim.")},
                                     options=flat)
            write_reference(out, state(model, opt))  # what PyTorch's model and optimizer now hold
        dist.barrier()
    finally:
        dist.destroy_process_group()


def distcp_job(world, mode, layout, ckpt, out, extra=""):
    mp.start_processes(distcp_worker, args=(world, free_port(), mode, layout, str(ckpt), str(out), extra),
                       nprocs=world, join=True, start_method="spawn")


def load_reference(path):
    import json
    return load_file(str(path)), json.loads((path.parent / (path.name + ".values.json")).read_text())


def assert_cpp_state_matches(cpp_path, torch_path):
    """Every tensor libfsdp holds (model, AdamW moments) equals PyTorch's bit for bit; steps and hyper-parameters
    agree (PyTorch keeps step as a float tensor, libfsdp as an integer)."""
    cpp_t, cpp_v = load_reference(cpp_path)
    py_t, py_v = load_reference(torch_path)
    assert any(k.endswith(".exp_avg_sq") for k in cpp_t) and "model.head.weight" in cpp_t
    assert_same(py_t, cpp_t)
    steps = [k for k in cpp_v if k.endswith(".step")]
    assert steps
    for k in steps:
        assert float(py_t[k]) == cpp_v[k], (k, py_t[k], cpp_v[k])
    for k, v in cpp_v.items():
        if k.startswith("optim.param_groups."):
            assert py_v[k] == v, (k, py_v[k], v)


# ------------------------------------------------------------------------------------------------
# 1. PyTorch reads ours.
def test_pytorch_loads_libfsdp_checkpoint_on_another_world_size(tmp_path):
    ckpt, ref, out = tmp_path / "ck", tmp_path / "ref.safetensors", tmp_path / "py.safetensors"
    p = interop(3, "save", "--dir", ckpt, "--ref", ref, "--steps", 2)
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
    p = interop(2, "load", "--dir", ckpt, "--out", out, "--prefix", "")
    assert p.returncode == 0, show(p)
    assert_same(load_file(out), load_file(ref))
    # The tool reads it too (no libfsdp metadata: everything comes from the headers).
    ls = run_program([FSDP_CKPT, "ls", ckpt])
    assert ls.returncode == 0 and "format safetensors" in ls.stdout and "head.weight" in ls.stdout, show(ls)
    v = run_program([FSDP_CKPT, "verify", ckpt])
    assert v.returncode == 0 and "no checksums" in v.stdout, show(v)


# ------------------------------------------------------------------------------------------------
# 3. kill -9 in the middle of a save.
@pytest.mark.parametrize("kill_rank,stage", [(1, "write"), (0, "before_metadata"), (0, "before_rename"),
                                             (0, "before_latest")])
def test_kill9_mid_save_leaves_previous_checkpoint(tmp_path, kill_rank, stage):
    parent, ref, out = tmp_path / "ckpts", tmp_path / "ref.safetensors", tmp_path / "loaded.safetensors"
    p = interop(2, "crash-save", "--parent", parent, "--ref", ref, "--kill-rank", kill_rank, "--kill-stage", stage)
    assert p.returncode != 0, show(p)
    assert f"SIGKILL at {stage}" in p.stderr, show(p)
    assert (parent / "latest").read_text().strip() == "step-1"
    # Before the rename only a DIR.tmp-* folder exists; after it the new folder is complete but not `latest`.
    assert (parent / "step-2").exists() == (stage == "before_latest")
    v = run_program([FSDP_CKPT, "verify", parent / "latest"])
    assert v.returncode == 0 and "every checksum matches" in v.stdout, show(v)
    if stage == "before_latest":
        v2 = run_program([FSDP_CKPT, "verify", parent / "step-2"])
        assert v2.returncode == 0, show(v2)
    # The previous checkpoint loads (on another world size) and holds the step-1 weights.
    p = interop(3, "load", "--dir", parent / "latest", "--out", out)
    assert p.returncode == 0, show(p)
    want = load_file(ref)
    assert_same(load_file(out), {k: v for k, v in want.items() if k.startswith("model.")})
    # The next save into step-2 removes the crashed attempt's temporary folder.
    if stage != "before_latest":
        assert any(".tmp-" in f.name for f in parent.iterdir())
        p = interop(2, "save", "--dir", parent / "step-2", "--ref", tmp_path / "ref2.safetensors")
        assert p.returncode == 0, show(p)
        assert not any(".tmp-" in f.name for f in parent.iterdir()), list(parent.iterdir())
        assert (parent / "latest").read_text().strip() == "step-2"



# 5. PyTorch's optimizer continues from libfsdp's state.
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_pytorch_optimizer_continues_from_libfsdp_state(tmp_path, kind):
    ckpt, ref, nxt, out = tmp_path / "ck", tmp_path / "ref.safetensors", tmp_path / "next.safetensors", tmp_path / "py.safetensors"
    p = interop(3, "save", "--dir", ckpt, "--ref", ref, "--steps", 2, "--optim", kind, "--next", nxt)
    assert p.returncode == 0, show(p)
    python_job(2, "optim-" + kind, ckpt, ref=nxt, out=out)
    got, want, before = load_file(out), load_file(nxt), load_file(ref)
    keys = sorted(k for k in want if k.startswith("model."))
    assert sorted(got) == keys
    for k in keys:
        # The same arithmetic in another order (PyTorch's gradient reduction over 2 ranks, ours over 3): rounding.
        diff = (got[k] - want[k]).abs().max().item()
        assert diff <= 2e-6, f"{k}: max |diff| {diff} between PyTorch's step and libfsdp's"
    # The step moved the parameters by far more than that (the comparison is not vacuous).
    assert max((want[k] - before[k]).abs().max().item() for k in keys) > 1e-3


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
    p = run_program([INTEROP, "copy-file", "--in", src, "--out", out], timeout=60)
    assert p.returncode == 0, show(p)
    assert_same(load_file(str(out)), want)
    with safe_open(str(out), "pt") as f:
        assert f.metadata() == {"producer": "checkpoint_interop"}
    # A file that is not safetensors fails with the path, not a crash.
    (tmp_path / "junk.safetensors").write_bytes(b"\x04" + b"\0" * 7 + b"{no}")
    p = run_program([INTEROP, "copy-file", "--in", tmp_path / "junk.safetensors", "--out", tmp_path / "x"], timeout=60)
    assert p.returncode == 1 and "dcp::load_file: " in p.stderr and "malformed safetensors header" in p.stderr, show(p)


# ------------------------------------------------------------------------------------------------
# 5. PyTorch's default format.
@pytest.mark.parametrize("layout,world", [("fsdp", 2), ("hsdp", 4), ("tp", 4)])
def test_pytorch_loads_libfsdp_distcp_checkpoint(tmp_path, layout, world):
    ckpt, ref, out = tmp_path / "ck", tmp_path / "ref.safetensors", tmp_path / "py.safetensors"
    p = interop(3, "save", "--dir", ckpt, "--ref", ref, "--steps", 2, "--format", "distcp")
    assert p.returncode == 0, show(p)
    assert (ckpt / ".metadata").exists() and (ckpt / "__2_0.distcp").exists(), sorted(ckpt.iterdir())
    distcp_job(world, "load", layout, ckpt, out)
    assert_cpp_state_matches(ref, out)


@pytest.mark.parametrize("first,world1,cpp_mesh,then,world2", [
    ("fsdp", 3, "2", "fsdp", 2),
    ("hsdp", 4, "3", "tp", 4),
    ("tp", 4, "2,2", "hsdp", 4),
])
def test_round_trip_pytorch_libfsdp_pytorch(tmp_path, first, world1, cpp_mesh, then, world2):
    """PyTorch saves (layout `first`), libfsdp loads (another world size or mesh) and saves in PyTorch's format,
    PyTorch loads that into layout `then`: every tensor and counter comes back bit for bit."""
    ck1, ck2 = tmp_path / "ck1", tmp_path / "ck2"
    ref, cpp, back = tmp_path / "ref.safetensors", tmp_path / "cpp.safetensors", tmp_path / "back.safetensors"
    distcp_job(world1, "save", first, ck1, ref)
    nproc = 1
    for d in cpp_mesh.split(","):
        nproc *= int(d)
    mesh = ["--mesh", cpp_mesh] if "," in cpp_mesh else []
    p = interop(nproc, "load", "--dir", ck1, "--out", cpp, "--optim", 1, "--resave", ck2, *mesh)
    assert p.returncode == 0, show(p)
    assert_cpp_state_matches(cpp, ref)
    distcp_job(world2, "load", then, ck2, back)
    assert_cpp_state_matches(cpp, back)
    py_ref, _ = load_reference(ref)
    py_back, _ = load_reference(back)
    assert_same(py_back, py_ref, keys=sorted(load_file(str(cpp))))


def test_round_trip_in_pytorchs_nested_optimizer_layout(tmp_path):
    """PyTorch's default get_state_dict layout (nested: param_groups.0.lr, param_groups.0.params) through dcp.save,
    into libfsdp's nested layout on 2 ranks, saved again and read back by PyTorch: the same tensors and groups."""
    ck1, ck2 = tmp_path / "ck1", tmp_path / "ck2"
    ref, cpp, back = tmp_path / "ref.safetensors", tmp_path / "cpp.safetensors", tmp_path / "back.safetensors"
    distcp_job(3, "save", "fsdp", ck1, ref, extra="nested")
    p = interop(2, "load", "--dir", ck1, "--out", cpp, "--optim", 1, "--nested", 1, "--resave", ck2)
    assert p.returncode == 0, show(p)
    distcp_job(2, "load", "fsdp", ck2, back, extra="nested")
    py_ref, ref_v = load_reference(ref)
    py_back, back_v = load_reference(back)
    cpp_t, cpp_v = load_reference(cpp)
    assert "optim.param_groups.0.params" in ref_v and "optim.param_groups.0.lr" in ref_v, sorted(ref_v)[:8]
    assert_same(py_back, py_ref, keys=sorted(cpp_t))
    for k in ("optim.param_groups.0.lr", "optim.param_groups.0.betas", "optim.param_groups.0.params"):
        assert back_v[k] == ref_v[k], (k, back_v[k], ref_v[k])


def test_fsdp_ckpt_reads_and_consolidates_a_pytorch_distcp_checkpoint(tmp_path):
    """A single-process dcp.save (nested dicts, an int, a scheduler-like dict): fsdp-ckpt lists it, verifies it and
    consolidates it into Hugging Face safetensors with the same tensors bit for bit."""
    import torch.distributed.checkpoint as dcp
    import warnings
    g = torch.Generator().manual_seed(3)
    sd = {"model": {"w": torch.randn(5, 3, generator=g), "b": torch.randn(3, generator=g).bfloat16()}, "step": 4,
          "sched": {"last_epoch": 3, "base_lrs": [0.1]}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(sd, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    ls = run_program([FSDP_CKPT, "ls", tmp_path / "ck"])
    assert ls.returncode == 0 and "format torch-dcp" in ls.stdout and "sched.last_epoch = 3" in ls.stdout, show(ls)
    v = run_program([FSDP_CKPT, "verify", tmp_path / "ck"])
    assert v.returncode == 0 and "every tensor covered exactly once" in v.stdout, show(v)
    c = run_program([FSDP_CKPT, "consolidate", tmp_path / "ck", tmp_path / "hf"])
    assert c.returncode == 0, show(c)
    assert_same(load_file(str(tmp_path / "hf" / "model.safetensors")), {"model.w": sd["model"]["w"],
                                                                       "model.b": sd["model"]["b"]})


def test_python_object_value_is_refused_by_name(tmp_path):
    ck, ref, out = tmp_path / "ck", tmp_path / "ref.safetensors", tmp_path / "cpp.safetensors"
    distcp_job(2, "save", "fsdp", ck, ref, extra="pyobj")
    # Strict: PyTorch's param-group options LibTorch lacks (and trainer.shape) are unexpected keys.
    p = interop(2, "load", "--dir", ck, "--out", out, "--optim", 1, "--strict", 1)
    assert p.returncode == 1 and "'optim.param_groups.blocks.0.fc1.bias.capturable'" in p.stderr, show(p)
    # Not strict: loads, trainer.shape skipped.
    p = interop(2, "load", "--dir", ck, "--out", out, "--optim", 1)
    assert p.returncode == 0, show(p)
    p = interop(2, "load", "--dir", ck, "--out", out, "--optim", 1, "--value", "trainer.shape")
    assert p.returncode == 1, show(p)
    assert "'trainer.shape' in " in p.stderr and "torch.Size(...)" in p.stderr and "which has no C++ form" in p.stderr, \
        show(p)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
