#include "options.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <regex>
#include <sstream>

#include <CLI/CLI.hpp>
#include <unistd.h>
#include <torch/cuda.h>

#include "fsdp/pipelining/schedules.h"
#include "token_shards.h"
#include "hf.h"

namespace train_gpt {

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

std::string one_line(std::string text) {
  std::replace(text.begin(), text.end(), '\n', ' ');
  return text;
}

/// The model shape: the preset with the explicit flags applied. Throws UsageError.
GPTConfig model_config(const Options& o) {
  GPTConfig cfg;
  if (!o.init_from.empty()) {
    // The shape is the Hugging Face folder's: flags that would change it are refused, not silently ignored.
    for (const auto& [flag, given] : {std::pair<const char*, bool>{"--model", o.model_given},
                                      {"--n-layer", o.n_layer.has_value()}, {"--n-head", o.n_head.has_value()},
                                      {"--n-embd", o.n_embd.has_value()}, {"--tie-weights", o.tie_weights.has_value()}}) {
      if (given) {
        throw UsageError(std::string(flag) + " with --init-from " + o.init_from + ": the model's shape comes from its "
                         "config.json. Fix: drop " + flag);
      }
    }
    cfg = read_hf_config(o.init_from);
    if (o.block_size) {
      if (!cfg.is_llama() && *o.block_size != cfg.block_size) {
        throw UsageError("--block-size " + std::to_string(*o.block_size) + " with --init-from a GPT-2 folder: its "
                         "learned positions fix the context at n_positions=" + std::to_string(cfg.block_size) +
                         ". Fix: drop --block-size");
      }
      cfg.block_size = *o.block_size;  // Llama: the training window (RoPE has no table to outgrow)
    }
    if (o.dropout) cfg.dropout = *o.dropout;
    if (cfg.vocab_size < 256) {
      throw UsageError("--init-from " + o.init_from + ": config.json: vocab_size=" + std::to_string(cfg.vocab_size) +
                       " is smaller than the 256 byte values the training text is tokenised into");
    }
    return cfg;
  }
  try {
    cfg = preset(o.model);
    if (o.n_layer) cfg.n_layer = *o.n_layer;
    if (o.n_head) cfg.n_head = *o.n_head;
    if (o.n_embd) cfg.n_embd = *o.n_embd;
    if (o.block_size) cfg.block_size = *o.block_size;
    if (o.dropout) cfg.dropout = *o.dropout;
    if (o.tie_weights) cfg.tie_weights = *o.tie_weights;
    validate(cfg);
  } catch (const std::invalid_argument& e) {
    throw UsageError(e.what());
  }
  return cfg;
}

/// "true" | "false" | N. Throws UsageError unless N divides the world size.
fsdp::ReshardAfterForward parse_reshard_after_forward(const std::string& s, int world_size) {
  // As fully_shard's int: N ranks keep 1/N each between forward and backward, so 1 keeps everything
  // (= false) and the world size keeps nothing extra (= true); fully_shard maps both itself.
  if (s == "true") return true;
  if (s == "false") return false;
  int n = 0;
  size_t used = 0;
  try {
    n = std::stoi(s, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != s.size() || n < 1) {
    throw UsageError("--reshard-after-forward " + s + " is invalid: expected true, false or a positive number " +
                     "of ranks that keep a slice of the parameters between forward and backward");
  }
  if (world_size % n != 0) {
    throw UsageError("--reshard-after-forward " + s + " does not divide the " + std::to_string(world_size) +
                     " ranks: expected a divisor of WORLD_SIZE (or true/false)");
  }
  return n;
}

namespace {

/// --pp > 1 (pipeline.h): the layout checks, here, before any rank talks to another, each naming its flag.
/// Sets p.pp, p.pp_schedule, p.stages_per_rank and p.pp_microbatches (defaults resolved). Throws UsageError.
void check_pipeline_options(const Options& o, const GPTConfig& cfg, int world_size, ParallelOptions& p) {
  const std::string pp = "--pp " + std::to_string(o.pp);
  // What the pipelined trainer (pipeline.cpp) does not do yet: refused by name rather than run wrongly.
  const std::vector<std::pair<bool, std::string>> unsupported = {
      {o.data_parallel == "replicate", "--data-parallel replicate: the stages are fully_shard'ed. Fix: drop it"},
      {o.grad_accum_steps > 1, "--grad-accum-steps " + std::to_string(o.grad_accum_steps) + ": the pipeline's "
                               "microbatches are the accumulation. Fix: --pp-microbatches (and a larger --batch-size)"},
      {o.mixed_precision == "fp16", "--mixed-precision fp16 (the loss scaler does not see the pipeline's losses). Fix: bf16"},
      {!o.sft.empty(), "--sft (its token-normalised loss is not the schedule's mean of microbatch means)"},
      {o.no_shard, "--no-shard"},
      {!o.init_from.empty() || !o.export_hf.empty() || !o.save_init.empty() || !o.dump_batches.empty() ||
           !o.logits_tokens.empty() || o.estimate_memory,
       "--init-from, --export-hf, --save-init, --dump-batches, --logits-tokens and --estimate-memory (they need the "
       "whole model on one rank). Fix: drop them, or --pp 1"},
      {o.activation_offload, "--activation-offload (not tested with the pipeline's schedules yet)"},
      {!o.freeze.empty(), "--freeze (not applied to the stages yet). Fix: drop it, or --pp 1"},
  };
  for (const auto& [bad, what] : unsupported) {
    if (bad) throw UsageError(pp + " does not support " + what);
  }
  p.pp = o.pp;
  p.pp_schedule = o.pp_schedule;
  const bool multi_stage = o.pp_schedule == "interleaved-1f1b" || o.pp_schedule == "interleaved-zero-bubble" ||
                           o.pp_schedule == "zbv-zero-bubble";
  p.stages_per_rank = o.stages_per_rank > 0 ? o.stages_per_rank : (multi_stage ? 2 : 1);
  const std::string v = "--stages-per-rank " + std::to_string(p.stages_per_rank);
  if (!multi_stage && p.stages_per_rank != 1) {
    throw UsageError(v + " with --pp-schedule " + o.pp_schedule + ": that schedule runs one stage per pipeline rank. "
                     "Fix: --stages-per-rank 1, or --pp-schedule interleaved-1f1b");
  }
  if (o.pp_schedule == "zbv-zero-bubble" && p.stages_per_rank != 2) {
    throw UsageError(v + " with --pp-schedule zbv-zero-bubble: the V runs exactly 2 stages per rank (rank r holds "
                     "stages r and 2 x pp - 1 - r). Fix: --stages-per-rank 2");
  }
  const int64_t others = static_cast<int64_t>(o.pp) * o.dp_replicate * o.tp;
  if (world_size % others != 0) {
    throw UsageError("WORLD_SIZE " + std::to_string(world_size) + " is not divisible by " + pp + " x --dp-replicate(" +
                     std::to_string(o.dp_replicate) + ") x --tp(" + std::to_string(o.tp) + ") = " + std::to_string(others) +
                     ": the ranks form a pp x dp_replicate x dp_shard x tp mesh. Fix: a --pp (and --tp, --dp-replicate) "
                     "whose product divides the number of ranks");
  }
  const int stages = p.num_stages();
  if (stages > cfg.n_layer) {
    throw UsageError(pp + " x " + v + " = " + std::to_string(stages) + " stages, but the model has " +
                     std::to_string(cfg.n_layer) + " transformer blocks (--n-layer): every stage needs one. Fix: "
                     "fewer stages or --n-layer >= " + std::to_string(stages));
  }
  p.pp_microbatches = o.pp_microbatches > 0 ? o.pp_microbatches : stages;
  const std::string m = "--pp-microbatches " + std::to_string(p.pp_microbatches);
  if (o.batch_size % p.pp_microbatches != 0) {
    throw UsageError("--batch-size " + std::to_string(o.batch_size) + " is not divisible by " + m +
                     (o.pp_microbatches > 0 ? "" : " (the default: one per stage)") + ": each microbatch takes "
                     "--batch-size / M sequences. Fix: a --batch-size that is a multiple of it, or another "
                     "--pp-microbatches");
  }
  // The schedules' own conditions (schedules.cpp), as PyTorch's.
  if (o.pp_schedule == "1f1b" && p.pp_microbatches < stages) {
    throw UsageError(m + " with --pp-schedule 1f1b on " + std::to_string(stages) + " stages: 1F1B needs at least "
                     "one microbatch per stage. Fix: --pp-microbatches >= " + std::to_string(stages));
  }
  if (o.pp_schedule.rfind("interleaved", 0) == 0) {
    const int rounds = std::max(1, p.pp_microbatches / o.pp);
    if (p.pp_microbatches % rounds != 0) {
      throw UsageError(m + " with --pp-schedule " + o.pp_schedule + ": must be a multiple of the rounds max(1, M / "
                       "--pp) = " + std::to_string(rounds) + " (PyTorch's rule). Fix: a multiple of " + pp);
    }
  }
  try {
    fsdp::pipelining::stage_ids_this_rank(o.pp_schedule, 0, o.pp, stages);
  } catch (const c10::Error& e) {
    throw UsageError(pp + ", --pp-schedule " + o.pp_schedule + ", " + v + ": " + e.what_without_backtrace());
  }
}

/// The compute dtype and the sharding of the blocks, from the flags. Throws UsageError.
ParallelOptions parallel_options(const Options& o, const GPTConfig& cfg, int world_size) {
  ParallelOptions p;
  if (o.mixed_precision == "bf16") p.param_dtype = torch::kBFloat16;
  if (o.mixed_precision == "fp16") p.param_dtype = torch::kHalf;
  p.activation_checkpointing = o.activation_checkpointing;
  p.checkpoint_options.use_reentrant(o.checkpoint_impl == "reentrant");
  if (o.activation_checkpointing == "selective-op" && o.checkpoint_impl == "reentrant") {
    throw UsageError("--activation-checkpointing selective-op needs --checkpoint-impl no_reentrant (selective "
                     "checkpointing works on the saved tensors, which the reentrant form does not use)");
  }
  if (o.activation_checkpointing != "none" && o.checkpoint_impl == "reentrant" && o.model_impl == "plain") {
    throw UsageError("--checkpoint-impl reentrant needs --model-impl holder: the plain model is unchanged LibTorch "
                     "code, whose blocks are checkpointed from the ops on their parameters (no call to re-run), which "
                     "only the non-reentrant form can do; use --checkpoint-impl no_reentrant (PyTorch's "
                     "recommendation, the default)");
  }
  if ((o.logits_tokens.empty()) != (o.dump_logits.empty())) {
    throw UsageError("--logits-tokens and --dump-logits go together: the tokens to evaluate and the file for their "
                     "logits. Fix: give both or neither");
  }
  if (!o.init_from.empty() && !o.save_init.empty()) {
    throw UsageError("--save-init with --init-from: --save-init writes the random initial weights, which --init-from "
                     "replaces. Fix: drop --save-init (the Hugging Face folder holds the initial weights)");
  }
  p.cpu_offload = o.cpu_offload;
  p.tp = o.tp;
  p.cp = o.cp;
  if (o.cp > 1) {
    // Context parallelism (issue 35): GPT-2 with the holder model, FSDP (with or without TP), one step of
    // --grad-accum-steps or more; what it has not been built or tested with is refused, naming the flag.
    auto need = [&](bool ok, const std::string& what) {
      if (!ok) throw UsageError("--cp " + std::to_string(o.cp) + ": " + what);
    };
    need(!cfg.is_llama(), "context parallelism is implemented for GPT-2 only (Llama's RoPE positions are not yet a "
                          "sharded buffer). Fix: --cp 1 or a GPT-2 model");
    need(o.model_impl == "holder", "needs --model-impl holder (the model that takes its positions as a buffer). Fix: "
                                   "--model-impl holder");
    need(o.pp == 1 && o.dp_replicate == 1 && o.data_parallel == "fully_shard",
         "does not combine with --pp, --dp-replicate or --data-parallel replicate yet. Fix: drop them or --cp 1");
    need(!o.sequence_parallel, "does not combine with --sequence-parallel (the sequence is already split by CP). "
                               "Fix: drop --sequence-parallel");
    need(cfg.dropout == 0.0, "--dropout > 0 is not supported (attention dropout under ring attention is refused). "
                             "Fix: --dropout 0");
    need(!o.activation_offload && !o.no_shard && o.sft.empty(),
         "does not combine with --activation-offload, --no-shard or --sft yet. Fix: drop them or --cp 1");
    need(cfg.block_size % (2 * o.cp) == 0,
         "the context of " + std::to_string(cfg.block_size) + " tokens (--block-size) is not a multiple of 2 x --cp = " +
             std::to_string(2 * o.cp) + " (causal load balancing cuts each sequence into 2 x cp equal chunks). Fix: a " +
             "--block-size that 2 x --cp divides");
  }
  p.dp_replicate = o.dp_replicate;
  p.sequence_parallel = o.sequence_parallel;
  p.replicate = o.data_parallel == "replicate";
  if (o.all_gather_dtype == "bf16") p.all_gather_dtype = torch::kBFloat16;
  if (o.all_gather_dtype == "float8") p.all_gather_dtype = torch::kFloat8_e4m3fn;
  p.shard_dim = o.shard_dim;
  if (o.shard_dim != 0 && (o.shard_dim != 1 || p.replicate || o.tp > 1 || p.all_gather_dtype)) {
    throw UsageError("--shard-dim " + std::to_string(o.shard_dim) + ": expected 0 or 1, with --data-parallel "
                     "fully_shard, without --tp and --all-gather-dtype (FSDP shards tensor-parallel weights and "
                     "extended all-gathers on dim 0). Fix: drop --shard-dim or the other flag");
  }
  if (!o.freeze.empty()) {
    try {
      p.freeze = std::regex(o.freeze);
    } catch (const std::regex_error& e) {
      throw UsageError("--freeze '" + o.freeze + "' is not a regular expression (" + e.what() + ")");
    }
  }
  if (o.frozen_dtype == "bf16") {
    if (o.freeze.empty()) throw UsageError("--frozen-dtype bf16 needs --freeze REGEX (the parameters to freeze)");
    p.frozen_dtype = torch::kBFloat16;
  }
  if (p.replicate && p.all_gather_dtype) {
    throw UsageError("--all-gather-dtype " + o.all_gather_dtype + " changes fully_shard's all-gather, but --data-parallel "
                     "replicate all-gathers nothing. Fix: drop --all-gather-dtype, or use --data-parallel fully_shard");
  }
  if (p.replicate && (o.tp > 1 || o.dp_replicate > 1)) {
    throw UsageError("--data-parallel replicate keeps the whole model on every rank; it does not combine with --tp "
                     "or --dp-replicate (got --tp " + std::to_string(o.tp) + ", --dp-replicate " +
                     std::to_string(o.dp_replicate) + "). Fix: drop them, or use --data-parallel fully_shard");
  }
  if (o.pp > 1) {
    check_pipeline_options(o, cfg, world_size, p);
  } else if (o.pp_microbatches > 0 || o.stages_per_rank > 0 || o.pp_schedule != Options().pp_schedule) {
    // Without a pipeline they would be ignored silently.
    throw UsageError(std::string(o.pp_microbatches > 0 ? "--pp-microbatches" : o.stages_per_rank > 0 ? "--stages-per-rank"
                                                                                                 : "--pp-schedule") +
                     " needs --pp > 1 (pipeline parallelism). Fix: add --pp N or drop it");
  }
  const int64_t tp_x_rep = static_cast<int64_t>(o.tp) * o.dp_replicate * p.pp * o.cp;
  if (o.pp == 1 && world_size % tp_x_rep != 0) {
    throw UsageError("WORLD_SIZE " + std::to_string(world_size) + " is not divisible by --dp-replicate(" +
                     std::to_string(o.dp_replicate) + ")" + (o.cp > 1 ? " x --cp(" + std::to_string(o.cp) + ")" : std::string()) +
                     " x --tp(" + std::to_string(o.tp) + ") = " +
                     std::to_string(tp_x_rep) + ": the ranks form a dp_replicate x dp_shard x tp mesh. Fix: a " +
                     "--tp and --dp-replicate whose product divides the number of ranks");
  }
  p.dp_shard = static_cast<int>(world_size / tp_x_rep);
  if (o.sequence_parallel && o.tp == 1) throw UsageError("--sequence-parallel needs --tp > 1");
  if (o.tp > 1) {
    auto need = [&](bool ok, const std::string& what) {
      if (!ok) throw UsageError("--tp " + std::to_string(o.tp) + ": " + what);
    };
    need(cfg.n_head % o.tp == 0, "the " + std::to_string(cfg.n_head) + " heads (--n-head) do not split evenly; use a " +
                                     "--tp that divides them");
    need(cfg.kv_heads() % o.tp == 0, "the " + std::to_string(cfg.kv_heads()) + " key/value heads of the model do not " +
                                         "split evenly; use a --tp that divides them");
    need(cfg.mlp_width() % o.tp == 0, "the MLP width " + std::to_string(cfg.mlp_width()) + " does not split evenly; " +
                                          "use a --tp that divides it");
    // Dropout draws from the DTensor RNG (every TP rank the mask one process would draw), which the GPT-2 holder
    // model's unpipelined forward applies (model.cpp, TPDropout); Llama's forward does not use it yet.
    need(cfg.dropout == 0.0 || (o.model_impl == "holder" && o.pp == 1 && !cfg.is_llama()),
         "--dropout > 0 with tensor parallelism needs the GPT-2 holder model and no --pp (the DTensor RNG's masks are "
         "applied by the GPT-2 holder model's forward, not yet by Llama's). Fix: --dropout 0, or drop --model-impl "
         "plain / --pp");
    need(!o.cpu_offload && o.mixed_precision != "fp16",
         "--cpu-offload and --mixed-precision fp16 are not supported with tensor parallelism yet. Fix: drop them or "
         "--tp 1");
    need(!o.sequence_parallel || cfg.block_size % o.tp == 0,
         "--sequence-parallel splits the context of " + std::to_string(cfg.block_size) + " tokens (--block-size) " +
             "evenly; use a --tp that divides it");
  }
  // loss_parallel (issue 35): the tied head vocabulary-parallel. Where it applies, on by default with --tp.
  std::string no_loss_parallel;  // why it does not apply ("" when it does)
  if (o.tp == 1) no_loss_parallel = "it needs --tp > 1";
  else if (o.model_impl != "holder") no_loss_parallel = "it needs --model-impl holder";
  else if (!cfg.tie_weights) no_loss_parallel = "it needs the tied head (--tie-weights)";
  else if (o.pp > 1) no_loss_parallel = "it does not combine with --pp (the last stage's head is a copy of wte)";
  else if (cfg.vocab_size % o.tp != 0) {
    no_loss_parallel = "the vocabulary of " + std::to_string(cfg.vocab_size) + " does not divide by --tp " +
                       std::to_string(o.tp) + " (pad it with --vocab-size)";
  }
  if (o.loss_parallel && !no_loss_parallel.empty()) {
    throw UsageError("--loss-parallel: " + no_loss_parallel + ". Fix: drop --loss-parallel");
  }
  p.loss_parallel = !o.no_loss_parallel && no_loss_parallel.empty();
  if (o.dtensor_rng && (o.model_impl != "holder" || o.pp > 1 || cfg.is_llama())) {
    throw UsageError("--dtensor-rng needs the GPT-2 holder model (--model-impl holder, not Llama) and no --pp. Fix: drop "
                     "--dtensor-rng");
  }
  p.dtensor_rng = o.dtensor_rng || (o.tp > 1 && cfg.dropout > 0.0);
  if (p.dtensor_rng && cfg.dropout > 0.0 && o.activation_checkpointing != "none") {
    // Recomputation would take new offsets, so new masks: its gradients would not be the forward's.
    throw UsageError("--dropout > 0 from the DTensor RNG (--tp or --dtensor-rng) with --activation-checkpointing " +
                     o.activation_checkpointing + ": the recomputed blocks would draw other masks than the forward "
                     "(the DTensor RNG's offsets are not replayed yet). Fix: --activation-checkpointing none or --dropout 0");
  }
  // reshard_after_forward's int counts ranks of the FSDP (shard) group.
  p.reshard_after_forward = parse_reshard_after_forward(o.reshard_after_forward, p.dp_shard);
  return p;
}

}  // namespace

/// The tokenizer file of this run ("" for bytes): --tokenizer FILE; `--tokenizer bytes` for byte ids on
/// purpose; else, with --init-from DIR, the folder's own SentencePiece model (DIR/tokenizer.model, as Llama 2
/// and Mistral folders ship it). A folder whose tokenizer train_gpt cannot read (tokenizer.json or
/// vocab.json: Hugging Face tokenizers' BPE, Llama 3's and GPT-2's) is refused: byte ids would feed its
/// model other tokens than the ones it learnt. Throws UsageError naming the file and the fix.
static std::string tokenizer_of_run(const Options& o) {
  if (o.tokenizer == "bytes") return "";
  if (!o.tokenizer.empty() || o.init_from.empty()) return o.tokenizer;
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path dir(o.init_from);
  if (fs::is_regular_file(dir / "tokenizer.model", ec)) return (dir / "tokenizer.model").string();
  for (const char* name : {"tokenizer.json", "vocab.json"}) {
    if (fs::is_regular_file(dir / name, ec)) {
      throw UsageError("--init-from " + o.init_from + ": the folder's tokenizer is " + name + " (Hugging Face " +
                       "tokenizers), which train_gpt does not read, and training on byte ids would feed this model " +
                       "other tokens than the ones it learnt. Fix: --tokenizer FILE.model (a SentencePiece model " +
                       "with the same ids), or --tokenizer bytes to train on byte ids anyway");
    }
  }
  return "";  // a folder with weights only: byte ids (the model's first 256)
}

/// The splits are large enough for one global batch and one evaluation batch; sets s.eval_batches.
/// Throws UsageError.
static void check_data_size(RunSetup& s, const fsdp::LaunchEnv& env);

namespace {

// --ft-*: one replica group of plain FSDP (fault_tolerance.h); the other parallelisms and fp16's scaler, whose
// state and collectives span what a replica group's heal does not carry, are refused.
void check_fault_tolerance(const Options& o, const ParallelOptions& p) {
  const bool any = o.ft_replica_id >= 0 || o.ft_group_size > 0 || o.ft_min_replica_size > 0 || !o.ft_lighthouse.empty();
  if (!any) return;
  if (o.ft_replica_id < 0 || o.ft_group_size < 1) {
    throw UsageError("--ft-* flags need both --ft-replica-id N and --ft-group-size G (this job is replica group N of G). "
                     "Fix: add the missing one");
  }
  if (o.ft_replica_id >= o.ft_group_size) {
    throw UsageError("--ft-replica-id " + std::to_string(o.ft_replica_id) + " is not below --ft-group-size " +
                     std::to_string(o.ft_group_size) + ": replica groups are numbered 0.." +
                     std::to_string(o.ft_group_size - 1));
  }
  if (o.ft_min_replica_size > o.ft_group_size) {
    throw UsageError("--ft-min-replica-size " + std::to_string(o.ft_min_replica_size) + " exceeds --ft-group-size " +
                     std::to_string(o.ft_group_size));
  }
  std::string other;
  if (o.no_shard) other = "--no-shard";
  else if (p.tp > 1) other = "--tp";
  else if (p.cp > 1) other = "--cp";
  else if (p.pp > 1) other = "--pp";
  else if (p.dp_replicate > 1) other = "--dp-replicate (HSDP: the replica groups are the replicate dimension)";
  else if (p.replicate) other = "--data-parallel replicate";
  else if (p.param_dtype == torch::kHalf) other = "--mixed-precision fp16 (its loss scaler's state is not healed)";
  else if (!o.sft.empty()) other = "--sft (its loss would be normalised by one replica group's tokens, not the job's)";
  if (!other.empty()) {
    throw UsageError("--ft-replica-id trains replica groups of plain FSDP; it does not combine with " + other +
                     ". Fix: drop one of them");
  }
}

}  // namespace

RunSetup prepare_run(const Options& o, const fsdp::LaunchEnv& env) {
  GPTConfig cfg = model_config(o);
  // The tokenizer sets the vocabulary (tokenizer.h); bytes keep every preset's as it is.
  const std::string tokenizer_path = tokenizer_of_run(o);
  const auto tokenizer = load_tokenizer(tokenizer_path);
  if (!tokenizer_path.empty() || o.vocab_size) {
    cfg.vocab_size = apply_tokenizer_vocab(cfg.vocab_size, o.vocab_size, *tokenizer);
  }
  const ParallelOptions parallel = parallel_options(o, cfg, env.world_size);
  check_fault_tolerance(o, parallel);
  if (o.min_lr > o.lr) {
    throw UsageError("--min-lr " + fmt("%g", o.min_lr) + " exceeds --lr " + fmt("%g", o.lr) +
                     ": the cosine schedule decays from --lr to --min-lr. Fix: --min-lr <= --lr");
  }
  if (!o.export_hf.empty()) {  // now, on every rank, rather than after training on rank 0 alone
    std::error_code ec;
    std::filesystem::create_directories(o.export_hf, ec);
    if (!std::filesystem::is_directory(o.export_hf) || access(o.export_hf.c_str(), W_OK) != 0) {
      throw UsageError("--export-hf " + o.export_hf + " cannot be created or written" +
                       (ec ? ": " + ec.message() : "") + ". Fix: a writable directory");
    }
  }

  const int64_t T = cfg.block_size;
  // Token shards, SFT examples, or text through a tokenizer (token_shards.h); byte-level text below.
  if (!o.data_shards.empty() || !o.sft.empty() || !tokenizer_path.empty()) {
    auto d = load_tokenized_data(o.data_shards, o.sft, o.data, *tokenizer, T, cfg.vocab_size, o.val_fraction);
    RunSetup s{o, cfg, parallel, std::move(d.train), std::move(d.val), 0, d.name, d.bytes, tokenizer, d.masked_targets};
    check_data_size(s, env);
    return s;
  }
  Corpus corpus = o.data.empty() ? load_default_corpus() : load_corpus(o.data);
  if (static_cast<int64_t>(corpus.text.size()) < T + 1) {
    throw UsageError("the text (" + corpus.name + ") has " + std::to_string(corpus.text.size()) +
                     " bytes, shorter than one block of --block-size + 1 = " + std::to_string(T + 1) +
                     " bytes. Fix: more text or a smaller --block-size");
  }
  // Segments of 8 windows alternate between the splits (see split_text).
  auto split = split_text(corpus.text, o.val_fraction, 8 * (T + 1));
  RunSetup s{o, cfg, parallel, TokenWindows(split.train, T), TokenWindows(split.val, T), 0, corpus.name,
             static_cast<int64_t>(corpus.text.size()), tokenizer};
  check_data_size(s, env);
  return s;
}

void check_data_size(RunSetup& s, const fsdp::LaunchEnv& env) {
  const Options& o = s.opts;
  const int64_t T = s.cfg.block_size;
  // The data-parallel ranks (a TP group and a pipeline share their batch): rank / tp of world / tp, or the
  // dp_shard coordinate of a (pp, dp_shard) mesh.
  const int data_world = s.parallel.data_ranks(env.world_size);
  const int data_rank = s.parallel.pp > 1 ? env.rank % data_world : env.rank / (o.tp * o.cp);
  const int64_t global_batch = o.batch_size * data_world;
  // --estimate-memory trains nothing: the model and the world size matter, not whether the text fills their
  // batches (an estimate for 512 ranks runs on a small corpus).
  if (o.estimate_memory) return;
  if (s.train.size() < global_batch) {
    DistributedSampler(s.train.size(), o.batch_size, data_rank, data_world, o.seed);  // throws the message
  }
  s.eval_batches = std::min(o.eval_batches, s.val.size() / global_batch);
  if (s.eval_batches == 0) {
    throw UsageError("the validation split has " + std::to_string(s.val.size()) + " windows of " +
                     std::to_string(T + 1) + " tokens but one evaluation batch needs --batch-size(" +
                     std::to_string(o.batch_size) + ") x data-parallel ranks(" + std::to_string(data_world) +
                     ") = " + std::to_string(global_batch) + ": more ranks than batches. Fix: more text, a larger "
                     "--val-fraction, a smaller --batch-size or --block-size, or fewer ranks");
  }
}

int data_parallel_ranks(const Options& o, int world_size) {
  return std::max<int>(1, world_size / static_cast<int>(std::max<int64_t>(1, o.tp * o.pp * o.cp)));
}

void resolve_global_batch(Options& o, int world_size) {
  if (o.global_batch_size <= 0) return;
  if (o.batch_size_given) {
    throw UsageError("--global-batch-size and --batch-size both given: the global batch sets the per-rank one. "
                     "Fix: drop one of them");
  }
  const int per_replica = static_cast<int>(std::max<int64_t>(1, o.tp * o.pp * o.cp));
  const int dp = data_parallel_ranks(o, world_size);
  if (o.global_batch_size % dp != 0) {
    throw UsageError("--global-batch-size " + std::to_string(o.global_batch_size) + " is not divisible by the " +
                     std::to_string(dp) + " data-parallel ranks (WORLD_SIZE " + std::to_string(world_size) +
                     " / (tp x pp x cp = " + std::to_string(per_replica) + ")). Fix: a global batch that every world "
                     "size the job may run at divides (e.g. a multiple of 12 for 1-4 ranks)");
  }
  o.batch_size = o.global_batch_size / dp;
}

void check_no_shard(const Options& o, int world_size) {
  if (world_size != 1) {
    throw UsageError("--no-shard runs one process without FSDP, but WORLD_SIZE is " + std::to_string(world_size) +
                     ". Fix: run train_gpt without a launcher (or --nproc-per-node 1), or drop --no-shard");
  }
  if (o.mixed_precision == "fp16" || o.cpu_offload || o.activation_checkpointing != "none") {
    throw UsageError("--no-shard supports fp32 and bf16 only, without --cpu-offload and --activation-checkpointing. "
                     "Fix: drop --no-shard or those options");
  }
}

bool use_cuda(const Options& o, const fsdp::LaunchEnv& env) {
  const bool cuda = o.device.empty() ? torch::cuda::is_available() : o.device == "cuda";
  if (cuda && !torch::cuda::is_available()) {
    throw UsageError("--device cuda: no CUDA device is usable (torch::cuda::is_available() is false" +
                     std::string(FSDP_WITH_CUDA ? "" : "; this train_gpt is built against a CPU-only LibTorch") +
                     "). Fix: --device cpu, or run on a machine with an NVIDIA GPU and a CUDA build (scripts/setup.sh)");
  }
  if (cuda && env.local_rank >= static_cast<int>(torch::cuda::device_count())) {
    throw UsageError("--device cuda: LOCAL_RANK " + std::to_string(env.local_rank) + " but only " +
                     std::to_string(torch::cuda::device_count()) + " CUDA device(s). Fix: --nproc-per-node <= " +
                     std::to_string(torch::cuda::device_count()) +
                     (env.source == "slurm" ? " (under srun: --ntasks-per-node <= --gpus-per-node, and no "
                                              "--gpus-per-task/--gpu-bind, so that every task sees its node's GPUs)"
                                            : ""));
  }
  return cuda;
}

}  // namespace train_gpt
