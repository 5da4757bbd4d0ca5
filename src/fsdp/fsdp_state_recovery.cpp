// FSDPState's recovery after a failed iteration: the local cleanup of a backward that threw (abort_backward)
// and the explicit reset of FSDPModule.reset_iter_state. The next root forward completes what either leaves
// in flight (root_pre_forward, fsdp_state.cpp).
#include "fsdp/fsdp_state.h"

namespace fsdp::detail {

void FSDPState::reset_iter_state() {
  if (!ctx) return;  // before the first forward: no iteration state yet
  TORCH_CHECK(is_root(), "reset_iter_state: ", name(), " is not the root of its sharded tree; call it on the root ",
              "(the module fully_shard was applied to last, whose forward begins the step)");
  // As an aborted backward's recovery at the next root forward (root_pre_forward), now, plus the
  // gradients held back across backwards: the failed iteration's gradients are lost.
  if (ctx->in_backward) abort_backward();
  ctx->backward_aborted = false;
  for (FSDPState* s : ctx->states) {
    if (!s->group) continue;
    s->group->discard_gradients_in_flight();
    s->group->discard_accumulated_gradients();
    s->group->reshard();
  }
  ctx->reset_forward(/*adds_to_backward=*/false);
  ctx->forward_open = false;
}

void FSDPState::abort_backward() noexcept {
  // Local only: see [Note: collective order].
  if (!ctx) return;
  for (FSDPState* s : ctx->states) {
    if (s->group) s->group->abort_backward();
  }
  ctx->reset_backward();
  ctx->backward_aborted = true;
}

}  // namespace fsdp::detail
