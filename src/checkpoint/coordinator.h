// Coordination of the ranks of one checkpoint operation through the group's c10d Store (not its
// collectives): every rank can report an error instead of hanging the others in a collective, and an
// async save can coordinate from a background thread while training issues collectives on the group.
//
// Each operation gets an id that every rank computes alike without communicating: its own count of
// checkpoint operations on the group, kept in the store under a per-rank key (so it restarts with a
// fresh store). Ranks call save/load in the same order, so their n-th operations match.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "fsdp/c10d/distributed.h"
#include "fsdp/checkpoint/state_dict.h"
#include "checkpoint/validate_agree_apply.h"

namespace fsdp::dcp::detail {

class Coordinator {
 public:
  /// A coordinator of one process (no communication).
  Coordinator() = default;
  /// Allocates the next operation id of this rank on `group` (null or size 1: a single process).
  /// `clone_store`: use a fresh store client (for a background thread).
  Coordinator(const ProcessGroupPtr& group, const char* api, bool clone_store = false) : api_(api) {
    if (!group || group->size() == 1) return;
    rank_ = group->rank();
    world_ = group->size();
    timeout_ = group->timeout();
    store_ = group->store();
    TORCH_CHECK(store_, api, ": the process group ", group->str(), " has no store; checkpoints of more than one rank ",
                "coordinate through it. Fix: use a group from init_process_group, make_gloo_group or new_group");
    const std::string base = "fsdp_dcp/" + group->name() + "/";
    int64_t id = store_->add(base + "ops/" + std::to_string(rank_), 1);
    prefix_ = base + std::to_string(id) + "/";
    if (clone_store) {
      try {
        store_ = store_->clone();
      } catch (const std::exception&) {
        // Stores without clone() support are shared; their calls are thread-safe.
      }
    }
  }

  /// The same operation's coordinator with a store client of its own, for another thread of this rank
  /// (a TCPStore client serializes its calls: a wait on one thread would hold up a set on another).
  Coordinator for_thread() const {
    Coordinator c = *this;
    if (c.store_) {
      try {
        c.store_ = c.store_->clone();
      } catch (const std::exception&) {
        // Stores without clone() support are shared; their calls are thread-safe.
      }
    }
    return c;
  }

  int rank() const { return rank_; }
  int world() const { return world_; }
  bool single() const { return world_ == 1; }

  /// Publishes `value` under `name` (per operation).
  void set(const std::string& name, const std::string& value) {
    if (single()) return;
    store_->set(prefix_ + name, value);
  }
  /// Waits (up to the group's timeout) for `name`, then returns it. `waiting_for` explains the wait in
  /// the timeout error, e.g. "rank 2 to finish writing its shard".
  std::string get(const std::string& name, const std::string& waiting_for) {
    TORCH_INTERNAL_ASSERT(!single());
    try {
      store_->wait({prefix_ + name}, timeout_);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, api_, ": rank ", rank_, " waited ", timeout_.count() / 1000.0, " s for ", waiting_for,
                  " in vain (did that rank crash or stop calling ", api_, "?): ", e.what());
    }
    auto v = store_->get(prefix_ + name);
    return std::string(v.begin(), v.end());
  }
  /// Every rank posts `mine`; rank 0 returns all ranks' (index = rank), other ranks an empty vector.
  std::vector<std::string> gather(const std::string& name, const std::string& mine, const std::string& what) {
    if (single()) return {mine};
    set(name + "/" + std::to_string(rank_), mine);
    std::vector<std::string> all;
    if (rank_ != 0) return all;
    for (int r = 0; r < world_; ++r) all.push_back(get(name + "/" + std::to_string(r), "rank " + std::to_string(r) + " " + what));
    return all;
  }
  /// Rank 0 publishes `value`; every rank returns it.
  std::string broadcast(const std::string& name, const std::string& value, const std::string& what) {
    if (single()) return value;
    if (rank_ == 0) {
      set(name, value);
      return value;
    }
    return get(name, "rank 0 " + what);
  }
  /// Phase 2 of [Note: validate, agree, apply] through the store (a load's only exchange): rank 0
  /// gathers every rank's problem and publishes the first as "<rank>\n<message>".
  fsdp::detail::Agree agreement() {
    return [this](const std::string& problem) -> std::optional<fsdp::detail::Failure> {
      if (single()) return std::nullopt;
      auto reports = gather("staged", problem, "to read its part of the checkpoint");
      std::string verdict;
      for (size_t r = 0; r < reports.size() && verdict.empty(); ++r) {
        if (!reports[r].empty()) verdict = std::to_string(r) + "\n" + reports[r];
      }
      verdict = broadcast("verdict", verdict, "to collect every rank's reading of the checkpoint");
      if (verdict.empty()) return std::nullopt;
      const size_t nl = verdict.find('\n');
      return fsdp::detail::Failure{std::stoi(verdict.substr(0, nl)), verdict.substr(nl + 1)};
    };
  }

 private:
  const char* api_ = "dcp";
  int rank_ = 0;
  int world_ = 1;
  std::chrono::milliseconds timeout_{0};
  c10::intrusive_ptr<c10d::Store> store_;
  std::string prefix_;
};

/// The group a save or load of `sd` runs over: the explicit one, else the mesh of its first DTensor,
/// else the default group (null when there is none: a single process).
inline ProcessGroupPtr resolve_group(const StateDict& sd, const ProcessGroupPtr& explicit_group) {
  if (explicit_group) return explicit_group;
  for (const auto& [k, v] : sd)
    // The whole mesh's group, not the DTensor's own (sub-)mesh: FSDP's parameters live on the dp
    // sub-mesh of a (pp, dp, tp) mesh, and a save over that sub-group alone would be one save per
    // pipeline stage into the same folder, each replacing the other's.
    if (const auto* d = std::get_if<DTensor>(&v)) return d->device_mesh()->root_mesh()->world();
  if (is_initialized()) return default_process_group();
  return nullptr;
}

}  // namespace fsdp::dcp::detail
