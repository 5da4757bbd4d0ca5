// The state a heal moves (src/ft/manager.cpp, [Note: replica quorum]): the donor's JSON description of its
// state dict and, on a joiner, the state dict rebuilt from what arrived, checked entry by entry against its own.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>
#include <torch/types.h>

#include "fsdp/checkpoint/state_dict.h"

namespace fsdp::ft::internal {

/// The dtype a description names (`key`: the entry, for the error). Throws c10::Error for a dtype a heal
/// does not carry.
c10::ScalarType dtype_named(const std::string& name, const std::string& key);

/// The donor's description of `sd` (step, keys, kinds, dtypes, shapes, non-tensor values) and, in `locals`,
/// its tensors' local pieces on the host, in that order.
nlohmann::json describe_state(const StateDict& sd, int64_t step, std::vector<torch::Tensor>& locals);

/// The joiner's state dict made of `received` (the description's tensors, in order), shaped as its own `own`.
/// Throws c10::Error naming the first entry whose key, kind, dtype or shape differs from the donor's.
StateDict received_state(const StateDict& own, const nlohmann::json& meta, const std::vector<torch::Tensor>& received,
                         int donor);

}  // namespace fsdp::ft::internal
