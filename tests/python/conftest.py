"""pytest's setup of the Python-side tests: the `regressions` marker, the `text_files` fixture, and the check of
the programs each test module needs (its BINARIES) before its first test. The shared helpers: fsdp_testing.py."""

from pathlib import Path

import pytest

from fsdp_testing import BUILD, LICENSES, licence_texts


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


@pytest.fixture(scope="module", autouse=True)
def binaries(request):
    """Every program in the test module's BINARIES exists, else the module fails at once saying how to build it."""
    for b in getattr(request.module, "BINARIES", ()):
        assert b.is_file(), f"{b} is missing: build it with `cmake --build {BUILD} --target {b.name}`"
