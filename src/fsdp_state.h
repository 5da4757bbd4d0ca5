// The per-module FSDP state: forward/backward hooks, root detection and lazy init, prefetching.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "fsdp/fully_shard.h"
#include "fsdp_param_group.h"

namespace fsdp::detail {

/// What a state is doing in the current iteration.
enum class TrainingState {
  IDLE,           // between iterations, or after its forward
  FORWARD,        // inside its forward
  PRE_BACKWARD,   // its backward started (parameters unsharded for it)
  POST_BACKWARD,  // its gradients were handed to the reduce-scatter
};

class FSDPState;

/// Shared by every state under one root (created at the root's lazy init).
struct FSDPContext {
  FSDPState* root = nullptr;
  /// Every state under the root, pre-order. End-of-backward work walks this fixed order so that every
  /// rank issues its collectives in the same order.
  std::vector<FSDPState*> states;
  /// Pre-forward order of the first iteration: implicit forward prefetch issues the all-gather of the
  /// state after the current one.
  std::vector<FSDPState*> forward_order;
  bool forward_order_recorded = false;
  /// Post-forward order of this iteration: implicit backward prefetch unshards the state that ran
  /// before the current one.
  std::vector<FSDPState*> post_forward_order;
  bool callback_queued = false;  // end-of-backward callback queued for this backward

  /// Every state back to IDLE with no per-iteration record (start of a forward, end of backward).
  void reset_iteration();
};

class FSDPState : public std::enable_shared_from_this<FSDPState> {
 public:
  FSDPState(std::vector<std::shared_ptr<torch::nn::Module>> modules, FullyShardOptions options);

  int64_t id = 0;                                          // key of the state registry
  std::vector<std::weak_ptr<torch::nn::Module>> modules;   // modules of the fully_shard call
  std::string module_type;                                 // e.g. "BlockImpl", for messages
  std::string fqn;                                         // path from the root ("" for the root)
  std::unique_ptr<FSDPParamGroup> group;                   // null when the modules own no parameter
  FullyShardOptions options;
  DeviceMeshPtr mesh;

  // Resolved at lazy init. 0: keep unsharded after forward; 1: reshard fully; k > 1: keep a 1/k slice.
  int reshard_after_forward_k = 1;
  ProcessGroupPtr post_forward_group;  // groups of k consecutive shard ranks (k > 1 only)

  TrainingState training_state = TrainingState::IDLE;
  std::shared_ptr<FSDPContext> ctx;  // set at lazy init
  bool is_root() const { return ctx && ctx->root == this; }

  // FSDPModule settings.
  bool requires_gradient_sync = true;
  bool reshard_after_backward = true;
  bool is_last_backward = true;
  std::optional<double> gradient_divide_factor;
  std::optional<std::vector<std::weak_ptr<FSDPState>>> forward_prefetch;   // explicit lists
  std::optional<std::vector<std::weak_ptr<FSDPState>>> backward_prefetch;

  /// Set by an active fsdp::Join on the root's state: runs before the root's forward issues any
  /// collective (announces the forward to ranks that ran out of data; see join.cpp).
  std::function<void()> on_root_forward;

  // Per iteration.
  bool ran_forward = false;
  bool post_backward_done = false;
  std::vector<size_t> post_forward_indices;  // positions in ctx->post_forward_order, popped by pre-backward

  double divide_factor() const;
  std::string name() const { return fqn.empty() ? module_type + " (root)" : "'" + fqn + "' (" + module_type + ")"; }

  void lazy_init();
  void root_pre_forward();
  std::vector<torch::Tensor> pre_forward(std::vector<torch::Tensor> inputs);
  std::vector<torch::Tensor> post_forward(std::vector<torch::Tensor> outputs);
  void pre_backward();
  void post_backward();
  /// The root's end-of-backward callback: finishes every group and returns all states to IDLE.
  void root_post_backward_final();
  void prefetch(FSDPState* other);
};

/// The state with registry key `id`, or null if it is gone.
std::shared_ptr<FSDPState> state_by_id(int64_t id);

/// The FSDP state managing `param` (a registered parameter of a sharded module), or null.
std::shared_ptr<FSDPState> state_of_param(const torch::Tensor& param);
/// Every parameter managed by a live FSDP state, with its state (one registry scan).
std::unordered_map<const c10::TensorImpl*, std::shared_ptr<FSDPState>> param_owners();

}  // namespace fsdp::detail
