// The states of the default generators a checkpoint region restores (its forward's, for the recomputation), shared
// by full (activation_checkpoint.cpp) and selective (selective_checkpoint.cpp) checkpointing.
#pragma once

#include <mutex>
#include <vector>

#include <ATen/core/Generator.h>
#include <torch/types.h>

namespace fsdp::detail {

/// Each generator's state, in order (under its lock).
inline std::vector<torch::Tensor> get_states(std::vector<at::Generator>& gens) {
  std::vector<torch::Tensor> states;
  for (auto& g : gens) {
    std::lock_guard<std::mutex> lock(g.mutex());
    states.push_back(g.get_state());
  }
  return states;
}

/// Sets each generator to its state in `states` (as get_states returned them).
inline void set_states(std::vector<at::Generator>& gens, const std::vector<torch::Tensor>& states) {
  for (size_t i = 0; i < gens.size(); ++i) {
    std::lock_guard<std::mutex> lock(gens[i].mutex());
    gens[i].set_state(states[i]);
  }
}

}  // namespace fsdp::detail
