"""Regressions of the command-line tools found by issue 17 item 6 (CTest labels foundation, checkpoint,
regressions): fsdp-ckpt's positional OUT, a --ckpt-dir followed to the checkpoint its `latest` names, a
clear message for a bad --max-file-size; fsdprun's OMP_NUM_THREADS notice in one line of its own.

FSDP_BUILD_DIR is the CMake build directory.
"""

import subprocess

import pytest

from test_train_gpt import BUILD, FSDPRUN, TRAIN_GPT, clean_env, run, show, text_files  # noqa: F401 (fixture)

FSDP_CKPT = BUILD / "bin" / "fsdp-ckpt"


def ckpt_tool(*args):
    return subprocess.run([str(FSDP_CKPT), *map(str, args)], capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def ckpt_dir(text_files, tmp_path_factory):
    """A train_gpt --ckpt-dir with step-2 and step-3 (`latest`: step-3), saved by 2 ranks."""
    d = tmp_path_factory.mktemp("tools") / "ckpt"
    p = run(["--model", "tiny", "--data", *text_files, "--steps", "3", "--ckpt-every", "2", "--sample-tokens", "0",
             "--threads", "1", "--ckpt-dir", d], timeout=60)
    assert p.returncode == 0, show(p)
    assert (d / "latest").read_text().strip() == "step-3"
    return d


def test_consolidate_takes_out_as_a_positional(ckpt_dir, tmp_path):
    """`fsdp-ckpt consolidate DIR OUT` (it said "--out is required") writes what `--out OUT` writes."""
    from safetensors.numpy import load_file
    a = ckpt_tool("consolidate", ckpt_dir / "step-3", tmp_path / "a")
    assert a.returncode == 0, a.stdout + a.stderr
    b = ckpt_tool("consolidate", ckpt_dir / "step-3", "--out", tmp_path / "b")
    assert b.returncode == 0, b.stdout + b.stderr
    ta, tb = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(tmp_path / "b" / "model.safetensors"))
    assert ta.keys() == tb.keys() and "model.wte.weight" in ta and all((ta[k] == tb[k]).all() for k in ta)
    both = ckpt_tool("consolidate", ckpt_dir / "step-3", tmp_path / "c", "--out", tmp_path / "d")
    assert both.returncode == 2 and "two output folders" in both.stderr and "Fix: give one" in both.stderr, both.stderr
    none = ckpt_tool("consolidate", ckpt_dir / "step-3")
    assert none.returncode == 2 and "Fix: fsdp-ckpt consolidate DIR OUT" in none.stderr, none.stderr


def test_commands_follow_a_ckpt_dirs_latest(ckpt_dir, tmp_path):
    """DIR may be a run's --ckpt-dir: verify, ls, consolidate and diff use the checkpoint `latest` names."""
    v = ckpt_tool("verify", ckpt_dir)
    assert v.returncode == 0, v.stdout + v.stderr
    assert v.stdout.startswith(f"OK {ckpt_dir}/step-3: ") and "every checksum matches" in v.stdout, v.stdout
    ls = ckpt_tool("ls", ckpt_dir)
    assert ls.returncode == 0 and f"checkpoint {ckpt_dir}/step-3" in ls.stdout, ls.stdout + ls.stderr
    d = ckpt_tool("diff", ckpt_dir, ckpt_dir / "step-3")
    assert d.returncode == 0 and "identical" in d.stdout, d.stdout + d.stderr
    c = ckpt_tool("consolidate", ckpt_dir, tmp_path / "out")
    assert c.returncode == 0 and (tmp_path / "out" / "model.safetensors").is_file(), c.stdout + c.stderr
    # A damaged newest checkpoint is found through the --ckpt-dir too.
    shard = next((ckpt_dir / "step-3").glob("shard-00001-model-*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    damaged = tmp_path / "damaged"
    subprocess.run(["cp", "-r", str(ckpt_dir), str(damaged)], check=True)
    next((damaged / "step-3").glob("shard-00001-model-*.safetensors")).write_bytes(bytes(data))
    (damaged / "latest").write_text("step-3\n")
    bad = ckpt_tool("verify", damaged)
    assert bad.returncode == 1 and "PROBLEM" in bad.stdout and "step-3" in bad.stdout, bad.stdout + bad.stderr


@pytest.mark.parametrize("size", ["abc", "-5GB", "0", "nan", "5XB", "1e999"])
def test_max_file_size_errors_are_clear(ckpt_dir, tmp_path, size):
    p = ckpt_tool("consolidate", ckpt_dir / "step-3", "--out", tmp_path / "out", "--max-file-size", size)
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"fsdp-ckpt: --max-file-size {size}: expected a positive size, a "
                                                   "number with an optional unit"), p.stderr
    assert "stod" not in p.stderr
    assert not (tmp_path / "out").exists(), "nothing is written for a bad flag"


def test_fsdprun_omp_notice_is_one_line_of_its_own(tmp_path):
    p = subprocess.run([str(FSDPRUN), "--standalone", "--nproc-per-node", "2", "--", "true"], env=clean_env(),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    lines = [l for l in p.stderr.splitlines() if "OMP_NUM_THREADS" in l]
    assert lines == ["fsdprun: OMP_NUM_THREADS is unset: each of this node's 2 workers gets 1 thread so that they do "
                     "not oversubscribe the CPUs; set OMP_NUM_THREADS to choose another number"], p.stderr
    assert "*****" not in p.stderr and "Setting OMP_NUM_THREADS environment variable" not in p.stderr, p.stderr


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
