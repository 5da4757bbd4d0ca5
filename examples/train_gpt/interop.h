// What train_gpt writes so that another program can replay its run exactly (bench/gpt_twin.py: the same
// GPT in PyTorch, sharded with PyTorch's own FSDP2; bench/compare_fsdp2.py runs both side by side):
//   --save-init FILE     the full initial weights, before sharding, as safetensors (rank 0);
//   --dump-batches DIR   DIR/rank<R>.safetensors: the int64 token batches rank R trained on, tensor
//                        "batches" of shape [steps, grad_accum_steps, 2 (input, target), batch_size,
//                        block_size]; DIR/run.json: the hyper-parameters the replay needs (rank 0).
// Both written by fsdp::dcp::save_file (safetensors.torch.load_file reads them). And the floor of the
// comparison (--no-shard): plain LibTorch in one process, mixed precision by CPU autocast.
#pragma once

#include <ATen/autocast_mode.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/cuda.h>
#include <torch/torch.h>

#include "data.h"
#include "fsdp/fsdp.h"
#include "model.h"
#include "options.h"

namespace train_gpt {

/// --save-init: the full weights under their named_parameters() names, a tied weight once (as wte.weight),
/// the model shape in the metadata. Call before parallelize(): afterwards each rank holds a shard only.
inline void save_initial_weights(const torch::nn::Module& model, const GPTConfig& c, const std::string& path) {
  std::map<std::string, torch::Tensor> tensors;
  std::unordered_set<const void*> seen;
  for (const auto& p : model.named_parameters()) {
    if (seen.insert(p.value().unsafeGetTensorImpl()).second) tensors.emplace(p.key(), p.value());
  }
  std::map<std::string, std::string> meta = {
      {"format", "pt"}, {"producer", "train_gpt"}, {"vocab_size", std::to_string(c.vocab_size)},
      {"block_size", std::to_string(c.block_size)}, {"n_layer", std::to_string(c.n_layer)},
      {"n_head", std::to_string(c.n_head)}, {"n_embd", std::to_string(c.n_embd)},
      {"dropout", fmt("%.17g", c.dropout)}, {"tie_weights", c.tie_weights ? "true" : "false"}, {"arch", c.arch}};
  if (c.is_llama()) {  // what the shapes do not say (GPTConfig's names; bench/gpt_twin.py reads them)
    meta.insert({{"n_kv_head", std::to_string(c.kv_heads())}, {"intermediate_size", std::to_string(c.mlp_width())},
                 {"norm_eps", fmt("%.17g", c.norm_eps)}, {"rope_theta", fmt("%.17g", c.rope_theta)},
                 {"rope_type", c.rope_type}, {"rope_factor", fmt("%.17g", c.rope_factor)},
                 {"rope_low_freq_factor", fmt("%.17g", c.rope_low_freq_factor)},
                 {"rope_high_freq_factor", fmt("%.17g", c.rope_high_freq_factor)},
                 {"rope_original_max_positions", std::to_string(c.rope_original_max_positions)},
                 {"max_positions", std::to_string(c.max_positions > 0 ? c.max_positions : c.block_size)}});
  }
  try {
    fsdp::dcp::save_file(tensors, path, meta);
  } catch (const c10::Error& e) {
    throw UsageError("--save-init " + path + " cannot be written: " + one_line(e.what_without_backtrace()));
  }
}

/// --dump-batches: DIR/run.json, what bench/gpt_twin.py needs to replay this run (the optimizer's
/// betas and eps are those make_adamw gives AdamW).
inline nlohmann::json run_description(const RunSetup& s, int world, int64_t start_step) {
  const Options& o = s.opts;
  return {{"world_size", world},         {"first_step", start_step + 1},  {"steps", o.steps},
          {"batch_size", o.batch_size},  {"grad_accum_steps", o.grad_accum_steps},
          {"block_size", s.cfg.block_size}, {"lr", o.lr},                 {"min_lr", o.min_lr},
          {"warmup_steps", o.warmup_steps}, {"weight_decay", o.weight_decay}, {"betas", {0.9, 0.95}},
          {"eps", torch::optim::AdamWOptions(o.lr).eps()}, {"clip_grad", o.clip_grad},
          {"mixed_precision", o.mixed_precision}, {"reshard_after_forward", o.reshard_after_forward},
          {"no_shard", o.no_shard},      {"seed", o.seed},
          {"data_parallel", o.data_parallel}, {"dp_replicate", o.dp_replicate},
          {"all_gather_dtype", o.all_gather_dtype}, {"shard_dim", o.shard_dim},
          {"freeze", o.freeze},          {"frozen_dtype", o.frozen_dtype},
          {"reduce_scatter_each_microbatch", o.reduce_scatter_each_microbatch},
          {"keep_unsharded_between_microbatches", o.keep_unsharded},
          {"activation_checkpointing", o.activation_checkpointing},
          {"device", o.device.empty() ? (torch::cuda::is_available() ? "cuda" : "cpu") : o.device}};
}

/// The batches one rank trains on, kept in memory during training and written once at the end (so
/// that recording costs the timed steps nothing but a reference).
class BatchRecorder {
 public:
  /// Creates `dir` (throws UsageError if that fails). Call on every rank before training.
  explicit BatchRecorder(std::string dir) : dir_(std::move(dir)) {
    std::error_code ec;
    std::filesystem::create_directories(dir_, ec);
    if (!std::filesystem::is_directory(dir_)) {
      throw UsageError("--dump-batches " + dir_ + " cannot be created: " + ec.message());
    }
  }
  /// One microbatch: inputs and targets [batch_size, block_size].
  void add(const torch::Tensor& x, const torch::Tensor& y) { batches_.push_back(torch::stack({x, y})); }
  /// Writes <dir>/rank<rank>.safetensors ("batches": [steps, accum, 2, batch_size, block_size]); rank 0
  /// also writes <dir>/run.json (`run`).
  void write(int rank, int64_t grad_accum_steps, const nlohmann::json& run) const {
    TORCH_CHECK(!batches_.empty() && batches_.size() % grad_accum_steps == 0, "BatchRecorder: ", batches_.size(),
                " microbatches recorded, not a whole number of steps of ", grad_accum_steps);
    auto all = torch::stack(batches_);  // [steps * accum, 2, B, T]
    const std::string path = dir_ + "/rank" + std::to_string(rank) + ".safetensors";
    try {
      fsdp::dcp::save_file({{"batches", all.view({-1, grad_accum_steps, 2, all.size(2), all.size(3)})}}, path);
    } catch (const c10::Error& e) {
      throw UsageError("--dump-batches: " + path + " cannot be written: " + one_line(e.what_without_backtrace()));
    }
    if (rank == 0) {
      std::ofstream out(dir_ + "/run.json", std::ios::trunc);
      out << run.dump(2) << '\n';
      if (!out) throw UsageError("--dump-batches: " + dir_ + "/run.json cannot be written");
    }
  }

 private:
  std::string dir_;
  std::vector<torch::Tensor> batches_;  // one [2, B, T] per microbatch, in training order
};

/// While alive, CPU ops listed by autocast run in `dtype` (bf16): how plain LibTorch trains in mixed
/// precision without FSDP (the --no-shard floor). Parameters and gradients stay fp32.
class CpuAutocast {
 public:
  /// Autocast on `device` (CPU or CUDA) to `dtype` for the scope.
  explicit CpuAutocast(torch::ScalarType dtype, at::DeviceType device = at::kCPU)
      : device_(device),
        was_enabled_(at::autocast::is_autocast_enabled(device)),
        old_dtype_(at::autocast::get_autocast_dtype(device)) {
    at::autocast::set_autocast_enabled(device_, true);
    at::autocast::set_autocast_dtype(device_, dtype);
  }
  ~CpuAutocast() {
    at::autocast::set_autocast_enabled(device_, was_enabled_);
    at::autocast::set_autocast_dtype(device_, old_dtype_);
    at::autocast::clear_cache();  // the weight casts of this forward
  }
  CpuAutocast(const CpuAutocast&) = delete;
  CpuAutocast& operator=(const CpuAutocast&) = delete;

 private:
  at::DeviceType device_;
  bool was_enabled_;
  at::ScalarType old_dtype_;
};

}  // namespace train_gpt
