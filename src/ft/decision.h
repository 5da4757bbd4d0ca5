// One round's decision of the replica quorum (src/ft/manager.cpp, [Note: replica quorum]): written once per
// round with compareSet as JSON, read by every rank.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace fsdp::ft::internal {

/// "[0, 2]" (replica groups, for messages).
inline std::string list_of(const std::vector<int>& v) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i];
  os << "]";
  return os.str();
}

/// Whether replica group `x` is in `v`.
inline bool contains(const std::vector<int>& v, int x) { return std::find(v.begin(), v.end(), x) != v.end(); }

struct Decision {
  int64_t round = -1;
  int64_t step = 0;
  std::vector<int> members, joiners;
  int donor = -1;
  bool new_group = false;
  std::map<int, std::string> reg;  // replica group -> the registration it was admitted with
  std::string lost;                // non-empty: no holder of the state arrived

  std::vector<int> participants() const {
    std::vector<int> p = members;
    p.insert(p.end(), joiners.begin(), joiners.end());
    std::sort(p.begin(), p.end());
    return p;
  }
  std::string dump() const {
    nlohmann::json j;
    j["round"] = round;
    j["step"] = step;
    j["members"] = members;
    j["joiners"] = joiners;
    j["donor"] = donor;
    j["new_group"] = new_group;
    nlohmann::json r = nlohmann::json::object();
    for (const auto& [k, v] : reg) r[std::to_string(k)] = v;
    j["reg"] = r;
    j["lost"] = lost;
    return j.dump();
  }
  static Decision parse(const std::string& s) {
    auto j = nlohmann::json::parse(s);
    Decision d;
    d.round = j.at("round");
    d.step = j.at("step");
    d.members = j.at("members").get<std::vector<int>>();
    d.joiners = j.at("joiners").get<std::vector<int>>();
    d.donor = j.at("donor");
    d.new_group = j.at("new_group");
    for (const auto& [k, v] : j.at("reg").items()) d.reg[std::stoi(k)] = v.get<std::string>();
    d.lost = j.at("lost");
    return d;
  }
};

}  // namespace fsdp::ft::internal
