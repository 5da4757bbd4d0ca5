// train_gpt's command line: every flag (Options), the model presets applied to it, and every check of
// the input that can run before the ranks talk to each other (prepare_run and the check_* functions),
// so that a bad flag fails every rank with the same one-line message instead of hanging the others.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "data.h"
#include "fsdp/fsdp.h"
#include "model.h"
#include "parallelize.h"
#include "tokenizer.h"

namespace train_gpt {

using Clock = std::chrono::steady_clock;

inline double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

/// `v` formatted by printf's format `f` ("%.4f").
std::string fmt(const char* f, double v);
/// A library error's text on one line (UsageError messages are one line).
std::string one_line(std::string text);

/// Everything the command line sets. Defaults train the "small" preset visibly in a couple of minutes
/// on two CPU cores (scripts/train.sh).
struct Options {
  // Model: a preset, optionally overridden field by field.
  std::string model = "small";
  std::optional<int64_t> n_layer, n_head, n_embd, block_size;
  std::optional<double> dropout;
  std::optional<bool> tie_weights;  // unset: the preset's (GPT presets tied, Llama presets untied)
  bool model_given = false;  // --model was on the command line (refused with --init-from)
  // Hugging Face in and out (hf.h).
  std::string init_from;  // a Hugging Face folder: its config.json is the model shape, its safetensors the weights
  std::string export_hf;  // write the trained model here as a Hugging Face folder (config.json + safetensors)
  double export_max_file_mb = 4096;  // --export-hf: split the safetensors above this many MiB (with an index)
  std::string logits_tokens;  // safetensors file with int64 "tokens" [B, T]
  std::string dump_logits;    // write the logits of --logits-tokens after initialisation and after training here
  std::string model_impl = "holder";  // holder: GPT (model.h); plain: PlainGPT, the unchanged model (model_plain.h)
  // Data.
  std::vector<std::string> data;  // empty: the default corpus
  double val_fraction = 0.1;
  // Tokens and data sources beyond byte-level text (issue 33; tokenizer.h, token_shards.h, sft.h).
  std::string tokenizer;               // SentencePiece .model; empty: bytes
  std::optional<int64_t> vocab_size;   // the model's vocabulary (>= the tokenizer's); unset: the tokenizer's
  std::string data_shards;             // llm.c token files: a directory or a glob
  std::string sft;                     // JSONL of {"prompt", "response"}: prompt tokens masked in the loss
  // Optimisation.
  int64_t steps = 500;
  int64_t batch_size = 16;  // per rank, per microbatch
  // --global-batch-size: sequences per microbatch over all data-parallel ranks; sets batch_size for the
  // world size at hand (resolve_global_batch), so that an elastic restart at another size keeps the batch.
  int64_t global_batch_size = 0;
  bool batch_size_given = false;
  int64_t grad_accum_steps = 1;
  double lr = 4e-3, min_lr = 4e-4;  // small models on bytes take a high rate (1e-3 and 2e-3 were slower)
  int64_t warmup_steps = 50;
  double weight_decay = 0.1;
  double clip_grad = 1.0;  // 0 = no clipping (the norm is still logged)
  // Parallelism and memory.
  std::string mixed_precision = "fp32";
  std::string all_gather_dtype = "fp32";  // bf16 | float8: weights all-gathered in it, upcast after (LowPrecisionAllGather)
  int shard_dim = 0;  // shard_placement_fn: 2-D weights whose size on this dim divides by the FSDP ranks
  std::string freeze;                 // regex on parameter names: frozen (requires_grad false) before sharding
  std::string frozen_dtype = "fp32";  // bf16: the frozen parameters stored in bf16 (mixed-dtype groups)
  std::string reshard_after_forward = "true";
  std::string activation_checkpointing = "none";  // none | full | selective-op | layer:K (torchtitan's modes)
  bool activation_offload = false;  // the forward's saved tensors in host memory (save_on_cpu)
  std::string checkpoint_impl = "no_reentrant";  // reentrant: torch.utils.checkpoint(use_reentrant=True)
  bool cpu_offload = false;
  bool estimate_memory = false;  // print fsdp::estimate_memory's per-rank breakdown and exit (issue 14)
  int tp = 1;                      // tensor-parallel ranks per block (issue 15): heads split across them
  int cp = 1;                      // context-parallel ranks (issue 35): each sequence split across them
  int dp_replicate = 1;            // HSDP: replicas of the FSDP group; WORLD_SIZE = dp_replicate x dp_shard x tp
  bool sequence_parallel = false;  // with --tp: norms and residuals on sequence-sharded activations
  bool loss_parallel = false;     // --loss-parallel (issue 35): demanded (an error where it does not apply)
  bool no_loss_parallel = false;  // --no-loss-parallel; neither: on with --tp where it applies
  bool dtensor_rng = false;           // --dtensor-rng: dropout from the DTensor RNG also without --tp
  std::string data_parallel = "fully_shard";   // or "replicate": whole parameters on every rank (DDP)
  bool reduce_scatter_each_microbatch = false;  // accumulate sharded sums; HSDP: all-reduce on the last only
  bool keep_unsharded = false;  // set_reshard_after_backward(false) but on the last microbatch: no re-gathers
  // Pipeline parallelism (issue 34; pipeline.h): WORLD_SIZE = --pp x FSDP ranks; each pipeline rank holds
  // --stages-per-rank stages of n_layer / stages blocks, fully_shard'ed over its data-parallel ranks.
  int pp = 1;
  std::string pp_schedule = "1f1b";  // gpipe | 1f1b | interleaved-1f1b | interleaved-zero-bubble | zbv-zero-bubble
  int pp_microbatches = 0;           // 0: the number of stages (--pp x --stages-per-rank)
  int stages_per_rank = 0;           // 0: 2 for the interleaved and ZBV schedules, else 1
  int threads = 0;  // 0 = leave LibTorch's default (OMP_NUM_THREADS; fsdprun/torchrun set 1)
  // Output.
  int64_t log_every = 10;
  int64_t eval_every = 100;
  int64_t eval_batches = 8;
  std::string metrics;
  bool no_progress = false;
  // Sampling.
  std::string sample_prompt = "The meaning of life is";
  int64_t sample_tokens = 200;
  double temperature = 0.8;
  int64_t top_k = 40;
  uint64_t seed = 1337;
  // Comparison with PyTorch's FSDP2 (bench/compare_fsdp2.py; see interop.h).
  std::string save_init;     // write the initial weights here (safetensors, rank 0)
  std::string dump_batches;  // write each rank's token batches and run.json into this directory
  bool no_shard = false;     // the floor: no fully_shard, one process, plain LibTorch
  // Device (issue 12): "cuda" (each rank on cuda:LOCAL_RANK, NCCL) or "cpu" (Gloo); empty: cuda when usable.
  std::string device;
  std::string optimizer_impl = "auto";  // foreach | libtorch; auto: foreach on CUDA, libtorch on the CPU
  double peak_tflops = 989.0;  // the GPU's dense bf16 peak for MFU (H100/H200 SXM: ~989 TFLOP/s)
  // [checkpoints] Distributed checkpoints (fsdp::dcp), see checkpointing.h.
  std::string ckpt_dir;     // save DIR/step-N here; --resume loads the newest
  int64_t ckpt_every = 0;   // steps between saves; 0: only after the last step (with --ckpt-dir)
  int keep_last = 0;        // keep the newest N step-N folders; 0: all
  std::string ckpt_format = "safetensors";  // safetensors (ours) | distcp (PyTorch's dcp.save default)
  std::string resume;       // "": new run (a restart resumes, as auto); "always": --resume; "auto": --resume auto
  int64_t stop_at = 0;      // stop after this step, as an interrupted run would; 0: run to --steps
  // Fault tolerance across replica groups (fault_tolerance.h, fsdp::ft::Manager).
  int ft_replica_id = -1;        // >= 0: this job is replica group N of --ft-group-size
  int ft_group_size = 0;         // replica groups of the job
  int ft_min_replica_size = 0;   // steps run with at least this many; 0: all of them
  std::string ft_lighthouse;     // HOST:PORT of fsdp_lighthouse; empty: TORCHFT_LIGHTHOUSE
  double ft_join_timeout = 10;   // seconds a step waits for the previous step's replica groups
  double ft_timeout = 60;        // seconds: the commit vote and the replica groups' collectives
  double ft_quorum_timeout = 900;  // seconds: waiting for --ft-min-replica-size replica groups, or to be admitted
};

/// Parses the command line into `o`. Returns the exit code when there is nothing to run (--help,
/// printed), nullopt otherwise. Throws UsageError (one line) for a bad flag or value.
std::optional<int> parse_options(int argc, char** argv, Options& o);

/// The model shape: the preset with the explicit flags applied. Throws UsageError.
GPTConfig model_config(const Options& o);

/// "true" | "false" | N. Throws UsageError unless N divides the world size.
fsdp::ReshardAfterForward parse_reshard_after_forward(const std::string& s, int world_size);

/// Everything the run is made of, checked: the options, the model shape, the data and how it is split.
struct RunSetup {
  Options opts;
  GPTConfig cfg;
  ParallelOptions parallel;
  TokenWindows train, val;
  int64_t eval_batches;  // per evaluation, capped by the validation split
  std::string data_name;
  int64_t data_bytes;
  std::shared_ptr<const Tokenizer> tokenizer;  // --tokenizer, else bytes: the sample is decoded with it
  bool masked_targets = false;  // --sft: the loss is the mean over the unmasked targets of the global batch
};

/// Builds the model shape and the parallelism from `o` and loads and splits the data, checking each
/// against the others and against the launcher's world (`env`). Throws UsageError.
RunSetup prepare_run(const Options& o, const fsdp::LaunchEnv& env);

/// --no-shard is one process of plain LibTorch: no launcher's world, nothing FSDP-only. Throws UsageError.
void check_no_shard(const Options& o, int world_size);
/// The data-parallel ranks of a `world_size`-rank run: WORLD_SIZE / (tp x pp x cp), at least 1 (before the
/// parallel options are checked: ParallelOptions::data_ranks is the same number once they are).
int data_parallel_ranks(const Options& o, int world_size);
/// --global-batch-size G: sets o.batch_size to G / the data-parallel ranks of `world_size` (WORLD_SIZE /
/// (tp x pp x cp)). Throws UsageError when they do not divide G or --batch-size was also given.
/// Example: 4 ranks, --global-batch-size 8 -> --batch-size 2; after an elastic restart on 2 -> 4.
void resolve_global_batch(Options& o, int world_size);

/// Whether this rank runs on CUDA (--device, else whether a CUDA device is usable). Throws UsageError
/// when --device cuda cannot be honoured for LOCAL_RANK.
bool use_cuda(const Options& o, const fsdp::LaunchEnv& env);

}  // namespace train_gpt
