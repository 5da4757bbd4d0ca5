// Uneven inputs: ranks that run out of data shadow the collectives of the ranks still training, so
// that no rank hangs and every rank ends with identical parameters.
//
//   fsdp::FSDPJoinable joinable(model, opt, [&] { return loss_fn(model(sample_x), sample_y); });
//   {
//     fsdp::Join join({&joinable});
//     for (auto& batch : my_batches) {            // ranks may have different numbers of batches
//       join.notify_join_context(joinable);        // once per iteration, before its collectives
//       opt.zero_grad(); loss(batch).backward(); opt.step();
//     }
//   }                                             // shadows the others' iterations until all are done
//
// Mirrors torch.distributed.algorithms.{Join, Joinable, JoinHook}.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "fsdp/distributed.h"

namespace fsdp {

/// What a joined rank does for each iteration the others still run. Mirrors JoinHook.
class JoinHook {
 public:
  virtual ~JoinHook() = default;
  /// Shadows one iteration of the ranks still training (the same collectives, zero contribution).
  /// `active_ranks`: how many ranks are still training in this iteration.
  virtual void main_hook(int active_ranks) {}
  /// Runs once every rank has joined; `is_last_joiner` is true on the ranks that joined last.
  virtual void post_hook(bool is_last_joiner) {}
};

/// Something whose collectives must be shadowed. Mirrors Joinable.
class Joinable {
 public:
  virtual ~Joinable() = default;
  virtual std::shared_ptr<JoinHook> join_hook() = 0;
  /// The group whose ranks join (the all-reduces that count active ranks run over it).
  virtual ProcessGroupPtr join_process_group() = 0;
  /// Called on training ranks by notify_join_context, with the number of ranks still training.
  virtual void on_iteration(int active_ranks) {}
};

/// A fully_shard model and its optimizer. Its join hook runs `forward_loss` (a forward of some input
/// through the sharded root, returning the loss), backpropagates zero times that loss (the same
/// all-gathers and reduce-scatters as the others, with a zero contribution), and steps the optimizer
/// with the reduced gradients. With divide_by_initial_world_size = false, gradients are divided by
/// the number of ranks still training in that iteration, on every rank.
class FSDPJoinable : public Joinable {
 public:
  FSDPJoinable(std::shared_ptr<torch::nn::Module> root, torch::optim::Optimizer& optimizer,
               std::function<torch::Tensor()> forward_loss, ProcessGroupPtr group = nullptr);
  template <typename T>
  FSDPJoinable(const torch::nn::ModuleHolder<T>& root, torch::optim::Optimizer& optimizer,
               std::function<torch::Tensor()> forward_loss, ProcessGroupPtr group = nullptr)
      : FSDPJoinable(std::static_pointer_cast<torch::nn::Module>(root.ptr()), optimizer, std::move(forward_loss),
                     std::move(group)) {}
  std::shared_ptr<JoinHook> join_hook() override;
  ProcessGroupPtr join_process_group() override { return group_; }
  void on_iteration(int active_ranks) override;
  /// Set by Join from its options.
  void set_divide_by_initial_world_size(bool v) { divide_by_initial_ = v; }
  /// Sets every sharded module's gradient divide factor to `n` ranks (or back to the world size).
  void set_divide_factor(int active_ranks);

 private:
  std::shared_ptr<torch::nn::Module> root_;
  torch::optim::Optimizer& optimizer_;
  std::function<torch::Tensor()> forward_loss_;
  ProcessGroupPtr group_;
  bool divide_by_initial_ = true;
};

/// Options of Join. Mirrors Join's keyword arguments.
struct JoinOptions {
  /// Divide gradients by the initial world size even after ranks joined (else by the number of
  /// ranks still training). (Default: true)
  TORCH_ARG(bool, divide_by_initial_world_size) = true;
  /// Raise on every rank as soon as one rank runs out of data, instead of shadowing. (Default: false)
  TORCH_ARG(bool, throw_on_early_termination) = false;
  /// Turn Join off (then it does nothing). (Default: true)
  TORCH_ARG(bool, enable) = true;
};

/// RAII join context. The destructor (or finish()) runs the joined loop: it all-reduces the number
/// of ranks still training and runs every joinable's main_hook until that number is 0.
/// Throws c10::Error (on every rank) with throw_on_early_termination when a rank ran out of data.
class Join {
 public:
  explicit Join(std::vector<Joinable*> joinables, JoinOptions options = {});
  /// Runs finish() unless an exception is propagating (then the others would wait forever for this
  /// rank: the group timeout turns that into errors on the other ranks).
  ~Join() noexcept(false);
  /// Call once per iteration on a training rank, before the iteration's collectives.
  /// Throws c10::Error with throw_on_early_termination if some rank has joined.
  void notify_join_context(Joinable& joinable);
  /// This rank is out of data: shadow the others until all have joined. Idempotent.
  void finish();

 private:
  std::vector<Joinable*> joinables_;
  JoinOptions options_;
  ProcessGroupPtr group_;
  bool finished_ = false;
};

}  // namespace fsdp
