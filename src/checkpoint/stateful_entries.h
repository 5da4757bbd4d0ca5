// Stateful objects spliced into a state dict for dcp::save and dcp::load (see stateful.cpp).
#pragma once

#include <vector>

#include "fsdp/checkpoint/stateful.h"

namespace fsdp::dcp::detail {

/// `sd` plus, for each Stateful object of it (in order), the entries its state_dict() returns under
/// "<key>." (tensors alias the object's). Each object's own dict goes into `subs` when given.
/// Throws c10::Error naming the key for a null object or an entry that collides with one of `sd`.
StateDict with_stateful_entries(const StateDict& sd, const char* api, std::vector<StateDict>* subs = nullptr);

}  // namespace fsdp::dcp::detail
