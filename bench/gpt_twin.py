#!/usr/bin/env python3
"""gpt_twin: train_gpt's GPT in PyTorch, sharded with PyTorch's own FSDP2 (torch.distributed.fsdp.fully_shard)
on Gloo, replaying a train_gpt run: the same weights, the same token batches, the same optimizer and schedule.

    build/bin/fsdprun --standalone --nproc-per-node 2 -- build/bin/train_gpt --model tiny --steps 20 \\
        --save-init /tmp/r/init.safetensors --dump-batches /tmp/r/batches ...
    torchrun --standalone --nproc-per-node 2 bench/gpt_twin.py \\
        --init /tmp/r/init.safetensors --batches /tmp/r/batches --metrics /tmp/r/torch.jsonl

What makes the two runs identical (examples/train_gpt/{model,parallelize,optimizer,main}.cpp are the reference):
  * the model: the same modules, parameter names and forward (examples/train_gpt/model.cpp), built from the
    shape in the safetensors metadata and loaded from the weights train_gpt wrote before sharding
    (--save-init; a tied lm_head.weight is stored once, as wte.weight);
  * the data: the batches train_gpt's ranks trained on (--dump-batches DIR: DIR/rank<R>.safetensors), rank R
    replays the tensor "batches" of DIR/rank<R>.safetensors; the hyper-parameters come from DIR/run.json;
  * the parallelism: each block a fully_shard group, then the root (default reshard_after_forward: False for
    the root); MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) for bf16;
  * the step: loss / accum per microbatch (gradient sync on the last one only), clip to the global norm,
    AdamW (betas and eps from run.json; weight decay on dim >= 2 only), warmup + cosine learning rate,
    zero_grad(set_to_none), the loss all-reduced (SUM / world) -- the step time covers exactly that.

--arch llama (picked automatically: a --save-init file of a Llama, whose parameters carry Hugging Face's
LlamaForCausalLM names, model.embed_tokens.weight, ...): the model is transformers' own LlamaForCausalLM
(attn_implementation "sdpa", fp32 weights) loaded from the same file; its config from --hf-config (a config.json,
e.g. what train_gpt --export-hf writes) when given, else from the file: the shapes (key/value heads from k_proj,
the MLP width from gate_proj) and train_gpt's defaults for what the shapes do not say (rms_norm_eps 1e-5, rope
theta 10000, no rope scaling: the llama-tiny and llama-150m presets'). Its fully_shard groups are train_gpt's
(examples/train_gpt/parallelize.cpp, torchtitan's layout): untied, model.model.embed_tokens a group, each decoder
layer model.model.layers[i] a group, lm_head a group with reshard_after_forward False, then the root (the final
norm); tied, the layers then the root.

--math torch (default) is what a PyTorch user writes: torch.optim.AdamW and torch.nn.utils' clipping on
DTensors. --math libtorch replays the arithmetic of LibTorch's C++ AdamW and of fsdp::clip_grad_norm_
operation by operation (on the local shards), to separate "different formulas" from "different results":
the two implementations round differently in two places (see the functions below).

--no-shard: plain PyTorch in one process, no fully_shard (bf16 by CPU autocast): PyTorch's floor.

--device cuda: each rank on cuda:LOCAL_RANK with NCCL (train_gpt --device cuda's twin); the batches and the
weights are moved there, bf16 --no-shard autocasts on CUDA.

Metrics (rank 0, JSON lines, one per step): step, loss, lr, grad_norm, step_ms, peak_rss_mb (max over ranks
of VmHWM), peak_gpu_mem_mb (torch.cuda.max_memory_allocated, max over ranks; 0 on CPU), as train_gpt's
--metrics with --log-every 1; for memory comparisons also baseline_rss_mb (rank 0's VmRSS after import and
init_process_group, before the model), peak_rss_over_baseline_mb and model_state_mb (max over ranks), and
rank 0's params_mb / grads_mb / optimizer_mb (after optimizer.step, before zero_grad); minor_faults_per_step:
rank 0's minor page faults (getrusage ru_minflt) during the step.
"""

import argparse
import json
import re
import math
import os
import resource
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file


# ---- Model (examples/train_gpt/model.cpp, line by line) ------------------------------------------------

class Config:
    def __init__(self, meta):
        self.vocab_size = int(meta["vocab_size"])
        self.block_size = int(meta["block_size"])
        self.n_layer = int(meta["n_layer"])
        self.n_head = int(meta["n_head"])
        self.n_embd = int(meta["n_embd"])
        self.dropout = float(meta["dropout"])
        self.tie_weights = meta["tie_weights"] == "true"


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        heads = lambda t: t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # noqa: E731
        y = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), attn_mask=None,
                                           dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class LMHead(nn.Module):
    def __init__(self, cfg, tied):
        super().__init__()
        self.weight = tied if tied is not None else nn.Parameter(torch.empty(cfg.vocab_size, cfg.n_embd))

    def forward(self, x):
        return F.linear(x, self.weight)


class GPT(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = LMHead(cfg, self.wte.weight if cfg.tie_weights else None)

    def forward(self, idx):
        T = idx.size(1)
        pos = torch.arange(T, dtype=idx.dtype, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


# ---- Llama: transformers' LlamaForCausalLM (train_gpt --model llama-*, examples/train_gpt/model_llama.h) --------

LLAMA_KEY = "model.embed_tokens.weight"  # Hugging Face's name, as train_gpt's Llama names its parameters


def llama_config(path, hf_config=None):
    """transformers' LlamaConfig of the Llama in train_gpt --save-init FILE: config.json's fields (hf_config: a
    path) when given, else the shapes in the file, and for the rest GPTConfig's fields in the file's metadata
    (norm_eps, rope_theta, rope_type, rope_factor, ...: train_gpt --save-init records them for a Llama)
    or else GPTConfig's defaults (rms_norm_eps 1e-5, rope theta 10000, rope type default: the llama-tiny and
    llama-150m presets'); fp32, SDPA attention, no KV cache. Exits naming a missing tensor."""
    import transformers
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        keys = set(f.keys())

        def shape(name):
            if name not in keys:
                sys.exit(f"gpt_twin: {path} has no tensor {name}: not a train_gpt Llama")
            return list(f.get_slice(name).get_shape())
        vocab, hidden = shape(LLAMA_KEY)
        n_layer = len({k.split(".")[2] for k in keys if k.startswith("model.layers.")})
        n_head = int(meta.get("n_head", 0))
        if n_head <= 0:
            sys.exit(f"gpt_twin: {path} has no n_head in its metadata: expected a file written by train_gpt --save-init")
        head_dim = hidden // n_head
        kv_heads = shape("model.layers.0.self_attn.k_proj.weight")[0] // head_dim
        intermediate = shape("model.layers.0.mlp.gate_proj.weight")[0]
        tied = "lm_head.weight" not in keys
    if hf_config:
        cfg = transformers.LlamaConfig.from_dict(json.loads(Path(hf_config).read_text()))
        want = {"vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": n_layer, "num_attention_heads": n_head,
                "num_key_value_heads": kv_heads, "intermediate_size": intermediate, "tie_word_embeddings": tied}
        wrong = {k: (getattr(cfg, k), v) for k, v in want.items() if getattr(cfg, k) != v}
        if wrong:
            sys.exit(f"gpt_twin: {hf_config} does not describe {path}: (config, file) {wrong}")
    else:
        # GPTConfig's fields where the metadata has them (train_gpt may record them), else GPTConfig's defaults.
        rope = {"rope_type": meta.get("rope_type", "default"), "rope_theta": float(meta.get("rope_theta", 10000.0))}
        if rope["rope_type"] == "llama3":
            rope.update(factor=float(meta.get("rope_factor", 8.0)),
                        low_freq_factor=float(meta.get("rope_low_freq_factor", 1.0)),
                        high_freq_factor=float(meta.get("rope_high_freq_factor", 4.0)),
                        original_max_position_embeddings=int(meta.get("rope_original_max_positions", 8192)))
        max_positions = int(meta.get("max_positions", 0)) or int(meta.get("block_size", 2048))
        cfg = transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=n_layer,
            num_attention_heads=n_head, num_key_value_heads=kv_heads, head_dim=head_dim,
            max_position_embeddings=max_positions, rms_norm_eps=float(meta.get("norm_eps", 1e-5)),
            rope_parameters=rope, tie_word_embeddings=tied, attention_dropout=float(meta.get("dropout", 0.0)),
            attention_bias=False, mlp_bias=False, hidden_act="silu")
    cfg.use_cache = False
    cfg._attn_implementation = "sdpa"
    return cfg


def load_llama(path, hf_config=None):
    """transformers' LlamaForCausalLM of train_gpt --save-init FILE (a Llama), every parameter from the file."""
    import transformers
    cfg = llama_config(path, hf_config)
    torch.manual_seed(0)  # the random initialisation is overwritten below; seeded only to be deterministic
    model = transformers.LlamaForCausalLM(cfg).to(torch.float32)
    with safe_open(path, framework="pt") as f:
        copy_parameters(model, f, path)  # a tied head once, as model.embed_tokens.weight
    model.train()
    return model, cfg


def copy_parameters(model, f, path):
    """Every parameter of `model` (named_parameters(): a tied one once) from the open safetensors file `f`, which
    holds exactly those names and shapes (else the twin exits naming the difference)."""
    names = dict(model.named_parameters())
    if set(names) != set(f.keys()):
        sys.exit(f"gpt_twin: {path} does not match {type(model).__name__}: only in the file "
                 f"{sorted(set(f.keys()) - set(names))}, only in the model {sorted(set(names) - set(f.keys()))}")
    with torch.no_grad():
        for name, p in names.items():
            t = f.get_tensor(name)
            if t.shape != p.shape:
                sys.exit(f"gpt_twin: {name} is {list(t.shape)} in {path}, {list(p.shape)} in the model")
            p.copy_(t)


def is_llama_file(path):
    with safe_open(path, framework="pt") as f:
        return (f.metadata() or {}).get("arch") == "llama" or LLAMA_KEY in set(f.keys())


def blocks_of(model):
    """The ModuleList of the units of sharding: GPT's h, Llama's model.layers."""
    return model.model.layers if hasattr(model, "model") else model.h


def logits_of(model, x):
    out = model(x)
    return out.logits if hasattr(out, "logits") else out


def load_model(path):
    """The model of train_gpt --save-init FILE: shape from the metadata, every parameter from the file."""
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
        missing = {"vocab_size", "block_size", "n_layer", "n_head", "n_embd", "dropout", "tie_weights"} - meta.keys()
        if missing:
            sys.exit(f"gpt_twin: {path} has no model shape in its metadata (missing {sorted(missing)}): "
                     "expected a file written by train_gpt --save-init")
        cfg = Config(meta)
        model = GPT(cfg)
        copy_parameters(model, f, path)  # a tied weight once, as wte.weight (as train_gpt writes it)
    return model, cfg


# ---- The step (examples/train_gpt: optimizer.cpp's lr_at, main.cpp's lm_loss and train_step) -----------

def lr_at(step, run):
    """Linear warmup to lr, then cosine decay to min_lr at the last step (same double arithmetic as lr_at)."""
    lr, min_lr, warmup, steps = run["lr"], run["min_lr"], run["warmup_steps"], run["steps"]
    if warmup > 0 and step <= warmup:
        return lr * float(step) / float(warmup)
    span = float(max(steps - warmup, 1))
    progress = min(1.0, float(step - warmup) / span)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def lm_loss(logits, targets):
    return F.cross_entropy(logits.to(torch.float32).reshape(-1, logits.size(-1)), targets.reshape(-1))


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def clip_torch(params, max_norm):
    """torch.nn.utils' clipping on DTensor gradients, the norm made a full tensor once (as torchtitan does:
    one all-reduce, shared by the clipping and the log)."""
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, 2.0)
    if hasattr(total, "full_tensor"):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


@torch.no_grad()
def clip_libtorch(params, max_norm, group, device="cpu"):
    """fsdp::clip_grad_norm_ (src/algorithms/clip_grad.cpp), operation by operation. It differs from torch.nn.utils in
    rounding only: it accumulates sum(norm_i^2) one gradient at a time (PyTorch: the 2-norm of the stacked
    norms), and computes max_norm / (norm + 1e-6) as a division (PyTorch: reciprocal times max_norm)."""
    grads = [local(p.grad) for p in params if p.grad is not None]
    acc = torch.zeros(1, device=device)
    for g in grads:
        if g.numel() > 0:
            acc += torch.linalg.vector_norm(g.to(torch.float32), 2.0).pow(2.0)
    if group is not None and dist.get_world_size(group) > 1:  # the shard group: replicas hold the same pieces
        dist.all_reduce(acc, op=dist.ReduceOp.SUM, group=group)
    total = (acc + torch.zeros(1, device=device)).pow(1.0 / 2.0).reshape(())
    shifted = total + 1e-6
    coef = torch.clamp_max(torch.empty_like(shifted).fill_(max_norm).div_(shifted), 1.0)  # C++ Scalar / Tensor
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return total


class LibTorchAdamW:
    """torch::optim::AdamW of LibTorch (torch/csrc/api/src/optim/adamw.cpp), operation by operation, on the
    local shards. It differs from torch.optim.AdamW (its single-tensor path, the one taken on CPU) in one
    rounding: the first moment is exp_avg.mul_(beta1).add_(grad, 1 - beta1) where PyTorch writes
    exp_avg.lerp_(grad, 1 - beta1). The rest (decoupled decay, second moment, bias corrections in double,
    addcdiv_ by sqrt(v) / sqrt(bc2) + eps with -lr / bc1) is the same arithmetic."""

    def __init__(self, groups, betas, eps):
        self.param_groups = [dict(g) for g in groups]
        self.betas, self.eps = betas, eps
        self.state = {}

    @torch.no_grad()
    def step(self):
        beta1, beta2 = self.betas
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                w, grad = local(p), local(p.grad)
                st = self.state.setdefault(p, {"step": 0, "exp_avg": torch.zeros_like(w), "exp_avg_sq": torch.zeros_like(w)})
                if wd != 0:
                    w.mul_(1 - lr * wd)
                st["step"] += 1
                bc1 = 1 - math.pow(beta1, st["step"])
                bc2 = 1 - math.pow(beta2, st["step"])
                st["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
                st["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = (st["exp_avg_sq"].sqrt() / math.sqrt(bc2)).add_(self.eps)
                w.addcdiv_(st["exp_avg"], denom, value=-(lr / bc1))

    def zero_grad(self):
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None


def status_mb(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024.0
    return 0.0


def peak_rss_mb():
    return status_mb("VmHWM")


def model_state_mb(params, optimizer):
    """This rank's model states in MiB: parameters (the padded shard storage FSDP2 allocates), gradients
    (local) and optimizer state (local), as train_gpt's "model states" line counts them."""
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t
    params_b = sum(local(p).untyped_storage().nbytes() for p in params)
    grads_b = sum(local(p.grad).numel() * local(p.grad).element_size() for p in params if p.grad is not None)
    opt_b = 0
    for st in optimizer.state.values():
        for v in st.values():
            if torch.is_tensor(v) and v.dim() > 0:
                opt_b += local(v).numel() * local(v).element_size()
    return params_b / 2**20, grads_b / 2**20, opt_b / 2**20


def parse_reshard(value):
    if value in ("true", "1"):
        return True
    if value in ("false", "0"):
        return False
    return int(value)


def apply_activation_checkpointing(model, mode):
    """train_gpt --activation-checkpointing as torchtitan applies it: each block (or every K-th) wrapped by
    checkpoint_wrapper before sharding; selective-op with torchtitan's op policy (matmul and attention outputs
    saved, every second matmul recomputed; GPT's biased linears are addmm here, Llama's mm)."""
    if mode == "none":
        return
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts
    aten = torch.ops.aten
    matmuls = {aten.mm.default, aten.addmm.default}
    save = matmuls | {aten._scaled_dot_product_flash_attention.default,
                      aten._scaled_dot_product_efficient_attention.default,
                      aten._scaled_dot_product_flash_attention_for_cpu.default, aten.max.default}

    def selective_context():
        counts = {"forward": 0, "recompute": 0}

        def policy(ctx, func, *args, **kwargs):
            key = "recompute" if ctx.is_recompute else "forward"
            if func in matmuls:
                counts[key] += 1
                if counts[key] % 2 == 0:
                    return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE if func in save else CheckpointPolicy.PREFER_RECOMPUTE
        return create_selective_checkpoint_contexts(policy)

    every = int(mode.split(":")[1]) if mode.startswith("layer:") else 1
    blocks = blocks_of(model)
    for i, block in enumerate(blocks):
        if (i + 1) % every == 0:
            kwargs = {"context_fn": selective_context} if mode == "selective-op" else {}
            blocks[i] = checkpoint_wrapper(block, **kwargs)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--init", required=True, help="initial weights: train_gpt --save-init FILE")
    ap.add_argument("--batches", required=True, help="train_gpt --dump-batches DIR (rank<R>.safetensors, run.json)")
    ap.add_argument("--steps", type=int, help="steps to run (default: all the recorded ones)")
    ap.add_argument("--mixed-precision", choices=["fp32", "bf16"], help="default: as recorded in run.json")
    ap.add_argument("--reshard-after-forward", help="true|false|N for the blocks (default: as recorded)")
    ap.add_argument("--math", choices=["torch", "libtorch"], default="torch",
                    help="torch: torch.optim.AdamW and torch.nn.utils clipping; libtorch: the arithmetic of "
                         "LibTorch's AdamW and fsdp::clip_grad_norm_ replayed (for bitwise comparison)")
    ap.add_argument("--no-shard", action="store_true", help="plain PyTorch in one process (no fully_shard)")
    ap.add_argument("--threads", type=int, default=0, help="intra-op threads per rank (0: leave the default)")
    ap.add_argument("--metrics", help="JSON lines, one per step (rank 0)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cpu (Gloo) or cuda (each rank on cuda:LOCAL_RANK, NCCL)")
    ap.add_argument("--arch", choices=["auto", "gpt2", "llama"], default="auto",
                    help="auto (default): llama when the --init file holds Hugging Face Llama names "
                         "(model.embed_tokens.weight), else train_gpt's GPT")
    ap.add_argument("--hf-config", help="--arch llama: a Hugging Face config.json for the model (default: the shapes "
                                        "of the --init file and train_gpt's defaults for eps and RoPE)")
    args = ap.parse_args()

    batches_dir = Path(args.batches)
    run = json.loads((batches_dir / "run.json").read_text())
    mp = args.mixed_precision or run["mixed_precision"]
    if mp not in ("fp32", "bf16"):
        sys.exit(f"gpt_twin: mixed precision {mp} is not supported (fp32 or bf16)")
    reshard = parse_reshard(args.reshard_after_forward or run["reshard_after_forward"])
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    launched = "RANK" in os.environ
    if args.no_shard and launched and int(os.environ.get("WORLD_SIZE", "1")) != 1:
        sys.exit("gpt_twin: --no-shard runs one process: launch it without torchrun")
    if not args.no_shard:
        if not launched:
            os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29531"))
        if args.device == "cuda":
            # Rank-aware device init before any CUDA work, as train_gpt's init_process_group does.
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group("nccl")
        else:
            dist.init_process_group("gloo")
    if args.device == "cuda" and args.no_shard:
        torch.cuda.set_device(0)
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    if not args.no_shard and world != run["world_size"]:
        sys.exit(f"gpt_twin: {world} ranks, but the batches were recorded on {run['world_size']}: "
                 f"launch with --nproc-per-node {run['world_size']}")

    # The process baseline for memory comparisons (issue 14): the interpreter, torch and the process
    # group, before any model or data.
    baseline_rss_mb = status_mb("VmRSS")
    # The batches this rank trained on in train_gpt: [steps, accum, 2, B, T] int64.
    batches = load_file(batches_dir / f"rank{rank}.safetensors")["batches"].to(device)
    steps = args.steps or batches.size(0)
    if steps > batches.size(0) or steps > run["steps"]:
        sys.exit(f"gpt_twin: --steps {steps} exceeds the {batches.size(0)} recorded steps")
    accum = batches.size(1)

    arch = args.arch if args.arch != "auto" else ("llama" if is_llama_file(args.init) else "gpt2")
    model, cfg = load_llama(args.init, args.hf_config) if arch == "llama" else load_model(args.init)
    model.to(device)
    # train_gpt --freeze REGEX [--frozen-dtype bf16]: frozen before sharding (a bf16 one beside fp32 weights makes
    # a group of two dtypes: FSDP2 all-gathers it as bytes).
    if run.get("freeze"):
        frozen_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[run.get("frozen_dtype", "fp32")]
        with torch.no_grad():
            for name, p in model.named_parameters():
                if re.search(run["freeze"], name):
                    p.requires_grad_(False)
                    p.data = p.data.to(frozen_dtype)
    apply_activation_checkpointing(model, run.get("activation_checkpointing", "none"))
    # AdamW groups as train_gpt: weight decay on dim >= 2 (full shapes, decided before sharding).
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    all_params = list(model.parameters())

    # The data parallelism train_gpt recorded: fully_shard on a 1-D mesh, HSDP on (dp_replicate, dp_shard), or
    # replicate (PyTorch's replicate_with_fsdp: DDP semantics on FSDP2's groups).
    data_parallel = run.get("data_parallel", "fully_shard")
    dp_replicate = run.get("dp_replicate", 1)
    rs_each_micro = run.get("reduce_scatter_each_microbatch", False)
    norm_group = None  # the ranks whose gradient pieces make up the whole (clip_libtorch)
    if not args.no_shard:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mp == "bf16" \
            else MixedPrecisionPolicy()
        if data_parallel == "replicate":
            from torch.distributed._composable.replicate_with_fsdp import replicate
            mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("replicate",))
            for block in blocks_of(model):
                replicate(block, mesh=mesh, mp_policy=policy)
            replicate(model, mesh=mesh, mp_policy=policy)
        else:
            if dp_replicate > 1:
                mesh = init_device_mesh(device.type, (dp_replicate, world // dp_replicate),
                                        mesh_dim_names=("dp_replicate", "dp_shard"))
                norm_group = mesh.get_group("dp_shard")
            else:
                mesh = init_device_mesh(device.type, (world,))
                norm_group = dist.group.WORLD
            # train_gpt --shard-dim 1: 2-D weights sharded on dim 1 where it divides by the shard ranks.
            shard_dim = run.get("shard_dim", 0)
            placement = {}
            if shard_dim:
                from torch.distributed.tensor import Shard
                shard_size = world // dp_replicate

                def placement_fn(p):
                    return Shard(shard_dim) if p.dim() == 2 and p.size(shard_dim) % shard_size == 0 else None

                placement = {"shard_placement_fn": placement_fn}
            # Llama, untied: the embedding and the head are groups of their own, as train_gpt's parallelize()
            # (torchtitan's layout): the embedding resharded after forward as the layers, the head kept gathered.
            own_groups = arch == "llama" and not cfg.tie_word_embeddings
            if own_groups:
                fully_shard(model.model.embed_tokens, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy,
                            **placement)
            for block in blocks_of(model):
                fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy, **placement)
            if own_groups:
                fully_shard(model.lm_head, mesh=mesh, reshard_after_forward=False, mp_policy=policy, **placement)
            # the root last; its default: no reshard after forward
            fully_shard(model, mesh=mesh, mp_policy=policy, **placement)
        # fully_shard replaced the parameters by DTensors: regroup by name.
        by_name = dict(model.named_parameters())
        decay = [p for n, p in by_name.items() if p.dim() >= 2]
        no_decay = [p for n, p in by_name.items() if p.dim() < 2]
        all_params = list(by_name.values())

    betas, eps = tuple(run["betas"]), run["eps"]
    groups = [{"params": decay, "weight_decay": run["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}]
    if args.math == "torch":
        optimizer = torch.optim.AdamW(groups, lr=run["lr"], betas=betas, eps=eps)
    else:
        optimizer = LibTorchAdamW([dict(g, lr=run["lr"]) for g in groups], betas, eps)
    max_norm = run["clip_grad"] if run["clip_grad"] > 0 else math.inf

    def forward(x):
        if args.no_shard and mp == "bf16":
            with torch.autocast(device.type, dtype=torch.bfloat16):
                return logits_of(model, x)
        return logits_of(model, x)

    out = open(args.metrics, "w") if args.metrics and rank == 0 else None
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        faults0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        lr = lr_at(step, run)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros(1, device=device)
        for micro in range(accum):
            x, y = batches[step - 1, micro, 0], batches[step - 1, micro, 1]
            if not args.no_shard:
                last = micro == accum - 1
                model.set_requires_gradient_sync(last or rs_each_micro)  # (also sets requires_all_reduce)
                if rs_each_micro:
                    model.set_requires_all_reduce(last)
                if run.get("keep_unsharded_between_microbatches", False):
                    model.set_reshard_after_backward(last)
            loss = lm_loss(forward(x), y) / float(accum)
            loss.backward()
            loss_sum += loss.detach()
        if args.math == "torch":
            norm = clip_torch(all_params, max_norm).item()
        else:
            norm = clip_libtorch(all_params, max_norm, norm_group, device).item()
        optimizer.step()
        states = model_state_mb(all_params, optimizer)  # gradients still there
        optimizer.zero_grad()
        if world > 1:
            dist.all_reduce(loss_sum, op=dist.ReduceOp.SUM)
        loss_value = loss_sum.item() / world
        step_ms = 1e3 * (time.perf_counter() - t0)
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults0  # rank 0's, this step
        if not math.isfinite(loss_value):
            sys.exit(f"gpt_twin: the loss is {loss_value} at step {step}")
        gpu_mb = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0
        peak = torch.tensor([peak_rss_mb(), gpu_mb, peak_rss_mb() - baseline_rss_mb, sum(states)],
                            dtype=torch.float64, device=device)
        if world > 1:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        if out:
            out.write(json.dumps({"step": step, "loss": loss_value, "lr": lr, "grad_norm": norm, "step_ms": step_ms,
                                  "peak_rss_mb": peak[0].item(), "peak_gpu_mem_mb": peak[1].item(),
                                  "peak_rss_over_baseline_mb": peak[2].item(), "baseline_rss_mb": baseline_rss_mb,
                                  "model_state_mb": peak[3].item(), "params_mb": states[0], "grads_mb": states[1],
                                  "optimizer_mb": states[2], "minor_faults_per_step": faults}) + "\n")
            out.flush()
    if out:
        out.close()
        # Every step's record is written: a crash in PyTorch's teardown after this (Gloo's occasional "terminate
        # called without an active exception") does not change the run (compare_fsdp2._run keeps it, reported).
        print("gpt_twin: done", flush=True)
    if dist.is_initialized():
        # Every rank done with every collective before the group goes away (an early destroy on one rank
        # can abort the other's teardown).
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
