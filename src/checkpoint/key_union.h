// Checkpoints of ranks that hold different keys: the stages of a pipeline each hold only their own FQNs.
// See [Note: ranks with different keys] in key_union.cpp. Internal (save.cpp, load.cpp).
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "checkpoint/coordinator.h"
#include "checkpoint/save_plan.h"

namespace fsdp::dcp::detail {

/// Save, rank 0: checks that the ranks describe each key alike and that the chunks of each tensor cover
/// it exactly once; `union_keys` gets the checkpoint's keys (their union, rank 0's first). Returns the
/// problem, or "".
std::string check_reports(const std::vector<nlohmann::json>& reports, nlohmann::json* union_keys);

/// Save: which rank writes each replicated (plain) tensor of `plan`: sets Item::write. Every rank takes
/// part, even one whose plan failed (`error` non-empty): then every rank throws that error here.
void decide_replicated_writers(Plan& plan, Coordinator& coord, const std::string& error, const char* api);

/// Strict load: the checkpoint's keys that no rank's state dict holds, from each rank's `unasked` (its
/// own unexpected keys); a rank that `failed` counts as asking for everything. Collective.
std::vector<std::string> unasked_by_every_rank(Coordinator& coord, const std::vector<std::string>& unasked, bool failed);

}  // namespace fsdp::dcp::detail
