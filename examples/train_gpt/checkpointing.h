// train_gpt's checkpoints: --ckpt-dir, --ckpt-every, --keep-last, --resume, --stop-at.
//
// [checkpoints] --ckpt-dir DIR saves DIR/step-N every --ckpt-every steps and after the run's last step:
// a distributed checkpoint (fsdp::dcp::save: every rank writes its own shards of the model and of the
// optimizer state, atomically; then DIR/latest names it; --keep-last N deletes the oldest). --resume
// loads the newest on any number of ranks: dcp::load reshards the model and the optimizer state to
// this run's ranks. Everything else a resume needs is the same on every rank and independent of the
// world size, so it is saved once (rank 0's) and loads on any world size:
//   train.step         the last step done (the learning rate is a function of the step)
//   train.sampler      the data position {epoch, cursor}: windows handed out to all ranks together (the
//                      sampler is an fsdp::Stateful: train.sampler.epoch, train.sampler.cursor; older
//                      checkpoints' single Value train.sampler still loads)
//   train.rng_state    the global CPU generator (dropout): every rank seeds it alike and draws alike
//   train.grad_scaler  fp16: {scale, growth_tracker} of the loss scaler (null without one)
//   train.run          the model shape, the data size and the seed, checked before a resume starts
//   train.first_eval   {step, loss} of the run's first evaluation (for the summary of a resumed run)
// Tied weights: named_parameters() lists the tied tensor as wte.weight and as lm_head.weight, so the
// model part holds it under both names (two views of one shard, loaded twice with the same bytes); the
// optimizer part keys its state once, by the first name (wte.weight).
// Both --model-impl variants (GPT, PlainGPT) have the same parameter names: a checkpoint saved by one
// resumes in the other.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

#include <nlohmann/json.hpp>

#include "fsdp/fsdp.h"
#include "options.h"

namespace train_gpt {

/// How this run treats the checkpoints in --ckpt-dir, decided by check_checkpoint_options.
struct ResumePlan {
  bool resume = false;    ///< load the newest checkpoint before training
  bool complete = false;  ///< (--resume auto, a restart) it is at or past this run's last step: train nothing
  std::string why;        ///< "--resume", "--resume auto" or "restart N (TORCHELASTIC_RESTART_COUNT=N)"
  int restart = 0;        ///< TORCHELASTIC_RESTART_COUNT (0 without a launcher)
};

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
ResumePlan check_checkpoint_options(const Options& o, const GPTConfig& cfg, int64_t train_windows, int restart);

/// The newest checkpoint in `dir`: the folder DIR/latest names; without a `latest` file, the complete
/// step-N folder (one with its metadata file) with the highest N; nullopt if there is none.
/// Throws c10::Error for a malformed `latest` file.
std::optional<std::string> newest_checkpoint(const std::string& dir);

/// train.run: what a resume must agree with (and what the log reports).
nlohmann::json checkpoint_run_info(const Options& o, const GPTConfig& cfg, int64_t train_windows, int world);

/// Whether to save after `step`: every --ckpt-every steps and after this run's last step (with --ckpt-dir).
bool checkpoint_due(const Options& o, int64_t step, int64_t last_step);

/// Saves DIR/step-N (collective: every rank writes its shards). Returns the folder.
std::string save_checkpoint(const Options& o, const nlohmann::json& run_info, int64_t step, const torch::nn::Module& model,
                            const torch::optim::Optimizer& optimizer, DistributedSampler& sampler,
                            const std::optional<fsdp::ShardedGradScaler>& scaler, const nlohmann::json& first_eval);

/// What resume() restored besides the model, the optimizer, the sampler, the generator and the scaler.
struct Resumed {
  int64_t step = 0;         ///< the step the checkpoint was saved after
  nlohmann::json first_eval;  ///< train.first_eval (null when the checkpoint predates it)
  std::string message;      ///< the "resume: ..." log line
};

/// --resume: loads the newest checkpoint of --ckpt-dir into the model and the optimizer (resharded to
/// this run's ranks), the sampler, the global generator and the loss scaler. Collective.
Resumed resume(const Options& o, const ResumePlan& plan, int64_t train_windows, int64_t last_step, torch::nn::Module& model,
               torch::optim::Optimizer& optimizer, DistributedSampler& sampler,
               std::optional<fsdp::ShardedGradScaler>& scaler, const fsdp::ProcessGroupPtr& pg);

/// Fault injection for the restart tests (tests/python/test_multinode.py, test_elastic.py):
/// TRAIN_GPT_TEST_KILL_AFTER_CHECKPOINT=STEP:RANK makes rank RANK kill itself with SIGKILL (what
/// `kill -9` does: no handler, no cleanup) right after the checkpoint of step STEP is complete, on the
/// first attempt only (TORCHELASTIC_RESTART_COUNT 0 or unset), so that the launcher's restart has a
/// checkpoint to resume from at a known step. STEP:RANK:agent kills the rank's launcher (its parent
/// process, the node's fsdprun) instead: a node lost at a known step. Unset: nothing. Throws UsageError
/// for a malformed value.
struct KillAt {
  int64_t step = 0;
  int rank = 0;
  bool agent = false;  // kill the parent (the node's agent), not this process
};
std::optional<KillAt> kill_after_checkpoint(int restart);
/// Kills this process (or its agent) with SIGKILL when `kill_at` is {step, rank}.
void kill_if_due(const std::optional<KillAt>& kill_at, int64_t step, int rank);
/// Slowing down for the elastic tests: TRAIN_GPT_TEST_STEP_DELAY_MS=N sleeps N ms after every step, so
/// that a tiny model trains as long as a real one does while a node joins (tests/python/test_elastic.py).
void test_step_delay();

}  // namespace train_gpt
