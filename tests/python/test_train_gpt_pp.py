"""train_gpt with pipeline parallelism (--pp; issue 34 item 4; CTest labels pipeline, train_gpt).

The tiny preset with 4 blocks (--n-layer 4: every stage needs a block), untied (--tie-weights false) except in
the tied-weights test (the head's copy on the last stage is kept equal to the first stage's wte), fp32, a few AdamW steps through fsdprun. The
global batch is the same as the reference's: --batch-size is per data-parallel rank and the ranks of a
pipeline share it, so `--pp 2` on 2 ranks must train like `--pp 1` on 1 rank, and pp 2 x dp 2 on 4 ranks
like `--pp 1` on 2 ranks: per step the training loss, the gradient norm (clipping is on: the norm is the
whole model's, summed over the stages) and the evaluation losses within 1e-5 (relative; the pipeline sums
the microbatches' gradients in another order). Every rank records the same loss (rank 0 holds no loss of its
own: the last stage's is summed over the pipeline). Composed with --tp (and --sequence-parallel) and with HSDP (--dp-replicate) on 4 ranks, likewise. Checkpoints:
each rank saves its stages' keys (the unpipelined model's), so a pipelined run resumes bit-identically and its
checkpoint resumes without a pipeline too. Bad layouts fail
before the rendezvous, naming the flag.

FSDP_BUILD_DIR is the CMake build directory (default: <repo>/build).
"""

import re
import shutil

import pytest

from fsdp_testing import FSDPRUN, TRAIN_GPT, metrics, run, show

BINARIES = (FSDPRUN, TRAIN_GPT)

RTOL = 1e-5
STEPS = 4
# Each schedule with its stages per rank: 1 for the one-stage schedules, 2 for the interleaved and V ones.
SCHEDULES = [
    ("1f1b", []),
    ("gpipe", []),
    ("interleaved-1f1b", ["--stages-per-rank", "2"]),
    ("zbv-zero-bubble", []),  # its default: 2 stages per rank
]


def args(text_files, tmp_path, name, *extra, steps=STEPS):
    return ["--model", "tiny", "--n-layer", "4", "--tie-weights", "false", "--data", *text_files, "--seed", "7",
            "--threads", "1", "--steps", str(steps), "--log-every", "1", "--eval-every", "2", "--eval-batches", "2",
            "--warmup-steps", "2", "--sample-tokens", "0", "--batch-size", "4", "--no-progress",
            "--metrics", tmp_path / f"{name}.jsonl", *extra]


def by_step(path):
    return {r["step"]: r for r in metrics(path)}


def max_rel_diff(got, ref, what):
    """The largest relative difference over the steps and keys; fails on a missing step or key."""
    assert sorted(got) == sorted(ref), f"{what}: steps {sorted(got)} vs {sorted(ref)}"
    worst = 0.0
    for s in sorted(ref):
        for k in ("loss", "eval_loss", "grad_norm"):
            a, b = got[s].get(k), ref[s].get(k)
            if b is None:
                continue
            assert a is not None, f"{what}: step {s} has no {k}"
            worst = max(worst, abs(a - b) / abs(b))
            assert abs(a - b) <= RTOL * abs(b), f"{what}: step {s} {k} {a} vs {b} (--pp 1)"
    return worst


@pytest.fixture(scope="module")
def reference(text_files, tmp_path_factory):
    """--pp 1 with the same global batch: on 1 rank (for pp 2) and on 2 ranks (for pp 2 x dp 2)."""
    d = tmp_path_factory.mktemp("pp1")
    out = {}
    for nproc in (1, 2):
        p = run(args(text_files, d, f"ref{nproc}"), nproc=nproc)
        assert p.returncode == 0, show(p)
        out[nproc] = by_step(d / f"ref{nproc}.jsonl")
    return out


@pytest.mark.parametrize("nproc", [2, 4])
@pytest.mark.parametrize("schedule,extra", SCHEDULES, ids=[s for s, _ in SCHEDULES])
def test_pipeline_trains_like_pp1(text_files, tmp_path, reference, schedule, extra, nproc):
    name = f"{schedule}_{nproc}"
    p = run(args(text_files, tmp_path, name, "--pp", "2", "--pp-schedule", schedule, *extra), nproc=nproc)
    assert p.returncode == 0, show(p)
    dp = nproc // 2
    assert f"pp 2 x dp {dp}" in p.stdout and f"schedule {schedule}" in p.stdout, p.stdout[-2000:]
    # Checked by train_gpt on every rank: each stage names its parameters as the whole model (4 blocks x 12 + wte,
    # wpe, ln_f x 2, lm_head = 53), together exactly once.
    assert "the stages' 53 parameter names are the whole model's" in p.stdout, p.stdout[-2000:]
    got = by_step(tmp_path / f"{name}.jsonl")
    worst = max_rel_diff(got, reference[dp], name)
    print(f"{name}: max relative difference to --pp 1 on {dp} rank(s): {worst:.3g}")


@pytest.mark.parametrize("schedule,nproc", [("1f1b", 2), ("zbv-zero-bubble", 4)])
def test_unchanged_model_pipeline_trains_like_pp1(text_files, tmp_path, reference, schedule, nproc):
    # --model-impl plain: stages of the unchanged-LibTorch GPT (PlainGPTStage), fully_shard at tensor level.
    name = f"plain_{schedule}_{nproc}"
    p = run(args(text_files, tmp_path, name, "--model-impl", "plain", "--pp", "2", "--pp-schedule", schedule),
            nproc=nproc)
    assert p.returncode == 0, show(p)
    assert "--model-impl plain" in p.stdout and f"pp 2 x dp {nproc // 2}" in p.stdout, p.stdout[-2000:]
    worst = max_rel_diff(by_step(tmp_path / f"{name}.jsonl"), reference[nproc // 2], name)
    print(f"{name}: max relative difference to --pp 1: {worst:.3g}")


@pytest.mark.parametrize("schedule,nproc", [("1f1b", 2), ("zbv-zero-bubble", 4)])
def test_tied_weights_train_like_pp1(text_files, tmp_path, schedule, nproc):
    # The preset's tied wte/lm_head: the last stage's head is a copy whose gradient is summed with wte's (under ZBV
    # both on rank 0); the copies must stay equal for the losses to match --pp 1 (one tensor there).
    tied = ["--tie-weights", "true"]
    ref = run(args(text_files, tmp_path, "tied_ref", *tied), nproc=nproc // 2)
    assert ref.returncode == 0, show(ref)
    p = run(args(text_files, tmp_path, "tied", *tied, "--pp", "2", "--pp-schedule", schedule), nproc=nproc)
    assert p.returncode == 0, show(p)
    worst = max_rel_diff(by_step(tmp_path / "tied.jsonl"), by_step(tmp_path / "tied_ref.jsonl"), f"tied {schedule}")
    print(f"tied {schedule} on {nproc} ranks: max relative difference to --pp 1: {worst:.3g}")


@pytest.mark.parametrize("impl,ac,schedule", [("holder", "full", "zbv-zero-bubble"),
                                               ("plain", "selective-op", "interleaved-zero-bubble")])
def test_activation_checkpointing_in_stages_trains_like_pp1(text_files, tmp_path, reference, impl, ac, schedule):
    # Blocks recomputed in backward, also under the zero-bubble schedules' split backward (input gradient, then
    # weight gradient later).
    name = f"ac_{impl}_{schedule}"
    p = run(args(text_files, tmp_path, name, "--model-impl", impl, "--activation-checkpointing", ac, "--pp", "2",
                 "--pp-schedule", schedule), nproc=2)
    assert p.returncode == 0, show(p)
    assert f"activation checkpointing {ac}" in p.stdout, p.stdout[-2000:]
    worst = max_rel_diff(by_step(tmp_path / f"{name}.jsonl"), reference[1], name)
    print(f"{name}: max relative difference to --pp 1: {worst:.3g}")


@pytest.mark.parametrize("name,extra,dp", [
    ("tp2", ["--tp", "2"], 1),
    ("tp2_sp_zbv", ["--tp", "2", "--sequence-parallel", "--pp-schedule", "zbv-zero-bubble"], 1),
    ("plain_tp2_sp_interleaved", ["--tp", "2", "--sequence-parallel", "--model-impl", "plain", "--pp-schedule",
                                  "interleaved-1f1b"], 1),
    ("hsdp", ["--dp-replicate", "2"], 2),
])
def test_pipeline_with_tp_or_hsdp_trains_like_pp1(text_files, tmp_path, reference, name, extra, dp):
    # 4 ranks: pp 2 x tp 2 (each stage's blocks tensor-parallel; with sequence parallelism the stages pass their
    # sequence shards), or pp 2 x dp_replicate 2 (HSDP inside each stage). --tp shares the batch: the reference
    # is --pp 1 on dp ranks.
    p = run(args(text_files, tmp_path, name, "--pp", "2", *extra), nproc=4)
    assert p.returncode == 0, show(p)
    layout = "pp 2 x dp 1 x tp 2" if dp == 1 else "pp 2 x dp 2, dp = dp_replicate 2 x dp_shard 1"
    assert layout in p.stdout, p.stdout[-2000:]
    worst = max_rel_diff(by_step(tmp_path / f"{name}.jsonl"), reference[dp], name)
    print(f"{name}: max relative difference to --pp 1 on {dp} rank(s): {worst:.3g}")


@pytest.mark.parametrize("impl,schedule,nproc", [("holder", "zbv-zero-bubble", 2), ("plain", "1f1b", 4)])
def test_llama_pipeline_trains_like_pp1(text_files, tmp_path, impl, schedule, nproc):
    # Llama stages: Hugging Face's names (model.embed_tokens, model.layers.N, model.norm, lm_head), its untied
    # embedding and head as fully_shard groups of their own, as --pp 1 shards them.
    llama = ["--model", "llama-tiny", "--model-impl", impl]
    ref = run(args(text_files, tmp_path, "llama_ref", *llama), nproc=nproc // 2)
    assert ref.returncode == 0, show(ref)
    p = run(args(text_files, tmp_path, "llama", *llama, "--pp", "2", "--pp-schedule", schedule), nproc=nproc)
    assert p.returncode == 0, show(p)
    assert "3 + norm, lm_head on pp rank" in p.stdout and "model.layers.0" in p.stdout, p.stdout[-2000:]
    worst = max_rel_diff(by_step(tmp_path / "llama.jsonl"), by_step(tmp_path / "llama_ref.jsonl"), f"llama {impl}")
    print(f"llama {impl} {schedule} on {nproc} ranks: max relative difference to --pp 1: {worst:.3g}")


def test_bf16_pipeline_tracks_pp1_in_bf16(text_files, tmp_path):
    # bf16 compute (fp32 shards and gradient reduction) in both runs; the pipeline's microbatches round their bf16
    # matmuls over smaller batches, so they agree to bf16's precision (3.9e-3 unit roundoff), not fp32's.
    bf16 = ["--mixed-precision", "bf16"]
    ref = run(args(text_files, tmp_path, "bf16_ref", *bf16), nproc=1)
    assert ref.returncode == 0, show(ref)
    p = run(args(text_files, tmp_path, "bf16", *bf16, "--pp", "2", "--pp-schedule", "zbv-zero-bubble"), nproc=2)
    assert p.returncode == 0, show(p)
    got, want = by_step(tmp_path / "bf16.jsonl"), by_step(tmp_path / "bf16_ref.jsonl")
    assert sorted(got) == sorted(want)
    worst = max(abs(got[s]["loss"] - want[s]["loss"]) / want[s]["loss"] for s in want if want[s].get("loss"))
    assert worst <= 5e-3, worst
    print(f"bf16 zbv: max relative loss difference to --pp 1 in bf16: {worst:.3g}")


def test_interleaved_zero_bubble_trains_like_pp1(text_files, tmp_path, reference):
    p = run(args(text_files, tmp_path, "izb", "--pp", "2", "--pp-schedule", "interleaved-zero-bubble"), nproc=2)
    assert p.returncode == 0, show(p)
    worst = max_rel_diff(by_step(tmp_path / "izb.jsonl"), reference[1], "interleaved-zero-bubble")
    print(f"interleaved-zero-bubble: max relative difference to --pp 1: {worst:.3g}")


def test_uneven_stages_and_more_microbatches_train_like_pp1(text_files, tmp_path, reference):
    # 3 blocks over 2 stages (the first gets 2), 4 microbatches of one sequence.
    ref = run(args(text_files, tmp_path, "ref3", "--n-layer", "3"), nproc=1)
    assert ref.returncode == 0, show(ref)
    p = run(args(text_files, tmp_path, "uneven", "--n-layer", "3", "--pp", "2", "--pp-microbatches", "4"), nproc=2)
    assert p.returncode == 0, show(p)
    assert "stage 0: h.0-1 + embeddings on pp rank 0; stage 1: h.2 + ln_f, lm_head on pp rank 1" in p.stdout, p.stdout
    max_rel_diff(by_step(tmp_path / "uneven.jsonl"), by_step(tmp_path / "ref3.jsonl"), "uneven")


def test_checkpoint_resumes_bit_identical_and_without_pipeline(text_files, tmp_path):
    # zbv-zero-bubble: rank 0 holds the first and the last stage (wte, wpe, h.0, h.3, ln_f, lm_head), rank 1 the
    # middle ones: each saves and loads the keys of two stages; the checkpoint holds their union.
    pp = ["--pp", "2", "--pp-schedule", "zbv-zero-bubble"]
    ckpt = tmp_path / "ckpt"
    straight = run(args(text_files, tmp_path, "straight", *pp, steps=6), nproc=2)
    assert straight.returncode == 0, show(straight)
    first = run(args(text_files, tmp_path, "first", *pp, "--ckpt-dir", ckpt, "--ckpt-every", "3", "--stop-at", "3",
                     steps=6), nproc=2)
    assert first.returncode == 0, show(first)
    assert f"[default0]:checkpoint: {ckpt}/step-3 saved" in first.stdout, show(first)
    shutil.copytree(ckpt, tmp_path / "ckpt_pp1")  # for the --pp 1 resume below (the second run adds step-6)
    second = run(args(text_files, tmp_path, "second", *pp, "--ckpt-dir", ckpt, "--resume", steps=6), nproc=2)
    assert second.returncode == 0, show(second)
    assert re.search(r"resume: .*step-3 \(after step 3, saved on 2 ranks, loaded on 2 .*continuing at step 4/6",
                     second.stdout), show(second)
    ref, a, b = (by_step(tmp_path / f"{n}.jsonl") for n in ("straight", "first", "second"))
    for k in ("loss", "grad_norm"):
        # Bit-identical: the JSON numbers round-trip doubles exactly.
        got = {s: r[k] for s, r in a.items() if r.get(k) is not None} | \
              {s: r[k] for s, r in b.items() if r.get(k) is not None}
        assert got == {s: r[k] for s, r in ref.items() if r.get(k) is not None}, k
    # The same checkpoint on one rank without a pipeline: its keys are the unpipelined model's.
    plain = run(args(text_files, tmp_path, "pp1", "--ckpt-dir", tmp_path / "ckpt_pp1", "--resume", steps=6), nproc=1)
    assert plain.returncode == 0, show(plain)
    c = by_step(tmp_path / "pp1.jsonl")
    assert sorted(s for s in c if c[s].get("loss") is not None) == [4, 5, 6]
    worst = max(abs(c[s]["loss"] - ref[s]["loss"]) / abs(ref[s]["loss"]) for s in (4, 5, 6))
    assert worst <= RTOL, worst
    print(f"pp 2 checkpoint resumed with --pp 1: max relative loss difference {worst:.3g}")


@pytest.mark.parametrize("extra,message", [
    (["--pp", "3"], "not divisible by --pp 3"),
    (["--pp", "2", "--pp-schedule", "interleaved-1f1b", "--stages-per-rank", "3"], "--n-layer"),
    (["--pp", "2", "--batch-size", "3"], "--batch-size 3 is not divisible by --pp-microbatches 2"),
    (["--pp", "2", "--pp-schedule", "1f1b", "--stages-per-rank", "2"], "--stages-per-rank 2 with --pp-schedule 1f1b"),
    (["--pp", "2", "--pp-schedule", "zbv-zero-bubble", "--stages-per-rank", "1"], "Fix: --stages-per-rank 2"),
    (["--pp", "2", "--pp-microbatches", "1"], "1F1B needs at least one microbatch per stage"),
    (["--pp", "2", "--tp", "2"], "not divisible by --pp 2 x --dp-replicate(1) x --tp(2) = 4"),
    (["--pp", "2", "--data-parallel", "replicate"], "--pp 2 does not support --data-parallel replicate"),
    (["--pp", "2", "--export-hf", "hf_out"], "--pp 2 does not support --init-from, --export-hf"),
    (["--stages-per-rank", "2"], "--stages-per-rank needs --pp > 1"),
    (["--pp-schedule", "gpipe"], "--pp-schedule needs --pp > 1"),
    (["--pp", "2", "--freeze", "wpe"], "--pp 2 does not support --freeze"),
])
def test_bad_layouts_fail_naming_the_flag(text_files, tmp_path, extra, message):
    p = run(args(text_files, tmp_path, "bad", *extra, steps=2), nproc=2, timeout=60)
    assert p.returncode != 0, show(p)
    assert message in p.stdout + p.stderr, show(p)
    # Refused while parsing, before the rendezvous and the model: both ranks print it.
    assert (p.stdout + p.stderr).count(message) >= 2, show(p)
