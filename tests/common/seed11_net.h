// The test model (fsdp_test_model.h's Net) with the weights of seed 11, sharded per block then the root:
// the helpers of the mixed precision, gradient scaler and CPU offload tests (tests/fsdp) and of the
// clip_grad_norm_ and activation checkpointing tests (tests/algorithms), in namespace fsdp::testing::seed11_net.
#pragma once

#include <map>
#include <string>

#include "fsdp_test_model.h"
#include "multi_rank.h"

namespace fsdp::testing::seed11_net {

inline constexpr int64_t kBatch = 12;
inline constexpr int64_t kSeq = 3;

inline std::map<std::string, torch::Tensor> initial_weights() {
  static std::map<std::string, torch::Tensor> w = [] {
    torch::manual_seed(11);
    Net net;
    return snapshot(*net);
  }();
  return w;
}

inline Net sharded_net(ProcessGroupPtr pg, const FullyShardOptions& base) {
  Net net;
  load_full(*net, initial_weights());
  auto opts = base;
  opts.mesh(init_device_mesh(torch::kCPU, {pg->size()}));
  for (auto& b : net->blocks) fully_shard(b, opts);
  fully_shard(net, opts);
  return net;
}

inline FullyShardOptions bf16(torch::ScalarType reduce) {
  return FullyShardOptions().mp_policy(MixedPrecisionPolicy().param_dtype(torch::kBFloat16).reduce_dtype(reduce));
}

}  // namespace fsdp::testing::seed11_net
