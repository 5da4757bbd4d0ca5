// train_gpt: trains a GPT-2-style byte-level language model on English text across ranks with FSDP2
// (libfsdp), evaluates it on a held-out split and prints a sample.
//
//   build/bin/fsdprun --standalone --nproc-per-node 2 -- build/bin/train_gpt --model small --steps 300
//   torchrun --standalone --nproc-per-node 2 --no-python build/bin/train_gpt ...   (the same)
//   build/bin/train_gpt ...                                                      (one process, no launcher)
//
// Reading order: main() parses and validates everything (on every rank, before any communication),
// loads the data, initialises the process group, builds the model on every rank from one seed,
// shards it in parallelize(), then train() runs the loop, evaluate() and generate() do the rest.
// The model code (model.h) is plain LibTorch; everything FSDP-specific is in this file.
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <cstdlib>
#include <string>
#include <unordered_set>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/cuda.h>
#if FSDP_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include "data.h"
#include "fsdp/activation_checkpoint.h"
#include "fsdp/clip_grad.h"
#include "fsdp/fsdp.h"
#include "fsdp/grad_scaler.h"
#include "interop.h"
#include "model.h"

namespace train_gpt {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// ---- Options -----------------------------------------------------------------------------------------

/// Everything the command line sets. Defaults train the "small" preset visibly in a couple of minutes
/// on two CPU cores (scripts/train.sh).
struct Options {
  // Model: a preset, optionally overridden field by field.
  std::string model = "small";
  std::optional<int64_t> n_layer, n_head, n_embd, block_size;
  std::optional<double> dropout;
  bool tie_weights = true;
  // Data.
  std::vector<std::string> data;  // empty: the default corpus
  double val_fraction = 0.1;
  // Optimisation.
  int64_t steps = 500;
  int64_t batch_size = 16;  // per rank, per microbatch
  int64_t grad_accum_steps = 1;
  double lr = 4e-3, min_lr = 4e-4;  // small models on bytes take a high rate (1e-3 and 2e-3 were slower)
  int64_t warmup_steps = 50;
  double weight_decay = 0.1;
  double clip_grad = 1.0;  // 0 = no clipping (the norm is still logged)
  // Parallelism and memory.
  std::string mixed_precision = "fp32";
  std::string reshard_after_forward = "true";
  bool activation_checkpointing = false;
  bool cpu_offload = false;
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
  // [checkpoints] Distributed checkpoints (fsdp::dcp), see "Checkpoints" below.
  std::string ckpt_dir;     // save DIR/step-N here; --resume loads the newest
  int64_t ckpt_every = 0;   // steps between saves; 0: only after the last step (with --ckpt-dir)
  int keep_last = 0;        // keep the newest N step-N folders; 0: all
  std::string resume;       // "": new run (a restart resumes, as auto); "always": --resume; "auto": --resume auto
  int64_t stop_at = 0;      // stop after this step, as an interrupted run would; 0: run to --steps
};

// ---- Flag values -------------------------------------------------------------------------------------
//
// Checks of numeric flags that fail with one line naming the flag, what it expects and what it got.
// CLI11's own PositiveNumber/NonNegativeNumber/Range print the type's whole range (1.8e308 written out
// in full) on a second line, and let NaN through (every comparison with NaN is false).

/// An integer of type T, at least `min`.
template <typename T>
CLI::Validator integer_at_least(T min) {
  const std::string expected = "expected an integer >= " + std::to_string(min);
  return CLI::Validator(
      [min, expected](std::string& s) -> std::string {
        errno = 0;
        char* end = nullptr;
        const bool is_signed = std::numeric_limits<T>::is_signed;
        // strtoull accepts "-1" (as 2^64 - 1): refuse a sign for unsigned types.
        if (s.empty() || std::isspace(static_cast<unsigned char>(s[0])) || (!is_signed && s[0] == '-')) {
          return expected + ", got '" + s + "'";
        }
        long long v = 0;
        unsigned long long u = 0;
        if (is_signed) {
          v = std::strtoll(s.c_str(), &end, 10);
        } else {
          u = std::strtoull(s.c_str(), &end, 10);
        }
        if (*end != '\0') return expected + ", got '" + s + "'";
        const bool too_large = errno == ERANGE || (is_signed ? v > static_cast<long long>(std::numeric_limits<T>::max())
                                                             : u > static_cast<unsigned long long>(
                                                                       std::numeric_limits<T>::max()));
        if (too_large || (is_signed && v < static_cast<long long>(std::numeric_limits<T>::min()))) {
          return expected + ", got " + s + ", which is out of range";
        }
        if (is_signed ? v < static_cast<long long>(min) : u < static_cast<unsigned long long>(min)) {
          return expected + ", got " + s;
        }
        return "";
      },
      "", "");
}

/// A finite number in [lo, hi] (or (lo, hi] with lo_open, [lo, hi) with hi_open; hi = inf: no bound).
CLI::Validator number_in(double lo, bool lo_open, double hi = std::numeric_limits<double>::infinity(),
                         bool hi_open = false) {
  auto num = [](double v) {
    std::ostringstream os;
    os << v;
    return os.str();
  };
  std::string expected = "expected a finite number ";
  if (std::isinf(hi)) {
    expected += (lo_open ? "> " : ">= ") + num(lo);
  } else {
    expected += std::string("in ") + (lo_open ? "(" : "[") + num(lo) + ", " + num(hi) + (hi_open ? ")" : "]");
  }
  return CLI::Validator(
      [=](std::string& s) -> std::string {
        char* end = nullptr;
        const double v = s.empty() ? 0.0 : std::strtod(s.c_str(), &end);
        if (s.empty() || std::isspace(static_cast<unsigned char>(s[0])) || *end != '\0') {
          return expected + ", got '" + s + "'";
        }
        const bool ok = std::isfinite(v) && (lo_open ? v > lo : v >= lo) && (hi_open ? v < hi : v <= hi);
        return ok ? "" : expected + ", got " + s;
      },
      "", "");
}

/// --resume's value: none (the flag alone), or auto.
CLI::Validator resume_value() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        return s == "always" || s == "auto" ? "" : "expected no value or 'auto', got '" + s + "'";
      },
      "", "");
}

void add_flags(CLI::App& app, Options& o) {
  std::string presets;
  for (const auto& n : preset_names()) presets += (presets.empty() ? "" : "|") + n;
  auto* g = app.add_option_group("Model");
  g->add_option("--model", o.model, "Preset: " + presets)->capture_default_str();
  g->add_option("--n-layer", o.n_layer, "Transformer blocks (overrides the preset)")->check(integer_at_least<int64_t>(1));
  g->add_option("--n-head", o.n_head, "Attention heads (overrides the preset)")->check(integer_at_least<int64_t>(1));
  g->add_option("--n-embd", o.n_embd, "Embedding width, a multiple of --n-head (overrides the preset)")
      ->check(integer_at_least<int64_t>(1));
  g->add_option("--block-size", o.block_size, "Context length in bytes (overrides the preset)")
      ->check(integer_at_least<int64_t>(1));
  g->add_option("--dropout", o.dropout, "Dropout probability (Default: 0)")->check(number_in(0, false, 1, true));
  g->add_option("--tie-weights", o.tie_weights, "Share the embedding and head weights")->capture_default_str();

  g = app.add_option_group("Data");
  g->add_option("--data", o.data, std::string("Text files to train on (Default: the fortunes in ") +
                                      kDefaultCorpusDir + ", installed by scripts/setup.sh)");
  g->add_option("--val-fraction", o.val_fraction, "Fraction of the text held out for evaluation")
      ->capture_default_str()->check(number_in(0.001, false, 0.5));

  g = app.add_option_group("Optimisation");
  g->add_option("--steps", o.steps, "Optimizer steps")
      ->capture_default_str()->check(integer_at_least<int64_t>(1));
  g->add_option("--batch-size", o.batch_size, "Sequences per rank per microbatch")
      ->capture_default_str()->check(integer_at_least<int64_t>(1));
  g->add_option("--grad-accum-steps", o.grad_accum_steps, "Microbatches per step")
      ->capture_default_str()->check(integer_at_least<int64_t>(1));
  g->add_option("--lr", o.lr, "Peak learning rate (AdamW)")->capture_default_str()->check(number_in(0, true));
  g->add_option("--min-lr", o.min_lr, "Learning rate at the end of the cosine decay")
      ->capture_default_str()->check(number_in(0, false));
  g->add_option("--warmup-steps", o.warmup_steps, "Steps of linear warmup")
      ->capture_default_str()->check(integer_at_least<int64_t>(0));
  g->add_option("--weight-decay", o.weight_decay, "AdamW weight decay (matrices and embeddings only)")
      ->capture_default_str()->check(number_in(0, false));
  g->add_option("--clip-grad", o.clip_grad, "Clip the global gradient norm to this (0: no clipping)")
      ->capture_default_str()->check(number_in(0, false));

  g = app.add_option_group("Parallelism and memory");
  g->add_option("--mixed-precision", o.mixed_precision, "Compute dtype (parameters and optimizer stay fp32)")
      ->capture_default_str()->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  g->add_option("--reshard-after-forward", o.reshard_after_forward,
                "Free the blocks' gathered parameters after forward: true|false|N (N ranks keep a slice)")
      ->capture_default_str();
  g->add_flag("--activation-checkpointing", o.activation_checkpointing, "Recompute each block in backward");
  g->add_flag("--cpu-offload", o.cpu_offload, "Keep shards, gradients and optimizer state on the CPU");
  g->add_option("--device", o.device, "cuda (each rank on cuda:LOCAL_RANK, NCCL) or cpu (Gloo) (Default: cuda "
                                      "when a CUDA device is usable, else cpu)")
      ->check(CLI::IsMember({"cuda", "cpu"}));
  g->add_option("--optimizer-impl", o.optimizer_impl, "AdamW's kernels: foreach (PyTorch's default on CUDA: a few "
                                                      "multi-tensor kernels per group, PyTorch's arithmetic) or "
                                                      "libtorch (torch::optim::AdamW::step, ~8 kernels per "
                                                      "parameter) (Default: foreach on CUDA, libtorch on the CPU)")
      ->check(CLI::IsMember({"auto", "foreach", "libtorch"}));
  g->add_option("--peak-tflops", o.peak_tflops, "Peak dense bf16 TFLOP/s of one GPU, for the MFU (model FLOPs "
                                                "utilisation) in the log and metrics; H100/H200 SXM: 989")
      ->capture_default_str()->check(CLI::PositiveNumber);
  g->add_option("--threads", o.threads, "Intra-op threads per rank (0: OMP_NUM_THREADS, 1 under fsdprun)")
      ->capture_default_str()->check(integer_at_least<int>(0));

  g = app.add_option_group("Output");
  g->add_option("--log-every", o.log_every, "Steps between log lines")
      ->capture_default_str()->check(integer_at_least<int64_t>(1));
  g->add_option("--eval-every", o.eval_every, "Steps between evaluations (and at the start and the end)")
      ->capture_default_str()->check(integer_at_least<int64_t>(1));
  g->add_option("--eval-batches", o.eval_batches, "Batches per rank per evaluation")
      ->capture_default_str()->check(integer_at_least<int64_t>(1));
  g->add_option("--metrics", o.metrics, "Write JSON lines (step, loss, lr, grad_norm, tokens_per_s, step_ms, "
                                        "peak_rss_mb, peak_gpu_mem_mb, mfu, eval_loss) to FILE (rank 0)");
  g->add_flag("--no-progress", o.no_progress, "No progress bar even on a terminal");

  g = app.add_option_group("Sampling");
  g->add_option("--sample-prompt", o.sample_prompt, "Text the sample continues")->capture_default_str();
  g->add_option("--sample-tokens", o.sample_tokens, "Bytes to generate (0: no sample)")
      ->capture_default_str()->check(integer_at_least<int64_t>(0));
  g->add_option("--temperature", o.temperature, "Sampling temperature (0: greedy)")
      ->capture_default_str()->check(number_in(0, false));
  g->add_option("--top-k", o.top_k, "Sample among the k likeliest bytes (0: all)")
      ->capture_default_str()->check(integer_at_least<int64_t>(0));
  app.add_option("--seed", o.seed, "Seed of the weights, the data order and the sample")
      ->capture_default_str()->check(integer_at_least<uint64_t>(0));

  // [checkpoints]
  g = app.add_option_group("Checkpoints");
  g->add_option("--ckpt-dir", o.ckpt_dir, "Save distributed checkpoints in DIR/step-N (every rank writes its "
                                          "shards; DIR/latest names the newest)");
  g->add_option("--ckpt-every", o.ckpt_every, "Steps between checkpoints (0: only after the last step)")
      ->capture_default_str()->check(integer_at_least<int64_t>(0));
  g->add_option("--keep-last", o.keep_last, "Keep only the newest N checkpoints (0: all)")
      ->capture_default_str()->check(integer_at_least<int>(0));
  g->add_option("--resume", o.resume,
                "Continue from the newest checkpoint in --ckpt-dir, on any number of ranks (model and optimizer "
                "resharded, the data position carried over); an error if there is none. --resume auto: continue "
                "if --ckpt-dir holds a checkpoint, else start a new run. A restart by fsdprun/torchrun "
                "(TORCHELASTIC_RESTART_COUNT > 0) resumes as with auto")
      ->expected(0, 1)
      ->default_str("always")
      ->check(resume_value());
  g->add_option("--stop-at", o.stop_at, "Stop after step N, as an interrupted run (the learning-rate schedule "
                                        "still spans --steps; continue with --resume)")
      ->check(integer_at_least<int64_t>(0));

  g = app.add_option_group("Comparison with PyTorch (bench/compare_fsdp2.py)");
  g->add_option("--save-init", o.save_init, "Write the initial weights (full, before sharding) to FILE as "
                                             "safetensors (rank 0)");
  g->add_option("--dump-batches", o.dump_batches, "Write the token batches each rank trains on to "
                                                  "DIR/rank<R>.npy, and DIR/run.json");
  g->add_flag("--no-shard", o.no_shard, "No FSDP: one process, plain LibTorch (bf16 by CPU autocast); the floor "
                                        "of the benchmark");
  // A flag given twice takes its last value, so that scripts can put defaults first and pass the
  // user's arguments after them (scripts/train.sh).
  std::vector<CLI::App*> sections = app.get_subcommands([](CLI::App*) { return true; });  // the option groups
  sections.push_back(&app);
  for (auto* section : sections) {
    for (auto* opt : section->get_options()) {
      if (opt->get_expected_max() == 1) opt->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
    }
  }
}

/// The model shape: the preset with the explicit flags applied. Throws UsageError.
GPTConfig model_config(const Options& o) {
  GPTConfig cfg;
  try {
    cfg = preset(o.model);
    if (o.n_layer) cfg.n_layer = *o.n_layer;
    if (o.n_head) cfg.n_head = *o.n_head;
    if (o.n_embd) cfg.n_embd = *o.n_embd;
    if (o.block_size) cfg.block_size = *o.block_size;
    if (o.dropout) cfg.dropout = *o.dropout;
    cfg.tie_weights = o.tie_weights;
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

// ---- Parallelism -----------------------------------------------------------------------------------

struct ParallelOptions {
  torch::ScalarType param_dtype = torch::kFloat32;  ///< compute dtype of forward and backward
  fsdp::ReshardAfterForward reshard_after_forward = true;  ///< for the blocks
  bool activation_checkpointing = false;
  bool cpu_offload = false;
};

/// Applies FSDP2 to the model, in this order:
///   1. each block becomes a fully_shard group of its own: in forward and backward only one block's
///      parameters (plus the prefetched next one) are gathered at a time;
///   2. the root last: what is left (wte, wpe, ln_f, lm_head) forms one group. lm_head.weight is
///      wte.weight when tied, and tied parameters must live in one group: so neither wte nor lm_head
///      is sharded on its own. The root keeps its parameters gathered between forward and backward
///      (reshard_after_forward false, FSDP2's default for the root): backward needs them first.
/// Mixed precision: parameters are gathered and used in `param_dtype`, gradients reduced in fp32, the
/// sharded parameters and the optimizer state stay fp32.
void parallelize(fsdp::FSDPModule<GPT>& model, const fsdp::DeviceMeshPtr& mesh, const ParallelOptions& p) {
  auto opts = fsdp::FullyShardOptions().mesh(mesh);
  if (p.param_dtype != torch::kFloat32) {
    opts.mp_policy(fsdp::MixedPrecisionPolicy().param_dtype(p.param_dtype).reduce_dtype(torch::kFloat32));
  }
  if (p.cpu_offload) opts.offload_policy(fsdp::CPUOffloadPolicy());
  // 0. Activation checkpointing: each block keeps only its input in forward and is recomputed in
  //    backward, after FSDP's pre-backward all-gather of that block (nothing extra is gathered).
  if (p.activation_checkpointing) {
    for (auto& block : model->blocks) fsdp::checkpoint_wrapper(block);
  }
  // 1. Blocks, bottom-up.
  auto block_opts = opts;
  block_opts.reshard_after_forward(p.reshard_after_forward);
  for (auto& block : model->blocks) fsdp::fully_shard(block, block_opts);
  // 2. The root last (its default reshard_after_forward: false).
  fsdp::fully_shard(model, opts);
}

// ---- Reporting ---------------------------------------------------------------------------------------

/// Peak resident memory of this process (VmHWM), MiB.
double peak_rss_mb() {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;  // "VmHWM:  123456 kB"
  }
  return 0.0;
}

/// Peak GPU memory of this process on `device` so far (MiB): the CUDA caching allocator's peak of allocated
/// bytes (torch.cuda.max_memory_allocated); 0 on a CPU device.
double peak_gpu_mem_mb(const torch::Device& device) {
#if FSDP_WITH_CUDA
  if (device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    return static_cast<double>(stats.allocated_bytes[0].peak) / (1024.0 * 1024.0);  // [0]: StatType::AGGREGATE
  }
#endif
  return 0.0;
}

/// Model FLOPs per trained token (forward and backward): 6 per parameter (PaLM's appendix B, the
/// embeddings' lookups included as matmuls for simplicity) plus the attention scores and values,
/// 12 * layers * width * context (6 * 2 matmuls of T x d per token, causal masking not discounted).
double flops_per_token(const GPTConfig& c, int64_t num_params) {
  return 6.0 * static_cast<double>(num_params) +
         12.0 * static_cast<double>(c.n_layer * c.n_embd * c.block_size);
}

/// One step of torch.optim.AdamW's foreach implementation (PyTorch's default on CUDA, _multi_tensor_adam with
/// decoupled weight decay), on LibTorch's AdamW state: the same exp_avg / exp_avg_sq / step that checkpoints
/// save and load, created lazily as torch::optim::AdamW::step does. Per parameter group, a handful of
/// multi-tensor kernels instead of ~8 kernels per parameter: on a GPU that is the difference between a few
/// and a few hundred launches per step. Arithmetic as PyTorch's (the first moment by lerp_; LibTorch's step
/// uses mul_ + add_, which rounds differently).
void foreach_adamw_step(torch::optim::AdamW& opt) {
  torch::NoGradGuard no_grad;
  for (auto& group : opt.param_groups()) {
    const auto& o = static_cast<const torch::optim::AdamWOptions&>(group.options());
    TORCH_CHECK(!o.amsgrad(), "foreach_adamw_step: amsgrad is not supported");
    const double lr = o.lr(), wd = o.weight_decay(), eps = o.eps();
    const double beta1 = std::get<0>(o.betas()), beta2 = std::get<1>(o.betas());
    std::vector<torch::Tensor> params, grads, exp_avgs, exp_avg_sqs;
    std::vector<c10::Scalar> step_size, bc2_sqrt;
    for (auto& p : group.params()) {
      if (!p.grad().defined() || p.numel() == 0) continue;
      auto& slot = opt.state()[p.unsafeGetTensorImpl()];
      if (!slot) {
        auto st = std::make_unique<torch::optim::AdamWParamState>();
        st->step(0);
        st->exp_avg(torch::zeros_like(p, torch::MemoryFormat::Preserve));
        st->exp_avg_sq(torch::zeros_like(p, torch::MemoryFormat::Preserve));
        slot = std::move(st);
      }
      auto& st = static_cast<torch::optim::AdamWParamState&>(*slot);
      st.step(st.step() + 1);
      params.push_back(p);
      grads.push_back(p.grad());
      exp_avgs.push_back(st.exp_avg());
      exp_avg_sqs.push_back(st.exp_avg_sq());
      const double t = static_cast<double>(st.step());
      step_size.emplace_back(-(lr / (1.0 - std::pow(beta1, t))));
      bc2_sqrt.emplace_back(std::sqrt(1.0 - std::pow(beta2, t)));
    }
    if (params.empty()) continue;
    if (wd != 0) at::_foreach_mul_(params, 1.0 - lr * wd);
    at::_foreach_lerp_(exp_avgs, grads, 1.0 - beta1);
    at::_foreach_mul_(exp_avg_sqs, beta2);
    at::_foreach_addcmul_(exp_avg_sqs, grads, grads, 1.0 - beta2);
    auto denom = at::_foreach_sqrt(exp_avg_sqs);
    at::_foreach_div_(denom, bc2_sqrt);
    at::_foreach_add_(denom, eps);
    at::_foreach_addcdiv_(params, exp_avgs, denom, step_size);
  }
}

/// A one-line progress bar with ETA on rank 0, only when stdout is a terminal.
class ProgressBar {
 public:
  ProgressBar(bool enabled, int64_t total) : enabled_(enabled), total_(total) {}
  void update(int64_t step, double loss, double seconds_per_step) {
    if (!enabled_) return;
    constexpr int kWidth = 30;
    const int filled = static_cast<int>(kWidth * step / std::max<int64_t>(total_, 1));
    const auto eta = static_cast<int64_t>(seconds_per_step * static_cast<double>(total_ - step));
    std::printf("\r\033[K[%s%s] %lld/%lld loss %.4f ETA %lld:%02lld", std::string(filled, '#').c_str(),
                std::string(kWidth - filled, '.').c_str(), static_cast<long long>(step),
                static_cast<long long>(total_), loss, static_cast<long long>(eta / 60),
                static_cast<long long>(eta % 60));
    std::fflush(stdout);
    shown_ = true;
  }
  /// Erases the bar so that a log line can be printed in its place.
  void clear() {
    if (!shown_) return;
    std::printf("\r\033[K");
    std::fflush(stdout);
    shown_ = false;
  }

 private:
  bool enabled_;
  int64_t total_;
  bool shown_ = false;
};

/// JSON lines on rank 0: one per log step and per evaluation step, each with every key (values null
/// where not measured: the evaluation before training has no training loss).
class MetricsWriter {
 public:
  /// A new run truncates `path`. A resumed run (keep_through_step >= 0) keeps the lines of the steps up
  /// to its checkpoint's and drops the later ones (written by the attempt that failed after it, and
  /// about to be trained again), so that a run restarted with the same --metrics FILE leaves one line
  /// per step in FILE.
  explicit MetricsWriter(const std::string& path, int64_t keep_through_step = -1) {
    if (path.empty()) return;
    std::string kept;
    if (keep_through_step >= 0) {
      std::ifstream in(path);
      for (std::string line; std::getline(in, line);) {
        const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
        if (j.is_object() && j.contains("step") && j["step"].is_number_integer() &&
            j["step"].get<int64_t>() <= keep_through_step) {
          kept += line + "\n";
        }
      }
    }
    out_.open(path, std::ios::trunc);
    if (!out_) throw UsageError("--metrics " + path + " cannot be written (missing directory?)");
    out_ << kept;
  }
  /// Throws UsageError now (not after training) if `path` cannot be written; leaves its content.
  static void probe(const std::string& path) {
    std::ofstream out(path, std::ios::app);
    if (!out) throw UsageError("--metrics " + path + " cannot be written (missing directory?)");
  }
  void write(const nlohmann::json& line) {
    if (!out_.is_open()) return;
    out_ << line.dump() << '\n';
    out_.flush();  // a crashed or interrupted run keeps its curve
  }

 private:
  std::ofstream out_;
};

// ---- Training ---------------------------------------------------------------------------------------

/// Linear warmup to `lr` over warmup_steps, then cosine decay to min_lr at the last step. step >= 1.
double lr_at(int64_t step, const Options& o) {
  if (o.warmup_steps > 0 && step <= o.warmup_steps) {
    return o.lr * static_cast<double>(step) / static_cast<double>(o.warmup_steps);
  }
  const double span = static_cast<double>(std::max<int64_t>(o.steps - o.warmup_steps, 1));
  const double progress = std::min(1.0, static_cast<double>(step - o.warmup_steps) / span);
  return o.min_lr + 0.5 * (1.0 + std::cos(M_PI * progress)) * (o.lr - o.min_lr);
}

torch::Tensor lm_loss(const torch::Tensor& logits, const torch::Tensor& targets) {
  // In fp32 whatever the compute dtype: a log-softmax over 256 classes in bf16 loses the small probabilities.
  return torch::nn::functional::cross_entropy(logits.to(torch::kFloat32).reshape({-1, logits.size(-1)}),
                                              targets.reshape({-1}));
}

/// Mean loss over the fixed evaluation batches of the validation split, averaged over ranks.
/// Every rank runs the same number of forwards (the blocks all-gather their parameters in each).
double evaluate(fsdp::FSDPModule<GPT>& model, const TokenWindows& val, int64_t num_batches, int64_t batch_size,
                fsdp::ProcessGroup& pg) {
  model->eval();
  torch::NoGradGuard no_grad;
  auto sum = torch::zeros({1}, torch::TensorOptions(torch::kDouble).device(pg.device()));
  for (int64_t b = 0; b < num_batches; ++b) {
    auto [x, y] = val.get(eval_indices(b, batch_size, pg.rank(), pg.size()));
    sum += lm_loss(model(x.to(pg.device())), y.to(pg.device())).to(torch::kDouble);
  }
  fsdp::all_reduce(sum, pg, fsdp::ReduceOp::SUM);
  model->train();
  return sum.item<double>() / static_cast<double>(num_batches * pg.size());
}

/// Continues `prompt` by `num_tokens` bytes. Every rank runs every forward in lockstep (each forward
/// all-gathers the blocks' parameters); rank 0 draws each byte and broadcasts it, so all ranks extend
/// the same text even if their logits differed in the last bit. Deterministic given `seed`.
std::string generate(fsdp::FSDPModule<GPT>& model, const std::string& prompt, int64_t num_tokens,
                     double temperature, int64_t top_k, uint64_t seed, fsdp::ProcessGroup& pg) {
  model->eval();
  torch::NoGradGuard no_grad;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  std::vector<int64_t> tokens;
  for (unsigned char c : (prompt.empty() ? std::string("\n") : prompt)) tokens.push_back(c);
  const int64_t context = model->cfg.block_size;
  std::string out;
  for (int64_t i = 0; i < num_tokens; ++i) {
    const auto begin = tokens.size() > static_cast<size_t>(context) ? tokens.end() - context : tokens.begin();
    auto idx = torch::tensor(std::vector<int64_t>(begin, tokens.end()), torch::kLong).unsqueeze(0);  // [1, T]
    auto logits = model(idx.to(pg.device())).select(1, -1).squeeze(0).to(torch::kCPU, torch::kFloat32);  // [vocab]
    auto next = torch::zeros({1}, torch::kLong);
    if (pg.rank() == 0) {
      if (temperature == 0.0) {
        next = logits.argmax().reshape({1});
      } else {
        logits = logits / temperature;
        if (top_k > 0 && top_k < logits.size(0)) {
          auto kth = std::get<0>(logits.topk(top_k)).min();
          logits = logits.masked_fill(logits < kth, -std::numeric_limits<float>::infinity());
        }
        next = torch::multinomial(torch::softmax(logits, 0), 1, /*replacement=*/false, gen);
      }
    }
    next = next.to(pg.device());  // NCCL broadcasts device tensors
    fsdp::broadcast(next, /*src=*/0, pg);
    tokens.push_back(next.item<int64_t>());
    out.push_back(static_cast<char>(tokens.back()));
  }
  model->train();
  return out;
}

/// Length of the well-formed UTF-8 sequence at bytes[i] (Unicode's table 3-7: no overlong forms, no
/// surrogates, nothing above U+10FFFF), or 0.
size_t utf8_sequence_length(const std::string& bytes, size_t i) {
  auto at = [&](size_t k) { return static_cast<unsigned char>(bytes[k]); };
  const unsigned char c = at(i);
  if (c < 0x80) return 1;
  size_t len = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // range of the second byte
  if (c >= 0xC2 && c <= 0xDF) {
    len = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    len = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    return 0;
  }
  if (i + len > bytes.size() || at(i + 1) < lo || at(i + 1) > hi) return 0;
  for (size_t k = 2; k < len; ++k) {
    if (at(i + k) < 0x80 || at(i + k) > 0xBF) return 0;
  }
  return len;
}

/// `bytes` as printable UTF-8: a byte-level model can emit ill-formed sequences and control bytes,
/// which become U+FFFD (newlines and tabs stay).
std::string printable(const std::string& bytes) {
  static const std::string kReplacement = "\xEF\xBF\xBD";
  std::string out;
  size_t i = 0;
  while (i < bytes.size()) {
    const auto c = static_cast<unsigned char>(bytes[i]);
    size_t len = utf8_sequence_length(bytes, i);
    if (len == 1 && ((c < 0x20 && c != '\n' && c != '\t') || c == 0x7F)) len = 0;
    if (len > 0) {
      out.append(bytes, i, len);
      i += len;
    } else {
      out += kReplacement;
      i += 1;
    }
  }
  return out;
}

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

/// How this run treats the checkpoints in --ckpt-dir, decided by check_checkpoint_options.
struct ResumePlan {
  bool resume = false;    ///< load the newest checkpoint before training
  bool complete = false;  ///< (--resume auto, a restart) it is at or past this run's last step: train nothing
  std::string why;        ///< "--resume", "--resume auto" or "restart N (TORCHELASTIC_RESTART_COUNT=N)"
  int restart = 0;        ///< TORCHELASTIC_RESTART_COUNT (0 without a launcher)
};

struct RunSetup {
  Options opts;
  GPTConfig cfg;
  ParallelOptions parallel;
  TokenWindows train, val;
  int64_t eval_batches;  // per evaluation, capped by the validation split
  std::string data_name;
  int64_t data_bytes;
  ResumePlan resume;
};

/// --no-shard is one process of plain LibTorch: no launcher's world, nothing FSDP-only. Throws UsageError.
void check_no_shard(const Options& o, int world_size) {
  if (world_size != 1) {
    throw UsageError("--no-shard runs one process without FSDP, but WORLD_SIZE is " + std::to_string(world_size) +
                     ". Fix: run train_gpt without a launcher (or --nproc-per-node 1), or drop --no-shard");
  }
  if (o.mixed_precision == "fp16" || o.cpu_offload || o.activation_checkpointing) {
    throw UsageError("--no-shard supports fp32 and bf16 only, without --cpu-offload and --activation-checkpointing. "
                     "Fix: drop --no-shard or those options");
  }
}

/// --save-init: the full weights under their named_parameters() names, a tied weight once (as wte.weight),
/// the model shape in the metadata. Call before parallelize(): afterwards each rank holds a shard only.
void save_initial_weights(const GPTImpl& model, const std::string& path) {
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  std::unordered_set<const void*> seen;
  for (const auto& p : model.named_parameters()) {
    if (seen.insert(p.value().unsafeGetTensorImpl()).second) tensors.emplace_back(p.key(), p.value());
  }
  const auto& c = model.cfg;
  write_safetensors(path, tensors,
                    {{"format", "pt"}, {"producer", "train_gpt"}, {"vocab_size", std::to_string(c.vocab_size)},
                     {"block_size", std::to_string(c.block_size)}, {"n_layer", std::to_string(c.n_layer)},
                     {"n_head", std::to_string(c.n_head)}, {"n_embd", std::to_string(c.n_embd)},
                     {"dropout", fmt("%.17g", c.dropout)}, {"tie_weights", c.tie_weights ? "true" : "false"}});
}

/// --dump-batches: DIR/run.json, what bench/gpt_twin.py needs to replay this run (the optimizer's
/// betas and eps are those train() passes to AdamW).
nlohmann::json run_description(const RunSetup& s, int world, int64_t start_step) {
  const Options& o = s.opts;
  return {{"world_size", world},         {"first_step", start_step + 1},  {"steps", o.steps},
          {"batch_size", o.batch_size},  {"grad_accum_steps", o.grad_accum_steps},
          {"block_size", s.cfg.block_size}, {"lr", o.lr},                 {"min_lr", o.min_lr},
          {"warmup_steps", o.warmup_steps}, {"weight_decay", o.weight_decay}, {"betas", {0.9, 0.95}},
          {"eps", torch::optim::AdamWOptions(o.lr).eps()}, {"clip_grad", o.clip_grad},
          {"mixed_precision", o.mixed_precision}, {"reshard_after_forward", o.reshard_after_forward},
          {"no_shard", o.no_shard},      {"seed", o.seed},
          {"device", o.device.empty() ? (torch::cuda::is_available() ? "cuda" : "cpu") : o.device}};
}

// ---- Checkpoints ---------------------------------------------------------------------------------
//
// [checkpoints] --ckpt-dir DIR saves DIR/step-N every --ckpt-every steps and after the run's last step:
// a distributed checkpoint (fsdp::dcp::save: every rank writes its own shards of the model and of the
// optimizer state, atomically; then DIR/latest names it; --keep-last N deletes the oldest). --resume
// loads the newest on any number of ranks: dcp::load reshards the model and the optimizer state to
// this run's ranks. Everything else a resume needs is the same on every rank and independent of the
// world size, so it is saved once (rank 0's) and loads on any world size:
//   train.step         the last step done (the learning rate is a function of the step)
//   train.sampler      the data position {epoch, cursor}: windows handed out to all ranks together
//   train.rng_state    the global CPU generator (dropout): every rank seeds it alike and draws alike
//   train.grad_scaler  fp16: {scale, growth_tracker} of the loss scaler (null without one)
//   train.run          the model shape, the data size and the seed, checked before a resume starts
// Tied weights: named_parameters() lists the tied tensor as wte.weight and as lm_head.weight, so the
// model part holds it under both names (two views of one shard, loaded twice with the same bytes); the
// optimizer part keys its state once, by the first name (wte.weight).

constexpr const char* kStepKey = "train.step";
constexpr const char* kSamplerKey = "train.sampler";
constexpr const char* kRngKey = "train.rng_state";
constexpr const char* kScalerKey = "train.grad_scaler";
constexpr const char* kRunKey = "train.run";
constexpr const char* kFirstEvalKey = "train.first_eval";  // {step, loss} of the run's first evaluation

std::string shape_str(c10::IntArrayRef sizes) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
  return s + "]";
}

/// A library error's text on one line (UsageError messages are one line).
std::string one_line(std::string text) {
  std::replace(text.begin(), text.end(), '\n', ' ');
  return text;
}

nlohmann::json model_json(const GPTConfig& c) {
  return {{"vocab_size", c.vocab_size}, {"block_size", c.block_size}, {"n_layer", c.n_layer}, {"n_head", c.n_head},
          {"n_embd", c.n_embd},         {"dropout", c.dropout},       {"tie_weights", c.tie_weights}};
}

GPTConfig model_from_json(const nlohmann::json& j) {
  GPTConfig c;
  c.vocab_size = j.at("vocab_size").get<int64_t>();
  c.block_size = j.at("block_size").get<int64_t>();
  c.n_layer = j.at("n_layer").get<int64_t>();
  c.n_head = j.at("n_head").get<int64_t>();
  c.n_embd = j.at("n_embd").get<int64_t>();
  c.dropout = j.at("dropout").get<double>();
  c.tie_weights = j.at("tie_weights").get<bool>();
  return c;
}

/// train.run: what a resume must agree with (and what the log reports).
nlohmann::json checkpoint_run_info(const Options& o, const GPTConfig& cfg, int64_t train_windows, int world) {
  return {{"model", model_json(cfg)},   {"train_windows", train_windows}, {"seed", o.seed},
          {"world_size", world},        {"batch_size", o.batch_size},     {"grad_accum_steps", o.grad_accum_steps},
          {"steps", o.steps},           {"mixed_precision", o.mixed_precision}};
}

/// The newest checkpoint in `dir`: the folder DIR/latest names; without a `latest` file, the complete
/// step-N folder (one with its metadata file) with the highest N; nullopt if there is none.
/// Throws c10::Error for a malformed `latest` file.
std::optional<std::string> newest_checkpoint(const std::string& dir) {
  namespace fs = std::filesystem;
  if (auto l = fsdp::dcp::latest(dir)) return l;
  std::optional<std::pair<int64_t, std::string>> best;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("step-", 0) != 0 || name.size() == 5 || name.size() > 23 ||
        name.find_first_not_of("0123456789", 5) != std::string::npos) {
      continue;  // not step-N (a step-N.tmp-* folder is a save that did not complete)
    }
    if (!fs::is_regular_file(e.path() / fsdp::dcp::kMetadataFileName, ec)) continue;
    const int64_t n = std::stoll(name.substr(5));
    if (!best || n > best->first) best = {n, e.path().string()};
  }
  if (!best) return std::nullopt;
  return best->second;
}

/// --ckpt-dir, --ckpt-every, --keep-last, --resume, --stop-at: checked on every rank before any
/// communication (reads the checkpoint's metadata and headers only). `restart` is the launcher's
/// TORCHELASTIC_RESTART_COUNT (0 on a run's first attempt, k on the k-th restart of the worker group;
/// fsdprun and torchrun set it). Returns whether to resume. Throws UsageError naming the path or value
/// and the fix.
///
/// One command line both starts and continues a run (the restart pattern): a new run refuses a
/// --ckpt-dir that already holds checkpoints (it would mix two runs' checkpoints), but a restart of the
/// worker group by fsdprun/torchrun (TORCHELASTIC_RESTART_COUNT > 0), like --resume auto, resumes
/// from the newest checkpoint when there is one and starts afresh when there is none. A checkpoint
/// of another model, other data or another seed is refused in every mode.
ResumePlan check_checkpoint_options(const Options& o, const GPTConfig& cfg, int64_t train_windows, int restart) {
  namespace fs = std::filesystem;
  ResumePlan plan;
  plan.restart = restart;
  const bool always = o.resume == "always";
  const bool automatic = o.resume == "auto" || (o.resume.empty() && restart > 0);
  plan.why = always ? "--resume" : o.resume == "auto" ? "--resume auto"
                                 : "restart " + std::to_string(restart) + " (TORCHELASTIC_RESTART_COUNT=" +
                                       std::to_string(restart) + ")";
  if (o.ckpt_dir.empty()) {
    for (const auto& [flag, given] : {std::pair<const char*, bool>{"--ckpt-every", o.ckpt_every > 0},
                                      {"--keep-last", o.keep_last > 0}, {"--resume", !o.resume.empty()}}) {
      if (given) {
        throw UsageError(std::string(flag) + " needs --ckpt-dir DIR, the directory that holds the step-N " +
                         "checkpoints. Fix: add --ckpt-dir DIR");
      }
    }
    return plan;  // a restart without --ckpt-dir has nothing to resume from: it starts afresh
  }
  const std::string& dir = o.ckpt_dir;
  std::error_code ec;
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec)) {
    throw UsageError("--ckpt-dir " + dir + " is a file, not a directory. Fix: another --ckpt-dir");
  }
  std::optional<std::string> newest;
  try {
    if (fs::is_directory(dir, ec)) newest = newest_checkpoint(dir);
  } catch (const c10::Error& e) {
    throw UsageError("--ckpt-dir " + dir + ": " + one_line(e.what_without_backtrace()) +
                     ". Fix: write the name of a step-N folder of " + dir + " into " + dir + "/latest");
  }
  if (!always && !(automatic && newest)) {
    if (newest) {
      throw UsageError("--ckpt-dir " + dir + " already holds checkpoints (the newest: " + *newest +
                       "); a new run would mix its checkpoints with theirs. Fix: --resume to continue that run "
                       "(--resume auto: continue if there is a checkpoint, else start a new run), or another "
                       "(empty) --ckpt-dir");
    }
    fs::create_directories(dir, ec);  // now, so that a bad path fails before training (every rank: idempotent)
    if (!fs::is_directory(dir) || access(dir.c_str(), W_OK) != 0) {
      throw UsageError("--ckpt-dir " + dir + " cannot be created or written" + (ec ? ": " + ec.message() : "") +
                       ". Fix: a writable directory");
    }
    return plan;
  }

  // Resume: --resume, or --resume auto / a restart with a checkpoint in --ckpt-dir.
  plan.resume = true;
  const std::string& who = plan.why;
  if (!fs::is_directory(dir, ec)) {
    throw UsageError("--resume: --ckpt-dir " + dir + " does not exist, so there is no checkpoint to resume from. "
                     "Fix: the --ckpt-dir of the run to continue, --resume auto to start a new run when there is no "
                     "checkpoint, or no --resume to start a new run");
  }
  if (!newest) {
    throw UsageError("--resume: no checkpoint in --ckpt-dir " + dir + " (no 'latest' file and no step-N folder). "
                     "Fix: the --ckpt-dir of the run to continue (runs save there with --ckpt-dir and --ckpt-every), "
                     "--resume auto to start a new run when there is no checkpoint, or no --resume to start a new run");
  }
  const std::string& path = *newest;
  fsdp::dcp::CheckpointInfo info;
  try {
    info = fsdp::dcp::inspect(path);
  } catch (const c10::Error& e) {
    throw UsageError(who + ": the checkpoint " + path + " cannot be read: " + one_line(e.what_without_backtrace()) +
                     ". Fix: restore it, or write the name of an older step-N folder into " + dir + "/latest");
  }
  const auto step_it = info.values.find(kStepKey);
  const auto run_it = info.values.find(kRunKey);
  if (step_it == info.values.end() || run_it == info.values.end()) {
    throw UsageError(who + ": " + path + " is not a train_gpt checkpoint (it has no '" + kStepKey + "' and '" +
                     kRunKey + "'). Fix: the --ckpt-dir of a train_gpt run");
  }
  const nlohmann::json& run = run_it->second;
  const GPTConfig saved = model_from_json(run.at("model"));

  // The model shape: every parameter of the model this run builds against the checkpoint's.
  std::vector<std::string> differ, absent, extra;
  std::unordered_set<std::string> mine;
  {
    GPT model(cfg);  // only its names and shapes are used (train() reseeds the generator before its own)
    auto check = [&](const std::string& name, const torch::Tensor& t) {
      const std::string key = fsdp::kModelPrefix + name;
      mine.insert(key);
      const auto it = info.tensors.find(key);
      if (it == info.tensors.end()) {
        absent.push_back("parameter '" + name + "' has shape " + shape_str(t.sizes()) +
                         " in this model but is not in the checkpoint");
      } else if (it->second.sizes != t.sizes().vec()) {
        differ.push_back("parameter '" + name + "' has shape " + shape_str(it->second.sizes) +
                         " in the checkpoint but " + shape_str(t.sizes()) + " in this model");
      }
    };
    for (const auto& p : model->named_parameters()) check(p.key(), p.value());
    for (const auto& b : model->named_buffers()) check(b.key(), b.value());
  }
  const std::string prefix = fsdp::kModelPrefix;
  for (const auto& [key, t] : info.tensors) {
    if (key.rfind(prefix, 0) == 0 && !mine.count(key)) {
      extra.push_back("the checkpoint has parameter '" + key.substr(prefix.size()) + "' of shape " +
                      shape_str(t.sizes) + ", which this model lacks");
    }
  }
  const std::string models = "saved: " + describe(saved) + "; this run: " + describe(cfg);
  for (auto* problems : {&differ, &absent, &extra}) {
    if (problems->empty()) continue;
    const size_t more = differ.size() + absent.size() + extra.size() - 1;
    throw UsageError(who + ": the checkpoint " + path + " holds a model of another shape: " + problems->front() +
                     (more ? ", and " + std::to_string(more) + " more difference" + (more > 1 ? "s" : "") : "") +
                     " (" + models + "). Fix: resume with the model options of the checkpoint (--model, --n-layer, "
                     "--n-head, --n-embd, --block-size, --tie-weights), or start a new run in another --ckpt-dir");
  }
  if (saved.n_head != cfg.n_head || saved.tie_weights != cfg.tie_weights || saved.vocab_size != cfg.vocab_size) {
    throw UsageError(who + ": the checkpoint " + path + " holds another model (" + models +
                     "). Fix: resume with the model options of the checkpoint (--n-head " +
                     std::to_string(saved.n_head) + " --tie-weights " + (saved.tie_weights ? "true" : "false") +
                     "), or start a new run in another --ckpt-dir");
  }
  // The data position is an index into this run's training windows: the same data, split and seed.
  const auto saved_windows = run.at("train_windows").get<int64_t>();
  if (saved_windows != train_windows) {
    throw UsageError(who + ": the checkpoint " + path + " was trained on " + std::to_string(saved_windows) +
                     " training windows, this run's data has " + std::to_string(train_windows) +
                     ": its data position would point elsewhere. Fix: resume with the checkpoint's --data and "
                     "--val-fraction");
  }
  const auto saved_seed = run.at("seed").get<uint64_t>();
  if (saved_seed != o.seed) {
    throw UsageError(who + ": the checkpoint " + path + " was trained with --seed " + std::to_string(saved_seed) +
                     ", this run has --seed " + std::to_string(o.seed) + " (the data order depends on it). Fix: --seed " +
                     std::to_string(saved_seed));
  }
  const auto step = step_it->second.get<int64_t>();
  // --resume auto, a restart: a checkpoint at or past this run's last step means the run is done (e.g.
  // a rank failed after the last checkpoint): load it and train nothing, instead of failing again.
  const int64_t last_step = o.stop_at > 0 ? std::min(o.stop_at, o.steps) : o.steps;
  if (automatic && !always && step >= last_step) {
    plan.complete = true;
    return plan;
  }
  if (step >= o.steps) {
    throw UsageError(who + ": the checkpoint " + path + " is at step " + std::to_string(step) + " and --steps is " +
                     std::to_string(o.steps) + ": nothing left to train. Fix: a larger --steps (the learning-rate " +
                     "schedule spans --steps)");
  }
  if (o.stop_at > 0 && o.stop_at <= step) {
    throw UsageError("--stop-at " + std::to_string(o.stop_at) + " is not after the checkpoint's step " +
                     std::to_string(step) + " (" + path + "). Fix: --stop-at > " + std::to_string(step));
  }
  return plan;
}

torch::Tensor get_rng_state() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_rng_state(const torch::Tensor& state) {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

/// Saves DIR/step-N (collective: every rank writes its shards). Returns the folder.
std::string save_checkpoint(const Options& o, const nlohmann::json& run_info, int64_t step, const GPTImpl& model,
                            const torch::optim::Optimizer& optimizer, const DistributedSampler& sampler,
                            const std::optional<fsdp::ShardedGradScaler>& scaler, const nlohmann::json& first_eval) {
  auto sd = fsdp::get_state_dict(model, optimizer);  // DTensors aliasing this rank's shards: no copy
  const auto pos = sampler.state();
  sd.insert_or_assign(kStepKey, fsdp::Value(step));
  sd.insert_or_assign(kSamplerKey, fsdp::Value(nlohmann::json{{"epoch", pos.epoch}, {"cursor", pos.cursor}}));
  sd.insert_or_assign(kRngKey, get_rng_state());
  sd.insert_or_assign(kScalerKey, fsdp::Value(scaler ? nlohmann::json{{"scale", scaler->get_scale()},
                                                                       {"growth_tracker", scaler->growth_tracker()}}
                                                     : nlohmann::json(nullptr)));
  sd.insert_or_assign(kRunKey, fsdp::Value(run_info));
  sd.insert_or_assign(kFirstEvalKey, fsdp::Value(first_eval));
  const std::string path = (std::filesystem::path(o.ckpt_dir) / ("step-" + std::to_string(step))).string();
  // overwrite: a resumed run may repeat a step of a checkpoint newer than the one `latest` named.
  fsdp::dcp::save(sd, path, fsdp::dcp::SaveOptions().keep_last(o.keep_last).overwrite(true));
  return path;
}

/// --resume: loads the checkpoint `path` into the model and the optimizer (resharded to this run's
/// ranks), the sampler, the global generator and the loss scaler. Collective. Returns the step it was
/// saved after; `run_info` gets its train.run, `first_eval` its train.first_eval (null when the
/// checkpoint predates that key, or the run had not evaluated yet).
int64_t load_checkpoint(const std::string& path, GPTImpl& model, torch::optim::Optimizer& optimizer,
                        DistributedSampler& sampler, std::optional<fsdp::ShardedGradScaler>& scaler,
                        const fsdp::ProcessGroupPtr& pg, nlohmann::json& run_info, nlohmann::json& first_eval) {
  auto sd = fsdp::get_state_dict(model, optimizer);  // the destinations, in this run's layout
  auto rng = get_rng_state();
  std::vector<const char*> values{kStepKey, kSamplerKey, kScalerKey, kRunKey};
  if (fsdp::dcp::inspect(path).values.count(kFirstEvalKey)) values.push_back(kFirstEvalKey);
  for (const char* key : values) sd.insert_or_assign(key, fsdp::Value());
  sd.insert_or_assign(kRngKey, rng);
  fsdp::dcp::load(sd, path);  // verified on every rank before anything is written
  auto value = [&](const char* key) { return std::get<fsdp::Value>(sd.at(key)).json; };
  const auto step = value(kStepKey).get<int64_t>();
  const auto pos = value(kSamplerKey);
  const auto scale = value(kScalerKey);
  run_info = value(kRunKey);
  first_eval = sd.contains(kFirstEvalKey) ? value(kFirstEvalKey) : nlohmann::json(nullptr);
  for (const char* key : values) sd.erase(key);
  sd.erase(kRngKey);
  fsdp::set_state_dict(model, optimizer, sd);  // step counts, hyper-parameters, the optimizer state it creates
  sampler.set_state({pos.at("epoch").get<int64_t>(), pos.at("cursor").get<int64_t>()});
  set_rng_state(rng);
  if (scaler && !scale.is_null()) {
    scaler.emplace(fsdp::GradScalerOptions().init_scale(scale.at("scale").get<double>()), pg);
    // ShardedGradScaler has no setter for its growth tracker; update() after no inf counts one finite
    // step, and the tracker is below growth_interval (it resets when it reaches it).
    for (int64_t i = 0; i < scale.at("growth_tracker").get<int64_t>(); ++i) scaler->update();
  }
  return step;
}

/// Fault injection for the restart test (tests/python/test_regressions_train_gpt.py):
/// TRAIN_GPT_TEST_KILL_AFTER_CHECKPOINT=STEP:RANK makes rank RANK kill itself with SIGKILL (what
/// `kill -9` does: no handler, no cleanup) right after the checkpoint of step STEP is complete, on the
/// first attempt only (TORCHELASTIC_RESTART_COUNT 0 or unset), so that the launcher's restart has a
/// checkpoint to resume from at a known step. Unset: nothing.
std::optional<std::pair<int64_t, int>> kill_after_checkpoint(int restart) {
  const char* v = std::getenv("TRAIN_GPT_TEST_KILL_AFTER_CHECKPOINT");
  if (!v || !*v || restart > 0) return std::nullopt;
  long long step = 0;
  int rank = 0;
  char extra = 0;
  if (std::sscanf(v, "%lld:%d%c", &step, &rank, &extra) != 2) {
    throw UsageError(std::string("TRAIN_GPT_TEST_KILL_AFTER_CHECKPOINT=") + v + ": expected STEP:RANK. Fix: unset it");
  }
  return std::make_pair(static_cast<int64_t>(step), rank);
}

int train(const RunSetup& s, const fsdp::ProcessGroupPtr& pg) {
  const Options& o = s.opts;
  const int rank = pg->rank(), world = pg->size();
  const bool main_rank = rank == 0;
  if (o.threads > 0) torch::set_num_threads(o.threads);
  auto say = [&](const std::string& line) {
    if (main_rank) std::cout << line << std::endl;
  };
  const torch::Device device = pg->device();
  auto mesh = fsdp::init_device_mesh(device.type(), {world});

  // Identical initial weights on every rank (and for every world size): one seed, full model, then shard.
  torch::manual_seed(o.seed);
  fsdp::FSDPModule<GPT> model(GPT(s.cfg));
  // AdamW groups: weight decay on matrices and embeddings (dim >= 2), not on biases and LayerNorms.
  // Decided on the full shapes, before sharding; fully_shard keeps the tensors' identity.
  std::vector<torch::Tensor> decay, no_decay;
  for (const auto& p : model->unique_parameters()) (p.dim() >= 2 ? decay : no_decay).push_back(p);
  const int64_t num_params = model->num_params();
  if (!o.save_init.empty() && main_rank) save_initial_weights(*model, o.save_init);

  // Built on the CPU from the seed (identical weights on every device), then moved to this rank's device
  // (with --cpu-offload the shards stay on the CPU: fully_shard puts them in pinned host memory).
  if (device.is_cuda() && !o.cpu_offload) model->to(device);
  if (!o.no_shard) parallelize(model, mesh, s.parallel);
  // --no-shard (the floor): mixed precision the plain-LibTorch way, by autocast around the forward.
  auto forward = [&](const torch::Tensor& x) {
    if (!o.no_shard || s.parallel.param_dtype == torch::kFloat32) return model(x);
    CpuAutocast autocast(s.parallel.param_dtype, device.type());
    return model(x);
  };
  std::optional<BatchRecorder> recorder;
  if (!o.dump_batches.empty()) recorder.emplace(o.dump_batches);

  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, std::make_unique<torch::optim::AdamWOptions>(
                                 torch::optim::AdamWOptions(o.lr).betas({0.9, 0.95}).weight_decay(o.weight_decay)));
  groups.emplace_back(no_decay, std::make_unique<torch::optim::AdamWOptions>(
                                    torch::optim::AdamWOptions(o.lr).betas({0.9, 0.95}).weight_decay(0.0)));
  torch::optim::AdamW optimizer(std::move(groups), torch::optim::AdamWOptions(o.lr));
  const auto params = model->unique_parameters();  // local shards: what clipping sees
  // fp16 only: dynamic loss scaling, so that small gradients do not flush to zero in fp16. Every rank
  // skips the same steps (the inf/nan check is all-reduced). bf16 has fp32's range and needs none.
  std::optional<fsdp::ShardedGradScaler> scaler;
  if (s.parallel.param_dtype == torch::kHalf) scaler.emplace(fsdp::GradScalerOptions(), pg);
  // fp16's scaler steps torch::optim::AdamW itself.
  const bool foreach_optimizer =
      !scaler && (o.optimizer_impl == "foreach" || (o.optimizer_impl == "auto" && device.is_cuda()));

  DistributedSampler sampler(s.train.size(), o.batch_size, rank, world, o.seed);
  const int64_t tokens_per_step = o.batch_size * s.cfg.block_size * o.grad_accum_steps;  // per rank
  const auto kill_at = kill_after_checkpoint(s.resume.restart);

  {
    std::ostringstream os;
    os << "train_gpt: " << world << " rank" << (world > 1 ? "s" : "") << " x " << torch::get_num_threads()
       << " thread" << (torch::get_num_threads() > 1 ? "s" : "") << " (" << pg->backend()->getBackendName()
       << " on " << device.str() << ")\n"
       << "model: " << o.model << ": " << describe(s.cfg) << ", " << fmt("%.2f", num_params / 1e6)
       << "M parameters, sharded over " << world << " rank" << (world > 1 ? "s" : "") << "\n"
       << "data: " << s.data_name << ", " << s.data_bytes << " bytes: train " << s.train.size()
       << " windows, val " << s.val.size() << " windows of " << s.cfg.block_size + 1 << " bytes; "
       << sampler.batches_per_epoch() / o.grad_accum_steps << " steps per epoch\n"
       << "batch: " << o.batch_size << " x " << s.cfg.block_size << " tokens x " << o.grad_accum_steps
       << " microbatch" << (o.grad_accum_steps > 1 ? "es" : "") << " x " << world << " ranks = "
       << tokens_per_step * world << " tokens per step\n"
       << "optim: AdamW lr " << fmt("%.2e", o.lr) << " -> " << fmt("%.2e", o.min_lr) << " (warmup " << o.warmup_steps
       << ", cosine), weight decay " << o.weight_decay << ", clip "
       << (o.clip_grad > 0 ? fmt("%g", o.clip_grad) : std::string("off")) << (foreach_optimizer ? ", foreach kernels" : "")
       << "; precision " << o.mixed_precision
       << ", reshard after forward " << o.reshard_after_forward << (o.cpu_offload ? ", cpu offload" : "")
       << (o.activation_checkpointing ? ", activation checkpointing" : "");
    say(os.str());
  }

  // [checkpoints] --resume: load the latest step-N checkpoint here (model, optimizer, sampler.state(),
  // step, RNG), before the first evaluation; the loop below then starts at step N + 1.
  int64_t start_step = 0;
  const nlohmann::json ckpt_run = checkpoint_run_info(o, s.cfg, s.train.size(), world);
  // --stop-at: this run's last step (the learning-rate schedule still spans --steps).
  const int64_t last_step = o.stop_at > 0 ? std::min(o.stop_at, o.steps) : o.steps;
  // The run's first evaluation (before its first step), carried in checkpoints so that a resumed run
  // reports the whole run's progress; and the last one.
  std::optional<std::pair<int64_t, double>> first_eval, last_eval;
  if (s.resume.resume) {
    const auto t_load = Clock::now();
    const std::string path = *newest_checkpoint(o.ckpt_dir);  // checked in run()
    nlohmann::json saved, saved_first_eval;
    start_step = load_checkpoint(path, *model, optimizer, sampler, scaler, pg, saved, saved_first_eval);
    if (saved_first_eval.is_object()) {
      first_eval = {saved_first_eval.at("step").get<int64_t>(), saved_first_eval.at("loss").get<double>()};
    }
    const auto pos = sampler.state();
    const int saved_world = saved.at("world_size").get<int>();
    say("resume: " + path + " (after step " + std::to_string(start_step) + ", saved on " +
        std::to_string(saved_world) + " rank" + (saved_world > 1 ? "s" : "") + ", loaded on " + std::to_string(world) +
        " in " + fmt("%.2f", seconds_since(t_load)) + " s); data: epoch " + std::to_string(pos.epoch) + ", window " +
        std::to_string(pos.cursor) + " of " + std::to_string(s.train.size()) + "; " +
        (s.resume.complete ? "nothing left to train (step " + std::to_string(start_step) + " of " +
                                 std::to_string(last_step) + " done)"
                           : "continuing at step " + std::to_string(start_step + 1) + "/" + std::to_string(o.steps)) +
        (s.resume.why == "--resume" ? std::string() : " [" + s.resume.why + "]"));
  }

  MetricsWriter metrics(main_rank ? o.metrics : std::string(), s.resume.resume ? start_step : -1);
  ProgressBar bar(main_rank && !o.no_progress && isatty(STDOUT_FILENO), o.steps);
  auto run_eval = [&](int64_t step) {
    double v = evaluate(model, s.val, s.eval_batches, o.batch_size, *pg);
    if (!first_eval) first_eval = {step, v};
    last_eval = {step, v};
    bar.clear();
    say("eval step " + std::to_string(step) + ": val loss " + fmt("%.4f", v));
    return v;
  };
  // A collective (all-reduce MAX): every rank calls it at the same steps (log and evaluation steps).
  auto global_peak_mb = [&] {
    auto t = torch::tensor({peak_rss_mb()}, torch::kDouble).to(device);
    fsdp::all_reduce(t, *pg, fsdp::ReduceOp::MAX);
    return t.item<double>();
  };
  auto global_peak_gpu_mb = [&] {
    auto t = torch::tensor({peak_gpu_mem_mb(device)}, torch::kDouble).to(device);
    fsdp::all_reduce(t, *pg, fsdp::ReduceOp::MAX);
    return t.item<double>();
  };
  const double model_flops_per_token = flops_per_token(s.cfg, num_params);
  // Model FLOPs utilisation of the GPUs: per rank, FLOPs per token x tokens/s / the GPU's peak.
  auto mfu = [&](double tokens_per_s_per_rank) -> nlohmann::json {
    if (!device.is_cuda()) return nullptr;
    return model_flops_per_token * tokens_per_s_per_rank / (o.peak_tflops * 1e12);
  };

  // The evaluation before training (the "first" evaluation loss): ~ln(256) = 5.55 for a fresh model.
  if (start_step == 0) {
    double v = run_eval(0);
    metrics.write({{"step", 0}, {"loss", nullptr}, {"lr", 0.0}, {"grad_norm", nullptr}, {"tokens_per_s", nullptr},
                   {"step_ms", nullptr}, {"peak_rss_mb", global_peak_mb()},
                   {"peak_gpu_mem_mb", global_peak_gpu_mb()}, {"mfu", nullptr}, {"eval_loss", v}});
  }

  const auto t_train = Clock::now();
  double train_seconds = 0;       // step time only (no evaluation, logging or sampling)
  double interval_seconds = 0;    // since the last log line
  double interval_loss = 0;
  int64_t interval_steps = 0;
  double last_loss = 0, last_norm = 0;
  for (int64_t step = start_step + 1; step <= last_step; ++step) {
    const auto t0 = Clock::now();
    const double lr = lr_at(step, o);
    for (auto& group : optimizer.param_groups()) static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);

    // Gradient accumulation: the gradients of every microbatch but the last stay local and unsharded
    // (no reduce-scatter); the last backward reduce-scatters the accumulated sum once.
    auto loss_sum = torch::zeros({1}, torch::TensorOptions().device(device));
    for (int64_t micro = 0; micro < o.grad_accum_steps; ++micro) {
      auto [x, y] = s.train.get(sampler.next());
      if (recorder) recorder->add(x, y);
      x = x.to(device, /*non_blocking=*/false);
      y = y.to(device, /*non_blocking=*/false);
      if (!o.no_shard) model.set_requires_gradient_sync(micro == o.grad_accum_steps - 1);
      auto loss = lm_loss(forward(x), y) / static_cast<double>(o.grad_accum_steps);
      (scaler ? scaler->scale(loss) : loss).backward();
      loss_sum += loss.detach();
    }
    // The norm of the full gradient (an all-reduce of the shards' partial norms): identical on every
    // rank, so every rank scales its shard by the same factor.
    // With fp16 the gradients are unscaled first; a step with inf/nan gradients is skipped (the norm
    // logged is then inf) and the scale backs off.
    const double max_norm = o.clip_grad > 0 ? o.clip_grad : std::numeric_limits<double>::infinity();
    if (scaler) scaler->unscale_(optimizer);
    last_norm = fsdp::clip_grad_norm_(params, max_norm).item<double>();
    if (scaler) {
      scaler->step(optimizer);
      scaler->update();
    } else if (foreach_optimizer) {
      foreach_adamw_step(optimizer);
    } else {
      optimizer.step();
    }
    optimizer.zero_grad();
    // The loss of the global batch: the mean of the ranks' means (equal batch sizes).
    fsdp::all_reduce(loss_sum, *pg, fsdp::ReduceOp::SUM);
    last_loss = loss_sum.item<double>() / world;
    if (!std::isfinite(last_loss)) {
      bar.clear();
      throw std::runtime_error("the loss is " + std::to_string(last_loss) + " at step " + std::to_string(step) +
                               ": training diverged. Fix: a lower --lr, --clip-grad 1, or fp32");
    }
    const double dt = seconds_since(t0);
    train_seconds += dt;
    interval_seconds += dt;
    interval_loss += last_loss;
    ++interval_steps;
    bar.update(step, last_loss, train_seconds / static_cast<double>(step - start_step));

    const bool log_now = step % o.log_every == 0 || step == o.steps;
    const bool eval_now = step % o.eval_every == 0 || step == o.steps;
    if (log_now || eval_now) {
      const double mean_loss = interval_loss / static_cast<double>(interval_steps);
      const double step_ms = 1e3 * interval_seconds / static_cast<double>(interval_steps);
      const double tps = static_cast<double>(tokens_per_step * interval_steps) / interval_seconds;  // per rank
      const double peak = global_peak_mb();
      const double peak_gpu = global_peak_gpu_mb();
      nlohmann::json line = {{"step", step},          {"loss", mean_loss},    {"lr", lr},
                             {"grad_norm", last_norm}, {"tokens_per_s", tps},  {"step_ms", step_ms},
                             {"peak_rss_mb", peak},   {"peak_gpu_mem_mb", peak_gpu}, {"mfu", mfu(tps)}};
      bar.clear();
      std::ostringstream os;
      os << "step " << std::setw(std::to_string(o.steps).size()) << step << "/" << o.steps << " | loss "
         << fmt("%.4f", mean_loss) << " | lr " << fmt("%.2e", lr) << " | grad norm " << fmt("%.3f", last_norm)
         << " | " << fmt("%.0f", tps) << " tok/s/rank | " << fmt("%.0f", step_ms) << " ms/step | peak "
         << fmt("%.0f", peak) << " MiB";
      if (device.is_cuda()) {
        os << " | GPU peak " << fmt("%.0f", peak_gpu) << " MiB | MFU " << fmt("%.1f", 100.0 * mfu(tps).get<double>())
           << "%";
      }
      say(os.str());
      if (eval_now) line["eval_loss"] = run_eval(step);
      metrics.write(line);
      interval_seconds = interval_loss = 0;
      interval_steps = 0;
    }
    // [checkpoints] --ckpt-every K: save step-N here (after the step and its evaluation), every rank
    // writing its shards; --keep-last N prunes the oldest. Also after this run's last step.
    if (!o.ckpt_dir.empty() && (step == last_step || (o.ckpt_every > 0 && step % o.ckpt_every == 0))) {
      const auto t_save = Clock::now();
      const nlohmann::json first =
          first_eval ? nlohmann::json{{"step", first_eval->first}, {"loss", first_eval->second}} : nlohmann::json();
      const std::string path = save_checkpoint(o, ckpt_run, step, *model, optimizer, sampler, scaler, first);
      bar.clear();
      say("checkpoint: " + path + " saved in " + fmt("%.2f", seconds_since(t_save)) + " s");
      if (kill_at && kill_at->first == step && kill_at->second == rank) {
        std::cout.flush();
        ::kill(::getpid(), SIGKILL);
      }
    }
  }
  bar.clear();
  // A resumed run that had nothing left to train still reports where the model stands.
  if (!last_eval && start_step > 0 && start_step >= last_step) run_eval(start_step);
  if (last_step < o.steps) {
    say("stopped after step " + std::to_string(last_step) + " of " + std::to_string(o.steps) + " (--stop-at)" +
        (o.ckpt_dir.empty() ? std::string() : ": continue with --resume --ckpt-dir " + o.ckpt_dir));
  }
  const double wall = seconds_since(t_train);
  if (recorder) recorder->write(rank, o.grad_accum_steps, run_description(s, world, start_step));

  // The sample: every rank runs the forwards, rank 0 prints.
  std::string sample;
  if (o.sample_tokens > 0) sample = generate(model, o.sample_prompt, o.sample_tokens, o.temperature, o.top_k, o.seed, *pg);
  if (main_rank) {
    const int64_t steps_run = last_step - start_step;
    std::ostringstream os;
    os << "done: " << steps_run << " steps in " << fmt("%.1f", wall) << " s ("
       << fmt("%.0f", 1e3 * train_seconds / std::max<int64_t>(steps_run, 1)) << " ms/step, "
       << fmt("%.0f", static_cast<double>(tokens_per_step * steps_run) / std::max(train_seconds, 1e-9))
       << " tok/s/rank, " << fmt("%.0f", static_cast<double>(tokens_per_step * steps_run * world) /
                                             std::max(train_seconds, 1e-9))
       << " tok/s in all)\n";
    if (device.is_cuda()) {
      const double tps = static_cast<double>(tokens_per_step * steps_run) / std::max(train_seconds, 1e-9);
      os << "gpu: peak " << fmt("%.0f", peak_gpu_mem_mb(device)) << " MiB allocated (rank 0), MFU "
         << fmt("%.1f", 100.0 * mfu(tps).get<double>()) << "% of " << fmt("%.0f", o.peak_tflops)
         << " TFLOP/s (" << fmt("%.3g", model_flops_per_token) << " FLOPs per token)\n";
    }
    // The run's first evaluation (restored from the checkpoint after a resume) and its last. A run
    // resumed from a checkpoint without train.first_eval that evaluated once shows that one only.
    if (first_eval && last_eval && first_eval->first != last_eval->first) {
      os << "eval loss: " << fmt("%.4f", first_eval->second) << " (step " << first_eval->first << ") -> "
         << fmt("%.4f", last_eval->second) << " (step " << last_eval->first << ")\n";
    } else if (last_eval) {
      os << "eval loss: " << fmt("%.4f", last_eval->second) << " (step " << last_eval->first << ")\n";
    }
    if (o.sample_tokens > 0) {
      os << "sample (seed " << o.seed << ", temperature " << o.temperature << ", top-k " << o.top_k << "):\n"
         << "----\n" << printable(o.sample_prompt + sample) << "\n----";
    }
    std::cout << os.str() << std::endl;
  }
  return 0;
}

/// The process group: from the launcher's environment, or a group of one when started without one.
fsdp::ProcessGroupPtr make_process_group(bool launched, bool cuda) {
  fsdp::InitOptions init;
  init.device_type(cuda ? torch::kCUDA : torch::kCPU);
  if (launched) return fsdp::init_process_group(init);
  if (cuda) {  // one process on cuda:0 without a launcher: NCCL over an in-memory store
    fsdp::LaunchEnv env;
    env.master_addr = "127.0.0.1";
    init.env(env);
    init.store(c10::make_intrusive<c10d::HashStore>());
    return fsdp::init_process_group(init);
  }
  auto pg = fsdp::make_gloo_group(c10::make_intrusive<c10d::HashStore>(), 0, 1, std::chrono::minutes(30));
  fsdp::set_default_process_group(pg);
  return pg;
}

bool launched_by_a_launcher() {
  for (const char* v : {"RANK", "WORLD_SIZE", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"}) {
    if (std::getenv(v)) return true;
  }
  return false;
}

int run(int argc, char** argv) {
  CLI::App app{"train_gpt: trains a GPT-2-style byte-level language model on English text with FSDP2 (libfsdp).\n"
               "Launch: fsdprun --standalone --nproc-per-node N -- train_gpt [OPTIONS]"};
  Options o;
  add_flags(app, o);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    // One line, like every other usage error (CLI11 adds "Run with --help ..." on a second line).
    // Our checks of flag values say what they expect; other parse errors (an unknown flag, a missing
    // value) point to --help.
    const bool says_expected = dynamic_cast<const CLI::ValidationError*>(&e) != nullptr;
    throw UsageError(one_line(e.what()) + (says_expected ? "" : ". Fix: see train_gpt --help"));
  }

  // Everything that can be wrong with the input is checked here, identically on every rank and before
  // any communication: a bad flag fails every rank with the same message instead of hanging the others.
  const bool launched = launched_by_a_launcher();
  const fsdp::LaunchEnv env = launched ? fsdp::read_launch_env() : fsdp::LaunchEnv{};
  RunSetup s{o, model_config(o), {}, TokenWindows(torch::zeros({1}, torch::kLong), 1),
             TokenWindows(torch::zeros({1}, torch::kLong), 1), 0, "", 0};
  if (o.mixed_precision == "bf16") s.parallel.param_dtype = torch::kBFloat16;
  if (o.mixed_precision == "fp16") s.parallel.param_dtype = torch::kHalf;
  s.parallel.activation_checkpointing = o.activation_checkpointing;
  s.parallel.reshard_after_forward = parse_reshard_after_forward(o.reshard_after_forward, env.world_size);
  s.parallel.cpu_offload = o.cpu_offload;
  if (o.min_lr > o.lr) {
    throw UsageError("--min-lr " + fmt("%g", o.min_lr) + " exceeds --lr " + fmt("%g", o.lr) +
                     ": the cosine schedule decays from --lr to --min-lr. Fix: --min-lr <= --lr");
  }

  Corpus corpus = o.data.empty() ? load_default_corpus() : load_corpus(o.data);
  const int64_t T = s.cfg.block_size;
  if (static_cast<int64_t>(corpus.text.size()) < T + 1) {
    throw UsageError("the text (" + corpus.name + ") has " + std::to_string(corpus.text.size()) +
                     " bytes, shorter than one block of --block-size + 1 = " + std::to_string(T + 1) +
                     " bytes. Fix: more text or a smaller --block-size");
  }
  // Segments of 8 windows alternate between the splits (see split_text).
  auto split = split_text(corpus.text, o.val_fraction, 8 * (T + 1));
  s.train = TokenWindows(split.train, T);
  s.val = TokenWindows(split.val, T);
  s.data_name = corpus.name;
  s.data_bytes = static_cast<int64_t>(corpus.text.size());
  const int64_t global_batch = o.batch_size * env.world_size;
  if (s.train.size() < global_batch) {
    DistributedSampler(s.train.size(), o.batch_size, env.rank, env.world_size, o.seed);  // throws the message
  }
  s.eval_batches = std::min(o.eval_batches, s.val.size() / global_batch);
  if (s.eval_batches == 0) {
    throw UsageError("the validation split has " + std::to_string(s.val.size()) + " windows of " +
                     std::to_string(T + 1) + " bytes but one evaluation batch needs --batch-size(" +
                     std::to_string(o.batch_size) + ") x ranks(" + std::to_string(env.world_size) +
                     ") = " + std::to_string(global_batch) + ": more ranks than batches. Fix: more text, a larger "
                     "--val-fraction, a smaller --batch-size or --block-size, or fewer ranks");
  }
  if (!o.metrics.empty() && env.rank == 0) MetricsWriter::probe(o.metrics);  // fails now, not after training
  if (o.no_shard) check_no_shard(o, env.world_size);
  s.resume = check_checkpoint_options(o, s.cfg, s.train.size(), env.restart_count);  // [checkpoints]

  bool cuda = o.device.empty() ? torch::cuda::is_available() : o.device == "cuda";
  if (cuda && !torch::cuda::is_available()) {
    throw UsageError("--device cuda: no CUDA device is usable (torch::cuda::is_available() is false" +
                     std::string(FSDP_WITH_CUDA ? "" : "; this train_gpt is built against a CPU-only LibTorch") +
                     "). Fix: --device cpu, or run on a machine with an NVIDIA GPU and a CUDA build (scripts/setup.sh)");
  }
  if (cuda && env.local_rank >= static_cast<int>(torch::cuda::device_count())) {
    throw UsageError("--device cuda: LOCAL_RANK " + std::to_string(env.local_rank) + " but only " +
                     std::to_string(torch::cuda::device_count()) + " CUDA device(s). Fix: --nproc-per-node <= " +
                     std::to_string(torch::cuda::device_count()));
  }
  auto pg = make_process_group(launched, cuda);
  const int rc = train(s, pg);
  // Before exit: a NCCL group left to static destruction can crash the exit (after CUDA's teardown).
  fsdp::destroy_process_group(pg);
  return rc;
}

}  // namespace
}  // namespace train_gpt

int main(int argc, char** argv) {
  try {
    const int rc = train_gpt::run(argc, argv);
    // On CUDA, skip static destruction: on an H200 (PyTorch 2.11, NCCL 2.28) train_gpt finished, wrote its
    // metrics and then died with SIGSEGV at exit under fsdprun, which a launcher reads as a failed run
    // (and restarts). Everything the run wrote is flushed and closed by now. Not yet verified on a GPU:
    // see docs/BENCHMARKS.md, GPU.
    if (torch::cuda::is_available()) {
      std::cout.flush();
      std::cerr.flush();
      std::_Exit(rc);
    }
    return rc;
  } catch (const train_gpt::UsageError& e) {
    std::cerr << "train_gpt: error: " << e.what() << std::endl;
    return 2;
  } catch (const c10::Error& e) {
    std::cerr << "train_gpt: error: " << e.what_without_backtrace() << std::endl;
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "train_gpt: error: " << e.what() << std::endl;
    return 1;
  }
}
