"""train_gpt's SentencePiece tokenizer (issue 33 item 3; CTest label train_gpt): the ids of our C++ path (SentencePiece's
C++ library, examples/train_gpt/tokenizer.cpp, through `train_gpt tokenize`) equal the Python `sentencepiece` package's
for the same .model file, both ways: encoding a test corpus (the licence texts and a file of non-ASCII text) and
decoding id sequences (the encoded corpus, and random ids: byte pieces that form invalid UTF-8 included). The model is
trained by scripts/train_tokenizer.sh (spm_train, BPE, byte fallback).

FSDP_BUILD_DIR is the CMake build directory (default: <repo>/build).
"""

import subprocess
from pathlib import Path

import pytest

from fsdp_testing import TRAIN_GPT, clean_env, licence_texts, show

BINARIES = (TRAIN_GPT,)

# Scripts and cases byte-level BPE on English text has never seen: the vocabulary lacks them, byte fallback encodes
# them as <0x..> pieces. Also combining marks, CRLF, tabs, runs of spaces, a NUL-free control character, emoji ZWJ.
NON_ASCII = ("Grüße aus Köln, señor! Ça va? Ελληνικά, русский текст, עברית, العربية, हिन्दी, 日本語のテキスト, 한국어.\r\n"
             "e\u0301 (combining acute) vs \u00e9; ﬁ ligature; full-width ＡＢＣ; emoji 👩‍👩‍👧 🚀\n"
             "\ttabbed   spaced    line\x07bell\n\n  leading spaces and a trailing one \n")


def sentencepiece():
    try:
        import sentencepiece as spm
    except ImportError:  # requirements.txt installs it; scripts/setup.sh makes .venv from it
        pytest.skip("the Python package sentencepiece is not installed (pip install -r requirements.txt)")
    return spm


def tokenize(*args, timeout=120):
    return subprocess.run([str(TRAIN_GPT), "tokenize", *map(str, args)], env=clean_env(), capture_output=True,
                          timeout=timeout)


def read_shards(files):
    """The tokens of llm.c token files, concatenated (numpy: the header's count, then uint16 or uint32)."""
    import numpy as np
    out = []
    for f in files:
        header = np.fromfile(f, dtype="<i4", count=256)
        assert header[0] in (20240520, 20240801), f"{f}: magic {header[0]}"
        dtype = "<u2" if header[0] == 20240520 else "<u4"
        toks = np.fromfile(f, dtype=dtype, offset=1024)
        assert len(toks) == header[2], f
        out.append(toks.astype(np.int64))
    return np.concatenate(out)


def write_shard(path, ids):
    """ids as one llm.c uint16 token file."""
    import numpy as np
    header = np.zeros(256, dtype="<i4")
    header[:3] = (20240520, 1, len(ids))
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(ids, dtype="<u2").tobytes())


def test_encode_matches_python_sentencepiece(tokenizer, tmp_path):
    spm = sentencepiece()
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer))
    (tmp_path / "non_ascii.txt").write_bytes((NON_ASCII * 3).encode("utf-8"))
    files = [*licence_texts(), str(tmp_path / "non_ascii.txt")]
    # Small shards (many files), no validation segment (0.001 of 8192-token segments: none in this corpus), so
    # the training files hold the whole stream: each file's ids, then EOS.
    p = tokenize("--tokenizer", tokenizer, "--out", tmp_path / "shards", "--shard-tokens", "20000", "--val-fraction",
                 "0.001", *files)
    assert p.returncode == 0, show(p)
    ours = read_shards(sorted((tmp_path / "shards").glob("train_*.bin")))
    want = []
    for f in files:
        want += sp.encode(Path(f).read_bytes().decode("utf-8")) + [sp.eos_id()]  # no newline translation
    assert len(sorted((tmp_path / "shards").glob("train_*.bin"))) > 3
    assert len(ours) == len(want), (len(ours), len(want))
    diff = [i for i, (a, b) in enumerate(zip(ours.tolist(), want)) if a != b]
    assert not diff, f"{len(diff)} ids differ, the first at {diff[0]}: ours {ours[diff[0]:diff[0] + 8]} " \
                     f"python {want[diff[0]:diff[0] + 8]}"
    # The non-ASCII file did exercise byte fallback (pieces <0x..>) and decodes back losslessly.
    tail = sp.encode(NON_ASCII)
    assert any(sp.id_to_piece(i).startswith("<0x") for i in tail)
    assert sp.decode(tail) == NON_ASCII
    print(f"[tokenizer] {len(ours)} ids identical to Python sentencepiece {spm.__version__} over {len(files)} files")


def test_decode_matches_python_sentencepiece(tokenizer, tmp_path):
    import random
    spm = sentencepiece()
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer))
    rng = random.Random(7)
    cases = {
        "non_ascii": sp.encode(NON_ASCII),
        "licence": sp.encode(Path(licence_texts()[0]).read_text(encoding="utf-8")[:5000]),
        # Random ids over the whole vocabulary except the control pieces (<unk> 0, <s> 1, </s> 2): lone byte pieces
        # make invalid UTF-8, which both sides turn into U+FFFD the same way.
        "random": [rng.randrange(3, sp.get_piece_size()) for _ in range(3000)],
        "bytes_only": [rng.randrange(3, 3 + 256) for _ in range(500)],
    }
    for name, ids in cases.items():
        write_shard(tmp_path / f"{name}.bin", ids)
        p = tokenize("--tokenizer", tokenizer, "--decode", tmp_path / f"{name}.bin")
        assert p.returncode == 0, show(p)
        want = sp.decode(ids)
        ours = p.stdout.decode("utf-8")  # strict: our output is valid UTF-8, as Python's str is
        assert ours == want, f"{name}: decoded texts differ\nours   {ours[:200]!r}\npython {want[:200]!r}"


def test_bad_tokenizer_file_is_refused(tokenizer, tmp_path):  # (tokenizer: skipped without SentencePiece)
    (tmp_path / "junk.model").write_bytes(b"not a model")
    p = tokenize("--tokenizer", tmp_path / "junk.model", "--out", tmp_path / "o", *licence_texts()[:1])
    assert p.returncode != 0 and b"is not a SentencePiece model" in p.stderr, show(p)
    p = tokenize("--tokenizer", tmp_path / "missing.model", "--out", tmp_path / "o")
    assert p.returncode != 0 and b"does not exist" in p.stderr, show(p)
