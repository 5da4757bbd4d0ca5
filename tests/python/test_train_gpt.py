"""train_gpt, the main job, end to end (CTest label train_gpt): real processes through fsdprun.

Every run uses the tiny preset for a few steps, so each takes a second or two. The text is the English
licence texts that every Debian system ships (/usr/share/common-licenses, package base-files), passed
with --data; one test trains on the default corpus that scripts/setup.sh installs.

FSDP_BUILD_DIR is the CMake build directory (default: <repo>/build).
"""

import json
import math
import os
import pty
import re
import select
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD = Path(os.environ.get("FSDP_BUILD_DIR", REPO / "build"))
FSDPRUN = BUILD / "bin" / "fsdprun"
TRAIN_GPT = BUILD / "bin" / "train_gpt"
LICENSES = Path("/usr/share/common-licenses")
METRIC_KEYS = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "step_ms", "peak_rss_mb"}

# Variables a launcher sets (or must not inherit from the test's own environment).
LAUNCHER_VARS = re.compile(r"^(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|GROUP_RANK|GROUP_WORLD_SIZE|ROLE_\w+"
                           r"|MASTER_ADDR|MASTER_PORT|OMP_NUM_THREADS|TORCHELASTIC_\w+|PET_\w+|SLURM_\w+|OMPI_\w+)$")

# Parity tolerance of sharded vs one-process training: the fully_shard parity tests' (fp32, relative).
# The sharded run sums gradients in another order (reduce-scatter), so bitwise equality is not expected.
RTOL = 1e-5


def clean_env():
    return {k: v for k, v in os.environ.items() if not LAUNCHER_VARS.match(k)}


@pytest.fixture(scope="module", autouse=True)
def binaries():
    for b in (FSDPRUN, TRAIN_GPT):
        assert b.is_file(), f"{b} is missing: build it with `cmake --build {BUILD} --target {b.name}`"


@pytest.fixture(scope="module")
def text_files():
    files = sorted(str(p) for p in LICENSES.iterdir() if p.is_file() and not p.is_symlink())
    assert sum(Path(f).stat().st_size for f in files) > 100_000, f"expected the licence texts in {LICENSES}"
    return files


def run(args, nproc=2, timeout=180):
    """train_gpt on `nproc` ranks through fsdprun, or as one process without a launcher (nproc=None)."""
    cmd = [str(TRAIN_GPT), *map(str, args)]
    if nproc is not None:
        cmd = [str(FSDPRUN), "--standalone", "--nproc-per-node", str(nproc), "--", *cmd]
    t0 = time.monotonic()
    # The sample may hold U+FFFD (train_gpt prints invalid bytes as such): still valid UTF-8.
    p = subprocess.run(cmd, env=clean_env(), capture_output=True, encoding="utf-8", timeout=timeout)
    p.elapsed = time.monotonic() - t0
    return p


def show(p):
    return f"rc={p.returncode}\n--- stdout ---\n{p.stdout[-4000:]}\n--- stderr ---\n{p.stderr[-4000:]}"


def tiny(text_files, tmp_path, *extra, name="m.jsonl"):
    return ["--model", "tiny", "--data", *text_files, "--batch-size", "4", "--seed", "7", "--threads", "1",
            "--metrics", tmp_path / name, "--sample-tokens", "16", *extra]


def metrics(path):
    rows = [json.loads(l) for l in Path(path).read_text().splitlines() if l.strip()]
    assert rows, f"{path} is empty"
    return rows


def train_losses(rows):
    return {r["step"]: r["loss"] for r in rows if r["loss"] is not None}


def eval_losses(rows):
    return {r["step"]: r["eval_loss"] for r in rows if "eval_loss" in r}


def assert_close(mine, ref, rtol, what):
    assert mine.keys() == ref.keys(), (what, sorted(mine), sorted(ref))
    worst = max(abs(mine[s] - ref[s]) / abs(ref[s]) for s in ref)
    assert worst <= rtol, f"{what}: max relative difference {worst:.3g} > {rtol:g}\nmine {mine}\nref  {ref}"
    return worst


# --------------------------------------------------------------------------------------------------
# 0. --estimate-memory (issue 14): prints fsdp::estimate_memory's table on rank 0 and exits without a
# process group or a step; the prediction follows the world size and the flags. A real run prints its
# model states against 16 x P / N.
def table_mib(out, row):
    m = re.search(r"\[default0\]:  " + re.escape(row) + r"\s+([\d.]+) MiB", out)
    assert m, f"no '{row}' row in:\n{out}"
    return float(m.group(1))


def test_estimate_memory_prints_the_table_and_exits(text_files, tmp_path):
    base = ["--model", "small", "--data", *text_files, "--batch-size", "4", "--threads", "1", "--estimate-memory"]
    one = run(base, nproc=1)
    two = run(base, nproc=2)
    bf16 = run(base + ["--mixed-precision", "bf16"], nproc=2)
    for p in (one, two, bf16):
        assert p.returncode == 0, show(p)
        assert "step " not in p.stdout and "[default1]:" not in p.stdout, show(p)
        assert "total peak" in p.stdout and "the forward's and backward's peak, at the " in p.stdout, show(p)
    # Model states halve on 2 ranks (every dimension of `small` divides by 2); bf16 compute halves the
    # gathered parameters but not the fp32 shards.
    assert table_mib(two.stdout, "sharded params") == pytest.approx(table_mib(one.stdout, "sharded params") / 2, abs=0.1)
    assert table_mib(two.stdout, "optimizer state") == pytest.approx(table_mib(one.stdout, "optimizer state") / 2, abs=0.1)
    assert table_mib(bf16.stdout, "sharded params") == table_mib(two.stdout, "sharded params")
    assert table_mib(two.stdout, "total peak") < table_mib(one.stdout, "total peak")


def test_model_states_line_is_16_bytes_per_parameter_over_n(text_files, tmp_path):
    p = run(["--model", "small", "--data", *text_files, "--batch-size", "2", "--threads", "1", "--steps", "1",
             "--sample-tokens", "0"], nproc=3)
    assert p.returncode == 0, show(p)
    m = re.search(r"model states on rank 0: params ([\d.]+) \+ grads ([\d.]+) \+ optimizer ([\d.]+) = ([\d.]+) MiB; "
                  r"16 x P / N = ([\d.]+) MiB \(x([\d.]+)", p.stdout)
    assert m, show(p)
    params, grads, opt, total, ideal, ratio = map(float, m.groups())
    assert opt == pytest.approx(2 * params, abs=0.15) and grads == pytest.approx(params, abs=0.1), show(p)
    assert total == pytest.approx(params + grads + opt, abs=0.15) and total == pytest.approx(ratio * ideal, abs=0.1)
    # small's rows do not all divide by 3 (128 dims, vocab 256): a little padding, under issue 14's 5%.
    assert 1.0 < ratio <= 1.05, f"padding overhead on 3 ranks: x{ratio}"


# --------------------------------------------------------------------------------------------------
# 1. A short run on 2 ranks lowers the evaluation loss; every metrics line has the keys.
def test_two_ranks_lower_eval_loss_and_write_metrics(text_files, tmp_path):
    p = run(tiny(text_files, tmp_path, "--steps", "40", "--log-every", "5", "--eval-every", "20"))
    assert p.returncode == 0, show(p)
    rows = metrics(tmp_path / "m.jsonl")
    for r in rows:
        assert METRIC_KEYS <= r.keys(), r
    assert [r["step"] for r in rows] == [0, 5, 10, 15, 20, 25, 30, 35, 40]
    ev = eval_losses(rows)
    assert sorted(ev) == [0, 20, 40]
    assert abs(ev[0] - math.log(256)) < 0.1, f"a fresh model should predict ~uniform bytes: {ev[0]}"
    assert ev[40] < ev[0] - 0.8, f"eval loss did not fall: {ev}"
    for r in rows[1:]:
        assert all(math.isfinite(r[k]) and r[k] >= 0 for k in METRIC_KEYS), r
        assert r["tokens_per_s"] > 0 and r["step_ms"] > 0 and r["peak_rss_mb"] > 10
    # Rank 0 reports (log lines, summary, sample); rank 1 stays quiet.
    out = p.stdout
    assert "[default0]:step 40/40 | loss" in out and "tok/s/rank" in out and "peak" in out, show(p)
    assert re.search(r"\[default0\]:eval loss: [\d.]+ \(step 0\) -> [\d.]+ \(step 40\)", out), show(p)
    assert "[default0]:sample (seed 7" in out, show(p)
    assert "[default1]:" not in out, show(p)


# 2. Sharded training on 2 ranks equals one process on the same global batch, step by step.
@pytest.mark.parametrize("accum", [1, 2])
def test_two_ranks_match_one_process(text_files, tmp_path, accum):
    common = ["--steps", "8", "--log-every", "1", "--eval-every", "4", "--grad-accum-steps", str(accum),
              "--warmup-steps", "2", "--sample-tokens", "0"]
    one = run(tiny(text_files, tmp_path, *common, "--batch-size", "8", name="one.jsonl"), nproc=None)
    assert one.returncode == 0, show(one)
    two = run(tiny(text_files, tmp_path, *common, "--batch-size", "4", name="two.jsonl"), nproc=2)
    assert two.returncode == 0, show(two)
    ref, mine = metrics(tmp_path / "one.jsonl"), metrics(tmp_path / "two.jsonl")
    assert len(train_losses(ref)) == 8
    # Same data order: the losses of step 1 (before any update) agree far below the tolerance.
    worst = assert_close(train_losses(mine), train_losses(ref), RTOL, "train loss")
    assert_close(eval_losses(mine), eval_losses(ref), RTOL, "eval loss")
    g1 = {r["step"]: r["grad_norm"] for r in ref if r["loss"] is not None}
    g2 = {r["step"]: r["grad_norm"] for r in mine if r["loss"] is not None}
    assert_close(g2, g1, 1e-4, "grad norm")
    print(f"[parity] accum {accum}: max relative loss difference {worst:.3g} (tolerance {RTOL:g})")


# 3. Options that must not change the math (fp32): the same losses, gradient norms and final parameters
#    as the baseline run. Mixed precision changes the rounding only: within a few percent. The runs go
#    past the warmup (2 steps of 6) at the full learning rate, without clipping: AdamW's update does not
#    see a constant factor on the gradients and clipping would hide one, so the gradient norms (logged
#    before clipping) catch a scaled gradient, and the parameters an optimizer that does not step.
OPTIONS_RUN = ["--steps", "6", "--log-every", "1", "--eval-every", "6", "--sample-tokens", "0", "--warmup-steps", "2",
               "--clip-grad", "0"]


def final_parameters(ckpt, out):
    """The full parameters in the checkpoint after the last step (fsdp-ckpt consolidate), by name."""
    from safetensors.numpy import load_file
    c = subprocess.run([str(BUILD / "bin" / "fsdp-ckpt"), "consolidate", ckpt / "latest", out, "--prefix", "model.",
                        "--strip-prefix"], capture_output=True, text=True, timeout=60)
    assert c.returncode == 0, c.stdout + c.stderr
    return load_file(str(out / "model.safetensors"))


def update_error(params, base, init):
    """Relative distance between this run's update of all the parameters and the baseline's: |p - base| /
    |base - init| over all of them together (per tensor, bf16 moves a few small ones by 0.4 of their
    update). An optimizer that never steps scores 1; every parameter must have moved in the baseline."""
    import numpy as np
    off = moved = 0.0
    for k, p0 in init.items():
        m = float(np.linalg.norm((base[k] - p0).astype(np.float64)))
        assert m > 0, f"{k} did not move in the baseline"
        moved += m * m
        off += float(np.linalg.norm((params[k] - base[k]).astype(np.float64))) ** 2
    return (off / moved) ** 0.5


@pytest.fixture(scope="module")
def baseline(text_files, tmp_path_factory):
    from safetensors.numpy import load_file
    d = tmp_path_factory.mktemp("baseline")
    p = run(tiny(text_files, d, *OPTIONS_RUN, "--save-init", d / "init.safetensors", "--ckpt-dir", d / "ckpt"))
    assert p.returncode == 0, show(p)
    return {"rows": metrics(d / "m.jsonl"), "init": load_file(str(d / "init.safetensors")),
            "params": final_parameters(d / "ckpt", d / "full")}


# Measured: the fp32 options are bitwise equal to the baseline (parameters 0 off); bf16 0.035 and fp16
# 0.008 of the update off (an optimizer that never steps: 1).
@pytest.mark.parametrize("flags,rtol,param_tol", [
    (["--activation-checkpointing"], 1e-6, 1e-6),
    (["--reshard-after-forward", "false"], 1e-6, 1e-6),
    (["--reshard-after-forward", "2"], 1e-6, 1e-6),
    (["--cpu-offload"], 1e-6, 1e-6),
    (["--mixed-precision", "bf16"], 3e-2, 0.15),
    (["--mixed-precision", "fp16"], 3e-2, 0.15),
], ids=lambda v: " ".join(v) if isinstance(v, list) else None)
def test_options_keep_the_losses(text_files, tmp_path, baseline, flags, rtol, param_tol):
    p = run(tiny(text_files, tmp_path, *OPTIONS_RUN, *flags, "--ckpt-dir", tmp_path / "ckpt"))
    assert p.returncode == 0, show(p)
    rows, ref = metrics(tmp_path / "m.jsonl"), baseline["rows"]
    what = " ".join(flags)
    assert_close(train_losses(rows), train_losses(ref), rtol, what + ": train loss")
    assert_close(eval_losses(rows), eval_losses(ref), rtol, what + ": eval loss")
    assert_close(grad_norms(rows), grad_norms(ref), rtol, what + ": grad norm")
    err = update_error(final_parameters(tmp_path / "ckpt", tmp_path / "full"), baseline["params"], baseline["init"])
    print(f"[options] {what}: parameters {err:.3g} of the update away from the baseline (tolerance {param_tol:g})")
    assert err <= param_tol, f"{what}: the parameters after 6 steps are {err:.3g} of the update off the baseline"


def test_untied_head_trains(text_files, tmp_path):
    p = run(tiny(text_files, tmp_path, "--steps", "20", "--eval-every", "20", "--tie-weights", "false"))
    assert p.returncode == 0, show(p)
    ev = eval_losses(metrics(tmp_path / "m.jsonl"))
    assert ev[20] < ev[0] - 0.3, ev
    assert "untied head" in p.stdout


# 4. The sample is deterministic given --seed (and depends on it).
def test_sample_is_deterministic(text_files, tmp_path):
    def sample(seed):
        p = run(["--model", "tiny", "--data", *text_files, "--steps", "5", "--seed", seed, "--threads", "1",
                 "--sample-tokens", "40", "--sample-prompt", "The "], nproc=None)
        assert p.returncode == 0, show(p)
        return p.stdout.split("----\n")[1]
    a, b, c = sample("1"), sample("1"), sample("2")
    assert a == b and a.startswith("The ") and len(a) >= len("The ") + 10  # 40 bytes: >= 10 characters
    assert a != c
    # An untrained model at a high temperature emits arbitrary bytes: the output must still be valid
    # UTF-8 (run() decodes strictly), with ill-formed sequences and control bytes shown as U+FFFD.
    p = run(["--model", "tiny", "--data", *text_files, "--steps", "1", "--sample-tokens", "2000", "--temperature", "5",
             "--top-k", "0", "--threads", "1"], nproc=None)
    assert p.returncode == 0, show(p)
    assert "\ufffd" in p.stdout and not re.search(r"[\x00-\x08\x0b-\x1f\x7f]", p.stdout)


# 5. The default corpus (scripts/setup.sh installs it) loads and trains.
def test_default_corpus(tmp_path):
    corpus = Path("/usr/share/games/fortunes")
    assert corpus.is_dir(), "the default corpus is missing: run scripts/setup.sh (Debian packages fortunes, fortunes-min)"
    p = run(["--model", "tiny", "--steps", "20", "--eval-every", "20", "--threads", "1", "--sample-tokens", "0",
             "--metrics", tmp_path / "m.jsonl"])
    assert p.returncode == 0, show(p)
    m = re.search(r"data: fortunes \((\d+) files in /usr/share/games/fortunes\), (\d+) bytes", p.stdout)
    assert m and int(m.group(2)) > 2_000_000, show(p)
    ev = eval_losses(metrics(tmp_path / "m.jsonl"))
    assert ev[20] < ev[0] - 0.3, ev


# 6. The progress bar appears on a terminal (and never in piped output, as the tests above show).
def test_progress_bar_on_a_terminal(text_files):
    master, slave = pty.openpty()
    proc = subprocess.Popen([str(TRAIN_GPT), "--model", "tiny", "--data", *text_files, "--steps", "30",
                             "--sample-tokens", "0", "--threads", "1"],
                            stdout=slave, stderr=subprocess.PIPE, env=clean_env())
    os.close(slave)
    out = b""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        r, _, _ = select.select([master], [], [], 1)
        if r:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    os.close(master)
    assert proc.wait(timeout=30) == 0, proc.stderr.read()
    text = out.decode(errors="replace")
    assert "ETA" in text and "\r" in text and "30/30" in text, text[-2000:]


# 7. Bad input: a clear error on every rank before training, naming the value and the fix. Each rank is
#    run on its own with a launcher's environment for rank r of 2 and no peer: the checks come before the
#    rendezvous, so each rank must fail by itself at once (not wait for the other). Then once through
#    fsdprun (which stops the other rank when the first fails).
BAD_INPUT = [
    ("missing data file", ["--data", "/nonexistent/corpus.txt"], "'/nonexistent/corpus.txt' does not exist"),
    ("text shorter than a block", ["--data", "{short}"], "shorter than one block of --block-size + 1 = 33"),
    ("more ranks than batches", ["--data", "{small}", "--batch-size", "40"], "more ranks than batches"),
    ("unknown preset", ["--model", "huge"], "unknown preset --model huge: expected one of tiny|small|medium"),
    ("n_embd not divisible by n_head", ["--n-embd", "30", "--n-head", "4"], "--n-embd=30 is not divisible by --n-head=4"),
    ("reshard-after-forward not dividing", ["--reshard-after-forward", "3"], "does not divide the 2 ranks"),
]


def bad_input_args(text_files, tmp_path, args):
    (tmp_path / "short.txt").write_text("too short")
    # 60 windows of 33 bytes: the training split has ~54, fewer than 40 x 2 ranks.
    (tmp_path / "small.txt").write_text(Path(text_files[0]).read_text()[:33 * 60])
    args = [a.format(short=tmp_path / "short.txt", small=tmp_path / "small.txt") for a in args]
    base = ([] if "--model" in args else ["--model", "tiny"]) + ([] if "--data" in args else ["--data", *text_files])
    return [str(TRAIN_GPT), *base, *args, "--steps", "5"]


@pytest.mark.parametrize("case,args,message", BAD_INPUT, ids=[c[0] for c in BAD_INPUT])
def test_bad_input_fails_on_every_rank(text_files, tmp_path, case, args, message):
    cmd = bad_input_args(text_files, tmp_path, args)
    for rank in (0, 1):
        # Port 1: nothing listens there; a rank that tried to rendezvous would fail differently (or hang).
        env = clean_env() | {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
                             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "FSDP_TIMEOUT_S": "5"}
        p = subprocess.run(cmd, env=env, capture_output=True, encoding="utf-8", timeout=30)
        assert p.returncode == 2, f"{case}: rank {rank}\n" + show(p)
        lines = p.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("train_gpt: error: ") and message in lines[0], \
            f"{case}: rank {rank}\n" + show(p)
        assert "Fix:" in lines[0] or "expected" in lines[0], f"{case}: the message names no fix\n" + show(p)
        assert p.stdout == "", f"{case}: rank {rank} started\n" + show(p)


def test_bad_input_through_fsdprun(text_files, tmp_path):
    case, args, message = BAD_INPUT[0]
    p = run(bad_input_args(text_files, tmp_path, args)[1:], timeout=60)
    assert p.returncode != 0, show(p)
    assert re.search(r"\[default\d\]:train_gpt: error: .*" + re.escape(message), p.stderr), show(p)
    assert "step " not in p.stdout, show(p)
    assert p.elapsed < 30, f"took {p.elapsed:.1f}s: the ranks should fail before the rendezvous"


# --------------------------------------------------------------------------------------------------
# 8. Checkpoints: --ckpt-dir DIR --ckpt-every K --keep-last N save distributed checkpoints in DIR/step-N;
#    --resume continues from the newest. --stop-at N interrupts a run after step N as a crash would (the
#    learning-rate schedule still spans --steps), so "10 steps, stop, resume, 10 steps" is one flag away.
RESUME = ["--steps", "20", "--log-every", "1", "--eval-every", "10", "--warmup-steps", "5", "--sample-tokens", "0"]


def grad_norms(rows):
    return {r["step"]: r["grad_norm"] for r in rows if r["loss"] is not None}


@pytest.mark.parametrize("flags", [
    ["--dropout", "0.1"],  # the random stream (dropout) must continue where it stopped
    ["--tie-weights", "false", "--mixed-precision", "fp16", "--grad-accum-steps", "2"],  # loss scaler, accumulation
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


def test_resume_on_another_world_size(text_files, tmp_path):
    """Saved on 2 ranks (batch 4 each), resumed on 1 with the same global batch (8): the model and the
    optimizer are resharded and the data position carries over (the very same batches)."""
    from safetensors.numpy import load_file
    ckpt = tmp_path / "ckpt"
    ref = run(tiny(text_files, tmp_path, *RESUME, "--dump-batches", tmp_path / "ref_batches", name="ref.jsonl"),
              timeout=120)
    assert ref.returncode == 0, show(ref)
    first = run(tiny(text_files, tmp_path, *RESUME, "--ckpt-dir", ckpt, "--ckpt-every", "10", "--stop-at", "10",
                     name="first.jsonl"), timeout=120)
    assert first.returncode == 0, show(first)
    second = run(tiny(text_files, tmp_path, *RESUME, "--batch-size", "8", "--ckpt-dir", ckpt, "--resume",
                      "--dump-batches", tmp_path / "batches", name="second.jsonl"), nproc=1, timeout=120)
    assert second.returncode == 0, show(second)
    assert re.search(r"\[default0\]:resume: .*/step-10 \(after step 10, saved on 2 ranks, loaded on 1 .*\); "
                     r"data: epoch 0, window 80 of \d+; continuing at step 11/20", second.stdout), show(second)
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
    for rank in (0, 1):
        env = clean_env() | {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": "2",
                             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1", "FSDP_TIMEOUT_S": "5"}
        p = subprocess.run(cmd, env=env, capture_output=True, encoding="utf-8", timeout=30)
        assert p.returncode == 2, f"{case}: rank {rank}\n" + show(p)
        lines = p.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith("train_gpt: error: ") and message in lines[0], \
            f"{case}: rank {rank}\n" + show(p)
        assert "Fix:" in lines[0], f"{case}: the message names no fix\n" + show(p)
        assert p.stdout == "", f"{case}: rank {rank} started\n" + show(p)
    # The checkpoint is untouched by the failed runs.
    assert sorted(d.name for d in tiny_checkpoint.iterdir()) == ["latest", "step-2"]


def test_checkpoint_bad_input_through_fsdprun(text_files, tmp_path, tiny_checkpoint):
    p = run(bad_input_args(text_files, tmp_path, ["--ckpt-dir", str(tiny_checkpoint), "--resume", "--n-embd", "64"])[1:],
            timeout=60)
    assert p.returncode != 0, show(p)
    assert re.search(r"\[default\d\]:train_gpt: error: --resume: the checkpoint .*/step-2 holds a model of another "
                     r"shape: parameter 'wte.weight' has shape \[256, 32\] in the checkpoint but \[256, 64\]", p.stderr), show(p)
    assert "step " not in p.stdout, show(p)
