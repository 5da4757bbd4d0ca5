"""fsdp-ckpt, the checkpoint tool (tools/fsdp-ckpt; CTest label checkpoint): ls (chunks per rank, values), verify
(damage and missing files found), consolidate (one file loadable by the `safetensors` package, or split with an
index; PyTorch's own consolidation reads our shards), diff. On a checkpoint that checkpoint_interop saved on 4
ranks under fsdprun. The regressions of issue 17 item 6 (marked `regressions`: their own ctest entry, labels
foundation, checkpoint, regressions): a positional OUT for consolidate, a train_gpt --ckpt-dir followed to the
checkpoint its `latest` names, a clear message for a bad --max-file-size.

FSDP_BUILD_DIR is the CMake build directory (default: <repo>/build). Every subprocess has a timeout.
"""

import json
import re
import subprocess

import pytest
from safetensors.torch import load_file

from fsdp_testing import (FSDP_CKPT, FSDPRUN, INTEROP, TRAIN_GPT, assert_same, interop, run_program, show)
from fsdp_testing import run as run_train_gpt

BINARIES = (FSDPRUN, INTEROP, FSDP_CKPT, TRAIN_GPT)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("tool")
    p = interop(4, "save", "--dir", d / "ck", "--ref", d / "ref.safetensors", "--steps", 2)
    assert p.returncode == 0, show(p)
    return d


def test_ckpt_ls(saved):
    p = run_program([FSDP_CKPT, "ls", "--values", saved / "ck"])
    assert p.returncode == 0, show(p)
    assert "format libfsdp-dcp v1, saved by 4 rank(s), mesh [4] (shard)" in p.stdout, p.stdout
    # wte.weight [11, 6] on 4 ranks: rows 0-3, 3-6, 6-9, 9-11; head.weight [2, 6]: ranks 0 and 1 only.
    assert re.search(r"model\.wte\.weight\s+F32\s+\[11, 6\]\s+4 chunk\(s\): r0\[0:3, 0:6\] r1\[3:6, 0:6\] "
                     r"r2\[6:9, 0:6\] r3\[9:11, 0:6\]", p.stdout), p.stdout
    assert re.search(r"model\.head\.weight\s+F32\s+\[2, 6\]\s+2 chunk\(s\): r0\[0:1, 0:6\] r1\[1:2, 0:6\]",
                     p.stdout), p.stdout
    assert "optim.state.wte.weight.step = 2" in p.stdout


def test_ckpt_verify_detects_damage(saved, tmp_path):
    ok = run_program([FSDP_CKPT, "verify", saved / "ck"])
    assert ok.returncode == 0 and ok.stdout.startswith("OK"), show(ok)
    bad = tmp_path / "bad"
    subprocess.run(["cp", "-r", str(saved / "ck"), str(bad)], check=True)
    f = bad / "shard-00003-model-00001-of-00001.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    (bad / "shard-00004-model-00001-of-00001.safetensors").unlink()
    p = run_program([FSDP_CKPT, "verify", bad])
    assert p.returncode == 1, show(p)
    assert "checksum mismatch in" in p.stdout and "shard-00003" in p.stdout, p.stdout
    assert "shard-00004-model-00001-of-00001.safetensors is missing" in p.stdout, p.stdout


def test_ckpt_consolidate_single_and_split(saved, tmp_path):
    ref = load_file(saved / "ref.safetensors")
    one = tmp_path / "one"
    p = run_program([FSDP_CKPT, "consolidate", saved / "ck", "--out", one])
    assert p.returncode == 0, show(p)
    assert sorted(f.name for f in one.iterdir()) == ["model.safetensors"]
    assert_same(load_file(one / "model.safetensors"), ref)
    # Split, model weights only, Hugging Face names: an index maps every name to its file.
    split = tmp_path / "split"
    p = run_program([FSDP_CKPT, "consolidate", saved / "ck", "--out", split, "--max-file-size", "300B", "--prefix",
                     "model.", "--strip-prefix"])
    assert p.returncode == 0, show(p)
    index = json.loads((split / "model.safetensors.index.json").read_text())
    files = sorted(f.name for f in split.iterdir() if f.suffix == ".safetensors")
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors", files
    got = {}
    for name in files:
        part = load_file(split / name)
        for k in part:
            assert index["weight_map"][k] == name
        got.update(part)
    want = {k[len("model."):]: v for k, v in ref.items() if k.startswith("model.")}
    assert_same(got, want)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in want.values())


def test_pytorch_consolidates_our_shards(saved, tmp_path):
    """Our DCP_SHARDING_INFO is what PyTorch's own consolidation reads."""
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

    ref = load_file(saved / "ref.safetensors")
    consolidate_safetensors_files(str(saved / "ck"), str(tmp_path), fqn_to_index_mapping={k: 1 for k in ref})
    (out,) = [f for f in tmp_path.iterdir() if f.suffix == ".safetensors"]
    assert_same(load_file(out), ref)


def test_ckpt_diff(saved, tmp_path):
    same = run_program([FSDP_CKPT, "diff", saved / "ck", saved / "ck"])
    assert same.returncode == 0 and "identical" in same.stdout, show(same)
    p = interop(2, "save", "--dir", tmp_path / "other", "--ref", tmp_path / "r.safetensors", "--steps", 3)
    assert p.returncode == 0, show(p)
    d = run_program([FSDP_CKPT, "diff", saved / "ck", tmp_path / "other"])
    assert d.returncode == 1, show(d)
    assert re.search(r"differs: model\.wte\.weight: \d+ of 66 elements differ", d.stdout), d.stdout
    assert "differs: optim.state.wte.weight.step: 2 vs 3" in d.stdout, d.stdout


# ---- Regressions (issue 17 item 6) ----------------------------------------------------------------------
def ckpt_tool(*args):
    return subprocess.run([str(FSDP_CKPT), *map(str, args)], capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def ckpt_dir(text_files, tmp_path_factory):
    """A train_gpt --ckpt-dir with step-2 and step-3 (`latest`: step-3), saved by 2 ranks."""
    d = tmp_path_factory.mktemp("tools") / "ckpt"
    p = run_train_gpt(["--model", "tiny", "--data", *text_files, "--steps", "3", "--ckpt-every", "2",
                       "--sample-tokens", "0", "--threads", "1", "--ckpt-dir", d], timeout=60)
    assert p.returncode == 0, show(p)
    assert (d / "latest").read_text().strip() == "step-3"
    return d


@pytest.mark.regressions
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


@pytest.mark.regressions
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


@pytest.mark.regressions
@pytest.mark.parametrize("size", ["abc", "-5GB", "0", "nan", "5XB", "1e999"])
def test_max_file_size_errors_are_clear(ckpt_dir, tmp_path, size):
    p = ckpt_tool("consolidate", ckpt_dir / "step-3", "--out", tmp_path / "out", "--max-file-size", size)
    assert p.returncode == 2, p.stdout + p.stderr
    lines = p.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"fsdp-ckpt: --max-file-size {size}: expected a positive size, a "
                                                   "number with an optional unit"), p.stderr
    assert "stod" not in p.stderr
    assert not (tmp_path / "out").exists(), "nothing is written for a bad flag"
