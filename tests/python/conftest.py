"""pytest's setup of the Python-side tests: the `regressions` marker, the `text_files` and `tokenizer` fixtures, and the check of
the programs each test module needs (its BINARIES) before its first test. The shared helpers: fsdp_testing.py."""

import shutil
import subprocess
from pathlib import Path

import pytest

from fsdp_testing import BUILD, LICENSES, REPO, TRAIN_GPT, clean_env, licence_texts, show


def pytest_configure(config):
    # tests/CMakeLists.txt runs a file's marked tests in a second ctest entry, py_<file>_regressions, with the
    # `regressions` label (issue 17: faults found by users, each a whole class).
    config.addinivalue_line("markers", "regressions: a regression test of issue 17 (its own ctest entry and label)")


@pytest.fixture(scope="module")
def text_files():
    """The training text (the licence texts), checked to be there."""
    files = licence_texts()
    assert sum(Path(f).stat().st_size for f in files) > 100_000, f"expected the licence texts in {LICENSES}"
    return files


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A 1000-piece BPE model trained on the licence texts by scripts/train_tokenizer.sh."""
    d = tmp_path_factory.mktemp("tok")
    if not shutil.which("spm_train"):  # scripts/setup.sh installs it (Debian package sentencepiece)
        pytest.skip("spm_train is not installed (apt-get install sentencepiece; scripts/setup.sh does)")
    p = subprocess.run([str(REPO / "scripts" / "train_tokenizer.sh"), str(d / "lic"), "1000", *licence_texts()],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, show(p)
    # A train_gpt built where CMake found no libsentencepiece-dev refuses --tokenizer, saying so.
    (d / "empty.bin").write_bytes((20240520).to_bytes(4, "little") + (1).to_bytes(4, "little") + bytes(1016))
    p = subprocess.run([str(TRAIN_GPT), "tokenize", "--tokenizer", str(d / "lic.model"), "--decode", str(d / "empty.bin")],
                       env=clean_env(), capture_output=True, text=True, timeout=60)
    if "built without SentencePiece" in p.stderr:
        pytest.skip("train_gpt was built without SentencePiece (apt-get install libsentencepiece-dev, then rebuild)")
    assert p.returncode == 0, show(p)
    return d / "lic.model"


@pytest.fixture(scope="module", autouse=True)
def binaries(request):
    """Every program in the test module's BINARIES exists, else the module fails at once saying how to build it."""
    for b in getattr(request.module, "BINARIES", ()):
        assert b.is_file(), f"{b} is missing: build it with `cmake --build {BUILD} --target {b.name}`"
