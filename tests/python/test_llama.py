"""train_gpt's Llama architecture and Hugging Face folders in and out (issue 33, items 1 and 2), against the
`transformers` package (a test dependency, requirements.txt):

- parity: a tiny random LlamaForCausalLM (GQA, an MLP width no multiple of anything, Llama 3.1's rope scaling, its
  weights saved in several files with an index) and a tiny GPT2LMHeadModel, made here and saved with
  save_pretrained; train_gpt --init-from that folder on 1 and 2 ranks gives transformers' logits on the same tokens
  (fp32, max abs diff <= 1e-5); after 10 training steps its --export-hf folder loads in transformers and gives the
  logits train_gpt computed after training (<= 1e-5), which differ from the initial ones (training happened);
- refusals: a config.json field this trainer would compute differently fails every rank before training, naming
  the field and its value;
- units: RMSNorm, RoPE's frequencies (default and llama3) with cos/sin and the rotation, grouped-query attention,
  each computed by model_llama.h's functions (build/bin/llama_units) against transformers' own functions;
- the llama presets train (loss falls) and --estimate-memory counts the 8B/70B shapes without allocating them.
"""

import json
import shutil

import pytest
import torch

from fsdp_testing import BUILD, FSDPRUN, TRAIN_GPT, run, run_program, show

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -r requirements.txt)")
from safetensors.torch import load_file, save_file  # noqa: E402  (after the skip: safetensors comes with it)

LLAMA_UNITS = BUILD / "bin" / "llama_units"
BINARIES = (TRAIN_GPT, FSDPRUN, LLAMA_UNITS)
TOL = 1e-5  # fp32 logits, ours against transformers'

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def make_llama(path, **overrides):
    """A tiny random LlamaForCausalLM saved in `path`: 2 layers, hidden 64, 4 heads over 2 key/value heads,
    intermediate 96, vocab 256, llama3 rope scaling (theta 500000: its three frequency bands all occur), untied;
    split into several safetensors files with model.safetensors.index.json."""
    torch.manual_seed(0)
    kw = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False,
              rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE))
    kw.update(overrides)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))
    # Hugging Face initialises the norms to 1: random scales make the parity test see a wrongly applied norm weight.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path, max_shard_size="100KB")
    return model


def make_gpt2(path):
    """A tiny random GPT2LMHeadModel (2 layers, 32 wide, 4 heads, context 32, vocab 256, tied head, no dropout)."""
    torch.manual_seed(1)
    cfg = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():  # LayerNorms (1, 0) by default: random ones, as above
        for name, p in model.named_parameters():
            if ".ln_" in name or name.startswith("transformer.ln_f"):
                p.uniform_(0.5, 1.5) if name.endswith("weight") else p.uniform_(-0.2, 0.2)
    model.save_pretrained(path)
    return model


def hf_logits(path, tokens):
    """transformers' fp32 logits of `tokens` for the folder `path` (from_pretrained)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(tokens).logits


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The two Hugging Face folders and the tokens file (2 rows of 24 byte ids)."""
    root = tmp_path_factory.mktemp("hf")
    make_llama(root / "llama")
    make_gpt2(root / "gpt2")
    torch.manual_seed(2)
    tokens = torch.randint(0, 256, (2, 24), dtype=torch.int64)
    save_file({"tokens": tokens}, str(root / "tokens.safetensors"))
    return {"llama": root / "llama", "gpt2": root / "gpt2", "tokens": root / "tokens.safetensors", "ids": tokens}


def train_args(text_files, folder, tokens, out, steps, *extra):
    return ["--init-from", folder, "--data", *text_files, "--steps", steps, "--batch-size", "2", "--seed", "3",
            "--threads", "1", "--lr", "1e-3", "--warmup-steps", "0", "--eval-every", "0", "--eval-batches", "1",
            "--sample-tokens", "0", "--no-progress", "--logits-tokens", tokens, "--dump-logits", out / "logits.safetensors",
            "--export-hf", out / "export", *extra]


# 3 ranks: shards of uneven size (Llama's 64-wide rows and 32-row k/v projections, GPT-2's 32-wide rows, over 3).
@pytest.mark.parametrize("nproc", [1, 2, 3])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_init_from_hf_matches_transformers_and_export_loads(arch, nproc, folders, text_files, tmp_path):
    """--init-from gives transformers' logits (1, 2 and 3 ranks); 10 steps later, --export-hf loads in transformers and
    gives ours. The Llama export is split (--export-max-file-mb) to exercise the index."""
    extra = ["--block-size", "32"] if arch == "llama" else []
    if arch == "llama":
        extra += ["--export-max-file-mb", "0.05"]
    p = run(train_args(text_files, folders[arch], folders["tokens"], tmp_path, 10, *extra), nproc=nproc, timeout=300)
    assert p.returncode == 0, show(p)
    assert "init-from: " in p.stdout, show(p)
    ours = load_file(str(tmp_path / "logits.safetensors"))
    ref = hf_logits(folders[arch], folders["ids"])
    init_diff = (ours["logits_init"] - ref).abs().max().item()
    print(f"{arch} on {nproc} rank(s): |ours - transformers| at init = {init_diff:.3g}")
    assert ours["logits_init"].shape == ref.shape
    assert init_diff <= TOL, f"{arch}: our logits after --init-from differ from transformers' by {init_diff}"
    export = tmp_path / "export"
    if arch == "llama":
        assert (export / "model.safetensors.index.json").is_file(), list(export.iterdir())
        assert len(list(export.glob("model-*-of-*.safetensors"))) > 1
    exported = hf_logits(export, folders["ids"])
    trained_diff = (ours["logits"] - exported).abs().max().item()
    moved = (ours["logits"] - ours["logits_init"]).abs().max().item()
    print(f"{arch} on {nproc} rank(s): |ours - transformers(export)| after 10 steps = {trained_diff:.3g}; "
          f"training moved the logits by {moved:.3g}")
    assert moved > 1e-3, "10 steps did not change the logits: the export test would compare the initial weights"
    assert trained_diff <= TOL, f"{arch}: the exported model's logits differ from ours by {trained_diff}"
    # The exported config.json keeps the source's fields the trainer does not use.
    src, out = (json.loads((d / "config.json").read_text()) for d in (folders[arch], export))
    assert out["model_type"] == arch and out.get("bos_token_id") == src.get("bos_token_id")


def test_export_without_init_from_loads(text_files, tmp_path):
    """The llama-tiny preset (no Hugging Face source) trained 3 steps exports a folder transformers loads, with our
    logits; and a GPT-2 preset's export holds transformers' names with Conv1D weights transposed."""
    tokens = tmp_path / "tokens.safetensors"
    ids = torch.randint(0, 256, (1, 16), dtype=torch.int64)
    save_file({"tokens": ids}, str(tokens))
    common = ["--data", *text_files, "--steps", "3", "--batch-size", "2", "--threads", "1", "--sample-tokens", "0",
              "--eval-batches", "1", "--no-progress", "--logits-tokens", tokens]
    p = run(["--model", "llama-tiny", *common, "--dump-logits", tmp_path / "l.safetensors", "--export-hf",
             tmp_path / "llama"], nproc=2)
    assert p.returncode == 0, show(p)
    diff = (load_file(str(tmp_path / "l.safetensors"))["logits"] - hf_logits(tmp_path / "llama", ids)).abs().max().item()
    assert diff <= TOL, diff
    p = run(["--model", "tiny", *common, "--dump-logits", tmp_path / "g.safetensors", "--export-hf", tmp_path / "gpt2"],
            nproc=2)
    assert p.returncode == 0, show(p)
    diff = (load_file(str(tmp_path / "g.safetensors"))["logits"] - hf_logits(tmp_path / "gpt2", ids)).abs().max().item()
    assert diff <= TOL, diff
    sd = load_file(str(tmp_path / "gpt2" / "model.safetensors"))
    assert sd["transformer.h.0.attn.c_attn.weight"].shape == (32, 96)  # Conv1D: [in, out]
    assert "lm_head.weight" not in sd  # tied: transformers ties it to transformer.wte.weight


REFUSALS = [
    ("llama", {"attention_bias": True}, "attention_bias=true"),
    ("llama", {"mlp_bias": True}, "mlp_bias=true"),
    ("llama", {"hidden_act": "gelu"}, 'hidden_act="gelu"'),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0}},
     'rope_parameters.rope_type="yarn"'),
    ("llama", {"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
     'rope_scaling.rope_type="dynamic"'),
    ("llama", {"head_dim": 8}, "head_dim=8"),
    ("llama", {"model_type": "mistral"}, 'model_type="mistral"'),
    ("gpt2", {"activation_function": "relu"}, 'activation_function="relu"'),
    ("gpt2", {"layer_norm_epsilon": 1e-6}, "layer_norm_epsilon=1e-06"),
    ("gpt2", {"n_inner": 100}, "n_inner=100"),
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=true"),
]


@pytest.mark.parametrize("arch,change,expected", REFUSALS, ids=[r[2].split("=")[0] for r in REFUSALS])
def test_unsupported_config_is_refused_naming_the_field(arch, change, expected, folders, text_files, tmp_path):
    folder = tmp_path / arch
    shutil.copytree(folders[arch], folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(change)
    (folder / "config.json").write_text(json.dumps(cfg))
    p = run(["--init-from", folder, "--data", *text_files, "--steps", "1", "--threads", "1"], nproc=2, timeout=60)
    assert p.returncode != 0, show(p)
    assert expected in p.stderr and "is not supported" in p.stderr, show(p)
    assert "step " not in p.stdout  # refused before training


def test_flag_conflicts_are_refused(folders, text_files):
    for extra, expected in ((["--model", "small"], "--model with --init-from"),
                            (["--n-layer", "3"], "--n-layer with --init-from"),
                            # Llama is tensor-parallel now (issue 35): --tp is checked against the world size.
                            (["--tp", "2"], "WORLD_SIZE 1 is not divisible by --dp-replicate(1) x --tp(2) = 2")):
        p = run(["--init-from", folders["llama"], "--data", *text_files, "--steps", "1", *extra], nproc=None, timeout=60)
        assert p.returncode == 2 and expected in p.stderr, show(p)
    p = run(["--init-from", folders["gpt2"], "--data", *text_files, "--block-size", "16"], nproc=None, timeout=60)
    assert p.returncode == 2 and "n_positions=32" in p.stderr, show(p)


def test_rmsnorm_rope_gqa_match_transformers(tmp_path):
    """model_llama.h's RMSNorm, RoPE frequencies (default and llama3), cos/sin, rotation and grouped-query
    attention against transformers' functions on the same random tensors."""
    from transformers.models.llama import modeling_llama as ml
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    torch.manual_seed(4)
    B, T, H, KV, D = 2, 40, 6, 2, 16
    x = torch.randn(B, T, 48) * 3
    w = torch.rand(48) + 0.5
    q, k, v = torch.randn(B, H, T, D), torch.randn(B, KV, T, D), torch.randn(B, KV, T, D)
    save_file({"x": x, "w": w, "q": q, "k": k, "v": v}, str(tmp_path / "in.safetensors"))
    for rope_type in ("default", "llama3"):
        rope = dict(LLAMA3_ROPE) if rope_type == "llama3" else {"rope_type": "default"}
        rope["rope_theta"] = 500000.0
        cfg = transformers.LlamaConfig(hidden_size=H * D, num_attention_heads=H, num_key_value_heads=KV,
                                       rope_parameters=rope, max_position_embeddings=128)
        args = [LLAMA_UNITS, tmp_path / "in.safetensors", tmp_path / "out.safetensors", D, 500000.0, rope_type,
                LLAMA3_ROPE["factor"], LLAMA3_ROPE["low_freq_factor"], LLAMA3_ROPE["high_freq_factor"],
                LLAMA3_ROPE["original_max_position_embeddings"], 1e-5]
        p = run_program(args, timeout=60)
        assert p.returncode == 0, show(p)
        ours = load_file(str(tmp_path / "out.safetensors"))

        norm = ml.LlamaRMSNorm(48, eps=1e-5)
        with torch.no_grad():
            norm.weight.copy_(w)
            ref_rms = norm(x)
        assert (ours["rms"] - ref_rms).abs().max().item() <= 1e-6

        if rope_type == "llama3":
            ref_inv, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
            # All three bands of the scaling occur: kept, divided by factor, interpolated.
            base = 1.0 / (500000.0 ** (torch.arange(0, D, 2).float() / D))
            ratio = ref_inv / base
            assert (ratio == 1).any() and (ratio == 1 / 8).any() and ((ratio > 1 / 8) & (ratio < 1)).any(), ratio
        else:
            ref_inv, _ = ml.LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
        assert torch.equal(ours["inv_freq"], ref_inv.float()), (ours["inv_freq"], ref_inv)
        rot = ml.LlamaRotaryEmbedding(cfg)
        cos, sin = rot(x, torch.arange(T).unsqueeze(0))
        assert (ours["cos"] - cos[0]).abs().max().item() <= 1e-6 and (ours["sin"] - sin[0]).abs().max().item() <= 1e-6
        ref_q, _ = ml.apply_rotary_pos_emb(q, k, cos, sin)
        assert (ours["q_rot"] - ref_q).abs().max().item() <= 1e-5

        # transformers' eager attention: repeat_kv, scores, causal mask, softmax, weighted sum ([B, T, H, D] out).
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        module = torch.nn.Module()
        module.num_key_value_groups, module.training = H // KV, False
        ref_attn, _ = ml.eager_attention_forward(module, q, k, v, mask, scaling=D ** -0.5)
        assert (ours["attn"] - ref_attn.transpose(1, 2)).abs().max().item() <= 1e-5


def test_llama_tiny_trains_on_two_ranks(text_files, tmp_path):
    """The llama-tiny preset learns (eval loss falls) under fully_shard with bf16 mixed precision and per-layer
    activation checkpointing, and reports MFU with the Llama FLOP count."""
    p = run(["--model", "llama-tiny", "--data", *text_files, "--steps", "30", "--batch-size", "8", "--threads", "1",
             "--mixed-precision", "bf16", "--activation-checkpointing", "full", "--sample-tokens", "0",
             "--eval-every", "0", "--no-progress", "--metrics", tmp_path / "m.jsonl"], nproc=2)
    assert p.returncode == 0, show(p)
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert len(evals) >= 2 and evals[-1] < evals[0] - 0.5, evals


@pytest.mark.parametrize("preset,expected_params", [("llama3-8b", 8_030_261_248), ("llama3-70b", 70_553_706_496)])
def test_estimate_memory_counts_llama3(preset, expected_params, text_files):
    """--estimate-memory builds nothing but meta tensors: Llama 3.1 8B and 70B's exact parameter counts (as
    transformers counts them) in seconds and without their memory."""
    p = run(["--model", preset, "--data", *text_files, "--estimate-memory", "--batch-size", "1", "--block-size", "512",
             "--mixed-precision", "bf16"], nproc=None, timeout=120)
    assert p.returncode == 0, show(p)
    assert f"{expected_params} parameters" in p.stdout, show(p)
    # As rank 0 of 512 (no process group is made: the estimate is computed alone by every rank): a corpus that could
    # not fill 512 ranks' batches is no reason to refuse an estimate; the untied embedding and head are groups of
    # their own (the largest, as in torchtitan's layout), not one 1B-parameter root group.
    env = {"WORLD_SIZE": 512, "RANK": 0, "LOCAL_RANK": 0, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 1}
    p = run_program([TRAIN_GPT, "--model", preset, "--data", *text_files, "--estimate-memory", "--batch-size", "1",
                     "--block-size", "2048", "--mixed-precision", "bf16", "--activation-checkpointing", "full"],
                    timeout=120, **env)
    assert p.returncode == 0, show(p)
    assert "512 ranks" in p.stdout and "largest group: 'model.embed_tokens'" in p.stdout, show(p)


LOAD_VARIANTS = [
    ("llama", 2, ["--model-impl", "plain"]),
    ("llama", 2, ["--data-parallel", "replicate"]),
    ("llama", 2, ["--cpu-offload", "--mixed-precision", "bf16"]),
    ("llama", None, ["--no-shard"]),
    ("gpt2", 2, ["--shard-dim", "1"]),
    ("gpt2", 2, ["--model-impl", "plain", "--reshard-after-forward", "false"]),
    ("gpt2", None, ["--no-shard"]),
]


@pytest.mark.parametrize("arch,nproc,extra", LOAD_VARIANTS, ids=[f"{a}-{' '.join(e)}" for a, _, e in LOAD_VARIANTS])
def test_init_from_under_every_layout(arch, nproc, extra, folders, text_files, tmp_path):
    """--init-from lands the same weights whatever holds them: the unchanged model, whole replicas, CPU-offloaded
    shards, no sharding at all, GPT-2's Conv1D weights into shards on dim 1 (a transposed Shard(1) view is a
    Shard(0) of the file). The logits before the first step (fp32 forward) equal transformers'."""
    args = ["--init-from", folders[arch], "--data", *text_files, "--steps", "1", "--batch-size", "2", "--threads", "1",
            "--sample-tokens", "0", "--eval-batches", "1", "--no-progress", "--logits-tokens", folders["tokens"],
            "--dump-logits", tmp_path / "l.safetensors", *extra]
    if arch == "llama":
        args += ["--block-size", "32"]
    p = run(args, nproc=nproc)
    assert p.returncode == 0, show(p)
    ours = load_file(str(tmp_path / "l.safetensors"))["logits_init"]
    ref = hf_logits(folders[arch], folders["ids"])
    # bf16 compute (mixed precision gathers the weights in bf16): transformers' model cast to bf16 is the reference.
    # Our bf16 forward is transformers' op for op (RMSNorm in fp32 and back, cos/sin cast to bf16): measured equal.
    tol = TOL
    if "bf16" in extra:
        model = transformers.AutoModelForCausalLM.from_pretrained(folders[arch], dtype=torch.bfloat16).eval()
        with torch.no_grad():
            ref = model(folders["ids"]).logits.float()
    diff = (ours - ref).abs().max().item()
    print(f"{arch} {' '.join(extra)}: |ours - transformers| at init = {diff:.3g}")
    assert diff <= tol, f"{arch} {extra}: |ours - transformers| = {diff}"


def test_init_from_bf16_files(folders, text_files, tmp_path):
    """A folder saved in bf16 (as most published checkpoints) loads into the fp32 shards exactly (bf16 -> fp32 is
    exact): our logits equal transformers' fp32 model of the same bf16 weights."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folders["llama"], dtype=torch.bfloat16)
    model.save_pretrained(tmp_path / "bf16")
    p = run(["--init-from", tmp_path / "bf16", "--data", *text_files, "--steps", "1", "--batch-size", "2",
             "--block-size", "32", "--threads", "1", "--sample-tokens", "0", "--eval-batches", "1", "--no-progress",
             "--logits-tokens", folders["tokens"], "--dump-logits", tmp_path / "l.safetensors"], nproc=2)
    assert p.returncode == 0, show(p)
    ref = hf_logits(tmp_path / "bf16", folders["ids"])  # upcast to fp32 by from_pretrained(dtype=float32)
    diff = (load_file(str(tmp_path / "l.safetensors"))["logits_init"] - ref).abs().max().item()
    assert diff <= TOL, diff


def test_plain_llama_trains_bit_identically_to_holder(text_files, tmp_path):
    """--model-impl plain (unchanged LibTorch, implicit groups) and holder train llama-tiny to the same losses, bit for
    bit, in fp32 and bf16, with activation checkpointing."""
    for precision in ("fp32", "bf16"):
        losses = {}
        for impl in ("holder", "plain"):
            out = tmp_path / f"{impl}-{precision}.jsonl"
            p = run(["--model", "llama-tiny", "--data", *text_files, "--steps", "8", "--batch-size", "4", "--threads",
                     "1", "--log-every", "1", "--eval-every", "4", "--eval-batches", "2", "--sample-tokens", "0",
                     "--no-progress", "--mixed-precision", precision, "--activation-checkpointing", "full",
                     "--model-impl", impl, "--metrics", out], nproc=2)
            assert p.returncode == 0, show(p)
            rows = [json.loads(line) for line in out.read_text().splitlines()]
            losses[impl] = [(r.get("loss"), r.get("eval_loss")) for r in rows]
        assert len(losses["holder"]) == 9 and losses["holder"] == losses["plain"], losses


def test_resume_of_an_init_from_run_is_exact(folders, text_files, tmp_path):
    """--init-from with --ckpt-dir: stopped after step 3 and resumed (the checkpoint, not the folder, is loaded), the
    run ends with the logits of an uninterrupted one, bit for bit; its export equals them too."""
    def args(ckpt, *extra):
        return ["--init-from", folders["llama"], "--data", *text_files, "--steps", "6", "--batch-size", "2",
                "--block-size", "32", "--threads", "1", "--sample-tokens", "0", "--eval-batches", "1",
                "--no-progress", "--logits-tokens", folders["tokens"], "--ckpt-dir", ckpt, *extra]
    p = run(args(tmp_path / "a", "--dump-logits", tmp_path / "a.safetensors"))
    assert p.returncode == 0, show(p)
    p = run(args(tmp_path / "b", "--dump-logits", tmp_path / "b1.safetensors", "--stop-at", "3"))
    assert p.returncode == 0, show(p)
    p = run(args(tmp_path / "b", "--dump-logits", tmp_path / "b2.safetensors", "--resume", "--export-hf",
                 tmp_path / "export"))
    assert p.returncode == 0 and "resume" in p.stdout and "init-from: " not in p.stdout, show(p)
    a, b1, b2 = (load_file(str(tmp_path / f"{n}.safetensors")) for n in ("a", "b1", "b2"))
    assert torch.equal(a["logits_init"], b1["logits_init"])
    assert torch.equal(b1["logits"], b2["logits_init"])  # the resumed run starts where the first stopped
    assert torch.equal(a["logits"], b2["logits"])
    assert (hf_logits(tmp_path / "export", folders["ids"]) - b2["logits"]).abs().max().item() <= TOL
