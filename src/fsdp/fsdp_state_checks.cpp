// FSDPState's checks for a forward that bypassed FSDP: a sharded parameter used outside its module's
// FSDP forward computes on this rank's shard. Caught in the root's post-forward (the autograd graph),
// when the gradient of the use arrives, or when a forward fails (naming the likely culprit).
#include <sstream>
#include <unordered_set>

#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include "fsdp/fsdp_state.h"
#include "util.h"

namespace fsdp::detail {

void FSDPState::check_grad_arrival(const FSDPParam& p, const torch::Tensor& grad) const {
  // A use inside one of the group's FSDP calls gets its gradient after that call's pre-backward
  // unsharded the group (the output's hook runs before any node of the call), and before its
  // post-backward (which waits for every call). Anything else used the parameter on its shard.
  // (An implicit group intercepts every use: see [Note: implicit groups].)
  if (implicit) return;
  if (ctx && ctx->in_backward && training_state == TrainingState::PRE_BACKWARD &&
      (group->sharded_state() == ShardedState::UNSHARDED ||
       group->sharded_state() == ShardedState::UNSHARDED_WITHOUT_DATA)) {
    return;
  }
  raise_bypass(p, "got a gradient (shape " + shape_str(grad.sizes()) + ") in backward from a use");
}

void FSDPState::check_forward_graph(const std::vector<torch::Tensor>& outputs) const {
  if (ctx->param_index.empty()) return;
  // Every node once; AccumulateGrad nodes are the parameters' uses. Checkpointed regions appear as
  // one node (their parameters are used in the recomputation).
  std::vector<torch::autograd::Node*> stack;
  std::unordered_set<torch::autograd::Node*> seen;
  const auto input = input_node.lock();  // held for the walk
  for (const auto& t : outputs) {
    if (t.defined() && t.requires_grad() && t.grad_fn() && seen.insert(t.grad_fn().get()).second) {
      stack.push_back(t.grad_fn().get());
    }
  }
  while (!stack.empty()) {
    auto* node = stack.back();
    stack.pop_back();
    for (const auto& edge : node->next_edges()) {
      auto* fn = edge.function.get();
      if (!fn || !seen.insert(fn).second) continue;
      auto* acc = dynamic_cast<torch::autograd::AccumulateGrad*>(fn);
      if (!acc) {
        if (fn != input.get()) stack.push_back(fn);
        continue;
      }
      auto it = ctx->param_index.find(acc->variable.unsafeGetTensorImpl());
      if (it == ctx->param_index.end()) continue;
      const FSDPState* s = it->second.first;
      const FSDPParam& p = s->group->params()[it->second.second];
      if (!s->ran_forward) {
        s->raise_bypass(p, "is used in this forward, but its module's forward did not go through FSDP: a use");
      }
      // Used while sharded (the accumulator records the shape of the first use in the graph).
      auto shape = C10_AS_INTARRAYREF_SLOW(acc->input_metadata(0).shape_as_dim_vector());
      if (shape != p.sharded_data.sizes() || shape == c10::IntArrayRef(p.orig_size)) continue;
      s->raise_bypass(p, "is used in this forward on its shard (shape " + shape_str(p.sharded_data.sizes()) + "): a use");
    }
  }
}

void FSDPState::raise_bypass(const FSDPParam& p, const std::string& what) const {
  std::string module_desc = name();
  if (modules.size() > 1) {
    auto m = modules[p.module_index].lock();
    const auto& mf = module_fqns.size() > p.module_index ? module_fqns[p.module_index] : std::nullopt;
    module_desc = (mf ? (mf->empty() ? std::string("the root") : "'" + *mf + "'") : std::string("a module")) + " (" +
                  (m ? m->name() : module_type) + ", sharded with " + name() + ")";
  }
  TORCH_CHECK(false, "fully_shard: parameter '", p.fqn, "' of ", module_desc, " on rank ", mesh->get_rank(), " ",
              what, " outside the module's FSDP forward: the forward ",
              "did not go through FSDP, so it computes on this rank's shard (local shape ", shape_str(p.sharded_data.sizes()),
              " of ", c10::IntArrayRef(p.orig_size), ") and its result and gradient would be wrong. A parameter used by ",
              "another module's forward (a tied weight) must belong to a group that is unsharded there (the root's, or ",
              "that module's: one fully_shard call for both), or to a module without a holder. Supported ways to call a ",
              "sharded module: through its fsdp::FSDPModule<Holder> holder as `module(x)` (not `module->forward(x)`, ",
              "which calls the module directly), from a parent's forward through an fsdp::FSDPModule<Holder> member (a ",
              "container such as torch::nn::Sequential calls its children directly: call the children through ",
              "FSDPModule holders in your own forward, or shard the container and its children as one group), not ",
              "through `as<>()`; other entry points through fsdp::fsdp_forward(module, fn)");
}

void forward_failed(FSDPState& state, std::exception_ptr error) {
  // Leave the module consistent: sharded, idle (the next forward gathers again).
  state.training_state = TrainingState::IDLE;
  try {
    if (state.group) state.group->reshard();
  } catch (...) {
    // keep the original error
  }
  if (!state.is_root()) std::rethrow_exception(error);
  std::string what;
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    what = e.what();
  } catch (...) {
    throw;
  }
  if (what.rfind("fully_shard: ", 0) == 0) std::rethrow_exception(error);  // already explained
  // A sharded module whose forward cannot go through FSDP and that did not run: it was most likely
  // called directly on its sharded parameters.
  std::ostringstream hint;
  int found = 0;
  for (FSDPState* s : state.ctx->states) {
    if (s == &state || !s->group || s->ran_forward || s->group->params().empty()) continue;
    auto m = s->modules[0].lock();
    if (!m || s->implicit || is_marked(*m)) continue;
    const auto& p = s->group->params()[0];
    hint << (found++ ? "; " : "") << s->name() << " (e.g. '" << p.fqn << "' holds local shape "
         << shape_str(p.sharded_data.sizes()) << " of " << c10::IntArrayRef(p.orig_size) << " on rank "
         << s->mesh->get_rank() << ")";
  }
  if (found == 0) std::rethrow_exception(error);
  TORCH_CHECK(false, "fully_shard: the forward of ", hint.str(), " did not go through FSDP, so it ran on sharded ",
              "parameters. Fix: declare the module as fsdp::FSDPModule<Holder> instead of Holder (the one-line change), ",
              "or call other entry points through fsdp::fsdp_forward(module, fn). Original error: ", what);
}

}  // namespace fsdp::detail
