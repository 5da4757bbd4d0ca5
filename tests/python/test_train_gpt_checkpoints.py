"""train_gpt's checkpoints, end to end (CTest label train_gpt): real processes through fsdprun, the tiny preset.

--ckpt-dir DIR --ckpt-every K --keep-last N save distributed checkpoints; --resume continues bit-identically (also
on another world size); bad checkpoints and flags fail on every rank before the rendezvous. The restart pattern of
issue 17 item 5 (marked `regressions`: their own ctest entry, labels train_gpt, regressions): one command line,
`fsdprun --max-restarts N -- train_gpt ... --ckpt-dir D --ckpt-every K`, starts a new run and continues it after a
restart (TORCHELASTIC_RESTART_COUNT > 0, set by fsdprun and torchrun), as does `--resume auto`; a checkpoint of
another model is still refused; after a resume the summary shows the run's first and last evaluation.

FSDP_BUILD_DIR is the CMake build directory (default: <repo>/build).
"""

import re
import subprocess

import pytest

from fsdp_testing import (BUILD, FSDP_CKPT, FSDPRUN, RTOL, TRAIN_GPT, assert_close, bad_input_args, clean_env,
                          eval_losses, expect_each_rank_fails_alone, fsdprun_cmd, grad_norms, metrics, run, show, tiny,
                          train_losses)

BINARIES = (FSDPRUN, TRAIN_GPT, FSDP_CKPT)


# --------------------------------------------------------------------------------------------------
# 1. Checkpoints: --ckpt-dir DIR --ckpt-every K --keep-last N save distributed checkpoints in DIR/step-N;
#    --resume continues from the newest. --stop-at N interrupts a run after step N as a crash would (the
#    learning-rate schedule still spans --steps), so "10 steps, stop, resume, 10 steps" is one flag away.
RESUME = ["--steps", "20", "--log-every", "1", "--eval-every", "10", "--warmup-steps", "5", "--sample-tokens", "0"]


@pytest.mark.parametrize("flags", [
    ["--dropout", "0.1"],  # the random stream (dropout) must continue where it stopped
    ["--tie-weights", "false", "--mixed-precision", "fp16", "--grad-accum-steps", "2"],  # loss scaler, accumulation
    ["--dropout", "0.1", "--ckpt-format", "distcp"],  # PyTorch's dcp.save layout: RNG tensor, Values as pickles
], ids=lambda v: " ".join(v))
def test_resume_is_bit_identical(text_files, tmp_path, flags):
    """20 steps straight == 10 steps, stop, --resume, 10 steps (2 ranks both times): identical losses."""
    ckpt = tmp_path / "ckpt"
    straight = run(tiny(text_files, tmp_path, *RESUME, *flags, name="straight.jsonl"), timeout=120)
    assert straight.returncode == 0, show(straight)
    first = run(tiny(text_files, tmp_path, *RESUME, *flags, "--ckpt-dir", ckpt, "--ckpt-every", "5", "--stop-at", "10",
                     name="first.jsonl"), timeout=120)
    assert first.returncode == 0, show(first)
    assert f"[default0]:checkpoint: {ckpt}/step-10 saved" in first.stdout, show(first)
    assert "[default0]:stopped after step 10 of 20 (--stop-at)" in first.stdout, show(first)
    assert (ckpt / "latest").read_text().strip() == "step-10"
    second = run(tiny(text_files, tmp_path, *RESUME, *flags, "--ckpt-dir", ckpt, "--ckpt-every", "5", "--resume",
                      name="second.jsonl"), timeout=120)
    assert second.returncode == 0, show(second)
    assert re.search(rf"\[default0\]:resume: {re.escape(str(ckpt))}/step-10 \(after step 10, saved on 2 ranks, "
                     r"loaded on 2 .*continuing at step 11/20", second.stdout), show(second)

    ref, a, b = (metrics(tmp_path / n) for n in ("straight.jsonl", "first.jsonl", "second.jsonl"))
    assert sorted(train_losses(a)) == list(range(1, 11)) and sorted(train_losses(b)) == list(range(11, 21))
    # Bit-identical: the JSON numbers round-trip doubles exactly.
    assert train_losses(a) | train_losses(b) == train_losses(ref), (train_losses(a), train_losses(b), train_losses(ref))
    assert grad_norms(a) | grad_norms(b) == grad_norms(ref)
    assert eval_losses(a)[10] == eval_losses(ref)[10] and eval_losses(b)[20] == eval_losses(ref)[20]
    assert (ckpt / "latest").read_text().strip() == "step-20"
    assert sorted(d.name for d in ckpt.iterdir()) == ["latest", "step-10", "step-15", "step-20", "step-5"]


def test_checkpoint_holds_tied_weight_once_for_the_optimizer(text_files, tmp_path):
    """A tied weight: in the model part under both of its names (the same values), its optimizer state once."""
    ckpt = tmp_path / "ckpt"
    p = run(tiny(text_files, tmp_path, "--steps", "3", "--sample-tokens", "0", "--ckpt-dir", ckpt), timeout=60)
    assert p.returncode == 0, show(p)
    ls = subprocess.run([str(BUILD / "bin" / "fsdp-ckpt"), "ls", ckpt / "step-3"], capture_output=True, text=True,
                        timeout=60)
    assert ls.returncode == 0, ls.stderr
    for key in ("model.wte.weight", "model.lm_head.weight", "optim.state.wte.weight.exp_avg", "train.rng_state"):
        assert re.search(rf"^\s+{re.escape(key)}\s", ls.stdout, re.M), (key, ls.stdout)
    assert "optim.state.lm_head.weight" not in ls.stdout, ls.stdout
    out = tmp_path / "full"
    c = subprocess.run([str(BUILD / "bin" / "fsdp-ckpt"), "consolidate", ckpt / "step-3", "--out", out,
                        "--prefix", "model.", "--strip-prefix"], capture_output=True, text=True, timeout=60)
    assert c.returncode == 0, c.stderr
    from safetensors.numpy import load_file
    full = load_file(str(out / "model.safetensors"))
    assert full["wte.weight"].shape == (256, 32) and (full["wte.weight"] == full["lm_head.weight"]).all()


@pytest.mark.parametrize("fmt", ["safetensors", "distcp"])
def test_resume_on_another_world_size(text_files, tmp_path, fmt):
    """Saved on 2 ranks (batch 4 each), resumed on 1 with the same global batch (8): the model and the
    optimizer are resharded and the data position carries over (the very same batches). In both formats."""
    from safetensors.numpy import load_file
    ckpt = tmp_path / "ckpt"
    ref = run(tiny(text_files, tmp_path, *RESUME, "--dump-batches", tmp_path / "ref_batches", name="ref.jsonl"),
              timeout=120)
    assert ref.returncode == 0, show(ref)
    first = run(tiny(text_files, tmp_path, *RESUME, "--ckpt-dir", ckpt, "--ckpt-every", "10", "--stop-at", "10",
                     "--ckpt-format", fmt, name="first.jsonl"), timeout=120)
    assert first.returncode == 0, show(first)
    assert (ckpt / "step-10" / (".metadata" if fmt == "distcp" else "libfsdp_checkpoint.json")).exists()
    second = run(tiny(text_files, tmp_path, *RESUME, "--batch-size", "8", "--ckpt-dir", ckpt, "--resume",
                      "--dump-batches", tmp_path / "batches", name="second.jsonl"), nproc=1, timeout=120)
    assert second.returncode == 0, show(second)
    assert re.search(r"\[default0\]:resume: .*/step-10 \(after step 10, saved on 2 ranks, loaded on 1 .*\); "
                     r"data: epoch 0, window 80 of \d+; continuing at step 11/20", second.stdout), show(second)
    assert "global batch changes" not in second.stdout, show(second)  # 2 x 4 then 1 x 8
    # The same batches: the one rank's batch of each step is the 2 ranks' batches interleaved (rank r
    # takes every 2nd window of the global batch from r).
    r0, r1 = (load_file(str(tmp_path / "ref_batches" / f"rank{r}.safetensors"))["batches"] for r in (0, 1))
    mine = load_file(str(tmp_path / "batches" / "rank0.safetensors"))["batches"]  # [steps, accum, 2, batch, block]
    assert r0.shape == (20, 1, 2, 4, 32) and mine.shape == (10, 1, 2, 8, 32), (r0.shape, mine.shape)
    assert (mine[:, :, :, 0::2] == r0[10:]).all() and (mine[:, :, :, 1::2] == r1[10:]).all()
    # Losses within the sharded-vs-unsharded parity tolerance of the uninterrupted 2-rank run.
    want = {s: l for s, l in train_losses(metrics(tmp_path / "ref.jsonl")).items() if s > 10}
    worst = assert_close(train_losses(metrics(tmp_path / "second.jsonl")), want, RTOL, "train loss after resume")
    ev = eval_losses(metrics(tmp_path / "ref.jsonl"))
    assert_close(eval_losses(metrics(tmp_path / "second.jsonl")), {20: ev[20]}, RTOL, "eval loss after resume")
    print(f"[resume 2 -> 1 rank] max relative loss difference {worst:.3g} (tolerance {RTOL:g})")


def test_resume_with_another_global_batch_says_so(text_files, tmp_path):
    """Saved on 2 ranks with --batch-size 4 (global 8), resumed on 1 with the same per-rank --batch-size: the run
    goes on with a global batch of 4, and the resume line says so and names the flag that keeps it."""
    ckpt = tmp_path / "ckpt"
    first = run(tiny(text_files, tmp_path, *RESUME, "--ckpt-dir", ckpt, "--ckpt-every", "2", "--stop-at", "2",
                     name="first.jsonl"), timeout=120)
    assert first.returncode == 0, show(first)
    second = run(tiny(text_files, tmp_path, *RESUME, "--ckpt-dir", ckpt, "--resume", "--stop-at", "3",
                      name="second.jsonl"), nproc=1, timeout=120)
    assert second.returncode == 0, show(second)
    assert "NOTE: the global batch changes from 8 to 4 sequences (--batch-size 4 per rank on 1 ranks): pass " \
           "--global-batch-size 8 to keep it" in second.stdout, show(second)


def test_keep_last(text_files, tmp_path):
    """--keep-last 2 keeps the two newest step-N folders; `latest` names the newest; a resumed run with a
    larger --steps goes on saving and pruning."""
    ckpt = tmp_path / "ckpt"
    common = ["--sample-tokens", "0", "--eval-every", "100", "--ckpt-dir", ckpt, "--ckpt-every", "2", "--keep-last", "2"]
    p = run(tiny(text_files, tmp_path, "--steps", "7", *common), timeout=60)
    assert p.returncode == 0, show(p)
    saved = re.findall(r"\[default0\]:checkpoint: .*/(step-\d+) saved", p.stdout)
    assert saved == ["step-2", "step-4", "step-6", "step-7"], show(p)  # and after the last step
    assert sorted(d.name for d in ckpt.iterdir()) == ["latest", "step-6", "step-7"]
    assert (ckpt / "latest").read_text().strip() == "step-7"
    p = run(tiny(text_files, tmp_path, "--steps", "10", "--resume", *common), timeout=60)
    assert p.returncode == 0, show(p)
    assert "resume: " in p.stdout and "continuing at step 8/10" in p.stdout, show(p)
    assert sorted(d.name for d in ckpt.iterdir()) == ["latest", "step-10", "step-8"]
    assert (ckpt / "latest").read_text().strip() == "step-10"
    v = subprocess.run([str(BUILD / "bin" / "fsdp-ckpt"), "verify", ckpt / "step-10"], capture_output=True, text=True,
                       timeout=60)
    assert v.returncode == 0, v.stdout + v.stderr


# Bad input: each rank alone (no peer, an unreachable rendezvous) must fail at once with the message, as
# in test_bad_input_fails_on_every_rank. {ckpt} is a checkpoint of the tiny preset after step 2 of 5.
CKPT_BAD_INPUT = [
    ("resume from an empty directory", ["--ckpt-dir", "{empty}", "--resume"],
     "--resume: no checkpoint in --ckpt-dir {empty} (no 'latest' file and no step-N folder). Fix: "),
    ("resume from a missing directory", ["--ckpt-dir", "{missing}", "--resume"],
     "--resume: --ckpt-dir {missing} does not exist"),
    ("resume without --ckpt-dir", ["--resume"], "--resume needs --ckpt-dir DIR"),
    ("resume with another --n-embd", ["--ckpt-dir", "{ckpt}", "--resume", "--n-embd", "64"],
     "holds a model of another shape: parameter 'wte.weight' has shape [256, 32] in the checkpoint but [256, 64] "
     "in this model"),
    ("resume with another --n-layer", ["--ckpt-dir", "{ckpt}", "--resume", "--n-layer", "3"],
     "holds a model of another shape: parameter 'h.2.ln_1.weight' has shape [32] in this model but is not in the "
     "checkpoint"),
    ("resume with fewer layers", ["--ckpt-dir", "{ckpt}", "--resume", "--n-layer", "1"],
     "the checkpoint has parameter 'h.1."),
    ("resume with an untied head", ["--ckpt-dir", "{ckpt}", "--resume", "--tie-weights", "false"],
     "holds another model (saved: 2 layers, 2 heads, 32 dims, context 32, vocab 256, tied head; this run: "),
    ("a new run into a directory with checkpoints", ["--ckpt-dir", "{ckpt}"], "already holds checkpoints"),
]


@pytest.fixture(scope="module")
def tiny_checkpoint(text_files, tmp_path_factory):
    """A checkpoint of the tiny preset after step 2 of 5 (2 ranks)."""
    d = tmp_path_factory.mktemp("tiny_ckpt") / "ckpt"
    p = run(["--model", "tiny", "--data", *text_files, "--steps", "5", "--stop-at", "2", "--sample-tokens", "0",
             "--threads", "1", "--ckpt-dir", d], timeout=60)
    assert p.returncode == 0, show(p)
    assert (d / "latest").read_text().strip() == "step-2"
    return d


@pytest.mark.parametrize("case,args,message", CKPT_BAD_INPUT, ids=[c[0] for c in CKPT_BAD_INPUT])
def test_checkpoint_bad_input_fails_on_every_rank(text_files, tmp_path, tiny_checkpoint, case, args, message):
    (tmp_path / "empty").mkdir()
    paths = {"empty": tmp_path / "empty", "missing": tmp_path / "missing", "ckpt": tiny_checkpoint}
    args = [a.format(**paths) for a in args]
    message = message.format(**paths)
    cmd = bad_input_args(text_files, tmp_path, args)  # ... --steps 5
    expect_each_rank_fails_alone(cmd, case, message)
    # The checkpoint is untouched by the failed runs.
    assert sorted(d.name for d in tiny_checkpoint.iterdir()) == ["latest", "step-2"]


def test_checkpoint_bad_input_through_fsdprun(text_files, tmp_path, tiny_checkpoint):
    p = run(bad_input_args(text_files, tmp_path, ["--ckpt-dir", str(tiny_checkpoint), "--resume", "--n-embd", "64"])[1:],
            timeout=60)
    assert p.returncode != 0, show(p)
    assert re.search(r"\[default\d\]:train_gpt: error: --resume: the checkpoint .*/step-2 holds a model of another "
                     r"shape: parameter 'wte.weight' has shape \[256, 32\] in the checkpoint but \[256, 64\]", p.stderr), show(p)
    assert "step " not in p.stdout, show(p)


# 2. The restart pattern (issue 17 item 5, regressions).
# 12 steps past a 2-step warmup, dropout on (the random stream must continue across the restart), a
# checkpoint every 4 steps, an evaluation every 6.
RESTART_RUN = ["--steps", "12", "--warmup-steps", "2", "--log-every", "1", "--eval-every", "6", "--ckpt-every", "4",
               "--dropout", "0.1", "--sample-tokens", "0"]


def launch(args, max_restarts=0, timeout=180, **env):
    """train_gpt on 2 ranks through fsdprun --max-restarts N."""
    cmd = fsdprun_cmd(2, TRAIN_GPT, *args, flags=("--max-restarts", max_restarts, "--shutdown-timeout", "5"))
    return subprocess.run(cmd, env=clean_env() | env, capture_output=True, encoding="utf-8", timeout=timeout)


def curve(rows):
    """What must be bit-identical per step (timings aside)."""
    return {r["step"]: (r["loss"], r["grad_norm"], r.get("eval_loss")) for r in rows}


@pytest.mark.regressions
@pytest.mark.parametrize("resume", [[], ["--resume", "auto"]], ids=["restart", "resume auto"])
def test_restart_after_kill_9_resumes_bit_identical(text_files, tmp_path, resume):
    """kill -9 of rank 1 right after the checkpoint of step 4, --max-restarts 1: the restarted group resumes
    from step-4 and ends bit-identical (parameters, optimizer state, losses) to an uninterrupted run."""
    straight = launch(tiny(text_files, tmp_path, *RESTART_RUN, "--ckpt-dir", tmp_path / "ckpt0", name="m0.jsonl"))
    assert straight.returncode == 0, show(straight)

    ckpt = tmp_path / "ckpt1"
    p = launch(tiny(text_files, tmp_path, *RESTART_RUN, "--ckpt-dir", ckpt, *resume, name="m1.jsonl"), max_restarts=1,
               TRAIN_GPT_TEST_KILL_AFTER_CHECKPOINT="4:1")
    assert p.returncode == 0, show(p)
    # The first attempt started a new run in the empty directory and lost rank 1 to SIGKILL after step-4.
    assert "fsdprun: attempt 0 failed: rank 1 ended with signal 9 (SIGKILL); restarting the worker group " \
           "(restart 1 of 1)" in p.stderr, show(p)
    why = "--resume auto" if resume else "restart 1 (TORCHELASTIC_RESTART_COUNT=1)"
    assert re.search(rf"\[default0\]:resume: {re.escape(str(ckpt))}/step-4 \(after step 4, saved on 2 ranks, loaded on "
                     rf"2 .*; continuing at step 5/12 \[{re.escape(why)}\]", p.stdout), show(p)
    # The first attempt evaluated at step 0 only; the restarted one reports the run's first evaluation.
    assert re.search(r"\[default0\]:eval loss: [\d.]+ \(step 0\) -> [\d.]+ \(step 12\)", p.stdout), show(p)

    # One metrics line per step across both attempts, each as in the uninterrupted run (JSON doubles
    # round-trip exactly): the lines the failed attempt wrote after step 4 were replaced.
    ref, mine = metrics(tmp_path / "m0.jsonl"), metrics(tmp_path / "m1.jsonl")
    assert [r["step"] for r in mine] == [r["step"] for r in ref] == list(range(13))
    assert curve(mine) == curve(ref)
    # The final checkpoints: every tensor (model, optimizer state, RNG) and value bitwise equal.
    d = subprocess.run([str(FSDP_CKPT), "diff", tmp_path / "ckpt0" / "step-12", ckpt / "step-12"], capture_output=True,
                       text=True, timeout=60)
    assert d.returncode == 0 and "identical" in d.stdout, d.stdout + d.stderr
    assert (ckpt / "latest").read_text().strip() == "step-12"


@pytest.mark.regressions
def test_resume_auto_starts_fresh_then_continues_then_is_done(text_files, tmp_path):
    """--resume auto: a new run in an empty --ckpt-dir, a resume when it holds one, and nothing left to train
    (exit 0) once the run is complete. After the resume, the summary spans the whole run."""
    ckpt = tmp_path / "ckpt"
    args = ["--steps", "6", "--eval-every", "100", "--sample-tokens", "0", "--ckpt-dir", ckpt, "--resume", "auto"]
    first = run(tiny(text_files, tmp_path, *args, "--stop-at", "3"), nproc=None)
    assert first.returncode == 0, show(first)
    assert "resume:" not in first.stdout and "stopped after step 3 of 6" in first.stdout, show(first)
    m = re.search(r"eval loss: ([\d.]+) \(step 0\)\n", first.stdout)
    assert m, show(first)
    second = run(tiny(text_files, tmp_path, *args), nproc=None)
    assert second.returncode == 0, show(second)
    assert "continuing at step 4/6 [--resume auto]" in second.stdout, show(second)
    # Before the fix: "eval loss: X (step 6) -> X (step 6)", the resumed part's one evaluation twice.
    assert re.search(rf"eval loss: {m.group(1)} \(step 0\) -> [\d.]+ \(step 6\)\n", second.stdout), show(second)
    third = run(tiny(text_files, tmp_path, *args), nproc=None)
    assert third.returncode == 0, show(third)
    assert "nothing left to train (step 6 of 6 done) [--resume auto]" in third.stdout, show(third)
    assert re.search(rf"eval loss: {m.group(1)} \(step 0\) -> [\d.]+ \(step 6\)\n", third.stdout), show(third)
    assert sorted(d.name for d in ckpt.iterdir()) == ["latest", "step-3", "step-6"]


# Each rank alone with a launcher's environment and an unreachable rendezvous: the check must fail at once.
RESTART_BAD_INPUT = [
    ("restart with another --n-embd", {"TORCHELASTIC_RESTART_COUNT": "1"}, ["--n-embd", "64"],
     "restart 1 (TORCHELASTIC_RESTART_COUNT=1): the checkpoint {ckpt}/step-2 holds a model of another shape: parameter "
     "'wte.weight' has shape [256, 32] in the checkpoint but [256, 64] in this model"),
    ("resume auto with another --n-embd", {}, ["--resume", "auto", "--n-embd", "64"],
     "--resume auto: the checkpoint {ckpt}/step-2 holds a model of another shape"),
    ("resume auto with another --seed", {}, ["--resume", "auto", "--seed", "5"],
     "--resume auto: the checkpoint {ckpt}/step-2 was trained with --seed 1337, this run has --seed 5"),
    ("restart with other data", {"TORCHELASTIC_RESTART_COUNT": "2"}, ["--val-fraction", "0.2"],
     "restart 2 (TORCHELASTIC_RESTART_COUNT=2): the checkpoint {ckpt}/step-2 was trained on"),
    ("a new run (attempt 0) into a directory with checkpoints", {"TORCHELASTIC_RESTART_COUNT": "0"}, [],
     "already holds checkpoints (the newest: {ckpt}/step-2); a new run would mix its checkpoints with theirs. Fix: "
     "--resume to continue that run (--resume auto: continue if there is a checkpoint, else start a new run)"),
]


@pytest.mark.regressions
@pytest.mark.parametrize("case,env,args,message", RESTART_BAD_INPUT, ids=[c[0] for c in RESTART_BAD_INPUT])
def test_restart_refuses_another_models_checkpoint(text_files, tmp_path, tiny_checkpoint, case, env, args, message):
    cmd = bad_input_args(text_files, tmp_path, ["--ckpt-dir", str(tiny_checkpoint), *args])
    message = message.format(ckpt=tiny_checkpoint)
    expect_each_rank_fails_alone(cmd, case, message, **env)
    assert sorted(d.name for d in tiny_checkpoint.iterdir()) == ["latest", "step-2"]
