// FSDPState's backward: the pre-backward (unshard, prefetch, the end-of-backward callback), the post-backward
// (the group's reduce-scatter) and the root's end-of-backward work. See [Note: post-backward and the
// end-of-backward callback] and [Note: collective order] (fsdp_state.cpp).
#include <torch/csrc/autograd/engine.h>

#include "fsdp/fsdp_state.h"

namespace fsdp::detail {

namespace {
// Runs the root's cleanup when a backward ends without its end-of-backward callback (an exception
// inside the backward: the engine drops the graph task, and with it this guard, before the
// exception reaches the caller — so before user code can zero or step the gradients).
// See [Note: post-backward and the end-of-backward callback].
struct BackwardGuard {
  explicit BackwardGuard(int64_t id) : root_id(id) {}
  BackwardGuard(const BackwardGuard&) = delete;  // one owner: only its destruction means "dropped"
  BackwardGuard& operator=(const BackwardGuard&) = delete;
  int64_t root_id;
  bool finished = false;
  ~BackwardGuard() {
    if (finished) return;
    if (auto r = state_by_id(root_id)) r->abort_backward();
  }
};
}  // namespace

void FSDPState::pre_backward() {
  if (!ctx->in_backward) {
    // See [Note: post-backward and the end-of-backward callback].
    // First FSDP hook of this backward: queue the end-of-backward callback (with a guard that cleans
    // up if the backward throws) and move every group's sharded gradients out of autograd's way.
    ctx->in_backward = true;
    if (ctx->forward_open) ctx->close_forward(this);  // an implicit root's forward ends here
    auto guard = std::make_shared<BackwardGuard>(ctx->root->id);
    torch::autograd::Engine::get_default_engine().queue_callback([guard] {
      if (auto r = state_by_id(guard->root_id)) r->root_post_backward_final();
      guard->finished = true;
    });
    for (FSDPState* s : ctx->states) {
      if (s->group) s->group->begin_backward();
    }
  }
  // Already ran for this backward of the module, and no post-backward since: still unsharded.
  if (training_state == TrainingState::PRE_BACKWARD) return;
  training_state = TrainingState::PRE_BACKWARD;
  if (group && group->unshard_in_backward) {
    group->unshard(/*async_op=*/true);
    group->wait_for_unshard();
  } else if (group) {
    group->expose_unsharded_shape();  // [Note: set_unshard_in_backward(false)] (fsdp_param_group.cpp)
  }
  // Prefetch: the explicit list, or the state whose forward ran just before this one (calls are
  // visited in reverse order of their post-forwards; a second backward over the graph reads again).
  size_t index = 0;
  bool have_index = false;
  if (backward_cursor < post_forward_indices.size()) {
    index = post_forward_indices[post_forward_indices.size() - 1 - backward_cursor];
    ++backward_cursor;
    have_index = true;
  }
  if (backward_prefetch) {
    for (auto& w : *backward_prefetch) prefetch(w.lock().get());
  } else if (have_index && index > 0) {
    prefetch(ctx->post_forward_order[index - 1]);
  }
}

void FSDPState::on_input_grads_ready() {
  // See [Note: post-backward and the end-of-backward callback].
  ++input_grads_ready;
  // Only when every use of the group's parameters is known to be done; otherwise (a call whose
  // inputs need no gradient, a call whose output got no gradient) the end-of-backward callback runs
  // the post-backward once the whole backward is done.
  if (training_state == TrainingState::PRE_BACKWARD && all_calls_done()) post_backward();
}

// [Note: one reduce-scatter in flight]
// A group's reduce-scatter is issued by its post-backward and overlaps the backward of the groups before
// it. Its buffers (the [ws, M + P] input, which the backend's work holds until it is destroyed, and the
// output) and the group's full-size gradients until then are the largest transient memory of a
// parameter-heavy backward, so a group's reduce-scatter is finished (waited, divided, copied out to the
// sharded gradients in the stash) when the next group's is issued, as FSDP2 waits for the previous
// reduce-scatter in each post-backward: at most two are alive at once, instead of every group's until the
// end-of-backward callback. The order stays that of the post-backwards, the same on every rank (see
// [Note: collective order]); a group with set_is_last_backward(false) keeps its reduce-scatter in flight
// past the backward, as before. On CUDA finishing makes the compute stream wait for the previous group's
// reduce-scatter, issued one group's backward earlier and normally complete by then (FSDP2 waits on its
// reduce-scatter stream instead; to revisit with a GPU profile).
void FSDPState::post_backward() {
  training_state = TrainingState::POST_BACKWARD;
  ++post_backward_runs;
  if (!group) return;
  group->post_backward(requires_gradient_sync, reshard_after_backward, divide_factor());
  if (!group->reduce_in_flight()) return;
  FSDPState* previous = std::exchange(ctx->reduce_pending, this);
  if (previous && previous != this && previous->group && previous->is_last_backward) {
    previous->group->finish_reduce(previous->divide_factor());
  }
}

void FSDPState::root_post_backward_final() {
  // See [Note: post-backward and the end-of-backward callback] and [Note: collective order].
  // Finish every group whose post-backward did not run (its hooks could not tell when its gradients
  // were complete: inputs without grad such as token ids, a call whose output fed no gradient), or
  // that received gradients after it ran. Fixed pre-order: the same collectives on every rank.
  for (FSDPState* s : ctx->states) {
    if (!s->group) continue;
    if (s->training_state == TrainingState::PRE_BACKWARD || s->group->has_unsharded_grads()) s->post_backward();
  }
  for (FSDPState* s : ctx->states) {
    if (!s->group) continue;
    if (s->is_last_backward) s->group->finish_reduce(s->divide_factor());
    // reshard_after_backward=false keeps the unsharded parameters, as PyTorch. After a synchronised
    // backward the optimizer may step next: the parameters hold their shards (with the gradients) and the
    // unsharded data is kept for the next unshard, which reuses it if no shard changed ([Note: kept
    // unsharded data]); between microbatches without gradient sync they stay unsharded.
    if (s->reshard_after_backward) {
      s->group->reshard();
    } else if (s->requires_gradient_sync && s->is_last_backward) {
      s->group->reshard_keep_unsharded();
    }
    s->group->end_backward();
  }
  ctx->reset_backward();
}

}  // namespace fsdp::detail
