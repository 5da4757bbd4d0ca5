"""train_gpt with an unchanged model (issue 13; CTest labels unchanged_models, train_gpt).

`--model-impl plain` builds the same GPT as the default `--model-impl holder` from plain LibTorch
containers (examples/train_gpt/model_plain.h: a ModuleList of blocks, a Sequential MLP, no libfsdp type)
and shards it with the same fully_shard calls; FSDP then drives the blocks at tensor level instead of
through fsdp::FSDPModule holders. Both paths issue the same collectives on the same data, so the runs
must agree to the bit: every training loss, gradient norm, evaluation loss and the sample. Tiny preset,
2 ranks through fsdprun, a few steps each.

FSDP_BUILD_DIR is the CMake build directory (default: <repo>/build).
"""

import json
import subprocess

import pytest

from fsdp_testing import FSDPRUN, TRAIN_GPT, clean_env, fsdprun_cmd

BINARIES = (FSDPRUN, TRAIN_GPT)
STEPS = 6


def train(impl, text_files, out, *extra, nproc=2):
    """Runs train_gpt --model-impl `impl` on `nproc` ranks; returns (per-step records, sample text)."""
    metrics = out / f"{impl}_{len(list(out.glob('*.jsonl')))}.jsonl"  # a fresh file per run (a resume appends)
    cmd = fsdprun_cmd(nproc, TRAIN_GPT, "--model-impl", impl, "--model", "tiny", "--data", *text_files, "--batch-size",
                      "4", "--seed", "7", "--threads", "1", "--steps", str(STEPS), "--log-every", "1", "--eval-every",
                      "3", "--eval-batches", "2", "--sample-tokens", "16", "--metrics", str(metrics), *map(str, extra))
    p = subprocess.run(cmd, env=clean_env(), capture_output=True, encoding="utf-8", timeout=240)
    assert p.returncode == 0, f"--model-impl {impl}: rc={p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    rows = [json.loads(l) for l in metrics.read_text().splitlines() if l.strip()]
    start = p.stdout.find("[default0]:sample (seed 7")  # the sample, between its two "----" lines
    sample = p.stdout[start:p.stdout.rfind("----")] if start >= 0 else None
    return rows, sample, p.stdout


def first_difference(holder, plain):
    """The first (step, key, holder value, plain value) that is not identical, or None."""
    assert [r["step"] for r in holder] == [r["step"] for r in plain], (holder, plain)
    for h, q in zip(holder, plain):
        for key in ("loss", "grad_norm", "eval_loss"):
            if h.get(key) != q.get(key):
                return h["step"], key, h.get(key), q.get(key)
    return None


CASES = {
    "fp32": [],
    "bf16": ["--mixed-precision", "bf16"],
    # Activation checkpointing with dropout: the holder model's blocks through checkpoint_wrapper, the plain model's
    # unchanged blocks through the recorded regions of checkpoint_wrapper on an unchanged module (no forward edit);
    # the replays draw the same random masks.
    "fp32_ac_dropout": ["--activation-checkpointing", "full", "--dropout", "0.1"],
    # Selective checkpointing (matmul and attention outputs kept) of implicit groups vs holders, with dropout.
    "fp32_sac_dropout": ["--activation-checkpointing", "selective-op", "--dropout", "0.1"],
    # Gradient accumulation: set_requires_gradient_sync on the unchanged root; blocks kept gathered.
    "bf16_accum_no_reshard": ["--mixed-precision", "bf16", "--grad-accum-steps", "2", "--reshard-after-forward",
                              "false"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_plain_model_trains_bit_identically_to_the_holder_model(case, text_files, tmp_path):
    holder, holder_sample, _ = train("holder", text_files, tmp_path, *CASES[case])
    plain, plain_sample, out = train("plain", text_files, tmp_path, *CASES[case])
    assert "unchanged model code" in out, out[-2000:]
    assert len([r for r in plain if r["loss"] is not None]) == STEPS
    diff = first_difference(holder, plain)
    assert diff is None, ("first difference (step, key, holder, plain): %r\nholder %r\nplain  %r" %
                          (diff, [(r["step"], r["loss"]) for r in holder], [(r["step"], r["loss"]) for r in plain]))
    assert holder_sample is not None and plain_sample == holder_sample


def test_checkpoints_are_interchangeable_between_the_two_models(text_files, tmp_path):
    """Same parameter names: a holder run's checkpoint resumes in the plain model and vice versa, and
    continues exactly as the uninterrupted run."""
    ref, _, _ = train("holder", text_files, tmp_path)
    ref_losses = {r["step"]: r["loss"] for r in ref if r["loss"] is not None}
    for first, second in (("holder", "plain"), ("plain", "holder")):
        ckpt = tmp_path / f"ckpt_{first}"
        train(first, text_files, tmp_path, "--ckpt-dir", ckpt, "--stop-at", 3)
        resumed, _, out = train(second, text_files, tmp_path, "--ckpt-dir", ckpt, "--resume", "always")
        assert "resume: " in out, out[-2000:]
        losses = {r["step"]: r["loss"] for r in resumed if r["loss"] is not None}
        assert losses == {s: ref_losses[s] for s in range(4, STEPS + 1)}, (first, second, losses, ref_losses)


def test_help_documents_model_impl():
    p = subprocess.run([str(TRAIN_GPT), "--help"], capture_output=True, encoding="utf-8", timeout=60)
    assert p.returncode == 0 and "--model-impl" in p.stdout and "plain" in p.stdout, p.stdout
    p = subprocess.run([str(TRAIN_GPT), "--model-impl", "unchanged"], capture_output=True, encoding="utf-8",
                       timeout=60)
    assert p.returncode != 0 and "--model-impl" in p.stderr, p.stderr


def test_reentrant_checkpointing_of_the_plain_model_is_refused_naming_the_fix(text_files, tmp_path):
    # The plain model's blocks have no call to re-run (the model's forward calls them): only the non-reentrant form.
    cmd = [str(TRAIN_GPT), "--model-impl", "plain", "--model", "tiny", "--data", *map(str, text_files), "--steps", "1",
           "--activation-checkpointing", "full", "--checkpoint-impl", "reentrant"]
    p = subprocess.run(cmd, env=clean_env(), capture_output=True, encoding="utf-8", timeout=120)
    assert p.returncode != 0
    assert "--checkpoint-impl reentrant needs --model-impl holder" in p.stdout + p.stderr, p.stdout + p.stderr
