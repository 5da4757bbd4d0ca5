// Stateful objects in dcp::save / dcp::load (include/fsdp/checkpoint/stateful.h): their state dicts
// are spliced into the state dict under "<key>." for the save or load, and handed back after a load.
#include "fsdp/checkpoint/stateful.h"

#include "checkpoint/stateful_entries.h"

namespace fsdp {

void Stateful::load_state_dict_resharded(const StateDict&, int saved_world_size, int world_size, int rank) {
  TORCH_CHECK(false, "Stateful::load_state_dict_resharded: this object returned reshardable() true but does not ",
              "override load_state_dict_resharded (per-rank state saved by ", saved_world_size, " ranks, loading on ",
              world_size, ", rank ", rank, ")");
}

namespace dcp::detail {

StateDict with_stateful_entries(const StateDict& sd, const char* api, std::vector<StateDict>* subs) {
  if (sd.stateful().empty()) return sd;
  StateDict out = sd;
  for (const auto& [key, obj] : sd.stateful()) {
    TORCH_CHECK(obj, api, ": the Stateful under '", key, "' is null");
    StateDict sub = obj->state_dict();
    for (const auto& [k, _] : sub) {
      TORCH_CHECK(!out.contains(key + "." + k), api, ": the Stateful '", key, "' returns '", k, "', but the state dict ",
                  "already holds '", key, ".", k, "'. Fix: insert the object under another key");
    }
    out.update(sub, key + ".");
    if (subs) subs->push_back(std::move(sub));
  }
  return out;
}

}  // namespace dcp::detail
}  // namespace fsdp
