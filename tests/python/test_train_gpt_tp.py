"""train_gpt with tensor parallelism (issue 15; CTest labels tensor_parallel, train_gpt).

4 ranks through fsdprun, tiny preset (2 heads, context 32), 10 AdamW steps, fp32. The global batch is
the same in every layout (8 sequences: --batch-size is per data-parallel rank, and a TP group shares
its batch), so every layout must train like FSDP alone on 4 ranks: losses, evaluation losses and
gradient norms within 1e-5 (relative; TP sums the blocks' matmuls in another order). Layouts: --tp 2
(dp_shard 2), --tp 2 --sequence-parallel, HSDP + TP (--dp-replicate 2 --tp 2), and the unchanged model
(--model-impl plain) with sequence parallelism, and with full or selective activation checkpointing; Llama
(llama-tiny, 5 steps) with --tp 2, with --sequence-parallel (RMSNorm SP, the sequence split and gathered by
PrepareModuleOutput/PrepareModuleInput plan entries) and its plain model. bf16 mixed precision tracks FSDP alone in bf16 to bf16's
precision. Checkpoints move between layouts; bad layouts fail with the flag to change.

Issue 35: with --tp the tied wte/lm_head are vocabulary-parallel under loss_parallel by default (the logits are
never gathered), so every layout above trains that way (and "tp2_no_loss_parallel" the gathered way); dropout
under --tp draws from the DTensor RNG and trains like --tp 1 with --dtensor-rng (same seed, same data ranks).

FSDP_BUILD_DIR is the CMake build directory (default: <repo>/build).
"""

import pytest

from fsdp_testing import FSDPRUN, TRAIN_GPT, metrics, run, show

BINARIES = (FSDPRUN, TRAIN_GPT)

RTOL = 1e-5
STEPS = 10


def args(text_files, tmp_path, name, *extra, steps=STEPS):
    return ["--model", "tiny", "--data", *text_files, "--seed", "7", "--threads", "1", "--steps", str(steps),
            "--log-every", "1", "--eval-every", "5", "--warmup-steps", "2", "--sample-tokens", "0",
            "--metrics", tmp_path / f"{name}.jsonl", *extra]


def by_step(path):
    return {r["step"]: r for r in metrics(path)}


def assert_same_training(got, ref, what, steps=None):
    steps = steps or sorted(ref)
    for s in steps:
        for k in ("loss", "eval_loss", "grad_norm"):
            a, b = got[s].get(k), ref[s].get(k)
            if b is None:
                continue
            assert a is not None, f"{what}: step {s} has no {k}"
            assert abs(a - b) <= RTOL * abs(b), f"{what}: step {s} {k} {a} vs {b} (FSDP alone)"


@pytest.fixture(scope="module")
def fsdp_alone(text_files, tmp_path_factory):
    d = tmp_path_factory.mktemp("fsdp_alone")
    p = run(args(text_files, d, "m", "--batch-size", "2"), nproc=4)
    assert p.returncode == 0, show(p)
    return by_step(d / "m.jsonl")


@pytest.mark.parametrize("name,extra", [
    ("tp2", ["--tp", "2"]),
    ("tp2_no_loss_parallel", ["--tp", "2", "--no-loss-parallel"]),
    ("tp2_sp", ["--tp", "2", "--sequence-parallel"]),
    ("hsdp_tp2", ["--tp", "2", "--dp-replicate", "2"]),
    ("plain_tp2_sp", ["--tp", "2", "--sequence-parallel", "--model-impl", "plain"]),
    # Activation checkpointing of the unchanged blocks (recorded and replayed regions) over TP's parameters: the
    # replay runs the TP styles' collectives again, as PyTorch's recomputation does.
    ("tp2_sp_ac", ["--tp", "2", "--sequence-parallel", "--activation-checkpointing", "full"]),
    ("plain_tp2_sp_ac", ["--tp", "2", "--sequence-parallel", "--model-impl", "plain", "--activation-checkpointing",
                         "full"]),
    ("plain_tp2_sac", ["--tp", "2", "--model-impl", "plain", "--activation-checkpointing", "selective-op"]),
])
def test_tensor_parallel_layouts_train_like_fsdp_alone(text_files, tmp_path, fsdp_alone, name, extra):
    p = run(args(text_files, tmp_path, name, "--batch-size", "4", *extra), nproc=4)
    assert p.returncode == 0, show(p)
    assert "x 2 tensor-parallel" in p.stdout, p.stdout[-2000:]
    # loss_parallel (issue 35) is on by default with --tp for the holder model's tied head.
    assert ("loss parallel" in p.stdout) == ("plain" not in name and "no_loss_parallel" not in name), p.stdout[-2000:]
    got = by_step(tmp_path / f"{name}.jsonl")
    assert sorted(got) == sorted(fsdp_alone), (sorted(got), sorted(fsdp_alone))
    assert_same_training(got, fsdp_alone, name)


def test_bf16_tensor_parallel_tracks_fsdp_alone_in_bf16(text_files, tmp_path):
    # The reference does the same casts (MixedPrecisionPolicy: bf16 parameters and compute, fp32 gradient
    # reduction); TP adds bf16 partial sums (row-parallel matmuls, then an all-reduce in bf16), so the runs
    # agree to bf16's precision, not fp32's: 5e-3 relative (bf16's unit roundoff is 3.9e-3). Measured:
    # 5e-4 (--tp 2), 7e-4 (with --sequence-parallel) over 10 steps.
    p = run(args(text_files, tmp_path, "ref", "--batch-size", "2", "--mixed-precision", "bf16"), nproc=4)
    assert p.returncode == 0, show(p)
    ref = by_step(tmp_path / "ref.jsonl")
    for name, extra in (("tp2", ["--tp", "2"]), ("tp2_sp", ["--tp", "2", "--sequence-parallel"])):
        p = run(args(text_files, tmp_path, name, "--batch-size", "4", "--mixed-precision", "bf16", *extra), nproc=4)
        assert p.returncode == 0, show(p)
        got = by_step(tmp_path / f"{name}.jsonl")
        for s in sorted(ref):
            for k in ("loss", "eval_loss"):
                if ref[s].get(k) is not None:
                    assert abs(got[s][k] - ref[s][k]) <= 5e-3 * abs(ref[s][k]), (name, s, k, got[s][k], ref[s][k])


def test_sequence_parallel_samples_the_same_text(text_files, tmp_path):
    # Sampling pads the context on the right to a multiple of --tp (exact: attention is causal).
    texts = []
    for extra in (["--batch-size", "2"], ["--tp", "2", "--sequence-parallel", "--batch-size", "4"]):
        # (the later --sample-tokens wins)
        p = run(args(text_files, tmp_path, "s", *extra, steps=3) + ["--sample-tokens", "12", "--temperature", "0"],
                nproc=4)
        assert p.returncode == 0, show(p)
        texts.append(p.stdout.split("sample (")[1].split("----")[1])
        assert len(texts[-1].strip()) > 12, p.stdout[-1000:]
    assert texts[0] == texts[1], texts


def test_checkpoints_move_between_tensor_parallel_layouts(text_files, tmp_path, fsdp_alone):
    # Saved at step 5 under TP with sequence parallelism, resumed under FSDP alone; and the other way.
    for first, then in ((["--tp", "2", "--sequence-parallel", "--batch-size", "4"], ["--batch-size", "2"]),
                        (["--batch-size", "2"], ["--tp", "2", "--batch-size", "4"])):
        ck = tmp_path / f"ck_{len(first)}"
        p = run(args(text_files, tmp_path, "first", *first, "--ckpt-dir", ck, "--ckpt-every", "5", "--stop-at", "5"),
                nproc=4)
        assert p.returncode == 0, show(p)
        p = run(args(text_files, tmp_path, "then", *then, "--ckpt-dir", ck, "--resume", "always"), nproc=4)
        assert p.returncode == 0, show(p)
        assert "resume: " in p.stdout and "continuing at step 6/10" in p.stdout, p.stdout[-2000:]
        got = by_step(tmp_path / "then.jsonl")
        assert_same_training(got, fsdp_alone, f"{first} -> {then}", steps=[s for s in range(6, STEPS + 1)])


LLAMA_STEPS = 5


@pytest.fixture(scope="module")
def llama_fsdp_alone(text_files, tmp_path_factory):
    d = tmp_path_factory.mktemp("llama_fsdp_alone")
    p = run(args(text_files, d, "m", "--batch-size", "2", "--model", "llama-tiny", steps=LLAMA_STEPS), nproc=4)
    assert p.returncode == 0, show(p)
    return by_step(d / "m.jsonl")


# Llama (RMSNorm, RoPE, grouped-query attention, SwiGLU) under TP and sequence parallelism: the RMSNorms run on each
# rank's positions (SequenceParallel on train_gpt's own RMSNorm module), the sequence is split at the embedding's
# holder and gathered at the head's (PrepareModuleOutput / PrepareModuleInput plan entries, no call in the model's
# forward); the plain model splits and gathers in its forward. Same global batch as FSDP alone on 4 ranks.
@pytest.mark.parametrize("name,extra", [
    ("llama_tp2", ["--tp", "2"]),
    ("llama_tp2_sp", ["--tp", "2", "--sequence-parallel"]),
    ("llama_plain_tp2_sp", ["--tp", "2", "--sequence-parallel", "--model-impl", "plain"]),
])
def test_llama_sequence_parallel_trains_like_fsdp_alone(text_files, tmp_path, llama_fsdp_alone, name, extra):
    p = run(args(text_files, tmp_path, name, "--batch-size", "4", "--model", "llama-tiny", *extra, steps=LLAMA_STEPS),
            nproc=4)
    assert p.returncode == 0, show(p)
    assert "x 2 tensor-parallel" in p.stdout, p.stdout[-2000:]
    got = by_step(tmp_path / f"{name}.jsonl")
    assert sorted(got) == sorted(llama_fsdp_alone), (sorted(got), sorted(llama_fsdp_alone))
    assert_same_training(got, llama_fsdp_alone, name)
    worst = max(abs(got[s][k] - llama_fsdp_alone[s][k]) / abs(llama_fsdp_alone[s][k])
                for s in got for k in ("loss", "grad_norm") if llama_fsdp_alone[s].get(k))
    print(f"[{name}] largest relative difference from FSDP alone: {worst:.1e}")


@pytest.mark.parametrize("extra,message", [
    (["--tp", "3"], "WORLD_SIZE 4 is not divisible by --dp-replicate(1) x --tp(3) = 3"),
    (["--tp", "4"], "--tp 4: the 2 heads (--n-head) do not split evenly"),
    (["--sequence-parallel"], "--sequence-parallel needs --tp > 1"),
    (["--tp", "2", "--dropout", "0.1", "--model-impl", "plain"],
     "--dropout > 0 with tensor parallelism needs the GPT-2 holder model and no --pp"),
    (["--loss-parallel"], "--loss-parallel: it needs --tp > 1"),
    (["--tp", "2", "--dropout", "0.1", "--activation-checkpointing", "full"],
     "the recomputed blocks would draw other masks than the forward"),
    (["--tp", "2", "--loss-parallel", "--model-impl", "plain"], "--loss-parallel: it needs --model-impl holder"),
])
def test_bad_layouts_fail_naming_the_flag(text_files, tmp_path, extra, message):
    p = run(args(text_files, tmp_path, "bad", "--batch-size", "2", *extra, steps=2), nproc=4)
    assert p.returncode != 0, show(p)
    assert message in p.stdout + p.stderr, show(p)


# Dropout under TP (issue 35): the DTensor RNG gives every layout the masks one process would draw, so --tp 2 with
# dropout trains like --tp 1 with --dtensor-rng on the same data ranks: 2 ranks (tp 2) vs 1 rank, and 4 ranks
# (dp 2 x tp 2, also with sequence parallelism) vs 2 ranks (dp 2). Losses, evaluation losses and gradient norms
# within 1e-5; the dropout must matter (the losses differ from a run without it).
@pytest.mark.parametrize("nproc,extra", [
    (2, ["--tp", "2"]),
    (4, ["--tp", "2"]),
    (4, ["--tp", "2", "--sequence-parallel"]),
])
def test_dropout_under_tp_trains_like_one_tp_rank(text_files, tmp_path, nproc, extra):
    common = ["--batch-size", "4", "--dropout", "0.1"]
    p = run(args(text_files, tmp_path, "ref", *common, "--dtensor-rng", steps=5), nproc=nproc // 2)
    assert p.returncode == 0, show(p)
    assert "DTensor RNG" in p.stdout, p.stdout[-2000:]
    ref = by_step(tmp_path / "ref.jsonl")
    p = run(args(text_files, tmp_path, "tp", *common, *extra, steps=5), nproc=nproc)
    assert p.returncode == 0, show(p)
    assert "DTensor RNG" in p.stdout and "loss parallel" in p.stdout, p.stdout[-2000:]
    got = by_step(tmp_path / "tp.jsonl")
    assert_same_training(got, ref, f"dropout {extra} on {nproc} ranks")
    worst = max(abs(got[s][k] - ref[s][k]) / abs(ref[s][k]) for s in ref for k in ("loss", "eval_loss", "grad_norm")
                if ref[s].get(k) is not None)
    print(f"dropout {extra} on {nproc} ranks vs --tp 1: max relative diff {worst:.3g}")
    p = run(args(text_files, tmp_path, "nodrop", "--batch-size", "4", "--dtensor-rng", steps=5), nproc=nproc // 2)
    assert p.returncode == 0, show(p)
    nodrop = by_step(tmp_path / "nodrop.jsonl")
    assert abs(nodrop[1]["loss"] - ref[1]["loss"]) > 1e-4, (nodrop[1], ref[1])


# --sft under loss_parallel (lm_loss_sum's reduction "sum" with ignore_index -100 on the vocabulary-sharded logits):
# --tp 2 on 2 ranks trains like one rank on the same batch (losses, evaluation losses, gradient norms, 1e-5).
def test_sft_under_loss_parallel_trains_like_one_rank(tmp_path):
    from test_train_gpt_data import sft_file
    data = sft_file(tmp_path / "sft.jsonl")
    common = ["--model", "tiny", "--seed", "7", "--threads", "1", "--sample-tokens", "0", "--log-every", "1", "--sft",
              data, "--steps", "6", "--eval-every", "3", "--warmup-steps", "2", "--batch-size", "4"]
    p = run(common + ["--metrics", tmp_path / "one.jsonl"], nproc=1)
    assert p.returncode == 0, show(p)
    p = run(common + ["--metrics", tmp_path / "tp.jsonl", "--tp", "2"], nproc=2)
    assert p.returncode == 0, show(p)
    assert "loss parallel" in p.stdout and "prompt tokens masked" in p.stdout, p.stdout[-2000:]
    assert_same_training(by_step(tmp_path / "tp.jsonl"), by_step(tmp_path / "one.jsonl"), "--sft --tp 2")
