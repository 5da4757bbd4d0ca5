// torch.utils.checkpoint for LibTorch: non-reentrant (saved-tensor hooks) and reentrant (an autograd function
// that recomputes the region in backward).
#include "fsdp/utils/activation_checkpoint.h"

#include <atomic>
#include <mutex>
#include <sstream>

#include <ATen/autocast_mode.h>
#include <ATen/core/Generator.h>
#include <torch/csrc/autograd/custom_function.h>

#include "utils/checkpoint_regions.h"
#include "utils/rng_states.h"
#include "utils/implicit_checkpoint.h"
#include "utils/non_reentrant_frame.h"
#include "utils/saved_tensor_hooks_internal.h"
#include "utils/selective_checkpoint_internal.h"

// [Note: recomputed regions]
// A module called in several checkpoint regions (each call checkpointed on its own, or nested regions) is
// recomputed region by region in backward: each recomputation runs its own nested backward, so when the
// first one's gradients are ready the later ones have not run yet, and a group reduced then would be
// reduced again by the next (two reduce-scatters, and in bf16 a rounded partial sum). Each region's
// CheckpointFunction node gets a number; while a region runs (its first run, or its recomputation) it is
// on this thread's frame stack (checkpoint_frames). FSDP records the regions whose first run used a group
// and waits, before the group's post-backward, until each was recomputed (FSDPState::note_checkpoint_use).
namespace fsdp {
namespace detail {
namespace {
thread_local std::vector<CheckpointFrame> t_frames;
thread_local int t_non_reentrant_recompute = 0;
std::atomic<uint64_t> next_region{1};
}  // namespace

const std::vector<CheckpointFrame>& checkpoint_frames() { return t_frames; }
bool in_non_reentrant_recompute() { return t_non_reentrant_recompute > 0; }
}  // namespace detail

namespace {

// Pushes a frame for the duration of a region's run.
struct FrameGuard {
  FrameGuard(uint64_t region, bool recompute) { detail::t_frames.push_back({region, recompute}); }
  ~FrameGuard() { detail::t_frames.pop_back(); }
  FrameGuard(const FrameGuard&) = delete;
  FrameGuard& operator=(const FrameGuard&) = delete;
};

}  // namespace

namespace detail {
namespace {
struct NonReentrantRecomputeDepth {
  NonReentrantRecomputeDepth() { ++t_non_reentrant_recompute; }
  ~NonReentrantRecomputeDepth() { --t_non_reentrant_recompute; }
};
}  // namespace

void NonReentrantFrame::recompute() {
  recomputed.assign(saved.size(), torch::Tensor());
  recomputed_count = 0;
  std::vector<torch::Tensor> detached;
  for (const auto& t : inputs) detached.push_back(t.defined() ? t.detach().requires_grad_(t.requires_grad()) : t);
  RecomputeStates states(gens, rng ? &*rng : nullptr, autocast, regions);
  torch::AutoGradMode enable(true);
  NonReentrantRecomputeDepth depth;
  SavedHooksScope hooks([this] { return std::make_unique<RecomputeHooks>(this); }, "checkpoint");
  // A selective region skips the ops its first run saved; their saved tensors arrive here.
  SelectiveRegion::Scope selective_scope(selective.get(), [this](size_t index, const torch::Tensor* t) {
    const size_t k = recomputed_count++;
    TORCH_CHECK(!check || k == index, "checkpoint (selective): a saved op's tensor #", index, " arrived as #", k,
                " of the recomputation. The region's ops depend on state that changed between forward and ",
                "backward; make them depend on the inputs only");
    if (t && index < recomputed.size()) recomputed[index] = t->detach();
  });
  fn(detached);  // the outputs and the recomputation's graph are dropped here
  selective_scope.finish();
  TORCH_CHECK(!check || recomputed_count == saved.size(), "checkpoint: the recomputation saved ", recomputed_count,
              " tensors for backward, the forward ", saved.size(), ". The region's ops depend on state that changed ",
              "between forward and backward; make them depend on the inputs only, or pass ",
              "CheckpointOptions().determinism_check(\"none\")");
}

torch::Tensor NonReentrantFrame::take(size_t index) {
  std::lock_guard<std::mutex> lock(mu);
  if (selective) {
    if (const torch::Tensor* kept = selective->kept(index)) return *kept;
  }
  if (index >= recomputed.size() || !recomputed[index].defined()) recompute();
  TORCH_CHECK(index < recomputed.size() && recomputed[index].defined(), "checkpoint: the recomputation did not save ",
              "tensor #", index, " (", saved[index].str(), ") that the forward saved (determinism_check \"none\")");
  return std::exchange(recomputed[index], torch::Tensor());
}

std::shared_ptr<NonReentrantFrame> make_non_reentrant_frame(const std::vector<torch::Tensor>& inputs,
                                                            const CheckpointOptions& options) {
  auto frame = std::make_shared<NonReentrantFrame>();
  frame->gens = generators_for(inputs);
  if (options.preserve_rng_state()) frame->rng = get_states(frame->gens);
  frame->autocast = AutocastState::current();
  frame->regions = capture_regions();
  frame->check = options.determinism_check() == "default";
  if (options.context_fn()) {
    frame->selective = std::make_unique<SelectiveRegion>(options.context_fn()(), frame->gens,
                                                         options.preserve_rng_state(), frame->check);
  }
  return frame;
}

}  // namespace detail

namespace {
using detail::AutocastState;
using detail::FirstRunHooks;
using detail::generators_for;
using detail::NonReentrantFrame;
using detail::RecomputeStates;

std::vector<torch::Tensor> checkpoint_non_reentrant(CheckpointFn fn, const std::vector<torch::Tensor>& inputs,
                                                    const CheckpointOptions& options) {
  auto frame = detail::make_non_reentrant_frame(inputs, options);
  frame->inputs = inputs;
  std::vector<torch::Tensor> outs;
  {
    std::weak_ptr<NonReentrantFrame> weak = frame;  // the hooks own the frame; the factory must not
    detail::SavedHooksScope hooks([weak] { return std::make_unique<FirstRunHooks>(weak.lock()); }, "checkpoint");
    // (Also without a policy: suspends an enclosing selective region, whose op count must not see this one's.)
    detail::SelectiveRegion::Scope selective_scope(frame->selective.get(), {});
    outs = fn(inputs);
  }
  frame->fn = std::move(fn);  // kept by the hooks for the recomputation (none: nothing was saved)
  return outs;
}

struct FnHolder : torch::CustomClassHolder {
  CheckpointFn fn;
  bool preserve_rng_state = true;
  AutocastState autocast = AutocastState::current();
  std::vector<detail::RegionReentry> regions = detail::capture_regions();
  explicit FnHolder(CheckpointFn f) : fn(std::move(f)) {}
};

// forward: run fn without grad, save the inputs and the RNG states.
// backward: restore the RNG states, recompute fn with grad, backpropagate through it (reentrant).
struct CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, at::TensorList inputs,
                                                c10::intrusive_ptr<FnHolder> holder) {
    // inputs.back() is the dummy that keeps the graph connected; the rest are the region's inputs.
    std::vector<torch::Tensor> real(inputs.begin(), inputs.end() - 1);
    auto gens = generators_for(real);
    auto rng = holder->preserve_rng_state ? detail::get_states(gens) : std::vector<torch::Tensor>();
    ctx->saved_data["fn"] = c10::IValue::make_capsule(holder);
    ctx->saved_data["rng"] = c10::List<torch::Tensor>(rng);
    ctx->save_for_backward(real);
    const auto region = detail::next_region.fetch_add(1);
    ctx->saved_data["region"] = static_cast<int64_t>(region);
    torch::autograd::variable_list outs;
    {
      torch::NoGradGuard no_grad;
      FrameGuard frame(region, /*recompute=*/false);
      outs = holder->fn(real);
    }
    TORCH_CHECK(!outs.empty(), "checkpoint: the checkpointed function returned no tensor");
    return outs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    auto saved = ctx->get_saved_variables();
    auto holder = c10::static_intrusive_pointer_cast<FnHolder>(ctx->saved_data["fn"].toCapsule());
    std::vector<torch::Tensor> inputs;
    for (const auto& t : saved) {
      inputs.push_back(t.defined() ? t.detach().requires_grad_(t.requires_grad()) : t);
    }
    // Recompute under the forward's RNG, autocast and thread-region states; leave the caller's as they were.
    auto rng_list = ctx->saved_data["rng"].toTensorList();
    std::vector<torch::Tensor> rng(rng_list.begin(), rng_list.end());
    torch::autograd::variable_list outs;
    {
      RecomputeStates states(generators_for(inputs), holder->preserve_rng_state ? &rng : nullptr, holder->autocast,
                             holder->regions);
      torch::AutoGradMode enable(true);
      FrameGuard frame(static_cast<uint64_t>(ctx->saved_data["region"].toInt()), /*recompute=*/true);
      outs = holder->fn(inputs);
    }
    torch::autograd::variable_list roots, grads;
    for (size_t i = 0; i < outs.size() && i < grad_outputs.size(); ++i) {
      if (outs[i].defined() && outs[i].requires_grad() && grad_outputs[i].defined()) {
        roots.push_back(outs[i]);
        grads.push_back(grad_outputs[i]);
      }
    }
    if (!roots.empty()) torch::autograd::backward(roots, grads);
    torch::autograd::variable_list result;
    for (const auto& t : inputs) result.push_back(t.defined() && t.requires_grad() ? t.grad() : torch::Tensor());
    result.emplace_back();  // the dummy
    result.emplace_back();  // the holder
    return result;
  }
};

}  // namespace

std::vector<torch::Tensor> checkpoint_tensors(CheckpointFn fn, const std::vector<torch::Tensor>& inputs,
                                              const CheckpointOptions& options) {
  TORCH_CHECK(options.determinism_check() == "default" || options.determinism_check() == "none",
              "checkpoint: determinism_check must be \"default\" or \"none\", got \"", options.determinism_check(), "\"");
  TORCH_CHECK(!options.use_reentrant() || !options.context_fn(), "checkpoint: context_fn (selective checkpointing) ",
              "needs the non-reentrant form; got use_reentrant(true). Fix: CheckpointOptions().use_reentrant(false)");
  // An implicit region open on this thread ends where an explicit one begins, and none opens inside it (its first run
  // and its reentrant forward; its recomputations run inside a backward, where none opens either): [Note: implicit
  // checkpoint regions].
  detail::SuspendImplicitRegions suspend_implicit;
  if (!torch::GradMode::is_enabled()) return fn(inputs);  // nothing to save for
  if (!options.use_reentrant()) return checkpoint_non_reentrant(std::move(fn), inputs, options);
  // A dummy input that requires grad keeps the recomputation in the graph even when no real input
  // does (e.g. token ids): parameter gradients must still flow.
  std::vector<torch::Tensor> all(inputs);
  all.push_back(torch::empty({0}, torch::TensorOptions().requires_grad(true)));
  auto holder = c10::make_intrusive<FnHolder>(std::move(fn));
  holder->preserve_rng_state = options.preserve_rng_state();
  return CheckpointFunction::apply(at::TensorList(all), holder);
}

torch::Tensor checkpoint_sequential(const torch::nn::Sequential& sequential, int64_t segments, torch::Tensor input,
                                    const CheckpointOptions& options) {
  const auto n = static_cast<int64_t>(sequential->size());
  TORCH_CHECK(segments >= 1 && segments <= n, "checkpoint_sequential: ", segments, " segments for a Sequential of ", n,
              " modules; expected between 1 and ", n);
  // The pieces as PyTorch cuts them: segments - 1 of n / segments modules, checkpointed; the rest runs as is.
  const int64_t size = n / segments;
  auto run = [seq = sequential.ptr()](int64_t begin, int64_t end) {
    return [seq, begin, end](torch::Tensor x) {
      for (auto it = seq->begin() + begin; it != seq->begin() + end; ++it) x = it->forward(x);
      return x;
    };
  };
  int64_t begin = 0;
  for (int64_t s = 0; s + 1 < segments; ++s, begin += size) input = checkpoint(options, run(begin, begin + size), input);
  return run(begin, n)(input);
}

}  // namespace fsdp
