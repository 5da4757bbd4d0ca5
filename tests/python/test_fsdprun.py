"""fsdprun: torchrun-compatible launcher (tools/fsdprun/main.cpp), and fsdp_hello under both launchers.

Runs real processes. FSDP_BUILD_DIR is the CMake build directory (default: <repo>/build); torchrun comes
from <repo>/.venv. Every subprocess has a timeout, and every job's processes carry a unique marker in
their environment so that the tests can prove none is left behind (and kill them if a test fails). Its
regressions (issue 17 item 6, marked `regressions`: their own ctest entry, labels foundation, checkpoint,
regressions): flag errors in one line, the OMP_NUM_THREADS notice in one line of its own.
"""

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from fsdp_testing import FSDPRUN, HELLO, TORCHRUN, clean_env, free_port, show

BINARIES = (FSDPRUN, HELLO)


def procs_with_marker(marker):
    """PIDs of live processes whose environment holds FSDPRUN_TEST_MARKER=<marker>."""
    needle = f"FSDPRUN_TEST_MARKER={marker}".encode()
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            if needle in (d / "environ").read_bytes().split(b"\0"):
                pids.append(int(d.name))
        except OSError:
            pass
    return pids


@pytest.fixture
def marker():
    """A unique marker for this test's job; kills whatever still carries it at teardown."""
    m = uuid.uuid4().hex
    yield m
    for pid in procs_with_marker(m):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass



def fsdprun(args, marker=None, timeout=60, **env):
    env = clean_env(**env)
    if marker:
        env["FSDPRUN_TEST_MARKER"] = marker
    t0 = time.monotonic()
    p = subprocess.run([str(FSDPRUN), *args], env=env, capture_output=True, text=True, timeout=timeout)
    p.elapsed = time.monotonic() - t0
    return p


def rank_lines(text):
    """{local_rank: [lines]} from fsdprun's (or torchrun --tee's) `[default<local_rank>]:` prefixed output."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"^\[default(\d+)\]:(.*)$", line)
        if m:
            out.setdefault(int(m.group(1)), []).append(m.group(2))
    return out


# --------------------------------------------------------------------------------------------------
# 1. Ranks and prefixes.
@pytest.mark.parametrize("flag", ["--nproc-per-node", "--nproc_per_node"])
def test_ranks_and_prefix(flag, marker):
    p = fsdprun(["--standalone", flag, "3", "--", "sh", "-c", "echo $RANK/$WORLD_SIZE/$LOCAL_RANK"], marker)
    assert p.returncode == 0, show(p)
    assert rank_lines(p.stdout) == {r: [f"{r}/3/{r}"] for r in range(3)}, show(p)
    assert "fsdprun: OMP_NUM_THREADS is unset: each of this node's 3 workers gets 1 thread" in p.stderr, show(p)
    assert procs_with_marker(marker) == []


def test_prefix_matches_torchrun_tee():
    """fsdprun always prefixes as `torchrun --tee 3` does: `[<role><local_rank>]:` on stdout and stderr."""
    script = "echo out$RANK; echo err$RANK >&2"
    ours = fsdprun(["--standalone", "--nproc-per-node", "2", "sh", "-c", script])
    theirs = subprocess.run([str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "--tee", "3", "--no-python",
                             "sh", "-c", script], env=clean_env(), capture_output=True, text=True, timeout=120)
    assert ours.returncode == 0 and theirs.returncode == 0, show(ours) + show(theirs)
    for stream in ("stdout", "stderr"):
        mine = sorted(l for l in getattr(ours, stream).splitlines() if l.startswith("[default"))
        ref = sorted(l for l in getattr(theirs, stream).splitlines() if l.startswith("[default"))
        assert mine == ref, (stream, mine, ref)
    assert sorted(ours.stdout.splitlines()) == ["[default0]:out0", "[default1]:out1"]


def test_local_ranks_filter_and_log_dir(tmp_path):
    p = fsdprun(["--standalone", "--nproc-per-node", "3", "--local-ranks-filter", "0,2", "--log-dir", str(tmp_path),
                 "sh", "-c", "echo out$RANK; echo err$RANK >&2"])
    assert p.returncode == 0, show(p)
    assert sorted(p.stdout.splitlines()) == ["[default0]:out0", "[default2]:out2"]
    assert sorted(l for l in p.stderr.splitlines() if l.startswith("[")) == ["[default0]:err0", "[default2]:err2"]
    # torchrun's layout: DIR/<run_id>_XXXXXX/attempt_<k>/<local_rank>/{stdout,stderr}.log, unprefixed.
    (run_dir,) = tmp_path.iterdir()
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}_\w+", run_dir.name)
    for r in range(3):
        assert (run_dir / "attempt_0" / str(r) / "stdout.log").read_text() == f"out{r}\n"
        assert (run_dir / "attempt_0" / str(r) / "stderr.log").read_text() == f"err{r}\n"


# --------------------------------------------------------------------------------------------------
# 2. The workers' environment is torchrun's.
def worker_envs(cmd, tmp_path, nproc):
    """Runs `cmd + sh -c 'env -0 > DIR/<local_rank>'` and returns ({local_rank: env}, parent env)."""
    parent = clean_env(ENV_DUMP_DIR=tmp_path)
    p = subprocess.run([*cmd, "sh", "-c", 'env -0 > "$ENV_DUMP_DIR/$LOCAL_RANK"'], env=parent,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, show(p)
    envs = {}
    for r in range(nproc):
        items = (tmp_path / str(r)).read_bytes().decode().split("\0")
        envs[r] = dict(kv.split("=", 1) for kv in items if "=" in kv)
    return envs, parent


def test_env_matches_torchrun(tmp_path):
    (tmp_path / "t").mkdir()
    (tmp_path / "f").mkdir()
    theirs, their_parent = worker_envs([str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "--no-python"],
                                       tmp_path / "t", 2)
    ours, our_parent = worker_envs([str(FSDPRUN), "--standalone", "--nproc-per-node", "2"], tmp_path / "f", 2)

    def added(env, parent):  # what the launcher set or changed (`_` is the shell's, not the launcher's)
        return {k for k, v in env.items() if parent.get(k) != v and k != "_"}

    same = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE",
            "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
            "TORCHELASTIC_USE_AGENT_STORE", "OMP_NUM_THREADS", "MASTER_ADDR", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
            "TORCHELASTIC_SIGNALS_TO_HANDLE"]
    uuid_re = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[0-9a-f]{4}-[0-9a-f]{12}"
    for r in range(2):
        assert added(ours[r], our_parent) == added(theirs[r], their_parent), (
            sorted(added(ours[r], our_parent)), sorted(added(theirs[r], their_parent)))
        for k in same:
            assert ours[r][k] == theirs[r][k], (r, k, ours[r][k], theirs[r][k])
        for env in (ours[r], theirs[r]):
            assert int(env["MASTER_PORT"]) > 0
            assert re.fullmatch(uuid_re, env["TORCHELASTIC_RUN_ID"]), env["TORCHELASTIC_RUN_ID"]
            assert env["TORCHELASTIC_ERROR_FILE"].endswith(f"/attempt_0/{r}/error.json")
    assert ours[0]["TORCHELASTIC_ERROR_FILE"] != ours[1]["TORCHELASTIC_ERROR_FILE"]
    assert ours[0]["MASTER_PORT"] == ours[1]["MASTER_PORT"]
    assert ours[0]["TORCHELASTIC_RUN_ID"] == ours[1]["TORCHELASTIC_RUN_ID"]
    assert ours[0]["RANK"] == "0" and ours[1]["WORLD_SIZE"] == "2" and ours[0]["MASTER_ADDR"] == "localhost"


def test_static_env_and_inherited_omp(marker):
    """Without --standalone: MASTER_ADDR/--master-port as given, run id "none", OMP_NUM_THREADS kept."""
    port = free_port()
    p = fsdprun(["--nproc_per_node=2", f"--master_port={port}", "sh", "-c",
                 "echo $MASTER_ADDR:$MASTER_PORT:$TORCHELASTIC_RUN_ID:$OMP_NUM_THREADS:$NCCL_DEBUG"],
                marker, OMP_NUM_THREADS=3, NCCL_DEBUG="INFO")
    assert p.returncode == 0, show(p)
    assert rank_lines(p.stdout) == {r: [f"127.0.0.1:{port}:none:3:INFO"] for r in range(2)}, show(p)
    assert "OMP_NUM_THREADS" not in p.stderr


# --------------------------------------------------------------------------------------------------
# 3. Failures stop the group quickly and leave no process behind.
def test_failure_stops_group(marker):
    script = 'if [ "$RANK" = 1 ]; then echo "rank one breaks" >&2; exit 3; fi; sleep 60'
    p = fsdprun(["--standalone", "--nproc-per-node", "3", "sh", "-c", script], marker, timeout=30)
    assert p.returncode == 1, show(p)
    assert p.elapsed < 10, show(p)
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)", p.stderr), show(p)
    assert re.search(r"exitcode\s*:\s*3\b", p.stderr), show(p)
    assert "rank one breaks" in p.stderr.split("Root Cause")[1], show(p)  # stderr tail in the summary
    assert procs_with_marker(marker) == []


def test_failure_lets_every_rank_report_before_stopping(marker):
    """A fault that hits every rank: the first to fail does not get the others SIGTERMed before they say it
    in their own words (fsdprun waits 2 s after the first failure; CI once lost a rank's message that way).
    A rank still running after the 2 s is stopped, and is reported as stopped."""
    script = ('if [ "$RANK" = 0 ]; then echo "rank zero breaks first" >&2; exit 3; fi; '
              'if [ "$RANK" = 1 ]; then sleep 0.7; echo "rank one breaks too" >&2; exit 4; fi; sleep 60')
    p = fsdprun(["--standalone", "--nproc-per-node", "3", "sh", "-c", script], marker, timeout=30)
    assert p.returncode == 1, show(p)
    assert 2 <= p.elapsed < 10, show(p)
    lines = rank_lines(p.stderr)
    assert "rank zero breaks first" in lines[0] and "rank one breaks too" in lines[1], show(p)
    assert re.search(r"rank\s*:\s*0 \(local_rank: 0\)", p.stderr), show(p)  # the root cause is the first
    assert re.search(r"rank 1 \(local_rank 1\): exitcode 4\b", p.stderr), show(p)
    assert re.search(r"rank 2 \(local_rank 2\): exitcode -15 \(SIGTERM\), after fsdprun began stopping", p.stderr), show(p)
    assert procs_with_marker(marker) == []


def test_failure_kills_stubborn_workers(marker):
    """Workers (and their children) that ignore SIGTERM get SIGKILL after the shutdown timeout."""
    script = 'trap "" TERM; if [ "$RANK" = 0 ]; then sleep 0.5; kill -USR1 $$; fi; sleep 60'
    p = fsdprun(["--standalone", "--nproc-per-node", "3", "sh", "-c", script], marker, timeout=30, FSDPRUN_GRACE_S=1)
    assert p.returncode == 1, show(p)
    assert p.elapsed < 10, show(p)
    assert re.search(r"rank\s*:\s*0 \(local_rank: 0\)", p.stderr), show(p)
    assert re.search(r"exitcode\s*:\s*-10 .*SIGUSR1", p.stderr), show(p)
    assert "sending SIGKILL" in p.stderr, show(p)
    assert procs_with_marker(marker) == []


def test_leftover_children_are_reaped(marker):
    """A worker that succeeds but leaves a background child behind: fsdprun ends it and still succeeds."""
    p = fsdprun(["--standalone", "--nproc-per-node", "2", "sh", "-c", "sleep 60 & echo done"], marker, timeout=30)
    assert p.returncode == 0, show(p)
    assert p.elapsed < 10, show(p)
    assert procs_with_marker(marker) == []


def test_exec_failure_and_bad_flags(marker):
    p = fsdprun(["--standalone", "--nproc-per-node", "2", "no-such-program-xyz"], marker)
    assert p.returncode != 0 and "fsdprun:" in p.stderr and "no-such-program-xyz" in p.stderr, show(p)
    p = fsdprun(["--nproc-per-node", "2", "--bogus-flag", "sh"], marker)
    assert p.returncode != 0 and "fsdprun: unknown option --bogus-flag" in p.stderr, show(p)
    p = fsdprun(["--nproc-per-node", "2"], marker)
    assert p.returncode != 0 and "fsdprun: no PROGRAM" in p.stderr, show(p)


# --------------------------------------------------------------------------------------------------
# 4. Restarts.
def test_max_restarts(tmp_path, marker):
    log = tmp_path / "attempts"
    # Every rank logs its attempt, waits for the other one to have logged too, then rank 1 fails.
    script = (f'echo "$RANK:$TORCHELASTIC_RESTART_COUNT:$TORCHELASTIC_MAX_RESTARTS" >> {log}; '
              f'while [ "$(grep -c ":$TORCHELASTIC_RESTART_COUNT:" {log})" -lt 2 ]; do sleep 0.05; done; '
              f'if [ "$RANK" = 1 ]; then exit 7; fi; sleep 60')
    p = fsdprun(["--standalone", "--nproc-per-node", "2", "--max-restarts", "2", "sh", "-c", script], marker)
    assert p.returncode == 1, show(p)
    assert sorted(log.read_text().split()) == sorted(f"{r}:{k}:2" for r in range(2) for k in range(3)), show(p)
    assert p.stderr.count("restarting the worker group") == 2, show(p)
    assert re.search(r"exitcode\s*:\s*7\b", p.stderr), show(p)
    # Each restarted attempt names every worker with how it ended, as the final summary does (issue 28, item 7).
    assert p.stderr.count("rank 1 (local_rank 1): exit code 7, the first failure") == 2, show(p)
    assert len(re.findall(r"rank 0 \(local_rank 0\): (signal \d+ \(SIG\w+\)|exit code \d+), after fsdprun began "
                          r"stopping the group", p.stderr)) == 2, show(p)
    assert procs_with_marker(marker) == []


# A node rank given with the c10d rendezvous (which assigns ranks in order of arrival) is warned about, never
# silently ignored (issue 28, item 7).
def test_node_rank_with_c10d_is_warned_as_ignored(marker):
    port = free_port()
    p = fsdprun(["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "nr",
                 "--node-rank", "1", "--nproc-per-node", "1", "true"], marker)
    assert p.returncode == 0, show(p)
    assert "--node-rank 1 is ignored with --rdzv-backend c10d" in p.stderr, show(p)
    assert "Fix: drop --node-rank" in p.stderr, show(p)
    q = fsdprun(["--nnodes", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
                 "--rdzv-id", "nr2", "--nproc-per-node", "1", "true"], marker)
    assert q.returncode == 0 and "--node-rank" not in q.stderr, show(q)


# --------------------------------------------------------------------------------------------------
# 5. The message a worker leaves in TORCHELASTIC_ERROR_FILE is in the summary.
def test_error_file_message(marker):
    script = ('if [ "$RANK" = 1 ]; then printf \'{"message": "disk full on shard 7", "timestamp": 1}\' '
              '> "$TORCHELASTIC_ERROR_FILE"; exit 2; fi; sleep 60')
    p = fsdprun(["--standalone", "--nproc-per-node", "2", "sh", "-c", script], marker, timeout=30)
    assert p.returncode == 1, show(p)
    root = p.stderr.split("Root Cause")[1]
    assert "disk full on shard 7" in root and "error.json" in root, show(p)
    assert procs_with_marker(marker) == []


def test_cpp_worker_records_its_error_as_torch_does(marker, tmp_path):
    """train_gpt writes its error with fsdp::elastic::record_exception: torch's JSON (message, extraInfo with
    py_callstack and timestamp), and the summary's root cause shows the C++ exception's type and message."""
    from fsdp_testing import TRAIN_GPT
    p = fsdprun(["--standalone", "--nproc-per-node", "2", "--log-dir", tmp_path, TRAIN_GPT, "--model", "tiny",
                 "--global-batch-size", "3", "--steps", "1"], marker, timeout=60)
    assert p.returncode == 1, show(p)
    root = p.stderr.split("Root Cause")[1]
    assert re.search(r"message   : train_gpt::UsageError: --global-batch-size 3 is not divisible by the 2 "
                     r"data-parallel ranks", root), show(p)
    files = list(tmp_path.rglob("error.json"))
    assert len(files) == 2, files
    import json
    for f in files:
        j = json.loads(f.read_text())["message"]
        assert j["message"].startswith("train_gpt::UsageError: --global-batch-size 3"), j
        assert set(j["extraInfo"]) == {"py_callstack", "timestamp"} and j["extraInfo"]["timestamp"].isdigit(), j


# --------------------------------------------------------------------------------------------------
# 6. Signals to fsdprun reach every worker.
def start_and_wait_ready(args, marker, ready_dir, nproc, **env):
    env = clean_env(FSDPRUN_TEST_MARKER=marker, READY_DIR=ready_dir, **env)
    p = subprocess.Popen([str(FSDPRUN), *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 20
    while len(list(Path(ready_dir).iterdir())) < nproc:
        if time.monotonic() > deadline or p.poll() is not None:
            p.kill()
            out, err = p.communicate(timeout=10)
            pytest.fail(f"workers did not start: rc={p.returncode}\n{out}\n{err}")
        time.sleep(0.05)
    return p


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_forwarded(tmp_path, marker, sig):
    script = ('trap "echo got-signal; exit 0" TERM INT; sleep 60 & touch "$READY_DIR/$RANK"; wait; '
              'echo not-reached')
    p = start_and_wait_ready(["--standalone", "--nproc-per-node", "3", "sh", "-c", script], marker, tmp_path, 3)
    p.send_signal(sig)
    out, err = p.communicate(timeout=20)
    assert p.returncode == 128 + sig, f"rc={p.returncode}\n{out}\n{err}"
    assert rank_lines(out) == {r: ["got-signal"] for r in range(3)}, f"{out}\n{err}"
    assert f"received {sig.name}" in err
    assert procs_with_marker(marker) == []


def test_sigterm_kills_stubborn_workers(tmp_path, marker):
    script = 'trap "" TERM; touch "$READY_DIR/$RANK"; sleep 60'
    p = start_and_wait_ready(["--standalone", "--nproc-per-node", "2", "--shutdown-timeout", "1", "sh", "-c", script],
                             marker, tmp_path, 2)
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=20)
    assert p.returncode == 128 + signal.SIGTERM, f"rc={p.returncode}\n{out}\n{err}"
    assert time.monotonic() - t0 < 10
    assert procs_with_marker(marker) == []


def test_second_signal_kills_stubborn_workers(tmp_path, marker):
    """With the default 30 s shutdown timeout, a second SIGINT (Ctrl-C twice) escalates to SIGKILL."""
    script = 'trap "" INT TERM; touch "$READY_DIR/$RANK"; sleep 60'
    p = start_and_wait_ready(["--standalone", "--nproc-per-node", "2", "sh", "-c", script], marker, tmp_path, 2)
    t0 = time.monotonic()
    p.send_signal(signal.SIGINT)
    time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=20)
    assert p.returncode == 128 + signal.SIGINT, f"rc={p.returncode}\n{out}\n{err}"
    assert time.monotonic() - t0 < 10 and "killing the workers" in err, err
    assert procs_with_marker(marker) == []


def test_broken_stdout_pipe_ends_job(marker):
    """`fsdprun ... | head -1`: once our stdout is gone, workers writing to it get SIGPIPE, as under torchrun."""
    env = clean_env(FSDPRUN_TEST_MARKER=marker)
    p = subprocess.Popen([str(FSDPRUN), "--standalone", "--nproc-per-node", "2", "sh", "-c", "yes $RANK"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert p.stdout.readline().startswith(b"[default")
    p.stdout.close()
    try:
        assert p.wait(timeout=20) == 1  # its stderr (a summary) fits in the pipe: no deadlock
    finally:
        p.kill()
        p.stderr.close()
    assert procs_with_marker(marker) == []


# --------------------------------------------------------------------------------------------------
# 7. Real rendezvous on fsdprun's store.
def test_hello_under_fsdprun(marker):
    p = fsdprun(["--standalone", "--nproc-per-node", "3", str(HELLO)], marker, timeout=120)
    assert p.returncode == 0, show(p)
    lines = rank_lines(p.stdout)
    assert sorted(lines) == [0, 1, 2], show(p)
    for r in range(3):
        assert lines[r] == [f"hello from rank {r}/3: sum of ranks = 3 (expected 3)"], show(p)
    assert procs_with_marker(marker) == []


def test_hello_restart_uses_new_store_prefix(marker):
    """Attempt 0 rendezvouses, then rank 1 fails; attempt 1 must rendezvous again under attempt_1."""
    script = f'{HELLO} || exit 1; if [ "$TORCHELASTIC_RESTART_COUNT" = 0 ] && [ "$RANK" = 1 ]; then exit 5; fi'
    p = fsdprun(["--standalone", "--nproc-per-node", "3", "--max-restarts", "1", "sh", "-c", script], marker,
                timeout=120)
    assert p.returncode == 0, show(p)
    assert p.stderr.count("restarting the worker group") == 1, show(p)
    assert "rank 1 ended with exit code 5" in p.stderr, show(p)
    lines = rank_lines(p.stdout)
    for r in range(3):  # attempt 1 completed on every rank
        assert f"hello from rank {r}/3: sum of ranks = 3 (expected 3)" in lines.get(r, []), show(p)
    assert procs_with_marker(marker) == []


def test_hello_multinode_static_two_agents(marker):
    """--nnodes 2 on one machine: node 0 hosts the store, node 1 joins it; ranks 0..3 all-reduce."""
    port = free_port()
    env = clean_env(FSDPRUN_TEST_MARKER=marker)
    common = ["--nnodes", "2", "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    procs = [subprocess.Popen([str(FSDPRUN), *common, "--node-rank", str(n), str(HELLO)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in (1, 0)]
    try:
        results = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    text = "".join(out for out, _ in results)
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, f"rc={p.returncode}\n{out}\n{err}"
    for r in range(4):
        assert f"hello from rank {r}/4: sum of ranks = 6 (expected 6)" in text, text
    assert procs_with_marker(marker) == []


# --------------------------------------------------------------------------------------------------
# 8. Our binary under PyTorch's own torchrun.
def test_hello_under_torchrun():
    p = subprocess.run([str(TORCHRUN), "--standalone", "--nproc-per-node", "2", "--no-python", str(HELLO)],
                       env=clean_env(), capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, show(p)
    for r in range(2):
        assert f"hello from rank {r}/2: sum of ranks = 1 (expected 1)" in p.stdout, show(p)


# --------------------------------------------------------------------------------------------------
# 9. Bad environments fail with a message naming the variable.
@pytest.mark.parametrize("env,name", [
    ({}, "RANK"),
    ({"RANK": 0, "WORLD_SIZE": 0}, "WORLD_SIZE"),
    ({"RANK": 0, "WORLD_SIZE": 2}, "MASTER_ADDR"),
    ({"RANK": 1, "WORLD_SIZE": 2, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "closed", "FSDP_TIMEOUT_S": 5},
     "MASTER_ADDR"),
], ids=["no-RANK", "WORLD_SIZE=0", "no-MASTER_ADDR", "unreachable-master"])
def test_hello_bad_env(env, name):
    env = dict(env)
    if env.get("MASTER_PORT") == "closed":
        env["MASTER_PORT"] = free_port()  # nothing listens there
    t0 = time.monotonic()
    p = subprocess.run([str(HELLO)], env=clean_env(**env), capture_output=True, text=True, timeout=60)
    assert p.returncode != 0, show(p)
    assert name in p.stderr, show(p)
    assert time.monotonic() - t0 < 45, show(p)


# 10. Flag errors in one line, the OMP_NUM_THREADS notice in one line of its own (issue 17 item 6, marked
#     `regressions`: their own ctest entry, labels foundation, checkpoint, regressions).
@pytest.mark.regressions
def test_fsdprun_omp_notice_is_one_line_of_its_own(tmp_path):
    p = subprocess.run([str(FSDPRUN), "--standalone", "--nproc-per-node", "2", "--", "true"], env=clean_env(),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    lines = [l for l in p.stderr.splitlines() if "OMP_NUM_THREADS" in l]
    assert lines == ["fsdprun: OMP_NUM_THREADS is unset: each of this node's 2 workers gets 1 thread so that they do "
                     "not oversubscribe the CPUs; set OMP_NUM_THREADS to choose another number"], p.stderr
    assert "*****" not in p.stderr and "Setting OMP_NUM_THREADS environment variable" not in p.stderr, p.stderr


@pytest.mark.regressions
@pytest.mark.parametrize("flag,value,message", [
    ("--max-restarts", "-1", "--max-restarts: expected an integer >= 0, got '-1'"),
    ("--max-restarts", "1.5", "--max-restarts: expected an integer >= 0, got '1.5'"),
    ("--shutdown-timeout", "nan", "--shutdown-timeout: expected a finite number >= 0 and <= 86400, got 'nan'"),
    ("--master-port", "70000", "--master-port: expected an integer >= 0 and <= 65535, got 70000, which is out of range"),
], ids=lambda v: v if isinstance(v, str) and v.startswith("-") else None)
def test_fsdprun_flag_errors_are_one_line(flag, value, message):
    p = subprocess.run([str(FSDPRUN), "--standalone", flag, value, "--", "true"], env=clean_env(), capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 1, p.stderr
    assert p.stderr.splitlines() == [f"fsdprun: {message} (see fsdprun --help)"], p.stderr


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
