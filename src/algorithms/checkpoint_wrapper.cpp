// checkpoint_wrapper: marks a module so that fsdp::FSDPModule runs its forward under fsdp::checkpoint (with the
// wrapper's options).
#include "fsdp/algorithms/checkpoint_wrapper.h"

#include "fsdp/fsdp_state.h"

namespace fsdp {

void checkpoint_wrapper(const std::shared_ptr<torch::nn::Module>& module, const CheckpointOptions& options) {
  TORCH_CHECK(module, "checkpoint_wrapper: got a null module");
  auto s = detail::state_of(*module);
  TORCH_CHECK(!s || !s->implicit, "checkpoint_wrapper: ", module->name(), " is sharded without an fsdp::FSDPModule ",
              "holder, so nothing can re-run its forward in backward. Fix: wrap its call in the model's forward, ",
              "`x = fsdp::checkpoint([m](torch::Tensor t) { return m->forward(t); }, x);`, or declare the module as ",
              "fsdp::FSDPModule<Holder>");
  detail::mark_checkpointed(module, options);
}

}  // namespace fsdp
