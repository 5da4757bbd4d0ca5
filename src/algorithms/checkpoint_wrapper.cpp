// checkpoint_wrapper: marks a module so that fsdp::FSDPModule runs its forward under fsdp::checkpoint (with the
// wrapper's options).
#include "fsdp/algorithms/checkpoint_wrapper.h"

#include <sstream>
#include <string>
#include <vector>

#include "fsdp/fsdp_state.h"

namespace fsdp {

namespace {
// Why `module` cannot be wrapped (empty: it can): only a module called through an FSDPModule holder has a call
// that libfsdp runs, and so can re-run in backward.
std::string unwrappable(const torch::nn::Module& module) {
  auto s = detail::state_of(module);
  if (s && s->implicit) return "is sharded without an fsdp::FSDPModule holder";
  if (!detail::is_marked(module)) return "has no live fsdp::FSDPModule holder (its forward is called by the model's own code)";
  return "";
}

const char* kFix = "so nothing in libfsdp calls its forward, and it cannot be re-run in backward. Fix: checkpoint "
                   "its call in the model's forward, `x = fsdp::checkpoint([m](torch::Tensor t) { return "
                   "m->forward(t); }, x);` (with the same CheckpointOptions), or declare the module as "
                   "fsdp::FSDPModule<Holder> before wrapping it";
}  // namespace

void checkpoint_wrapper(const std::shared_ptr<torch::nn::Module>& module, const CheckpointOptions& options) {
  TORCH_CHECK(module, "checkpoint_wrapper: got a null module");
  const auto why = unwrappable(*module);
  TORCH_CHECK(why.empty(), "checkpoint_wrapper: ", module->name(), " ", why, ", ", kFix);
  detail::mark_checkpointed(module, options);
}

void offload_wrapper(const std::shared_ptr<torch::nn::Module>& module) {
  TORCH_CHECK(module, "offload_wrapper: got a null module");
  const auto why = unwrappable(*module);
  TORCH_CHECK(why.empty(), "offload_wrapper: ", module->name(), " ", why, ", so nothing in libfsdp calls its forward. ",
              "Fix: run its call in the model's forward under `fsdp::save_on_cpu offload(/*pin_memory=*/true);`, or ",
              "declare the module as fsdp::FSDPModule<Holder> before wrapping it");
  detail::mark_offloaded(module);
}

int64_t apply_activation_checkpointing(torch::nn::Module& model, const std::function<bool(torch::nn::Module&)>& check_fn,
                                       const CheckpointOptions& options) {
  TORCH_CHECK(check_fn, "apply_activation_checkpointing: expected a check_fn, got an empty function");
  std::vector<std::shared_ptr<torch::nn::Module>> matches;
  std::ostringstream refused;
  int64_t n_refused = 0;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    if (!check_fn(*item.value())) continue;
    const auto why = unwrappable(*item.value());
    if (why.empty()) {
      matches.push_back(item.value());
    } else {
      refused << (n_refused++ ? "; " : "") << "'" << item.key() << "' (" << item.value()->name() << ") " << why;
    }
  }
  TORCH_CHECK(n_refused == 0, "apply_activation_checkpointing: ", n_refused, " of the ", n_refused + matches.size(),
              " modules check_fn selected cannot be wrapped, none was: ", refused.str(), "; ", kFix);
  for (const auto& m : matches) detail::mark_checkpointed(m, options);
  return static_cast<int64_t>(matches.size());
}

}  // namespace fsdp
