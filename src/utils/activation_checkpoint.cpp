// torch.utils.checkpoint (reentrant) for LibTorch: the autograd function that recomputes a region in backward.
#include "fsdp/utils/activation_checkpoint.h"

#include <atomic>
#include <mutex>

#include <ATen/core/Generator.h>
#include <torch/csrc/autograd/custom_function.h>

#include "utils/checkpoint_regions.h"

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
std::atomic<uint64_t> next_region{1};
}  // namespace

const std::vector<CheckpointFrame>& checkpoint_frames() { return t_frames; }
}  // namespace detail

namespace {

// Pushes a frame for the duration of a region's run.
struct FrameGuard {
  FrameGuard(uint64_t region, bool recompute) { detail::t_frames.push_back({region, recompute}); }
  ~FrameGuard() { detail::t_frames.pop_back(); }
  FrameGuard(const FrameGuard&) = delete;
  FrameGuard& operator=(const FrameGuard&) = delete;
};

struct FnHolder : torch::CustomClassHolder {
  CheckpointFn fn;
  explicit FnHolder(CheckpointFn f) : fn(std::move(f)) {}
};

// Default generators whose state the forward saves and the recomputation restores.
std::vector<at::Generator> generators_for(const std::vector<torch::Tensor>& inputs) {
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

std::vector<torch::Tensor> get_states(std::vector<at::Generator>& gens) {
  std::vector<torch::Tensor> states;
  for (auto& g : gens) {
    std::lock_guard<std::mutex> lock(g.mutex());
    states.push_back(g.get_state());
  }
  return states;
}

void set_states(std::vector<at::Generator>& gens, const std::vector<torch::Tensor>& states) {
  for (size_t i = 0; i < gens.size(); ++i) {
    std::lock_guard<std::mutex> lock(gens[i].mutex());
    gens[i].set_state(states[i]);
  }
}

// forward: run fn without grad, save the inputs and the RNG states.
// backward: restore the RNG states, recompute fn with grad, backpropagate through it (reentrant).
struct CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, at::TensorList inputs,
                                                c10::intrusive_ptr<FnHolder> holder) {
    // inputs.back() is the dummy that keeps the graph connected; the rest are the region's inputs.
    std::vector<torch::Tensor> real(inputs.begin(), inputs.end() - 1);
    auto gens = generators_for(real);
    auto rng = get_states(gens);
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
    // Recompute under the forward's RNG state; leave the caller's RNG state as it was.
    auto gens = generators_for(inputs);
    auto now = get_states(gens);
    auto rng_list = ctx->saved_data["rng"].toTensorList();
    std::vector<torch::Tensor> rng(rng_list.begin(), rng_list.end());
    set_states(gens, rng);
    torch::autograd::variable_list outs;
    try {
      torch::AutoGradMode enable(true);
      FrameGuard frame(static_cast<uint64_t>(ctx->saved_data["region"].toInt()), /*recompute=*/true);
      outs = holder->fn(inputs);
    } catch (...) {
      set_states(gens, now);
      throw;
    }
    set_states(gens, now);
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

std::vector<torch::Tensor> checkpoint_tensors(CheckpointFn fn, const std::vector<torch::Tensor>& inputs) {
  // A dummy input that requires grad keeps the recomputation in the graph even when no real input
  // does (e.g. token ids): parameter gradients must still flow.
  std::vector<torch::Tensor> all(inputs);
  all.push_back(torch::empty({0}, torch::TensorOptions().requires_grad(true)));
  auto holder = c10::make_intrusive<FnHolder>(std::move(fn));
  if (!torch::GradMode::is_enabled()) return holder->fn(inputs);  // nothing to save for
  return CheckpointFunction::apply(at::TensorList(all), holder);
}

}  // namespace fsdp
