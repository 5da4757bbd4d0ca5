"""train_gpt with context parallelism (issue 35 item 4; CTest labels context_parallel, train_gpt).

Tiny preset (2 heads, context 32), 6 AdamW steps, fp32, one thread per rank. The global batch is the same in every
layout (4 sequences: --batch-size counts sequences per data-parallel rank, and a CP group, like a TP group, shares
its batch while each of its ranks holds 1/cp of every sequence, load-balanced), so every layout must train like one
process on the full sequences (--cp 1, --batch-size 4): losses, evaluation losses and gradient norms within 1e-5
(relative; the ring attention and FSDP's reductions sum in another order). Layouts: --cp 2 (2 ranks), --cp 2 --tp 2
(4 ranks), --cp 4 (4 ranks), --cp 2 with 2 FSDP ranks (4 ranks: the (dp_shard, cp) HSDP mesh), --cp 2 with full
activation checkpointing and --cp 2 --tp 2 with selective-op checkpointing. Unsupported
combinations fail naming the flag.

PyTorch's own context_parallel does not run on the CPU (PyTorch 2.13, Gloo: "Operator
aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy registered"), so the
reference here is the semantics it implements: one process on the full sequence, train_gpt's own (--cp 1) and
PyTorch's (bench/gpt_twin.py: the same GPT under PyTorch's fully_shard, F.scaled_dot_product_attention on whole
sequences, torch.optim.AdamW; same initial weights and batches).

FSDP_BUILD_DIR is the CMake build directory (default: <repo>/build).
"""

import sys

import pytest

from fsdp_testing import FSDPRUN, REPO, TRAIN_GPT, metrics, run, show

sys.path.insert(0, str(REPO / "bench"))
import compare_fsdp2 as cmp  # noqa: E402  (bench/compare_fsdp2.py: the launchers of train_gpt and gpt_twin.py)

BINARIES = (FSDPRUN, TRAIN_GPT)

RTOL = 1e-5
STEPS = 6


def args(text_files, tmp_path, name, *extra, steps=STEPS):
    return ["--model", "tiny", "--data", *text_files, "--seed", "7", "--threads", "1", "--steps", str(steps),
            "--log-every", "1", "--eval-every", "3", "--warmup-steps", "2", "--sample-tokens", "0",
            "--metrics", tmp_path / f"{name}.jsonl", *extra]


def by_step(path):
    return {r["step"]: r for r in metrics(path)}


@pytest.fixture(scope="module")
def one_process(text_files, tmp_path_factory):
    d = tmp_path_factory.mktemp("cp1")
    p = run(args(text_files, d, "m", "--batch-size", "4"), nproc=1)
    assert p.returncode == 0, show(p)
    return by_step(d / "m.jsonl")


@pytest.mark.parametrize("name,nproc,extra", [
    ("cp2", 2, ["--cp", "2", "--batch-size", "4"]),
    ("cp2_tp2", 4, ["--cp", "2", "--tp", "2", "--batch-size", "4"]),
    ("cp4", 4, ["--cp", "4", "--batch-size", "4"]),
    ("dp2_cp2", 4, ["--cp", "2", "--batch-size", "2"]),
    # Activation checkpointing: the blocks' recomputation in backward runs the ring attention (and its all-gathers)
    # again, inside the same region; under selective-op the ring attention is recomputed too (the policy sees the
    # ops on the ring attention's inputs, not the attention itself, which context parallelism runs below the layers).
    ("cp2_ac_full", 2, ["--cp", "2", "--batch-size", "4", "--activation-checkpointing", "full"]),
    ("cp2_tp2_sac", 4, ["--cp", "2", "--tp", "2", "--batch-size", "4", "--activation-checkpointing", "selective-op"]),
])
def test_context_parallel_trains_like_one_process(text_files, tmp_path, one_process, name, nproc, extra):
    p = run(args(text_files, tmp_path, name, *extra), nproc=nproc)
    assert p.returncode == 0, show(p)
    assert "context-parallel" in p.stdout, p.stdout[-2000:]
    got = by_step(tmp_path / f"{name}.jsonl")
    assert sorted(got) == sorted(one_process), (sorted(got), sorted(one_process))
    worst = 0.0
    for s in sorted(one_process):
        for k in ("loss", "eval_loss", "grad_norm"):
            a, b = got[s].get(k), one_process[s].get(k)
            if b is None:
                continue
            assert a is not None, f"{name}: step {s} has no {k}"
            worst = max(worst, abs(a - b) / abs(b))
            assert abs(a - b) <= RTOL * abs(b), f"{name}: step {s} {k} {a} vs {b} (--cp 1, one process)"
    # The sequence really was split: the cp group carries the ring attention's all-gathers (K and V of each of the
    # 2 blocks, in forward and again in backward: 8 per step) besides FSDP's (at least one per group: 3), where
    # FSDP alone would issue 5; and its reduce-scatters of dK/dV (4) besides FSDP's 3.
    comm = got[max(got)]["comm_per_step"]["cp"]
    assert comm["all_gather_into_tensor"]["count"] >= 8 + 3, comm
    assert comm["reduce_scatter_tensor"]["count"] >= 4 + 3, comm
    print(f"{name}: max relative difference {worst:.2e} over {len(one_process)} steps; cp group per step: {comm}")


@pytest.mark.parametrize("extra,message", [
    (["--cp", "2", "--tp", "2", "--sequence-parallel"], "--cp 2: does not combine with --sequence-parallel"),
    (["--cp", "2", "--block-size", "30"], "--cp 2: the context of 30 tokens (--block-size) is not a multiple of 2 x --cp = 4"),
    (["--cp", "2", "--model-impl", "plain"], "--cp 2: needs --model-impl holder"),
    (["--cp", "2", "--dropout", "0.1"], "--cp 2: --dropout > 0 is not supported"),
    (["--cp", "3", "--block-size", "24"], "WORLD_SIZE 4 is not divisible by --dp-replicate(1) x --cp(3) x --tp(1) = 3"),
])
def test_bad_layouts_fail_naming_the_flag(text_files, tmp_path, extra, message):
    p = run(args(text_files, tmp_path, "bad", "--batch-size", "2", *extra, steps=2), nproc=4)
    assert p.returncode != 0, show(p)
    assert message in p.stdout + p.stderr, show(p)


@pytest.mark.parametrize("name,nproc,extra", [("cp2", 2, ["--cp", "2"]), ("cp2_tp2", 4, ["--cp", "2", "--tp", "2"])])
def test_context_parallel_matches_pytorch_on_whole_sequences(tmp_path, name, nproc, extra):
    # Every rank of ours holds 1/cp of each sequence; every rank of the twin holds the same whole sequences (train_gpt
    # --dump-batches records each rank's batch before context_parallel shards it, the same on the ranks of a CP/TP
    # group), so the twin's FSDP mean over its ranks is one process's loss. 10 steps, fp32, within 1e-5.
    flags = ["--model", "tiny", "--batch-size", "4", "--seed", "7", "--steps", "10", "--warmup-steps", "3", *extra]
    ours = cmp.run_ours(flags, cmp.default_data(), tmp_path / "ours.jsonl", nproc=nproc,
                        save_init=tmp_path / "init.safetensors", dump_batches=tmp_path / "batches", timeout=300)
    theirs = cmp.run_torch(tmp_path / "init.safetensors", tmp_path / "batches", tmp_path / "torch.jsonl", nproc=nproc,
                           math="torch", timeout=300)
    assert [r["step"] for r in ours] == [r["step"] for r in theirs] == list(range(1, 11)), (ours, theirs)
    dl = max(abs(a["loss"] - b["loss"]) for a, b in zip(ours, theirs))
    dg = max(abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"] for a, b in zip(ours, theirs))
    print(f"{name} vs PyTorch: max |dloss| {dl:.3g}, max relative grad-norm difference {dg:.3g}")
    assert dl <= RTOL, [(a["loss"], b["loss"]) for a, b in zip(ours, theirs)]
    assert dg <= RTOL, [(a["grad_norm"], b["grad_norm"]) for a, b in zip(ours, theirs)]
    assert ours[-1]["loss"] < ours[0]["loss"] - 0.3, [r["loss"] for r in ours]
