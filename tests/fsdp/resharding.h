// The test model (seed 11) sharded with reshard_after_forward settings, and the bytes its groups hold
// unsharded: test_reshard_after_forward.cpp, test_memory.cpp and test_init.cpp, in namespace
// fsdp::testing::resharding.
#pragma once

#include <map>
#include <optional>
#include <string>

#include "fsdp/fsdp_state.h"
#include "fsdp_test_model.h"

namespace fsdp::testing::resharding {

inline constexpr int64_t kSeq = 3;

inline std::map<std::string, torch::Tensor> init_weights() {
  static std::map<std::string, torch::Tensor> w = [] {
    torch::manual_seed(11);
    Net net;
    return snapshot(*net);
  }();
  return w;
}

// Blocks with `block_raf` (unset: the default), then the root with `root_raf`.
inline Net shard_net(const DeviceMeshPtr& mesh, std::optional<ReshardAfterForward> block_raf = std::nullopt,
                     std::optional<ReshardAfterForward> root_raf = std::nullopt) {
  Net net;
  load_full(*net, init_weights());
  for (auto& b : net->blocks) fully_shard(b, FullyShardOptions().mesh(mesh).reshard_after_forward(block_raf));
  fully_shard(net, FullyShardOptions().mesh(mesh).reshard_after_forward(root_raf));
  return net;
}

// Bytes held by the unsharded parameters of a group (0 when they are freed).
inline int64_t unsharded_bytes(const detail::FSDPParamGroup& g) {
  int64_t b = 0;
  for (const auto& p : g.params()) {
    if (p.unsharded_padded.defined()) b += static_cast<int64_t>(p.unsharded_padded.storage().nbytes());
  }
  return b;
}

// Bytes the unsharded parameters of a group need (ws * padded rows of each, in the gather dtype).
inline int64_t full_unsharded_bytes(const detail::FSDPParamGroup& g) {
  int64_t b = 0;
  for (const auto& p : g.params()) {
    b += g.shard_size() * p.padded_numel() * static_cast<int64_t>(c10::elementSize(p.param_dtype));
  }
  return b;
}

}  // namespace fsdp::testing::resharding
