// checkpoint_wrapper: marks a module so that fsdp::FSDPModule runs its forward under fsdp::checkpoint (with the
// wrapper's options).
#include "fsdp/algorithms/checkpoint_wrapper.h"

#include <sstream>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "fsdp/fsdp_state.h"
#include "util.h"
#include "utils/implicit_checkpoint.h"

namespace fsdp {

namespace {
// Whether `module` has a call that libfsdp runs (a live FSDPModule holder through which the model calls it, not an
// implicit group), so that its forward can be re-run as one region; else it is checkpointed from its parameters
// ([Note: implicit checkpoint regions], src/utils/implicit_checkpoint.cpp).
bool has_holder_call(const torch::nn::Module& module) {
  auto s = detail::state_of(module);
  return detail::is_marked(module) && !(s && s->implicit);
}

// The parameters whose ops open an unchanged module's regions: its own and its descendants', except those of
// descendants called through a holder (a holder's forward ends a region and runs as its own call).
void region_params(const torch::nn::Module& module, std::vector<torch::Tensor>& out) {
  for (const auto& p : module.named_parameters(/*recurse=*/false)) out.push_back(p.value());
  for (const auto& child : module.children()) {
    if (!has_holder_call(*child)) region_params(*child, out);
  }
}

std::vector<torch::Tensor> region_params(const torch::nn::Module& module) {
  std::vector<torch::Tensor> out;
  region_params(module, out);
  return out;
}
}  // namespace

void checkpoint_wrapper(const std::shared_ptr<torch::nn::Module>& module, const CheckpointOptions& options) {
  TORCH_CHECK(module, "checkpoint_wrapper: got a null module");
  if (has_holder_call(*module)) return detail::mark_checkpointed(module, options);
  detail::checkpoint_implicitly(module->name(), region_params(*module), options);
}

void offload_wrapper(const std::shared_ptr<torch::nn::Module>& module) {
  TORCH_CHECK(module, "offload_wrapper: got a null module");
  if (has_holder_call(*module)) return detail::mark_offloaded(module);
  detail::checkpoint_implicitly(module->name(), region_params(*module), CheckpointOptions(),
                                detail::ImplicitRegionKind::Offload);
}

int64_t apply_activation_checkpointing(torch::nn::Module& model, const std::function<bool(torch::nn::Module&)>& check_fn,
                                       const CheckpointOptions& options) {
  TORCH_CHECK(check_fn, "apply_activation_checkpointing: expected a check_fn, got an empty function");
  struct Match {
    std::string path;
    std::shared_ptr<torch::nn::Module> module;
    bool holder;
    std::vector<torch::Tensor> params;  // (without a holder) the parameters that open its regions
  };
  std::vector<Match> matches;
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    if (!check_fn(*item.value())) continue;
    Match m{item.key(), item.value(), has_holder_call(*item.value()), {}};
    if (!m.holder) m.params = region_params(*m.module);
    matches.push_back(std::move(m));
  }
  // All or nothing: every unchanged match is checked before any is applied.
  std::ostringstream refused;
  std::set<const Match*> refused_matches;
  auto refuse = [&](const Match& m, const std::string& why) {
    if (!refused_matches.insert(&m).second) return;  // (its first reason)
    refused << (refused_matches.size() > 1 ? "; " : "") << "'" << m.path << "' (" << m.module->name() << ") " << why;
  };
  for (const auto& m : matches) {
    if (m.holder) continue;
    if (m.params.empty()) {
      refuse(m, "has no parameters outside modules with a holder, so its ops cannot be told from the model's (an "
                "unchanged module is checkpointed from the ops on its parameters): select its parent, or checkpoint "
                "its call with fsdp::checkpoint");
    } else if (options.use_reentrant()) {
      refuse(m, "has no fsdp::FSDPModule holder, and the reentrant form re-runs a call, which the model's own code "
                "makes: use the non-reentrant form (the default), or declare it as fsdp::FSDPModule<Holder>");
    }
    for (const auto& outer : matches) {
      if (&outer == &m || outer.holder) continue;
      if (m.path.size() > outer.path.size() && m.path.compare(0, outer.path.size() + 1, outer.path + ".") == 0) {
        refuse(m, "is inside '" + outer.path + "', which check_fn selected too: an unchanged module's region is "
                  "told by its parameters, and each parameter opens one region. Select one of the two");
      }
    }
  }
  std::unordered_map<const c10::TensorImpl*, const Match*> owner;  // parameters tied between two matches
  for (const auto& m : matches) {
    for (const auto& p : m.params) {
      auto [it, fresh] = owner.emplace(p.unsafeGetTensorImpl(), &m);
      if (!fresh && it->second != &m) {
        refuse(m, "shares a parameter (shape " + detail::shape_str(p.sizes()) + ") with '" + it->second->path +
                  "': an op on it could not tell which module's region it begins. Select one of the two");
      }
    }
  }
  TORCH_CHECK(refused_matches.empty(), "apply_activation_checkpointing: ", refused_matches.size(), " of the ",
              matches.size(),
              " modules check_fn selected cannot be checkpointed, none was: ", refused.str());
  for (const auto& m : matches) {
    if (m.holder) {
      detail::mark_checkpointed(m.module, options);
    } else {
      detail::checkpoint_implicitly(m.path + " (" + m.module->name() + ")", m.params, options);
    }
  }
  return static_cast<int64_t>(matches.size());
}

}  // namespace fsdp
