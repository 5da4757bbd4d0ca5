// See heal_state.h.
#include "ft/heal_state.h"

namespace fsdp::ft::internal {

using json = nlohmann::json;

c10::ScalarType dtype_named(const std::string& name, const std::string& key) {
  for (auto st : {torch::kFloat, torch::kDouble, torch::kHalf, torch::kBFloat16, torch::kLong, torch::kInt,
                  torch::kShort, torch::kChar, torch::kByte, torch::kBool}) {
    if (name == c10::toString(st)) return st;
  }
  TORCH_CHECK(false, "the donor sent '", key, "' as ", name, ", a dtype a heal does not carry");
}

json describe_state(const StateDict& sd, int64_t step, std::vector<torch::Tensor>& locals) {
  json meta;
  meta["step"] = step;
  json entries = json::array();
  for (const auto& [k, v] : sd) {
    json e;
    e["key"] = k;
    e["kind"] = kind_name(v);
    if (const auto* value = std::get_if<Value>(&v)) {
      e["value"] = value->json;
    } else {
      const auto* dt = std::get_if<DTensor>(&v);
      // On the host: the replicate group is Gloo over sockets.
      locals.push_back((dt ? dt->to_local() : std::get<torch::Tensor>(v)).detach().to(torch::kCPU).contiguous());
      e["dtype"] = std::string(c10::toString(locals.back().scalar_type()));
      e["shape"] = locals.back().sizes().vec();
    }
    entries.push_back(e);
  }
  meta["entries"] = entries;
  return meta;
}

StateDict received_state(const StateDict& own, const json& meta, const std::vector<torch::Tensor>& received, int donor) {
  const auto& entries = meta.at("entries");
  const std::string from = " on the donor (replica group " + std::to_string(donor) + ")";
  TORCH_CHECK(entries.size() == own.size(), "the state dict has ", entries.size(), " entries", from, " and ", own.size(),
              " here: every replica group must build the same model and optimizer");
  StateDict in;
  size_t ei = 0, ti = 0;
  for (const auto& [k, v] : own) {
    const auto& e = entries[ei++];
    const std::string dk = e.at("key"), kind = e.at("kind");
    TORCH_CHECK(dk == k && kind == kind_name(v), "entry ", ei - 1, " is '", dk, "' (", kind, ")", from, " and '", k,
                "' (", kind_name(v), ") here: every replica group must build the same model and optimizer");
    if (const auto* value = std::get_if<Value>(&v)) {
      in.insert_or_assign(k, Value(e.at("value"), value->per_rank));
      continue;
    }
    const auto& t = received.at(ti++);
    const auto* dt = std::get_if<DTensor>(&v);
    const torch::Tensor& mine = dt ? dt->to_local() : std::get<torch::Tensor>(v);
    TORCH_CHECK(t.sizes() == mine.sizes() && t.scalar_type() == mine.scalar_type(), "'", k, "' is ",
                c10::toString(t.scalar_type()), " ", t.sizes(), from, " and ", c10::toString(mine.scalar_type()), " ",
                mine.sizes(), " here: every replica group must shard the model alike (same size, same fully_shard calls)");
    auto local = t.to(mine.device());
    if (dt) in.insert_or_assign(k, DTensor(local, dt->device_mesh(), dt->placements(), dt->sizes()));
    else in.insert_or_assign(k, local);
  }
  return in;
}

}  // namespace fsdp::ft::internal
