// The frame of a non-reentrant checkpoint region (see [Note: non-reentrant checkpoint], activation_checkpoint.cpp):
// what its first run records per saved tensor and what its recomputation fills. Shared by fsdp::checkpoint
// (activation_checkpoint.cpp) and the implicit regions of unchanged modules (implicit_checkpoint.cpp).
#pragma once

#include <algorithm>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <ATen/autocast_mode.h>
#include <ATen/core/Generator.h>
#include <torch/csrc/autograd/saved_variable_hooks.h>

#include "fsdp/utils/activation_checkpoint.h"
#include "utils/recompute_regions.h"
#include "utils/rng_states.h"
#include "utils/selective_checkpoint_internal.h"

namespace fsdp::detail {

// Default generators whose state the forward saves and the recomputation restores.
inline std::vector<at::Generator> generators_for(const std::vector<torch::Tensor>& inputs) {
  std::vector<at::Generator> gens{at::detail::getDefaultCPUGenerator()};
  std::vector<c10::Device> seen;
  for (const auto& t : inputs) {
    if (!t.defined() || t.device().is_cpu()) continue;
    if (std::find(seen.begin(), seen.end(), t.device()) != seen.end()) continue;
    seen.push_back(t.device());
    gens.push_back(at::globalContext().defaultGenerator(t.device()));
  }
  return gens;
}

// The autocast state a region ran under (CPU and CUDA), restored for its recomputation.
struct AutocastState {
  bool cpu = false, cuda = false;
  at::ScalarType cpu_dtype = at::kBFloat16, cuda_dtype = at::kHalf;
  static AutocastState current() {
    return {at::autocast::is_autocast_enabled(at::kCPU), at::autocast::is_autocast_enabled(at::kCUDA),
            at::autocast::get_autocast_dtype(at::kCPU), at::autocast::get_autocast_dtype(at::kCUDA)};
  }
  bool operator==(const AutocastState& o) const {
    return cpu == o.cpu && cuda == o.cuda && (!cpu || cpu_dtype == o.cpu_dtype) && (!cuda || cuda_dtype == o.cuda_dtype);
  }
  void apply() const {
    at::autocast::set_autocast_enabled(at::kCPU, cpu);
    at::autocast::set_autocast_enabled(at::kCUDA, cuda);
    at::autocast::set_autocast_dtype(at::kCPU, cpu_dtype);
    at::autocast::set_autocast_dtype(at::kCUDA, cuda_dtype);
  }
};

// Sets a region's RNG (optional), autocast and thread-region states ([Note: regions a recomputation re-enters])
// for its recomputation; puts the caller's back.
class RecomputeStates {
 public:
  RecomputeStates(std::vector<at::Generator> gens, const std::vector<torch::Tensor>* rng, const AutocastState& autocast,
                  const std::vector<RegionReentry>& regions)
      : gens_(std::move(gens)), autocast_before_(AutocastState::current()), regions_(regions) {
    if (rng) {
      rng_before_ = detail::get_states(gens_);
      detail::set_states(gens_, *rng);
    }
    autocast.apply();
    // As torch.autocast's scope: the casts cached for the recomputation (of the parameters) are dropped when
    // the outermost autocast scope ends, so that none survives an optimizer step.
    if (autocast.cpu || autocast.cuda) {
      at::autocast::increment_nesting();
      nested_ = true;
    }
  }
  ~RecomputeStates() {
    autocast_before_.apply();
    if (nested_ && at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
    if (!rng_before_.empty()) detail::set_states(gens_, rng_before_);
  }
  RecomputeStates(const RecomputeStates&) = delete;
  RecomputeStates& operator=(const RecomputeStates&) = delete;

 private:
  std::vector<at::Generator> gens_;
  std::vector<torch::Tensor> rng_before_;
  AutocastState autocast_before_;
  bool nested_ = false;
  ReenterRegions regions_;
};

// [Note: non-reentrant checkpoint]
// torch.utils.checkpoint(use_reentrant=False), built on the saved-tensor hooks of saved_tensor_hooks.cpp. The
// first run is an ordinary forward with gradients, so the region's graph is the graph without checkpointing
// (same nodes, same gradients, the parameters' AccumulateGrads); only the tensors its ops save for backward
// are not kept: each one's pack hook records its description (shape, dtype, device) and its index in the
// region. The first unpack in backward re-runs the region (same RNG, autocast and thread-region states, gradients enabled,
// the inputs detached) with hooks that store every saved tensor under its index, so the k-th tensor the
// recomputation saves serves the k-th one of the first run; then each unpack takes its tensor (freed from
// the region as it is taken: a second backward over a retained graph recomputes again). The recomputation's
// own graph is dropped. Determinism check ("default"): the recomputation must save the same sequence of
// descriptions. Regions nest: a region's hooks are the innermost on the thread's stack, so an inner region
// records its own tensors, in the first run and in the outer region's recomputation alike. FSDP: the
// recomputation runs inside the backward, after the pre-backward of the group whose node needs the tensor;
// a sharded module called in it unshards (pre-backward) and is not counted as a call, since its graph is
// never backpropagated (in_non_reentrant_recompute, FSDPState::pre_forward).
struct SavedMeta {
  std::vector<int64_t> sizes;
  at::ScalarType dtype;
  c10::Device device;
  std::string str() const {
    std::ostringstream os;
    os << "shape " << c10::IntArrayRef(sizes) << ", " << dtype << ", " << device;
    return os.str();
  }
  bool operator==(const SavedMeta& o) const { return sizes == o.sizes && dtype == o.dtype && device == o.device; }
};

struct NonReentrantFrame {
  CheckpointFn fn;
  std::vector<torch::Tensor> inputs;  // the region's inputs, as passed
  std::vector<at::Generator> gens;
  std::optional<std::vector<torch::Tensor>> rng;
  AutocastState autocast;
  std::vector<RegionReentry> regions;  // the thread regions the first run saw ([Note: regions a recomputation re-enters])
  bool check = true;
  std::vector<SavedMeta> saved;            // first run: per saved tensor
  std::vector<torch::Tensor> recomputed;   // recomputation: per saved tensor, until unpacked
  size_t recomputed_count = 0;             // tensors the running recomputation saved so far
  std::mutex mu;                           // unpacks may come from several autograd threads
  std::unique_ptr<detail::SelectiveRegion> selective;  // context_fn's policy ([Note: selective checkpoint])

  // Runs the recomputation if `index`'s tensor is not waiting (first unpack, or a second backward).
  torch::Tensor take(size_t index);
  void recompute();
};

struct FirstRunHooks : torch::autograd::SavedVariableHooks {
  explicit FirstRunHooks(std::shared_ptr<NonReentrantFrame> f) : frame(std::move(f)) {}
  void call_pack_hook(const at::Tensor& t) override {
    std::lock_guard<std::mutex> lock(frame->mu);  // (a backward on another thread may be recomputing)
    index = frame->saved.size();
    frame->saved.push_back({t.sizes().vec(), t.scalar_type(), t.device()});
    if (frame->selective) frame->selective->on_pack(index, t);
  }
  at::Tensor call_unpack_hook() override { return frame->take(index); }
  std::shared_ptr<NonReentrantFrame> frame;
  size_t index = 0;
};

// The recomputation's saved tensors: stored in the frame under their index (their own graph is dropped).
struct RecomputeHooks : torch::autograd::SavedVariableHooks {
  explicit RecomputeHooks(NonReentrantFrame* f) : frame(f) {}
  void call_pack_hook(const at::Tensor& t) override {
    const size_t k = frame->recomputed_count++;
    SavedMeta meta{t.sizes().vec(), t.scalar_type(), t.device()};
    if (frame->check) {
      TORCH_CHECK(k < frame->saved.size(), "checkpoint: the recomputation saved more tensors for backward than the ",
                  "forward did (", frame->saved.size(), "); tensor #", k, ": ", meta.str(), ". The region's ops depend ",
                  "on state that changed between forward and backward (a flag, a shape, a branch); make them depend on ",
                  "the inputs only, or pass CheckpointOptions().determinism_check(\"none\")");
      TORCH_CHECK(meta == frame->saved[k], "checkpoint: recomputed tensor #", k, " differs from the forward's: ",
                  meta.str(), " instead of ", frame->saved[k].str(), ". The region's ops depend on state that ",
                  "changed between forward and backward; make them depend on the inputs only, or pass ",
                  "CheckpointOptions().determinism_check(\"none\")");
    }
    if (k < frame->recomputed.size()) frame->recomputed[k] = t.detach();
  }
  at::Tensor call_unpack_hook() override {
    TORCH_CHECK(false, "checkpoint: the graph of a recomputation was backpropagated (internal error)");
  }
  NonReentrantFrame* frame;  // (alive: the recomputation runs inside its take)
};


/// A frame for a region run with `options`: the generators of `inputs`' devices (and the CPU's), their states
/// (preserve_rng_state), the autocast state, the determinism check and the selective policy (context_fn). Its `fn`
/// is set by the caller.
std::shared_ptr<NonReentrantFrame> make_non_reentrant_frame(const std::vector<torch::Tensor>& inputs,
                                                            const CheckpointOptions& options);

}  // namespace fsdp::detail
