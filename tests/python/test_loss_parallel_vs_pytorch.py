"""loss_parallel against PyTorch's own (issue 35; CTest labels tensor_parallel, vs_pytorch).

The same bias-free head Linear(16, V) (weights and inputs from sin/cos formulas both sides evaluate alike),
ColwiseParallel over 2 ranks on Gloo: libfsdp's fsdp::tp::vocab_parallel_cross_entropy on the head's local
output (tests/tensor/parallel/loss_parallel_twin.cpp under fsdprun) against PyTorch's
`with loss_parallel(): F.cross_entropy(dtensor_logits, target)` on a ColwiseParallel(use_local_output=False) head
(this file's worker under torchrun). Loss, local logits gradient, head weight gradient (local rows) and input
gradient within 1e-5. PyTorch's loss_parallel does not support label_smoothing (documented as such; in torch 2.13
it fails with "aten.masked_fill_.Scalar got mixed torch.Tensor and DTensor"); with smoothing the reference is one
process's F.cross_entropy on the same logits.

FSDP_BUILD_DIR is the CMake build directory (default: <repo>/build).
"""

import os
import sys
from pathlib import Path

import pytest

from fsdp_testing import BUILD, TORCHRUN, free_port, fsdprun_cmd, run_program, run_pytorch_reference, show

TWIN = BUILD / "bin" / "loss_parallel_twin"
BINARIES = (TWIN,)
TOL = 1e-5
D = 16


def inputs(vocab, rows):
    import torch
    w = (torch.arange(vocab * D, dtype=torch.float32).view(vocab, D) * 0.31).sin()
    x = (torch.arange(rows * D, dtype=torch.float32).view(rows, D) * 0.13).cos()
    target = (torch.arange(rows, dtype=torch.int64) * 7 + 3).remainder(vocab)
    target[1] = -100
    return w, x, target


def worker(out, vocab, rows, smoothing, reduction):
    """PyTorch's side, one rank of torchrun: DTensor logits from a ColwiseParallel head, loss_parallel."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module

    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    w, x, target = inputs(vocab, rows)
    head = torch.nn.Linear(D, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(w)
    parallelize_module(head, mesh, ColwiseParallel(use_local_output=False))
    x.requires_grad_(True)
    logits = head(x)  # DTensor [rows, V], Shard(-1)
    logits.retain_grad()
    with loss_parallel():
        loss = F.cross_entropy(logits, target, reduction=reduction, label_smoothing=smoothing)
        (loss.sum() if reduction == "none" else loss).backward()
    save_file({"loss": loss.full_tensor().contiguous(), "logits_grad": logits.grad.to_local().contiguous(),
               "weight_grad": head.weight.grad.to_local().contiguous(), "x_grad": x.grad.contiguous()},
              f"{out}/rank{dist.get_rank()}.safetensors")
    # Both ranks out of every collective before either tears Gloo down (a teardown race of PyTorch's aborted
    # one CI run with "terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


def run_torch(out, *args):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parent))
    cmd = [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", f"--master-port={free_port()}", __file__,
           "worker", str(out), *map(str, args)]
    return run_pytorch_reference(cmd, env=env, timeout=300)


def load(out, rank):
    from safetensors.torch import load_file
    return load_file(f"{out}/rank{rank}.safetensors")


def max_diff(a, b):
    return (a - b).abs().max().item() if a.numel() else 0.0


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_loss_parallel_matches_pytorchs(tmp_path, reduction):
    vocab, rows = 50, 12
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir()
    theirs.mkdir()
    p = run_program(fsdprun_cmd(2, TWIN, ours, vocab, rows, 0.0, reduction), timeout=300)
    assert p.returncode == 0, show(p)
    p = run_torch(theirs, vocab, rows, 0.0, reduction)
    assert p.returncode == 0, show(p)
    worst = 0.0
    for r in range(2):
        a, b = load(ours, r), load(theirs, r)
        for k in ("loss", "logits_grad", "weight_grad", "x_grad"):
            assert a[k].shape == b[k].shape, (k, a[k].shape, b[k].shape)
            d = max_diff(a[k], b[k])
            worst = max(worst, d)
            assert d <= TOL, (reduction, r, k, d)
    print(f"loss_parallel vs PyTorch's ({reduction}): max |diff| {worst:.3g}")


def test_label_smoothing_matches_one_process(tmp_path):
    # PyTorch's loss_parallel does not take label_smoothing; the reference is one process's cross_entropy.
    import torch
    import torch.nn.functional as F
    vocab, rows, smoothing = 50, 12, 0.1
    p = run_program(fsdprun_cmd(2, TWIN, tmp_path, vocab, rows, smoothing, "mean"), timeout=300)
    assert p.returncode == 0, show(p)
    w, x, target = inputs(vocab, rows)
    w.requires_grad_(True)
    x.requires_grad_(True)
    logits = x @ w.t()
    logits.retain_grad()
    loss = F.cross_entropy(logits, target, label_smoothing=smoothing)
    loss.backward()
    worst = 0.0
    for r in range(2):
        a = load(tmp_path, r)
        cols = slice(r * vocab // 2, (r + 1) * vocab // 2)
        for k, ref in (("loss", loss.detach()), ("logits_grad", logits.grad[:, cols]), ("weight_grad", w.grad[cols]),
                       ("x_grad", x.grad)):
            d = max_diff(a[k], ref)
            worst = max(worst, d)
            assert d <= TOL, (r, k, d)
    print(f"loss_parallel with label smoothing vs one process: max |diff| {worst:.3g}")


def test_pytorchs_loss_parallel_fails_with_label_smoothing(tmp_path):
    # Documents why the test above compares against one process (torch 2.13 on CPU/Gloo).
    p = run_torch(tmp_path, 50, 12, 0.1, "mean")
    assert p.returncode != 0
    assert "got mixed torch.Tensor and DTensor" in p.stdout + p.stderr, show(p)


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "worker":
    worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]), sys.argv[6])
