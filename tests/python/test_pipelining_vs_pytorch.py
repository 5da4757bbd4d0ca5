"""libfsdp's pipeline schedules against PyTorch's own torch.distributed.pipelining on the same model, weights,
batches, loss and optimizer (bench/compare_pipeline.py: build/bin/bench_pipeline under fsdprun beside
bench/pp_twin.py under torchrun, 2 ranks over Gloo): every microbatch loss of every step must agree within 1e-5
(they are bitwise equal when both sides run the same kernels in the same order). A small model, so that this is
a parity test, not a benchmark (the timings it prints mean nothing)."""

import re
import subprocess
import sys

from fsdp_testing import BUILD, REPO, clean_env


def test_losses_equal_pytorchs_for_every_runtime_path():
    env = clean_env()
    env["FSDP_BUILD_DIR"] = str(BUILD)
    # 1F1B (one stage per rank), interleaved zero bubble (several stages per rank, split backward) and ZBV
    # (the last stage on rank 0, stages handing over in memory).
    cmd = [sys.executable, str(REPO / "bench" / "compare_pipeline.py"), "--nproc", "2", "--blocks", "4", "--d", "32",
           "--batch", "16", "--steps", "2", "--warmup", "1", "--microbatches", "4", "--repeats", "1",
           "--schedules", "1f1b", "interleaved-zero-bubble", "zbv-zero-bubble"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    rows = re.findall(r"^\| (\S+) \| 4 \|.*\| (\S+) \|$", p.stdout, flags=re.M)
    assert sorted(r[0] for r in rows) == ["1f1b", "interleaved-zero-bubble", "zbv-zero-bubble"], out
    for schedule, diff in rows:
        assert float(diff) <= 1e-5, f"{schedule}: losses differ from PyTorch's by {diff}\n{out}"
    print(f"[pipelining vs PyTorch] largest loss difference: {max(float(d) for _, d in rows):.1e}")
