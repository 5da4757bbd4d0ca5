// Checkpoint regions of unchanged modules (apply_activation_checkpointing / checkpoint_wrapper on a module that
// the model's own forward calls): the region is told by the module's parameters at op level, recorded as an op
// tape in forward and replayed in backward. See [Note: implicit checkpoint regions] in implicit_checkpoint.cpp.
// Also the entry of the checkpoint layer of the interception fallback (utils/intercept.h), shared with
// selective checkpointing.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/types.h>

#include "fsdp/utils/activation_checkpoint.h"

namespace fsdp::detail {

/// What an implicit region does with the tensors autograd saves in it: recomputes them (checkpoint_wrapper), or keeps
/// them in host memory (offload_wrapper: save_on_cpu's hooks, nothing recorded).
enum class ImplicitRegionKind { Checkpoint, Offload };

/// Makes the ops on `params` (the parameters of one module, `name` for messages) open a region of `kind`: a
/// checkpoint region run with `options` (non-reentrant; a context_fn makes it selective), or an offload region. The parameters get the interception key (those that
/// lack it: FSDP's shards and TP's parameters have it). Applying to the same parameters again replaces the options.
/// Throws c10::Error for an empty `params`, for use_reentrant(true) (a region without a call has nothing to re-enter;
/// the message names the fix), when a parameter is already another module's (naming both), or when the module has
/// regions of the other kind.
void checkpoint_implicitly(const std::string& name, const std::vector<torch::Tensor>& params,
                           const CheckpointOptions& options, ImplicitRegionKind kind = ImplicitRegionKind::Checkpoint);

/// Whether `param` opens implicit checkpoint regions (FSDP then keys its unsharded data too, so that its ops are seen).
bool is_implicitly_checkpointed(const torch::Tensor& param);

/// Ends the implicit region open on this thread, if any (a backward begins, an explicit checkpoint region begins,
/// FSDP's pre- or post-forward of a holder runs).
void close_implicit_region();

/// While alive, no implicit region opens on this thread, and the open one has ended (library code: FSDP's pre- and
/// post-forward of a holder).
class SuspendImplicitRegions {
 public:
  SuspendImplicitRegions();
  ~SuspendImplicitRegions();
  SuspendImplicitRegions(const SuspendImplicitRegions&) = delete;
  SuspendImplicitRegions& operator=(const SuspendImplicitRegions&) = delete;
};

/// Counters of this process's implicit regions, for tests and debugging.
struct ImplicitCheckpointStats {
  int64_t regions = 0;   // regions opened (first runs)
  int64_t replays = 0;   // recomputations
  int64_t ops = 0;       // ops recorded
};
ImplicitCheckpointStats implicit_checkpoint_stats();

/// Installs the checkpoint layer of the interception fallback (implicit regions, then selective regions).
void install_checkpoint_layer();

/// The selective part of the checkpoint layer (selective_checkpoint.cpp): what an op that no implicit region records
/// goes through.
void selective_handle(bool composite, const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack);

}  // namespace fsdp::detail
