// What train_gpt prints and writes about a run, on rank 0: the banner, the log lines and the progress
// bar, the --metrics JSON lines, memory peaks and the model FLOPs utilisation, and the summary.
#pragma once

#include <cstdint>
#include <fstream>
#include <functional>
#include <optional>
#include <string>
#include <utility>

#include <nlohmann/json.hpp>

#include "fsdp/fsdp.h"
#include "options.h"

namespace train_gpt {

/// Peak resident memory of this process (VmHWM), MiB.
double peak_rss_mb();
/// Resident memory of this process now (VmRSS), MiB.
double current_rss_mb();
/// Peak GPU memory of this process on `device` so far (MiB): the CUDA caching allocator's peak of allocated
/// bytes (torch.cuda.max_memory_allocated); 0 on a CPU device.
double peak_gpu_mem_mb(const torch::Device& device);
/// Model FLOPs per trained token (forward and backward): 6 per parameter (PaLM's appendix B, the
/// embeddings' lookups included as matmuls for simplicity) plus the attention scores and values,
/// 12 * layers * width * context (6 * 2 matmuls of T x d per token, causal masking not discounted).
/// Llama (cfg.arch "llama"): torchtitan's count, 6 x (parameters - an untied embedding: a lookup) + 12 x layers x
/// heads x head_dim x context.
double flops_per_token(const GPTConfig& c, int64_t num_params);
/// `bytes` as printable UTF-8: a byte-level model can emit ill-formed sequences and control bytes,
/// which become U+FFFD (newlines and tabs stay).
std::string printable(const std::string& bytes);

/// A pipelined run's layout for the log: "pp 2 x dp 2", "pp 2 x dp 1 x tp 2, sequence parallel",
/// "pp 2 x dp 4, dp = dp_replicate 2 x dp_shard 2".
std::string pipeline_layout(const ParallelOptions& p);

/// A one-line progress bar with ETA on rank 0, only when stdout is a terminal.
class ProgressBar {
 public:
  ProgressBar(bool enabled, int64_t total) : enabled_(enabled), total_(total) {}
  void update(int64_t step, double loss, double seconds_per_step);
  /// Erases the bar so that a log line can be printed in its place.
  void clear();

 private:
  bool enabled_;
  int64_t total_;
  bool shown_ = false;
};

/// JSON lines on rank 0: one per log step and per evaluation step, each with every key (values null
/// where not measured: the evaluation before training has no training loss).
class MetricsWriter {
 public:
  MetricsWriter() = default;
  /// A new run truncates `path`. A resumed run (keep_through_step >= 0) keeps the lines of the steps up
  /// to its checkpoint's and drops the later ones (written by the attempt that failed after it, and
  /// about to be trained again), so that a run restarted with the same --metrics FILE leaves one line
  /// per step in FILE. An empty `path` writes nothing.
  explicit MetricsWriter(const std::string& path, int64_t keep_through_step = -1);
  /// Throws UsageError now (not after training) if `path` cannot be written; leaves its content.
  static void probe(const std::string& path);
  void write(const nlohmann::json& line);

 private:
  std::ofstream out_;
};

/// The run's output. Every rank holds one and makes the same calls (the memory peaks in log lines and
/// metrics are all-reduced over the ranks); only rank 0 prints and writes.
class Reporter {
 public:
  Reporter(const RunSetup& s, int64_t num_params, fsdp::ProcessGroupPtr pg);
  /// Prints `line` on rank 0, in place of the progress bar.
  void say(const std::string& line);
  /// The banner: ranks, threads and backend, model, data, batch, optimizer and parallelism.
  void banner(int64_t steps_per_epoch, bool foreach_optimizer);
  /// Opens --metrics; a resumed run keeps the lines through `keep_through_step` (see MetricsWriter).
  void open_metrics(int64_t keep_through_step);
  /// Also report, per step, each of these groups' collectives ("comm_per_step": {name: {kind: {count,
  /// sent}}}; a multi-dimensional mesh's dims: FSDP's and TP's collectives run on them, not on the world).
  void watch_groups(std::vector<std::pair<std::string, fsdp::ProcessGroupPtr>> groups);
  /// The run's first evaluation, restored from a checkpoint (null: none).
  void restore_first_eval(const nlohmann::json& first_eval);
  /// The run's first evaluation as a checkpoint saves it: {step, loss}, or null.
  nlohmann::json first_eval_json() const;
  bool evaluated() const { return last_eval_.has_value(); }
  /// An evaluation's loss: printed, and kept as the run's first (when none is known) and last.
  void eval(int64_t step, double loss);
  /// The metrics line of the evaluation before training (step 0). Collective.
  void initial_metrics(double eval_loss);
  /// After `step` took `seconds` (with learning rate `lr`): the progress bar; on log and evaluation
  /// steps a log line and a metrics line, with `evaluate()`'s loss on evaluation steps. Collective on
  /// those steps. Throws std::runtime_error when the loss is not finite (training diverged).
  void step(int64_t step, double lr, double loss, double grad_norm, double seconds,
            const std::function<double()>& evaluate);
  /// After the last step: erases the progress bar; the --stop-at note when the run stopped early.
  void end_of_training(int64_t last_step);
  /// The end: steps run, throughput, GPU memory and MFU, the first and last
  /// evaluation loss and the sample (`sample`: the generated bytes after --sample-prompt).
  void summary(int64_t start_step, int64_t last_step, double wall_seconds, const std::string& sample);

 private:
  /// Global peaks over the ranks (an all-reduce MAX each).
  double global_peak_mb();
  double global_peak_gpu_mb();
  /// Model FLOPs utilisation of the GPUs: per rank, FLOPs per token x tokens/s / the GPU's peak; null on a CPU.
  nlohmann::json mfu(double tokens_per_s_per_rank) const;

  const RunSetup& s_;
  const Options& o_;
  fsdp::ProcessGroupPtr pg_;
  torch::Device device_;
  bool main_rank_;
  int64_t num_params_;
  int64_t tokens_per_step_;  // per rank
  double flops_per_token_;
  ProgressBar bar_;
  MetricsWriter metrics_;
  std::optional<std::pair<int64_t, double>> first_eval_, last_eval_;  // {step, loss}
  double train_seconds_ = 0;     // step time only (no evaluation, logging or sampling)
  double interval_seconds_ = 0;  // since the last log line
  double interval_loss_ = 0;
  int64_t interval_steps_ = 0;
  int64_t steps_timed_ = 0;  // steps of this run so far (the ETA's denominator)
  /// Communication and page-fault counters at the start of the current log interval (see mark_interval).
  struct Marks {
    double sent = 0, all_gather = 0, reduce_scatter = 0, wait_seconds = 0;
    long minor_faults = 0;
  } marks_;
  /// The mesh's groups (watch_groups) and their counters at the start of the interval.
  std::vector<std::pair<std::string, fsdp::ProcessGroupPtr>> groups_;
  std::vector<fsdp::CommStats> group_marks_;
  /// Starts a log interval: reads the counters after the reporting's own collectives (peaks, evaluation),
  /// so that the per-step figures in the metrics count the training step's collectives only.
  void mark_interval();
};

}  // namespace train_gpt
