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

// The autocast state a region ran under (CPU and CUDA), restored for its recomputation.
struct AutocastState {
  bool cpu = false, cuda = false;
  at::ScalarType cpu_dtype = at::kBFloat16, cuda_dtype = at::kHalf;
  static AutocastState current() {
    return {at::autocast::is_autocast_enabled(at::kCPU), at::autocast::is_autocast_enabled(at::kCUDA),
            at::autocast::get_autocast_dtype(at::kCPU), at::autocast::get_autocast_dtype(at::kCUDA)};
  }
  void apply() const {
    at::autocast::set_autocast_enabled(at::kCPU, cpu);
    at::autocast::set_autocast_enabled(at::kCUDA, cuda);
    at::autocast::set_autocast_dtype(at::kCPU, cpu_dtype);
    at::autocast::set_autocast_dtype(at::kCUDA, cuda_dtype);
  }
};

// Sets a region's RNG (optional) and autocast states for its recomputation; puts the caller's back.
class RecomputeStates {
 public:
  RecomputeStates(std::vector<at::Generator> gens, const std::vector<torch::Tensor>* rng, const AutocastState& autocast)
      : gens_(std::move(gens)), autocast_before_(AutocastState::current()) {
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
};

// [Note: non-reentrant checkpoint]
// torch.utils.checkpoint(use_reentrant=False), built on the saved-tensor hooks of saved_tensor_hooks.cpp. The
// first run is an ordinary forward with gradients, so the region's graph is the graph without checkpointing
// (same nodes, same gradients, the parameters' AccumulateGrads); only the tensors its ops save for backward
// are not kept: each one's pack hook records its description (shape, dtype, device) and its index in the
// region. The first unpack in backward re-runs the region (same RNG and autocast states, gradients enabled,
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

struct NonReentrantRecomputeDepth {
  NonReentrantRecomputeDepth() { ++detail::t_non_reentrant_recompute; }
  ~NonReentrantRecomputeDepth() { --detail::t_non_reentrant_recompute; }
};

void NonReentrantFrame::recompute() {
  recomputed.assign(saved.size(), torch::Tensor());
  recomputed_count = 0;
  std::vector<torch::Tensor> detached;
  for (const auto& t : inputs) detached.push_back(t.defined() ? t.detach().requires_grad_(t.requires_grad()) : t);
  RecomputeStates states(gens, rng ? &*rng : nullptr, autocast);
  torch::AutoGradMode enable(true);
  NonReentrantRecomputeDepth depth;
  detail::SavedHooksScope hooks([this] { return std::make_unique<RecomputeHooks>(this); }, "checkpoint");
  // A selective region skips the ops its first run saved; their saved tensors arrive here.
  detail::SelectiveRegion::Scope selective_scope(selective.get(), [this](size_t index, const torch::Tensor* t) {
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

std::vector<torch::Tensor> checkpoint_non_reentrant(CheckpointFn fn, const std::vector<torch::Tensor>& inputs,
                                                    const CheckpointOptions& options) {
  auto frame = std::make_shared<NonReentrantFrame>();
  frame->inputs = inputs;
  frame->gens = generators_for(inputs);
  if (options.preserve_rng_state()) frame->rng = detail::get_states(frame->gens);
  frame->autocast = AutocastState::current();
  frame->check = options.determinism_check() == "default";
  if (options.context_fn()) {
    frame->selective = std::make_unique<detail::SelectiveRegion>(options.context_fn()(), frame->gens,
                                                                 options.preserve_rng_state(), frame->check);
  }
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
    // Recompute under the forward's RNG and autocast states; leave the caller's as they were.
    auto rng_list = ctx->saved_data["rng"].toTensorList();
    std::vector<torch::Tensor> rng(rng_list.begin(), rng_list.end());
    torch::autograd::variable_list outs;
    {
      RecomputeStates states(generators_for(inputs), holder->preserve_rng_state ? &rng : nullptr, holder->autocast);
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
