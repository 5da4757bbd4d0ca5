// FSDPParamGroup: the unsharded data kept for the next unshard ([Note: kept unsharded data]).
#include "fsdp/fsdp_param_group.h"

namespace fsdp::detail {

// [Note: kept unsharded data]
// PyTorch leaves a group unsharded where libfsdp would free its unsharded data and gather it again at the
// next unshard: after a backward with set_reshard_after_backward(false) (also when it synchronised the
// gradients: microbatches that reduce-scatter each time), and for a group unsharded before the root's
// forward (an explicit unshard(), an unused prefetch). PyTorch then runs the next forward on that data
// even if the optimizer changed the shards in between (stale parameters). libfsdp keeps the data, but the
// parameters hold their shards again (the optimizer steps them), and the next unshard reuses the kept data
// only if every rank of the shard group still finds its own shard in it, bit for bit after the cast to
// param_dtype (a local comparison of 1/ws of the group, then one all-reduce of a flag, so that all ranks
// decide alike: a rank whose shard is empty or unchanged must gather when another's changed); otherwise
// it all-gathers as usual. So the all-gather is saved between microbatches and redone after an optimizer
// step or a load, whatever wrote the shards. Parameters with an all-gather extension are not compared
// (their unsharded values are the extension's, not the shards'): those groups reshard.
void FSDPParamGroup::reshard_keep_unsharded() {
  if (pending_ag_) wait_for_unshard();
  if (state_ == ShardedState::SHARDED) return;
  bool comparable = state_ == ShardedState::UNSHARDED;
  for (const auto& p : params_) comparable = comparable && !p.all_gather_extension;
  if (!comparable) {
    reshard();
    return;
  }
  to_sharded_data();
  state_ = ShardedState::SHARDED;
  unsharded_kept_ = true;
}

bool FSDPParamGroup::kept_unsharded_data_is_current() {
  torch::NoGradGuard no_grad;
  bool current = true;
  for (const auto& p : params_) {
    if (p.local_rows == 0) continue;  // nothing of this rank's in it
    auto mine = p.unsharded_padded.narrow(p.shard_dim, static_cast<int64_t>(shard_rank()) * p.padded_rows, p.local_rows);
    if (!torch::equal(mine, p.sharded_data.to(mine.device(), mine.scalar_type()))) {
      current = false;
      break;
    }
  }
  auto flag = torch::full({1}, current ? 1.0f : 0.0f, torch::TensorOptions().device(opts_.mesh->device()));
  all_reduce(flag, *shard_pg_, ReduceOp::MIN);
  return flag.item<float>() == 1.0f;
}

}  // namespace fsdp::detail
