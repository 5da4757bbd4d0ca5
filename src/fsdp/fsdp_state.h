// The per-module FSDP state: forward/backward hooks, root detection and lazy init, prefetching, and the
// registry that maps modules and parameters to their state.
// Mirrors torch.distributed.fsdp._fully_shard._fsdp_state.FSDPState.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

#include "fsdp/fsdp/fully_shard.h"
#include "fsdp/fsdp_param_group.h"

namespace fsdp::detail {

/// What a state is doing in the current iteration.
enum class TrainingState {
  IDLE,           // between iterations, or after its forward
  FORWARD,        // inside its forward
  PRE_BACKWARD,   // its backward started (parameters unsharded for it)
  POST_BACKWARD,  // its gradients were handed to the reduce-scatter
};

class FSDPState;

/// A weak reference to an autograd node ([Note: identity by address], fsdp/fsdp_interception.cpp).
/// LibTorch holds nodes by c10::intrusive_ptr (2.13 and later) or std::shared_ptr (earlier): this works
/// with either. lock() gives the node, or null once it was freed.
class WeakNode {
 public:
  using Ptr = std::decay_t<decltype(std::declval<const torch::Tensor&>().grad_fn())>;
  WeakNode& operator=(const Ptr& node) {
    weak_.reset();
    if (node) weak_.emplace(node);
    return *this;
  }
  void reset() { weak_.reset(); }
  Ptr lock() const { return weak_ ? weak_->lock() : Ptr(); }

 private:
  template <typename P>
  struct WeakOf;
  template <typename T>
  struct WeakOf<std::shared_ptr<T>> {
    using type = std::weak_ptr<T>;
  };
  template <typename T>
  struct WeakOf<c10::intrusive_ptr<T>> {
    using type = c10::weak_intrusive_ptr<T>;
  };
  std::optional<typename WeakOf<Ptr>::type> weak_;
};

/// Shared by every state under one root (created at the root's lazy init).
struct FSDPContext {
  FSDPState* root = nullptr;
  /// Every state under the root, pre-order. End-of-backward work walks this fixed order so that every
  /// rank issues its collectives in the same order (see [Note: collective order], fsdp_state.cpp).
  std::vector<FSDPState*> states;
  /// Pre-forward order of the first iteration: implicit forward prefetch issues the all-gather of the
  /// state after the current one.
  std::vector<FSDPState*> forward_order;
  bool forward_order_recorded = false;
  /// Post-forward order of this iteration: implicit backward prefetch unshards the state that ran
  /// before the current one.
  std::vector<FSDPState*> post_forward_order;
  /// Every sharded parameter under the root -> its state and index in the group (for the forward
  /// graph check of the root's post-forward).
  std::unordered_map<const c10::TensorImpl*, std::pair<FSDPState*, size_t>> param_index;
  /// A backward is running: its end-of-backward callback is queued and every group's sharded grads
  /// are stashed (begin_backward). Cleared by the callback or, when the backward throws, by abort.
  bool in_backward = false;
  /// The last backward threw: the next root forward completes and drops its in-flight collectives.
  bool backward_aborted = false;
  /// A root forward began (root_pre_forward) and has not ended: the holder root's post-forward, or for
  /// an implicit root the first pre-backward, ends it. See [Note: implicit groups] (fsdp_implicit.cpp).
  bool forward_open = false;
  /// The states whose forward is running, outermost first: a state stays while ops use it or states of
  /// its submodules, and is popped (its post-forward runs) when an op uses a state outside its subtree.
  std::vector<FSDPState*> forward_stack;
  /// The state whose reduce-scatter was issued last in this backward and is not finished: finished when
  /// the next group's is issued. See [Note: one reduce-scatter in flight] (fsdp_state.cpp).
  FSDPState* reduce_pending = nullptr;

  /// Pops the forward stack down to (and, with `inclusive`, including) `s`, running the post-forward of
  /// each implicit state popped; with s == nullptr pops everything.
  void pop_forward_stack(FSDPState* s, bool inclusive);
  /// Ends the open forward: pops the whole stack; `keep` (the state whose pre-backward ends it) is not
  /// resharded, since its backward needs it unsharded.
  void close_forward(FSDPState* keep);

  /// The autograd node of the holder root's output, from the root forwards since the last backward.
  /// While it lives, a new root forward adds its calls to the same backward (a loss summed over two
  /// forwards): see [Note: several forwards, one backward] (fsdp_state.cpp).
  WeakNode open_graph;

  /// Start of a root forward: forgets the previous forward's calls (a new graph), unless
  /// `adds_to_backward` (the previous forward's graph is still alive and not backwarded): then only the
  /// per-forward flags are cleared and the calls add up.
  void reset_forward(bool adds_to_backward = false);
  /// End of a backward: every state back to IDLE, per-backward counts cleared. The per-forward
  /// record stays, so that a second backward over the same graph (retain_graph) works the same way.
  void reset_backward();
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
  // See [Note: reshard_after_forward=k] (fsdp_param_group.cpp).
  int reshard_after_forward_k = 1;
  ProcessGroupPtr post_forward_group;  // groups of k consecutive shard ranks (k > 1 only)

  TrainingState training_state = TrainingState::IDLE;
  std::shared_ptr<FSDPContext> ctx;  // set at lazy init
  /// Driven by tensor interception (no module of the fully_shard call has an FSDPModule holder).
  /// See [Note: implicit groups] (fsdp_implicit.cpp).
  bool implicit = false;
  /// Made by fsdp::replicate (a (world, 1) mesh): see [Note: replicate as HSDP with one-rank shards].
  bool replicated = false;
  FSDPState* parent = nullptr;  // nearest sharded ancestor (set at lazy init; null for the root)
  bool is_root() const { return ctx && ctx->root == this; }

  // FSDPModule settings.
  bool requires_gradient_sync = true;
  bool reshard_after_backward = true;
  bool is_last_backward = true;
  std::optional<double> gradient_divide_factor;
  std::shared_ptr<c10::Event> post_optim_event;  // set_post_optim_event (root): consumed by the next forward
  std::optional<std::vector<std::weak_ptr<FSDPState>>> forward_prefetch;   // explicit lists
  std::optional<std::vector<std::weak_ptr<FSDPState>>> backward_prefetch;

  /// Set by an active fsdp::Join on the root's state: runs before the root's forward issues any
  /// collective (announces the forward to ranks that ran out of data; see join.cpp).
  std::function<void()> on_root_forward;

  // Per forward (reset by the root's pre-forward). A "call" is one forward of the module through
  // FSDP with grad enabled; it is "tracked" when an input requires grad, so that RegisterPostBackward
  // tells when the call's backward is done.
  bool ran_forward = false;
  int fwd_calls = 0;
  int fwd_untracked = 0;
  std::vector<size_t> post_forward_indices;  // positions in ctx->post_forward_order (backward prefetch)
  // The RegisterPostBackward node of this call's inputs (root only): the forward graph check stops
  // there (what lies beyond is the inputs' history, e.g. another forward).
  // Held weakly ([Note: identity by address]): a freed node's address can be reused by a new node.
  WeakNode input_node;

  // Implicit states, per parameter: used with grad enabled in this forward / in this backward (a
  // recomputation), and whose gradient autograd accumulated in this backward. The post-backward runs
  // once every used trainable parameter has its gradient.
  std::vector<char> fwd_used, bwd_used, grad_accumulated;
  // The fallback hooks each node once. Held weakly ([Note: identity by address]): compared by address, a
  // new node allocated where a freed one was would never be hooked, and the group's backward never run.
  WeakNode last_hooked_node;

  // Per backward (reset at its end).
  int bwd_calls = 0;       // calls made during this backward (recomputation inside a checkpoint)
  int bwd_untracked = 0;
  int input_grads_ready = 0;  // RegisterPostBackward backward calls in this backward
  size_t backward_cursor = 0;  // pre-backwards so far (reads post_forward_indices from the back)
  int post_backward_runs = 0;

  /// See [Note: post-backward and the end-of-backward callback] (fsdp_state.cpp).
  /// Every use of the group's parameters in this backward has produced its gradient when every call
  /// is tracked and each call's inputs got their gradients (the engine runs a call's nodes, and the
  /// AccumulateGrad nodes they complete, before the call's RegisterPostBackward node).
  bool all_calls_done() const {
    return fwd_untracked + bwd_untracked == 0 && input_grads_ready >= fwd_calls + bwd_calls && all_regions_recomputed();
  }

  // Checkpoint regions ([Note: recomputed regions], activation_checkpoint.cpp). Per forward: the regions
  // whose first run used the group, so whose recomputation will use it again in backward (also regions
  // first run inside a recomputation: nested checkpoints). Per backward: those recomputed so far.
  std::vector<uint64_t> ckpt_regions;
  std::vector<uint64_t> ckpt_recomputed;
  /// Records a use of the group (a call on the holder path, an op on the implicit path) in the thread's
  /// checkpoint regions. Returns whether it is part of the recomputation of a region that used the group.
  bool note_checkpoint_use();
  /// Every region that used the group was recomputed in this backward: no later recomputation will add
  /// gradients.
  bool all_regions_recomputed() const;

  double divide_factor() const;
  /// mp_policy's casts of a call's floating inputs (cast_forward_inputs, to param_dtype) and outputs
  /// (output_dtype); also applied when the call is recomputed, so that it computes the same tensors.
  std::vector<torch::Tensor> cast_forward_inputs(std::vector<torch::Tensor> inputs) const;
  std::vector<torch::Tensor> cast_outputs(std::vector<torch::Tensor> outputs) const;

  // Implicit states (fsdp_implicit.cpp), called by the interception fallback (fsdp_interception.cpp).
  /// An op uses parameter `index` outside a backward, not in place: unshards for the forward (lazy init
  /// and the root's pre-forward first when needed).
  void implicit_forward_use(size_t index, bool grad_mode);
  /// An op uses parameter `index` during a backward (a backward formula, or a recomputation).
  void implicit_backward_use(size_t index, bool grad_mode);
  /// An op writes a parameter in place outside a backward (optimizer step, init): the shard is written,
  /// so an unsharded group (left by an evaluation forward) reshards first.
  void implicit_write();
  /// The first autograd node of an op that used the group runs (pre-backward).
  void implicit_pre_backward();
  /// Autograd accumulated parameter `index`'s gradient (post-accumulate-grad hook).
  void on_grad_accumulated(size_t index);
  /// Registers the parameters with the interception (their shards carry its key; fully_shard).
  void register_params();
  /// Implicit group: the unsharded data carry the key too, and gradients are followed per parameter.
  void enable_interception();
  /// Back to the holder path (an FSDPModule holder was made for every module after fully_shard): the
  /// parameters' data lose the interception key.
  void disable_interception();
  [[noreturn]] void raise_stale_alias(const FSDPParam& p, const std::string& op) const;
  /// A holder group's parameter used by `op` while a forward is open and the group is sharded (outside
  /// its module's forward): see [Note: reads of a sharded parameter].
  [[noreturn]] void raise_use_outside_forward(const FSDPParam& p, const std::string& op) const;
  /// An implicit group's sharded parameter read by `op` with grad enabled while no forward is open.
  [[noreturn]] void raise_read_with_grad(const FSDPParam& p, const std::string& op) const;
  /// Pushes this state on the forward stack (popping the states it is not nested in) and returns true;
  /// returns false when it is on the stack already (popping the states nested in it).
  bool enter_forward_stack();
  /// The post-forward of an implicit state: reshard per reshard_after_forward, record the order.
  void implicit_post_forward();
  /// Shared by the holder and implicit pre-forward: unshard, prefetch, record the forward order.
  void begin_call();
  /// For messages: "'blocks.1' (BlockImpl)", "the root (NetImpl)", or before the first forward
  /// "the module passed to fully_shard (BlockImpl)".
  std::string name() const;
  /// Path of modules[i] from the root (set at lazy init; empty before or when outside the root).
  std::vector<std::optional<std::string>> module_fqns;

  /// After the group is built (fully_shard): records where each parameter comes from (`origin`: module
  /// index and name in that module, per parameter) and registers the hook that checks every gradient
  /// reaching a parameter (check_grad_arrival).
  void init_params(const std::vector<std::pair<size_t, std::string>>& origin);
  void lazy_init();
  void root_pre_forward();
  /// Join's announcement and the root's pre-forward, for a root whose forward is seen at tensor level.
  void begin_root_forward();
  std::vector<torch::Tensor> pre_forward(std::vector<torch::Tensor> inputs);
  std::vector<torch::Tensor> post_forward(std::vector<torch::Tensor> outputs);
  void pre_backward();
  /// RegisterPostBackward: the gradients of one call's inputs are ready.
  void on_input_grads_ready();
  void post_backward();
  /// The root's end-of-backward callback: finishes every group (runs the post-backward of groups
  /// whose hooks could not tell that their gradients were complete) and returns all states to IDLE.
  void root_post_backward_final();
  /// The root's cleanup when a backward threw (local only, never throws).
  void abort_backward() noexcept;
  /// FSDPModuleAPI::reset_iter_state (root only; a no-op before the first forward).
  void reset_iter_state();
  void prefetch(FSDPState* other);
  /// The root's post-forward: walks the autograd graph of `outputs` and raises the bypass error for
  /// a sharded parameter used by a module whose forward did not go through FSDP in this forward, or
  /// used on its shard (ws > 1). Uses inside activation-checkpointed regions are not in the graph yet;
  /// check_grad_arrival catches them in backward.
  void check_forward_graph(const std::vector<torch::Tensor>& outputs) const;
  /// The error for a use of `p` outside its group's FSDP forward. `what` describes the evidence.
  [[noreturn]] void raise_bypass(const FSDPParam& p, const std::string& what) const;
  /// A gradient reached `p` (a parameter of this group) in backward: checks that it came from a use
  /// inside this group's FSDP forward, else raises the bypass error.
  void check_grad_arrival(const FSDPParam& p, const torch::Tensor& grad) const;
};

/// Registers a new state for `modules` (keyed weakly by module) and gives it its id.
void register_state(const std::shared_ptr<FSDPState>& state,
                    const std::vector<std::shared_ptr<torch::nn::Module>>& modules);
/// Marks a module whose forward goes through FSDP (fsdp::mark_fsdp_forward).
void mark_module(const torch::nn::Module& module);
/// Whether `module` takes the holder path: marked by mark_module, or a live FSDPModule holder of it.
bool is_marked(const torch::nn::Module& module);

/// Every parameter managed by a live state -> its state and its FSDPParam.
using ManagedParamMap =
    std::unordered_map<const c10::TensorImpl*, std::pair<std::shared_ptr<FSDPState>, const FSDPParam*>>;
/// The managed parameters (one registry scan). With `forget_destroyed`, first drops the registry entries
/// (and so the states) of destroyed modules.
ManagedParamMap managed_params(bool forget_destroyed = false);

/// Every live state (one registry scan).
std::vector<std::shared_ptr<FSDPState>> live_states();
/// The state with registry key `id`, or null if it is gone.
std::shared_ptr<FSDPState> state_by_id(int64_t id);

/// The FSDP state managing `param` (a registered parameter of a sharded module), or null.
std::shared_ptr<FSDPState> state_of_param(const torch::Tensor& param);
/// Every parameter managed by a live FSDP state, with its state (one registry scan).
std::unordered_map<const c10::TensorImpl*, std::shared_ptr<FSDPState>> param_owners();

}  // namespace fsdp::detail
