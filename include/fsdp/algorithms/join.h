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
// Gradient accumulation works with either notification pattern: notify once per microbatch or once
// per optimizer step (before the iteration's first forward):
//
//     for (size_t i = 0; i < my_microbatches.size(); ++i) {
//       join.notify_join_context(joinable);          // per microbatch (or only when i % k == 0)
//       model.set_requires_gradient_sync(i % k == k - 1);   // BEFORE the forward, as in FSDP2
//       (loss(my_microbatches[i]) / k).backward();
//       if (i % k == k - 1) { opt.step(); opt.zero_grad(); }
//     }
//
// How: a forward of the FSDP root on a training rank first announces itself with one small
// all-reduce (a "round") once some rank has joined (learned at the notify before), and for every
// forward but the first after a notify (notification once per step, where a rank may run out between
// two microbatches of a step). The round carries the FSDP settings of this microbatch (per group:
// requires_gradient_sync, reshard_after_backward, is_last_backward), whether autograd is on, and
// whether the optimizer stepped since the previous round (seen from a checksum of this rank's
// parameter shards: LibTorch's SGD bumps no version counter). The joined rank mirrors the settings, runs `forward_loss` and backpropagates zero times
// it: the same all-gathers and reduce-scatters as the training ranks, including microbatches without
// gradient sync and groups that stay unsharded between microbatches (reshard_after_backward false);
// it steps its optimizer (then zero_grad) exactly when the training ranks stepped theirs. Its
// gradient contribution is zero; gradients are divided as JoinOptions::divide_by_initial_world_size
// says. Cost per round (each notify_join_context, as PyTorch's Join, and each announced forward): one
// all-reduce of 4 + 2 + 3 x (FSDP groups) integers and a read of this rank's parameter shards.
// Rules: a microbatch is one forward of the root followed by one backward (forwards without autograd,
// e.g. evaluation, may come in between); the gradient-sync settings of a microbatch must be set before
// its forward; every rank runs the same loop structure (a rank that runs out must leave its loop
// where the others call notify_join_context or start a microbatch). Ranks still training that
// disagree (one in notify_join_context, another in a forward, or with different settings) raise
// c10::Error on every rank instead of hanging.
// A rank that runs out in the middle of an accumulation keeps the microbatches it already ran.
//
// Mirrors torch.distributed.algorithms.{Join, Joinable, JoinHook}.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include "fsdp/fsdp/detail/hooks.h"
#include "fsdp/c10d/distributed.h"

namespace fsdp {

/// One round of the join protocol (one all-reduce over the join group): a notify_join_context or a
/// forward announcement of the ranks still training, seen by every rank.
struct JoinRound {
  int active_ranks = 0;          ///< ranks still training (0: every rank has joined; the last round)
  int new_joiners = 0;           ///< ranks that joined in this round (they report their last interval)
  bool forward = false;          ///< a forward announced by the training ranks; else a notify_join_context
  bool first = false;            ///< joined side: the first round since this rank joined (it covers the
                                 ///< interval in which this rank still trained itself)
  const int64_t* values = nullptr;  ///< the joinable's message_size() values, summed over the ranks
};

/// What a joined rank does for each round the others still run. Mirrors JoinHook.
class JoinHook {
 public:
  virtual ~JoinHook() = default;
  /// Shadows one iteration of the ranks still training (the same collectives, zero contribution).
  /// `active_ranks`: how many ranks are still training in this iteration.
  virtual void main_hook(int active_ranks) {}
  /// Runs once every rank has joined; `is_last_joiner` is true on the ranks that joined last.
  virtual void post_hook(bool is_last_joiner) {}
  /// Every round a joined rank sees, including the last (active_ranks == 0). Default: main_hook for
  /// each notify round with ranks still training (PyTorch's one main_hook per iteration).
  virtual void on_round(const JoinRound& round) {
    if (!round.forward && round.active_ranks > 0) main_hook(round.active_ranks);
  }
};

class Join;

/// Something whose collectives must be shadowed. Mirrors Joinable.
class Joinable {
 public:
  virtual ~Joinable() = default;
  virtual std::shared_ptr<JoinHook> join_hook() = 0;
  /// The group whose ranks join (the all-reduces that count active ranks run over it).
  virtual ProcessGroupPtr join_process_group() = 0;
  /// Called on training ranks by notify_join_context, with the number of ranks still training.
  virtual void on_iteration(int active_ranks) {}
  /// Number of int64 values this joinable adds to every round (identical on every rank). (Default: 0)
  virtual int64_t message_size() { return 0; }
  /// This rank's message_size() values for a round: `training` on a training rank; false in the first
  /// round of a rank that just joined (which reports what it did since its last round); ranks that
  /// joined earlier contribute zeros without a call.
  virtual void write_message(int64_t* values, bool training) {}
  /// Every rank, every round: validates the summed values (throw c10::Error on every rank on a
  /// disagreement rather than let the collectives that follow mismatch).
  virtual void check_round(const JoinRound& round) {}
  /// Called by Join's constructor (the join) and destructor (null).
  virtual void attach(Join* join) {}
};

/// A fully_shard model and its optimizer. For every forward the training ranks announce (see the top
/// of this file), its join hook mirrors their FSDP settings, runs `forward_loss` (a forward of some
/// input through the sharded root, returning the loss) and backpropagates zero times that loss (the
/// same all-gathers and reduce-scatters as the others, with a zero contribution); it steps the
/// optimizer (then zero_grad) whenever the training ranks stepped theirs. With
/// divide_by_initial_world_size = false, gradients are divided by the number of ranks still training
/// in that iteration, on every rank. `root` must be the module fully_shard was applied to last.
/// Throws c10::Error (every rank) when the training ranks disagree about the settings or about
/// whether they stepped.
class FSDPJoinable : public Joinable {
 public:
  FSDPJoinable(std::shared_ptr<torch::nn::Module> root, torch::optim::Optimizer& optimizer,
               std::function<torch::Tensor()> forward_loss, ProcessGroupPtr group = nullptr);
  template <typename T>
  FSDPJoinable(const torch::nn::ModuleHolder<T>& root, torch::optim::Optimizer& optimizer,
               std::function<torch::Tensor()> forward_loss, ProcessGroupPtr group = nullptr)
      : FSDPJoinable(std::static_pointer_cast<torch::nn::Module>(root.ptr()), optimizer, std::move(forward_loss),
                     std::move(group)) {}
  ~FSDPJoinable() override;
  std::shared_ptr<JoinHook> join_hook() override;
  ProcessGroupPtr join_process_group() override { return group_; }
  void on_iteration(int active_ranks) override;
  int64_t message_size() override;
  void write_message(int64_t* values, bool training) override;
  void check_round(const JoinRound& round) override;
  /// Installs (or with null removes) the announcement of the root's forwards.
  void attach(Join* join) override;
  /// Set by Join from its options.
  void set_divide_by_initial_world_size(bool v) { divide_by_initial_ = v; }
  /// Sets every sharded module's gradient divide factor to `n` ranks (or back to the world size).
  void set_divide_factor(int active_ranks);

 private:
  friend class FSDPJoinHook;
  /// A checksum of this rank's parameter shards: changes when the optimizer steps.
  int64_t param_checksum() const;
  /// The root's states and their settings, in pre-order (identical on every rank).
  std::vector<std::shared_ptr<detail::FSDPState>> states_;
  void collect_states();

  std::shared_ptr<torch::nn::Module> root_;
  torch::optim::Optimizer& optimizer_;
  std::function<torch::Tensor()> forward_loss_;
  ProcessGroupPtr group_;
  bool divide_by_initial_ = true;
  int64_t last_checksum_ = 0;
  Join* join_ = nullptr;
};

/// Options of Join. Mirrors Join's keyword arguments.
/// Example: `fsdp::Join join({&joinable}, fsdp::JoinOptions().throw_on_early_termination(true));`
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
  /// rank: the group timeout turns that into errors on the other ranks); detaches the joinables.
  ~Join() noexcept(false);
  /// Call once per iteration on a training rank, before the iteration's collectives.
  /// Throws c10::Error with throw_on_early_termination if some rank has joined.
  void notify_join_context(Joinable& joinable);
  /// This rank is out of data: shadow the others until all have joined. Idempotent.
  void finish();
  /// Called by FSDP before each forward of a joinable's root on this rank. Announces the forward (one
  /// all-reduce) once another rank has joined, and for every forward but the first after a
  /// notify_join_context (notification once per step: a rank may run out between two microbatches).
  /// No-op otherwise and on joined ranks.
  void announce_forward();

 private:
  /// One round: all-reduces [training, notify, forward, newly joined] + every joinable's values.
  /// Returns the sums.
  std::vector<int64_t> exchange(bool training, bool forward, bool newly_joined);
  /// Validates the header of a round on every rank; fills `round`.
  void check_header(const std::vector<int64_t>& sums, bool training, JoinRound& round);

  std::vector<Joinable*> joinables_;
  JoinOptions options_;
  ProcessGroupPtr group_;
  bool finished_ = false;
  bool others_joined_ = false;  // learned at the last round: some rank has joined
  int forwards_since_notify_ = 0;  // >0: notified once per step; announce every further forward
};

}  // namespace fsdp
