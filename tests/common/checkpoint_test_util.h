// Helpers of the checkpoint tests (test_state_dict, test_checkpoint, checkpoint_interop): the tiny test
// model sharded over a group with its optimizer, training steps on this rank's slice of a global batch,
// and snapshots of full and local state to compare.
#pragma once

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include <torch/torch.h>

#include "fsdp/fsdp.h"
#include "fsdp_test_model.h"

namespace fsdp::testing {

constexpr int64_t kCkptBatch = 12;  // global batch: divides by 1, 2, 3 and 4 ranks
constexpr int64_t kCkptSeq = 3;

/// Initial weights of Net for `seed`, identical on every rank (threads share the global generator, so
/// they are made once, under a lock).
inline std::map<std::string, torch::Tensor> seeded_weights(uint64_t seed) {
  static std::mutex mu;
  static std::map<uint64_t, std::map<std::string, torch::Tensor>> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto it = cache.find(seed);
  if (it == cache.end()) {
    torch::manual_seed(seed);
    Net net;
    it = cache.emplace(seed, snapshot(*net)).first;
  }
  return it->second;
}

enum class OptimKind { ADAMW, ADAM, SGD, ADAGRAD, RMSPROP };

/// The checkpoint tests' optimizer of each kind over `params`, with hyper-parameters that give every
/// optional state tensor (Adam's amsgrad max_exp_avg_sq, SGD's momentum_buffer, RMSprop's momentum_buffer
/// and grad_avg) and non-default values (Adagrad's lr_decay and initial_accumulator_value).
inline std::unique_ptr<torch::optim::Optimizer> make_ckpt_optimizer(const std::vector<torch::Tensor>& params,
                                                                   OptimKind kind) {
  namespace optim = torch::optim;
  switch (kind) {
    case OptimKind::ADAMW: return std::make_unique<optim::AdamW>(params, optim::AdamWOptions(1e-2).weight_decay(0.01));
    case OptimKind::ADAM: return std::make_unique<optim::Adam>(params, optim::AdamOptions(1e-2).amsgrad(true));
    case OptimKind::SGD:
      return std::make_unique<optim::SGD>(params, optim::SGDOptions(5e-2).momentum(0.9).dampening(0.1));
    case OptimKind::ADAGRAD:
      return std::make_unique<optim::Adagrad>(
          params, optim::AdagradOptions(5e-2).lr_decay(0.01).weight_decay(0.01).initial_accumulator_value(0.1));
    case OptimKind::RMSPROP:
      return std::make_unique<optim::RMSprop>(
          params, optim::RMSpropOptions(1e-2).momentum(0.5).centered(true).weight_decay(0.01));
  }
  return nullptr;
}

/// The test model sharded over `pg` (blocks, then the root) with an optimizer over its shards.
struct Trainer {
  ProcessGroupPtr pg;
  DeviceMeshPtr mesh;
  Net net{nullptr};
  FSDPModule<Net> model{nullptr};  // the root's holder, for the trainer's life: the holder path
  std::unique_ptr<torch::optim::Optimizer> opt;

  explicit Trainer(ProcessGroupPtr group, uint64_t seed = 7, OptimKind kind = OptimKind::ADAMW,
                   std::vector<int64_t> mesh_shape = {})
      : pg(std::move(group)) {
    net = Net();
    model = FSDPModule<Net>(net);
    load_full(*net, seeded_weights(seed));
    if (mesh_shape.empty()) mesh_shape = {pg->size()};
    std::vector<std::string> names = mesh_shape.size() == 2 ? std::vector<std::string>{"replicate", "shard"}
                                                            : std::vector<std::string>{"shard"};
    mesh = init_device_mesh(torch::kCPU, mesh_shape, names, pg);
    auto opts = FullyShardOptions().mesh(mesh);
    for (auto& b : net->blocks) fully_shard(b, opts);
    fully_shard(net, opts);
    opt = make_ckpt_optimizer(net->parameters(), kind);
  }

  /// One optimizer step on this rank's slice of `global`; returns the loss averaged over ranks.
  float step(const Batch& global) {
    // Data-parallel ranks: with a 2-D mesh every rank still takes its own slice of the batch.
    const int64_t local = kCkptBatch / pg->size();
    auto b = global.slice(pg->rank() * local, local);
    opt->zero_grad();
    auto loss = loss_fn(model(b.idx), b.targets);
    loss.backward();
    opt->step();
    auto g = loss.detach().clone();
    all_reduce(g, *pg, ReduceOp::AVG);
    return g.item<float>();
  }
};

/// Full state (model and optimizer) as every rank sees it after a gather: tensors and Values by key.
struct FullState {
  std::map<std::string, torch::Tensor> tensors;
  std::map<std::string, nlohmann::json> values;
};

inline FullState full_state(Trainer& t) {
  FullState s;
  for (const auto& [k, v] : get_state_dict(t.net, *t.opt, StateDictOptions().full_state_dict(true))) {
    if (const auto* tensor = std::get_if<torch::Tensor>(&v)) s.tensors[k] = tensor->clone();
    else if (const auto* val = std::get_if<Value>(&v)) s.values[k] = val->json;
  }
  return s;
}

/// Copies of this rank's local pieces and Values of the sharded state dict: to prove that a failed
/// load changed nothing.
inline FullState local_state(Trainer& t) {
  FullState s;
  for (const auto& [k, v] : get_state_dict(t.net, *t.opt)) {
    if (const auto* d = std::get_if<DTensor>(&v)) s.tensors[k] = d->to_local().clone();
    else if (const auto* tensor = std::get_if<torch::Tensor>(&v)) s.tensors[k] = tensor->clone();
    else s.values[k] = std::get<Value>(v).json;
  }
  // Whether the optimizer holds state at all (a failed load must not create it).
  s.values["<optimizer state entries>"] = static_cast<int64_t>(t.opt->state().size());
  return s;
}

/// "" when a and b hold the same keys and bit-identical tensors and equal Values, else the first difference.
inline std::string diff_states(const FullState& a, const FullState& b) {
  if (a.tensors.size() != b.tensors.size()) {
    return "tensor counts differ: " + std::to_string(a.tensors.size()) + " vs " + std::to_string(b.tensors.size());
  }
  for (const auto& [k, t] : a.tensors) {
    auto it = b.tensors.find(k);
    if (it == b.tensors.end()) return "'" + k + "' missing";
    if (t.sizes() != it->second.sizes() || t.scalar_type() != it->second.scalar_type()) return "'" + k + "' shape/dtype";
    if (!torch::equal(t, it->second)) {
      return "'" + k + "' differs: max |diff| " + std::to_string(max_abs_diff(t, it->second));
    }
  }
  if (a.values != b.values) return "values differ";
  return "";
}

/// A fresh folder under $TMPDIR/fsdp_ckpt_test_<pid>/, removed when the process exits (unless
/// FSDP_KEEP_TEST_DIRS is set, to inspect them).
inline std::string temp_dir(const std::string& name) {
  static const std::filesystem::path base =
      std::filesystem::temp_directory_path() / ("fsdp_ckpt_test_" + std::to_string(::getpid()));
  static const bool registered = [] {
    if (!std::getenv("FSDP_KEEP_TEST_DIRS")) {
      std::atexit([] {
        std::error_code ec;
        std::filesystem::remove_all(base, ec);
      });
    }
    return true;
  }();
  (void)registered;
  auto p = base / name;
  std::filesystem::remove_all(p);
  std::filesystem::create_directories(p);
  return p.string();
}

}  // namespace fsdp::testing
