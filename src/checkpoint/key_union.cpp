// Checkpoints of ranks that hold different keys (checkpoint/key_union.h).
//
// [Note: ranks with different keys]
// The stages of a pipeline each hold only their own FQNs, so the ranks of one save hold different
// keys: the checkpoint holds their union (rank 0 merges the reports: save.cpp's check_reports), a key
// held by several ranks must be described alike, and a strict load finds unexpected only the keys that
// no rank's state dict asks for. Sharded tensors need nothing more (each rank writes its own chunks);
// replicated ones need a writer chosen before anything is written, below. Both cost one exchange
// through the store.
#include "checkpoint/key_union.h"

#include <optional>
#include <set>

#include <nlohmann/json.hpp>

#include "util.h"

namespace fsdp::dcp::detail {

using fsdp::detail::numel_of;

// Rank 0: checks that the ranks describe each key alike and that the chunks of each tensor cover it
// exactly once. The ranks may hold different keys (pipeline stages each hold their own): the checkpoint
// holds their union, in order of first appearance (rank 0's first), returned in `union_keys`. Returns
// the problem, or "".
std::string check_reports(const std::vector<nlohmann::json>& reports, nlohmann::json* union_keys) {
  std::map<std::string, std::pair<nlohmann::json, size_t>> seen;  // key -> (description, first rank)
  *union_keys = nlohmann::json::array();
  for (size_t r = 0; r < reports.size(); ++r) {
    for (const auto& k : reports[r]["keys"]) {
      const auto key = k[0].get<std::string>();
      auto it = seen.find(key);
      if (it == seen.end()) {
        seen.emplace(key, std::make_pair(k, r));
        union_keys->push_back(k);
      } else if (it->second.first != k) {
        return "'" + key + "' is " + it->second.first.dump() + " on rank " + std::to_string(it->second.second) + " but " +
               k.dump() + " on rank " + std::to_string(r);
      }
    }
  }
  const auto& keys0 = *union_keys;
  // Coverage: the chunks of every tensor tile it (no gap, no overlap).
  struct Box {
    std::vector<int64_t> off, size;
    int rank;
  };
  std::map<std::string, std::vector<Box>> boxes;
  for (size_t r = 0; r < reports.size(); ++r)
    for (const auto& c : reports[r]["chunks"])
      boxes[c[0].get<std::string>()].push_back(
          {c[1].get<std::vector<int64_t>>(), c[2].get<std::vector<int64_t>>(), static_cast<int>(r)});
  for (const auto& k : keys0) {
    if (k[1] == "Value") continue;
    const auto key = k[0].get<std::string>();
    const auto global = k[3].get<std::vector<int64_t>>();
    const auto& bs = boxes[key];
    int64_t covered = 0;
    for (size_t i = 0; i < bs.size(); ++i) {
      covered += numel_of(bs[i].size);
      for (size_t j = 0; j < i; ++j) {
        bool overlap = numel_of(bs[i].size) > 0 && numel_of(bs[j].size) > 0;
        for (size_t d = 0; overlap && d < global.size(); ++d)
          overlap = bs[i].off[d] < bs[j].off[d] + bs[j].size[d] && bs[j].off[d] < bs[i].off[d] + bs[i].size[d];
        if (overlap)
          return "'" + key + "': the chunks of ranks " + std::to_string(bs[j].rank) + " and " + std::to_string(bs[i].rank) +
                 " overlap (are replicas sharing a mesh whose Replicate dim was not marked?)";
      }
    }
    if (covered != numel_of(global))
      return "'" + key + "': the ranks' chunks hold " + std::to_string(covered) + " of its " +
             std::to_string(numel_of(global)) + " elements (every rank of the DTensor's mesh must pass its shard)";
  }
  return "";
}

// Which rank writes each replicated (plain) tensor: the lowest rank holding its key. Usually rank 0
// holds every key, but the stages of a pipeline each hold only their own (the same key never on two
// stages), so a plain tensor of stage 1 must be written by a rank of stage 1. One exchange through the
// store: every rank lists its plain keys, rank 0 answers with the keys whose writer is not rank 0. A
// rank that failed to build its plan lists nothing and its error reaches every rank: all throw it here.
void decide_replicated_writers(Plan& plan, Coordinator& coord, const std::string& error, const char* api) {
  if (coord.single()) {
    TORCH_CHECK(error.empty(), error);
    return;
  }
  nlohmann::json mine;
  if (!error.empty()) {
    mine = {{"error", error}};
  } else {
    mine = {{"plain", nlohmann::json::array()}};
    for (const auto& it : plan.items)
      if (!it.sharded) mine["plain"].push_back(it.key);
  }
  auto all = coord.gather("plain_keys", mine.dump(), "to list its replicated tensors");
  std::string answer;
  if (coord.rank() == 0) {
    nlohmann::json out = {{"writers", nlohmann::json::object()}};
    std::set<std::string> held_by_0;
    for (size_t r = 0; r < all.size(); ++r) {
      auto j = nlohmann::json::parse(all[r]);
      if (j.contains("error")) {
        out = {{"error", "rank " + std::to_string(r) + ": " + j["error"].get<std::string>()}};
        break;
      }
      for (const auto& k : j["plain"]) {
        const auto key = k.get<std::string>();
        if (r == 0) held_by_0.insert(key);
        else if (!held_by_0.count(key) && !out["writers"].contains(key)) out["writers"][key] = r;
      }
    }
    answer = out.dump();
  }
  auto verdict = nlohmann::json::parse(coord.broadcast("plain_writers", answer, "to choose who writes replicated tensors"));
  if (verdict.contains("error")) {
    const auto e = verdict["error"].get<std::string>();
    TORCH_CHECK(false, error.empty() ? std::string(api) + ": " + e : error);
  }
  const auto& writers = verdict["writers"];
  for (auto& it : plan.items) {
    if (it.sharded) continue;
    it.write = writers.contains(it.key) ? writers[it.key].get<int>() == coord.rank() : coord.rank() == 0;
    if (!it.write) it.data = torch::Tensor();
  }
}

std::vector<std::string> unasked_by_every_rank(Coordinator& coord, const std::vector<std::string>& unasked,
                                               bool failed) {
  if (coord.single()) return unasked;
  auto all = coord.gather("unasked", failed ? std::string("*") : nlohmann::json(unasked).dump(),
                          "to list the checkpoint keys its state dict lacks");
  std::string answer;
  if (coord.rank() == 0) {
    std::optional<std::set<std::string>> common;
    for (const auto& a : all) {
      if (a == "*") continue;
      auto keys = nlohmann::json::parse(a).get<std::vector<std::string>>();
      std::set<std::string> mine(keys.begin(), keys.end()), both;
      if (!common) {
        common = std::move(mine);
        continue;
      }
      for (const auto& k : *common)
        if (mine.count(k)) both.insert(k);
      common = std::move(both);
    }
    answer = nlohmann::json(common ? std::vector<std::string>(common->begin(), common->end())
                                   : std::vector<std::string>{}).dump();
  }
  return nlohmann::json::parse(coord.broadcast("unasked_all", answer, "to find the keys no rank asked for"))
      .get<std::vector<std::string>>();
}

}  // namespace fsdp::dcp::detail
