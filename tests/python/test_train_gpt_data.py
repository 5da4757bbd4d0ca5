"""train_gpt's data beyond byte-level text (issue 33 items 3-5; CTest label train_gpt): a SentencePiece tokenizer
(--tokenizer), pre-tokenized llm.c token shards read by memory map (--data-shards, written by `train_gpt tokenize`)
whose position resumes exactly (also on another world size), and SFT on prompt/response JSONL with the prompt masked
(--sft): the loss is the mean over the global batch's unmasked tokens, so 2 ranks equal 1.

FSDP_BUILD_DIR is the CMake build directory (default: <repo>/build).
"""

import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from fsdp_testing import (BUILD, FSDP_CKPT, FSDPRUN, RTOL, TRAIN_GPT, assert_close, clean_env, eval_losses,
                          grad_norms, licence_texts, metrics, run, show, train_losses)

BINARIES = (FSDPRUN, TRAIN_GPT, FSDP_CKPT)


def base(tmp_path, *extra, name="m.jsonl"):
    """The tiny preset, seed 7, one thread, metrics to tmp_path/name, no sample."""
    return ["--model", "tiny", "--seed", "7", "--threads", "1", "--metrics", tmp_path / name, "--sample-tokens", "0",
            "--log-every", "1", *extra]


# --------------------------------------------------------------------------------------------------
# 1. --tokenizer: the model's vocabulary is the tokenizer's, the text is encoded with it, the sample decoded.
def test_tokenizer_sets_vocab_and_decodes_the_sample(tokenizer, text_files, tmp_path):
    p = run(base(tmp_path, "--tokenizer", tokenizer, "--data", *text_files, "--batch-size", "4", "--steps", "30",
                 "--eval-every", "30", "--sample-tokens", "24", "--sample-prompt", "The licence"), timeout=180)
    assert p.returncode == 0, show(p)
    assert "vocab 1000" in p.stdout, show(p)
    ev = eval_losses(metrics(tmp_path / "m.jsonl"))
    assert abs(ev[0] - math.log(1000)) < 0.3, f"a fresh model should predict ~uniform ids over 1000: {ev[0]}"
    assert ev[30] < ev[0] - 0.5, ev  # measured: 6.89 -> 6.17
    sample = re.search(r"\[default0\]:----\n\[default0\]:(.*?)\n", p.stdout, re.S)
    assert sample and sample.group(1).startswith("The licence"), show(p)
    # Decoded subwords, not ids or pieces: no SentencePiece meta symbol or byte-piece spelling in the text.
    assert "\u2581" not in sample.group(1) and "<0x" not in sample.group(1), sample.group(1)


def test_vocab_smaller_than_the_tokenizer_is_refused(tokenizer, text_files, tmp_path):
    p = run(base(tmp_path, "--tokenizer", tokenizer, "--data", *text_files, "--vocab-size", "512", "--steps", "1"),
            nproc=None, timeout=60)
    assert p.returncode == 2, show(p)
    assert "--vocab-size 512 is smaller than the tokenizer's vocabulary (sentencepiece, vocab 1000" in p.stderr, show(p)


# --------------------------------------------------------------------------------------------------
# 2. Token shards: `train_gpt tokenize` writes them; --data-shards reads them by memory map (windows across file
#    boundaries); a run stopped and resumed on 2, 3 or 1 ranks (the same global batch of 12) trains on exactly the
#    global batches of the uninterrupted run.
SHARD_RUN = ["--batch-size", "{B}", "--steps", "8", "--eval-every", "4", "--warmup-steps", "2"]
T = 32  # the tiny preset's context


@pytest.fixture(scope="module")
def shards(tokenizer, tmp_path_factory):
    d = tmp_path_factory.mktemp("shards")
    # 700 tokens a file: one window in ~22 spans two files.
    p = subprocess.run([str(TRAIN_GPT), "tokenize", "--tokenizer", str(tokenizer), "--out", str(d), "--shard-tokens",
                        "700", *licence_texts()], env=clean_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, show(p)
    assert len(list(d.glob("train_*.bin"))) > 50 and list(d.glob("val_*.bin")), sorted(d.iterdir())
    return d


def stream(files):
    import numpy as np
    parts = [np.fromfile(f, dtype="<u2", offset=1024).astype(np.int64) for f in sorted(files)]
    starts = np.cumsum([0] + [len(p) for p in parts])
    return np.concatenate(parts), starts


def shard_run(tokenizer, shards, tmp_path, nproc, B, *extra, name):
    args = base(tmp_path, "--tokenizer", tokenizer, "--data-shards", shards,
                *[a.format(B=B) for a in SHARD_RUN], *extra, name=name)
    return run(args, nproc=nproc, timeout=180)


def global_batches(d, world, first_step):
    """{step: the global batch's inputs and targets [G, 2, T]}, from --dump-batches of `world` ranks: rank r's row j
    is the global batch's row j * world + r (DistributedSampler: rank r takes every world-th window from r)."""
    import numpy as np
    from safetensors.numpy import load_file
    per_rank = [load_file(str(d / f"rank{r}.safetensors"))["batches"][:, 0] for r in range(world)]  # [S, 2, B, T]
    S, _, B, _ = per_rank[0].shape
    out = {}
    for s in range(S):
        g = np.empty((B * world, 2, per_rank[0].shape[3]), dtype=np.int64)
        for r in range(world):
            g[r::world] = per_rank[r][s].transpose(1, 0, 2)
        out[first_step + s] = g
    return out


def test_shards_resume_exactly_on_any_world_size(tokenizer, shards, tmp_path):
    ckpt = tmp_path / "ckpt"
    ref = shard_run(tokenizer, shards, tmp_path, 2, 6, "--dump-batches", tmp_path / "ref", name="ref.jsonl")
    assert ref.returncode == 0, show(ref)
    assert "memory-mapped" in ref.stdout, show(ref)
    first = shard_run(tokenizer, shards, tmp_path, 2, 6, "--ckpt-dir", ckpt, "--stop-at", "4", name="first.jsonl")
    assert first.returncode == 0, show(first)
    want = global_batches(tmp_path / "ref", 2, 1)
    assert sorted(want) == list(range(1, 9))

    # Every window trained on is block_size + 1 consecutive tokens of the files' stream (numpy's reading), at a
    # multiple of block_size; some cross a file boundary.
    tokens, starts = stream(shards.glob("train_*.bin"))
    spans = 0
    for s, g in want.items():
        for x, y in g:
            i = None
            for cand in range(0, len(tokens) - T, T):  # find the window (few: search by its first tokens)
                if tokens[cand] == x[0] and (tokens[cand:cand + T] == x).all() and (tokens[cand + 1:cand + T + 1] == y).all():
                    i = cand
                    break
            assert i is not None, f"step {s}: a window that is not in the shards' stream"
            spans += any(i < b < i + T + 1 for b in starts[1:-1])
    assert spans > 0, "no window of the 96 read spans two files: the test no longer covers that case"

    for world, B in ((2, 6), (3, 4), (1, 12)):
        d = tmp_path / f"ckpt{world}"
        shutil.copytree(ckpt, d)
        p = shard_run(tokenizer, shards, tmp_path, world if world > 1 else None, B, "--ckpt-dir", d, "--resume",
                      "--dump-batches", tmp_path / f"resumed{world}", name=f"resumed{world}.jsonl")
        assert p.returncode == 0, show(p)
        got = global_batches(tmp_path / f"resumed{world}", world, 5)
        assert sorted(got) == [5, 6, 7, 8]
        for s in got:
            assert (got[s] == want[s]).all(), f"resumed on {world} ranks: the global batch of step {s} differs"
        assert re.search(rf"resume: .*step-4 \(after step 4, saved on 2 ranks, loaded on {world} .*data: epoch 0, "
                         r"window 48 of", p.stdout), show(p)
        # And the same losses (bitwise on the same world size; within the parity tolerance on another).
        mine = train_losses(metrics(tmp_path / f"resumed{world}.jsonl"))
        ref_l = {s: l for s, l in train_losses(metrics(tmp_path / "ref.jsonl")).items() if s > 4}
        if world == 2:
            assert mine == ref_l
        else:
            assert_close(mine, ref_l, RTOL, f"train loss resumed on {world} ranks")


def test_uint32_shards_read_as_uint16(shards, tmp_path):
    """llm.c's uint32 files (its Llama 3 format: magic 20240801, version 7) give the very batches of the same tokens
    in uint16 files."""
    import numpy as np
    (tmp_path / "u32").mkdir()
    for f in shards.glob("*.bin"):
        toks = np.fromfile(f, dtype="<u2", offset=1024).astype("<u4")
        header = np.zeros(256, dtype="<i4")
        header[:3] = (20240801, 7, len(toks))
        (tmp_path / "u32" / f.name).write_bytes(header.tobytes() + toks.tobytes())
    for name, d in (("u16", shards), ("u32", tmp_path / "u32")):
        p = run(base(tmp_path, "--data-shards", d, "--vocab-size", "1000", "--steps", "3", "--batch-size", "4",
                     "--dump-batches", tmp_path / f"b_{name}", name=f"{name}.jsonl"), timeout=120)
        assert p.returncode == 0, show(p)
    from safetensors.numpy import load_file
    for r in (0, 1):
        a, b = (load_file(str(tmp_path / f"b_{n}" / f"rank{r}.safetensors"))["batches"] for n in ("u16", "u32"))
        assert a.shape == (3, 1, 2, 4, T) and (a == b).all()
    assert train_losses(metrics(tmp_path / "u16.jsonl")) == train_losses(metrics(tmp_path / "u32.jsonl"))


def test_shards_are_mapped_not_read(shards, tmp_path):
    """A 128 MiB training file costs the ranks' memory only the windows they read (mmap): the peak RSS stays within
    half the file of a run on the 0.15 MiB of the licence shards (the sampler's permutation of the 2M windows takes
    16 MiB; reading the file would take 128 MiB, 512 as int64)."""
    big = tmp_path / "big"
    big.mkdir()
    n = 64 * 2**20  # uint16 tokens: 128 MiB
    header = (20240520).to_bytes(4, "little") + (1).to_bytes(4, "little") + n.to_bytes(4, "little") + bytes(1012)
    with open(big / "train_000000.bin", "wb") as f:
        f.write(header)
        f.truncate(1024 + 2 * n)  # sparse: zeros (token 0) without writing them
    shutil.copy(next(shards.glob("val_*.bin")), big)
    peaks = {}
    for name, d in (("small", shards), ("big", big)):
        p = run(base(tmp_path, "--data-shards", d, "--vocab-size", "1000", "--steps", "3", "--batch-size", "4",
                     "--eval-every", "3", name=f"{name}.jsonl"), timeout=120)
        assert p.returncode == 0, show(p)
        peaks[name] = max(r["peak_rss_mb"] for r in metrics(tmp_path / f"{name}.jsonl") if r.get("peak_rss_mb"))
    assert peaks["big"] < peaks["small"] + 64, f"peak RSS {peaks} (MiB): the 128 MiB file was read into memory?"
    print(f"[mmap] peak RSS {peaks['small']:.0f} MiB (0.15 MiB of shards) vs {peaks['big']:.0f} MiB (128 MiB)")


def test_bad_shards_are_refused(tokenizer, shards, tmp_path):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "train_000000.bin").write_bytes(b"\0" * 2048)
    shutil.copy(next(shards.glob("val_*.bin")), tmp_path / "bad")
    p = run(base(tmp_path, "--tokenizer", tokenizer, "--data-shards", tmp_path / "bad", "--steps", "1"), nproc=None)
    assert p.returncode == 2 and "has no llm.c header" in p.stderr, show(p)
    p = run(base(tmp_path, "--data-shards", shards, "--steps", "1"), nproc=None)  # bytes: ids up to 999 do not fit
    assert p.returncode == 2 and "outside the model's vocabulary of 256" in p.stderr, show(p)
    p = run(base(tmp_path, "--data-shards", tmp_path / "nothing*.bin", "--steps", "1"), nproc=None)
    assert p.returncode == 2 and "matches no token file" in p.stderr, show(p)


# --------------------------------------------------------------------------------------------------
# 3. SFT: prompt tokens masked; the loss is the mean over the global batch's response tokens.
def sft_file(path, n=240, empty_responses=False):
    """JSONL of prompt/response pairs cut from the licence texts: prompts and responses of varied lengths (so that
    the ranks' batches hold different numbers of unmasked tokens)."""
    lines = [l for l in Path(licence_texts()[0]).read_text().splitlines() if l.strip()]
    with open(path, "w") as f:
        for i in range(n):
            a, b = lines[i % len(lines)], lines[(i * 7 + 3) % len(lines)]
            f.write(json.dumps({"prompt": a[: 5 + i % 30], "response": "" if empty_responses else b[: 3 + (i * 13) % 40]})
                    + "\n")
    return path


def final_parameters(ckpt, out):
    from safetensors.numpy import load_file
    c = subprocess.run([str(FSDP_CKPT), "consolidate", ckpt / "latest", out, "--prefix", "model.", "--strip-prefix"],
                       capture_output=True, text=True, timeout=60)
    assert c.returncode == 0, c.stdout + c.stderr
    return load_file(str(out / "model.safetensors"))


SFT_RUN = ["--steps", "6", "--eval-every", "3", "--warmup-steps", "2", "--clip-grad", "0"]


# The global batch of 8 examples as 2 ranks x 4, or as one rank's 2 microbatches of 4 (--grad-accum-steps 2: the
# mean is over both microbatches' unmasked tokens too), against one rank x 8.
@pytest.mark.parametrize("tok,layout", [("bytes", "2 ranks"), ("sentencepiece", "2 ranks"), ("sentencepiece", "accum 2")])
def test_sft_two_ranks_match_one(request, tmp_path, tok, layout):
    data = sft_file(tmp_path / "sft.jsonl")
    t = ["--tokenizer", request.getfixturevalue("tokenizer")] if tok == "sentencepiece" else []
    one = run(base(tmp_path, "--sft", data, *t, *SFT_RUN, "--batch-size", "8", "--ckpt-dir", tmp_path / "c1",
                   "--save-init", tmp_path / "init.safetensors", name="one.jsonl"), nproc=None, timeout=180)
    assert one.returncode == 0, show(one)
    assert "prompt tokens masked" in one.stdout, show(one)
    split = ["--grad-accum-steps", "2"] if layout == "accum 2" else []
    two = run(base(tmp_path, "--sft", data, *t, *SFT_RUN, "--batch-size", "4", *split, "--ckpt-dir", tmp_path / "c2",
                   name="two.jsonl"), nproc=None if split else 2, timeout=180)
    assert two.returncode == 0, show(two)
    ref, mine = metrics(tmp_path / "one.jsonl"), metrics(tmp_path / "two.jsonl")
    worst = assert_close(train_losses(mine), train_losses(ref), RTOL, "sft train loss")
    assert_close(eval_losses(mine), eval_losses(ref), RTOL, "sft eval loss")
    gworst = assert_close(grad_norms(mine), grad_norms(ref), 1e-4, "sft grad norm")
    import numpy as np
    from safetensors.numpy import load_file
    p1, p2 = final_parameters(tmp_path / "c1", tmp_path / "f1"), final_parameters(tmp_path / "c2", tmp_path / "f2")
    init = load_file(str(tmp_path / "init.safetensors"))
    # The parameters: the 2-rank run's distance from the 1-rank run's, relative to how far the 1-rank run moved them
    # (all parameters together; an update of another size or direction scores ~1).
    off = sum(float(np.linalg.norm((p2[k] - p1[k]).astype(np.float64))) ** 2 for k in init) ** 0.5
    moved = sum(float(np.linalg.norm((p1[k] - init[k]).astype(np.float64))) ** 2 for k in init) ** 0.5
    pworst = max(float(np.abs(p1[k] - p2[k]).max()) for k in init)
    assert off / moved < 1e-4, f"parameters after 6 steps: {off / moved:.3g} of the update apart (max |diff| {pworst})"
    print(f"[sft parity] {tok}, {layout}: loss rel {worst:.3g}, grad norm rel {gworst:.3g}, parameters {off / moved:.3g} of the "
          f"update apart (max |diff| {pworst:.3g})")


def test_sft_all_masked_targets_give_zero_gradient(tmp_path):
    # Bytes have no EOS: with empty responses every target is a prompt's or padding's.
    data = sft_file(tmp_path / "masked.jsonl", empty_responses=True)
    p = run(base(tmp_path, "--sft", data, "--steps", "2", "--batch-size", "4", "--eval-every", "2"), timeout=120)
    assert p.returncode == 0, show(p)
    rows = [r for r in metrics(tmp_path / "m.jsonl") if r["loss"] is not None]
    assert [r["grad_norm"] for r in rows] == [0.0, 0.0] and [r["loss"] for r in rows] == [0.0, 0.0], rows


def test_sft_malformed_line_is_refused_with_its_number(tmp_path):
    data = sft_file(tmp_path / "bad.jsonl", n=10)
    lines = data.read_text().splitlines()
    for bad, why in (('{"prompt": "a"}', 'has no "response"'), ('{"prompt": "a", "response": 3}', "not a string"),
                     ("not json", "is not valid JSON"), ('["a", "b"]', "is not a JSON object")):
        data.write_text("\n".join(lines[:4] + [bad] + lines[4:]) + "\n")
        p = run(base(tmp_path, "--sft", data, "--steps", "1"), nproc=None, timeout=60)
        assert p.returncode == 2, show(p)
        assert f"bad.jsonl: line 5 {why}" in p.stderr or (f"line 5 " in p.stderr and why in p.stderr), show(p)


# --------------------------------------------------------------------------------------------------
# 6. --init-from DIR picks the folder's own SentencePiece model (DIR/tokenizer.model, as Llama 2 and Mistral folders
#    ship it); a folder whose tokenizer train_gpt cannot read (tokenizer.json) is refused unless --tokenizer says
#    what to use (`bytes` included).
def test_init_from_uses_the_folders_tokenizer_or_refuses_one_it_cannot_read(tokenizer, text_files, tmp_path):
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (requirements.txt)")
    import torch
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=1000, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    folder = tmp_path / "hf"
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    args = ["--init-from", folder, "--data", *text_files, "--steps", "2", "--batch-size", "2", "--block-size", "32",
            "--threads", "1", "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0", "--no-progress"]
    shutil.copy(tokenizer, folder / "tokenizer.model")
    p = run(args + ["--export-hf", tmp_path / "out"], timeout=180)
    assert p.returncode == 0, show(p)
    assert "sentencepiece" in p.stdout and str(folder / "tokenizer.model") in p.stdout, show(p)
    # The export carries the tokenizer it was trained with (and the folder's generation_config.json).
    assert (tmp_path / "out" / "tokenizer.model").read_bytes() == Path(tokenizer).read_bytes()
    assert (tmp_path / "out" / "generation_config.json").is_file()
    assert "tokenizer files: tokenizer.model generation_config.json" in p.stdout, show(p)
    (folder / "tokenizer.model").unlink()
    (folder / "tokenizer.json").write_text("{}")
    p = run(args, timeout=180)
    assert p.returncode != 0, show(p)
    assert "the folder's tokenizer is tokenizer.json" in p.stderr + p.stdout, show(p)
    assert "--tokenizer bytes" in p.stderr + p.stdout, show(p)
    p = run(args + ["--tokenizer", "bytes"], timeout=180)
    assert p.returncode == 0, show(p)
    assert "sentencepiece" not in p.stdout, show(p)
