"""Regressions of train_gpt and its launcher found by issue 17 (CTest labels train_gpt, regressions).

- Item 5, the restart pattern: one command line, `fsdprun --max-restarts N -- train_gpt ... --ckpt-dir D
  --ckpt-every K`, starts a new run and continues it after a restart (TORCHELASTIC_RESTART_COUNT > 0, set by
  fsdprun and torchrun), as does `--resume auto`; a checkpoint of another model is still refused.
- Item 6: after a resume the summary shows the run's first and last evaluation; numeric flags fail with one
  line without the type's bounds, and NaN/inf are refused.

Helpers and the text come from test_train_gpt.py. FSDP_BUILD_DIR is the CMake build directory.
"""

import os
import re
import shutil
import subprocess

import pytest

from test_train_gpt import (BUILD, FSDPRUN, TRAIN_GPT, bad_input_args, clean_env, eval_losses, grad_norms, metrics,
                            run, show, text_files, tiny, train_losses)  # noqa: F401 (text_files: a fixture)

FSDP_CKPT = BUILD / "bin" / "fsdp-ckpt"

# 12 steps past a 2-step warmup, dropout on (the random stream must continue across the restart), a
# checkpoint every 4 steps, an evaluation every 6.
RESTART_RUN = ["--steps", "12", "--warmup-steps", "2", "--log-every", "1", "--eval-every", "6", "--ckpt-every", "4",
               "--dropout", "0.1", "--sample-tokens", "0"]


def launch(args, max_restarts=0, timeout=180, **env):
    """train_gpt on 2 ranks through fsdprun --max-restarts N."""
    cmd = [str(FSDPRUN), "--standalone", "--nproc-per-node", "2", "--max-restarts", str(max_restarts),
           "--shutdown-timeout", "5", "--", str(TRAIN_GPT), *map(str, args)]
    return subprocess.run(cmd, env=clean_env() | env, capture_output=True, encoding="utf-8", timeout=timeout)


def curve(rows):
    """What must be bit-identical per step (timings aside)."""
    return {r["step"]: (r["loss"], r["grad_norm"], r.get("eval_loss")) for r in rows}


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


@pytest.fixture(scope="module")
def tiny_ckpt(text_files, tmp_path_factory):
    """A checkpoint of the tiny preset after step 2 of 5 (2 ranks)."""
    d = tmp_path_factory.mktemp("regr_ckpt") / "ckpt"
    p = run(["--model", "tiny", "--data", *text_files, "--steps", "5", "--stop-at", "2", "--sample-tokens", "0",
             "--threads", "1", "--ckpt-dir", d], timeout=60)
    assert p.returncode == 0, show(p)
    return d


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


@pytest.mark.parametrize("case,env,args,message", RESTART_BAD_INPUT, ids=[c[0] for c in RESTART_BAD_INPUT])
def test_restart_refuses_another_models_checkpoint(text_files, tmp_path, tiny_ckpt, case, env, args, message):
    cmd = bad_input_args(text_files, tmp_path, ["--ckpt-dir", str(tiny_ckpt), *args])
    message = message.format(ckpt=tiny_ckpt)
    for rank in (0, 1):
        e = clean_env() | env | {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
                                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "FSDP_TIMEOUT_S": "5"}
        p = subprocess.run(cmd, env=e, capture_output=True, encoding="utf-8", timeout=30)
        assert p.returncode == 2, f"{case}: rank {rank}\n" + show(p)
        lines = p.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("train_gpt: error: ") and message in lines[0], \
            f"{case}: rank {rank}\n" + show(p)
        assert "Fix:" in lines[0], f"{case}: the message names no fix\n" + show(p)
        assert p.stdout == "", f"{case}: rank {rank} started\n" + show(p)
    assert sorted(d.name for d in tiny_ckpt.iterdir()) == ["latest", "step-2"]


# Numeric flags: one line naming the flag, what it expects and what it got; no 1.8e308 written out, no
# second line; NaN and inf refused (CLI11's checks let NaN through: every comparison with NaN is false).
FLAG_ERRORS = [
    ("--steps", "-1", "--steps: expected an integer >= 1, got -1"),
    ("--steps", "abc", "--steps: expected an integer >= 1, got 'abc'"),
    ("--batch-size", "0", "--batch-size: expected an integer >= 1, got 0"),
    ("--threads", "-3", "--threads: expected an integer >= 0, got -3"),
    ("--threads", "99999999999", "--threads: expected an integer >= 0, got 99999999999, which is out of range"),
    ("--steps", "99999999999999999999", "--steps: expected an integer >= 1, got 99999999999999999999, which is out of "
     "range"),
    ("--seed", "-1", "--seed: expected an integer >= 0, got '-1'"),
    ("--lr", "0", "--lr: expected a finite number > 0, got 0"),
    ("--lr", "nan", "--lr: expected a finite number > 0, got nan"),
    ("--min-lr", "nan", "--min-lr: expected a finite number >= 0, got nan"),
    ("--clip-grad", "nan", "--clip-grad: expected a finite number >= 0, got nan"),
    ("--clip-grad", "inf", "--clip-grad: expected a finite number >= 0, got inf"),
    ("--temperature", "NaN", "--temperature: expected a finite number >= 0, got NaN"),
    ("--weight-decay", "-0.1", "--weight-decay: expected a finite number >= 0, got -0.1"),
    ("--dropout", "nan", "--dropout: expected a finite number in [0, 1), got nan"),
    ("--dropout", "1", "--dropout: expected a finite number in [0, 1), got 1"),
    ("--val-fraction", "0.7", "--val-fraction: expected a finite number in [0.001, 0.5], got 0.7"),
    ("--val-fraction", "nan", "--val-fraction: expected a finite number in [0.001, 0.5], got nan"),
    ("--resume", "sometimes", "--resume: expected no value or 'auto', got 'sometimes'"),
    ("--bogus", "1", "The following arguments were not expected: 1 --bogus. Fix: see train_gpt --help"),
]


@pytest.mark.parametrize("flag,value,message", FLAG_ERRORS, ids=[f"{f} {v}" for f, v, _ in FLAG_ERRORS])
def test_flag_errors_are_one_clear_line(flag, value, message):
    p = subprocess.run([str(TRAIN_GPT), "--model", "tiny", flag, value], env=clean_env(), capture_output=True,
                       encoding="utf-8", timeout=30)
    assert p.returncode == 2, show(p)
    assert p.stderr.splitlines() == [f"train_gpt: error: {message}"], show(p)
    assert not re.search(r"\d{21}", p.stderr), show(p)  # no bound of a type written out
    assert p.stdout == "", show(p)


def test_help_still_exits_0():
    p = subprocess.run([str(TRAIN_GPT), "--help"], env=clean_env(), capture_output=True, encoding="utf-8", timeout=30)
    assert p.returncode == 0 and "--resume" in p.stdout and "TORCHELASTIC_RESTART_COUNT" in p.stdout, show(p)
