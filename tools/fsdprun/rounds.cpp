// fsdprun's elastic membership (--nnodes MIN:MAX): the rendezvous rounds of nodes.cpp's Nodes, by which the
// agents agree who trains in each round (see the note below); nodes.cpp has the store, the heartbeats and
// the attempts' outcomes.
#include <algorithm>
#include <map>
#include <optional>
#include <sstream>
#include <thread>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "agent_store.h"
#include "fsdprun.h"
#include "util.h"

namespace fsdprun {

using fsdp::detail::message_of;

// [Note: elastic rounds]
// --nnodes MIN:MAX (c10d): membership is agreed in numbered rounds, as torchrun's dynamic rendezvous does.
// - Joining: an agent reads rdzv/open (the round accepting joins), takes a ticket (rdzv/<k>/count),
//   publishes "<store host 0|1> <previous node rank or -1> <host> <addr>" under rdzv/<k>/node/<ticket>, and
//   from then on beats rdzv/<k>/hb/<ticket> (while it waits, and as a member: a ticket whose heartbeat
//   stops is a dead agent, wherever it is).
// - Closing: round k closes when MAX live tickets are in, or when at least MIN are and last_call_timeout
//   passed since the watching agent first saw MIN; and, for k > 0, only once round k - 1 has ended (its
//   change key is set): an agent that arrives while a full round runs waits instead of starting a second
//   job beside it. Any waiting agent may close it: it publishes the members' tickets in rank order with
//   compareSet(rdzv/<k>/closed), so one list wins, and moves rdzv/open from k to k + 1. Live tickets are
//   those with an entry whose heartbeat moved within the keep-alive (dead joiners, and an agent that
//   gave up waiting, are left out). Rank order: the store's host first (it must stay in: the job's store
//   lives with it), then the previous round's members in their order, then newcomers by ticket; at most
//   MAX. Tickets left out wait for round k + 1.
// - The attempt number and TORCHELASTIC_RESTART_COUNT are the round number k, the same on every member
//   (newcomers included), which also keeps each round's worker keys (/worker/attempt_<k>) apart.
// - Ending: a member that finds a lost node (each node watches the next one's ticket heartbeat) records it
//   under rdzv/<k>/lost, and sets rdzv/<k>/change, as does one that sees agents waiting in round k + 1
//   while the round has fewer than MAX nodes; every member takes its ticket for round k + 1 at once (so
//   that the next round's last call waits for it and its heartbeat goes on while it stops its workers),
//   stops its workers and joins. A failed attempt also ends the round (each agent rejoins). A lost node
//   uses one of --max-restarts, nodes joining do not (torchrun counts the same way).
// - The store lives with the agent on the endpoint's host: losing that node ends the job (as torchrun).
// - When the job succeeds, "done" (and rdzv/<k + 1>/closed = "done") tells agents waiting to join to exit 0.
void Nodes::join_round() {
  const std::string store_desc = plan_.master_addr + ":" + std::to_string(plan_.master_port);
  const auto start = Clock::now();
  auto lost_store = [&](const std::exception& e) {
    die("lost the store at " + store_desc + " during the rendezvous: " + message_of(e));
  };
  auto exit_if_done_or_aborted = [&] {
    if (store_->check({prefix_ + "done"})) {
      warn("rendezvous '" + plan_.run_id + "': the job finished before this node could join; exiting");
      std::exit(0);
    }
    if (store_->check({prefix_ + "abort"})) die(str_of(store_->get(prefix_ + "abort")));
    if (const int sig = take_pending_signal()) {
      warn("stopped by " + signame(sig) + " while waiting to join a round");
      std::exit(128 + sig);
    }
  };
  for (;;) {
    try {
      StoreCall call(*this);
      exit_if_done_or_aborted();
      if (!ticket_) take_ticket();
    } catch (const std::exception& e) {
      lost_store(e);
    }
    const auto [k, ticket] = *ticket_;
    std::optional<Clock::time_point> min_seen;
    std::string closed;
    bool announced = false;
    std::map<int64_t, std::pair<int64_t, Clock::time_point>> seen;  // ticket -> (heartbeat, since)
    for (;;) {
      try {
        StoreCall call(*this);
        exit_if_done_or_aborted();
        beat(false);
        if (store_->check({round_key(k) + "closed"})) {
          closed = str_of(store_->get(round_key(k) + "closed"));
          break;
        }
        // The live tickets: an entry, and a heartbeat that moved within the keep-alive.
        const int64_t count = store_->add(round_key(k) + "count", 0);
        struct Entry {
          bool store_host;
          int prev;
          int64_t ticket;
        };
        std::vector<Entry> live;
        for (int64_t t = 1; t <= count; ++t) {
          const std::string key = round_key(k) + "node/" + std::to_string(t);
          if (!store_->check({key})) continue;
          const int64_t hb = store_->add(round_key(k) + "hb/" + std::to_string(t), 0);
          auto it = seen.find(t);
          if (it == seen.end() || it->second.first != hb) {
            seen[t] = {hb, Clock::now()};
          } else if (Clock::now() - it->second.second > plan_.heartbeat_timeout) {
            continue;  // a dead agent's ticket
          }
          std::istringstream v(str_of(store_->get(key)));
          Entry e{false, -1, t};
          int host = 0;
          v >> host >> e.prev;
          e.store_host = host != 0;
          live.push_back(e);
        }
        const int64_t n = static_cast<int64_t>(live.size());
        const bool previous_ended = k == 0 || store_->check({round_key(k - 1) + "change"});
        if (n >= plan_.min_nodes && previous_ended && !min_seen) min_seen = Clock::now();
        if (!previous_ended && !announced) {
          warn("rendezvous '" + plan_.run_id + "': round " + std::to_string(k - 1) + " is training; this node "
               "joins round " + std::to_string(k) + " (the training nodes restart for it when they are fewer than " +
               std::to_string(plan_.max_nodes) + ", else when a node leaves)");
          announced = true;
        }
        const bool full = n >= plan_.max_nodes && previous_ended;
        if (full || (min_seen && n >= plan_.min_nodes && Clock::now() - *min_seen >= plan_.last_call_timeout)) {
          std::stable_sort(live.begin(), live.end(), [](const Entry& a, const Entry& b) {
            if (a.store_host != b.store_host) return a.store_host;
            const bool an = a.prev < 0, bn = b.prev < 0;
            if (an != bn) return !an;
            return an ? a.ticket < b.ticket : a.prev < b.prev;
          });
          std::string list;
          for (int64_t i = 0; i < std::min<int64_t>(n, plan_.max_nodes); ++i)
            list += (i ? "," : "") + std::to_string(live[static_cast<size_t>(i)].ticket);
          store_->compareSet(round_key(k) + "closed", {}, bytes_of(list));
          store_->compareSet(prefix_ + "rdzv/open", bytes_of(std::to_string(k)), bytes_of(std::to_string(k + 1)));
          continue;  // read what won
        }
      } catch (const std::exception& e) {
        lost_store(e);
      }
      if (Clock::now() - start > plan_.rdzv_timeout) {
        // Only this agent gives up (its heartbeat stops, so no round counts it): the nodes training go on.
        die("rendezvous '" + plan_.run_id + "' at " + store_desc + " timed out after " + fmt_s(seconds_since(start)) +
            " waiting for round " + std::to_string(k) + " to form and take this node (at least " +
            std::to_string(plan_.min_nodes) + " and at most " + std::to_string(plan_.max_nodes) +
            " nodes, --nnodes). Fix: start fsdprun on more nodes with the same --rdzv-endpoint and --rdzv-id, "
            "wait for a node of a full job to leave, or raise --rdzv-conf join_timeout");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    ticket_.reset();
    std::vector<int64_t> members;
    if (closed != "done") {
      std::stringstream ss(closed);
      for (std::string t; std::getline(ss, t, ',');) members.push_back(std::stoll(t));
    }
    const auto mine = std::find(members.begin(), members.end(), ticket);
    if (mine == members.end()) {
      // Round k closed without this node: wait for the next (the members see it waiting).
      try {
        StoreCall call(*this);
        store_->compareSet(prefix_ + "rdzv/open", bytes_of(std::to_string(k)), bytes_of(std::to_string(k + 1)));
      } catch (const std::exception& e) {
        lost_store(e);
      }
      continue;
    }
    node_desc_.clear();
    last_beat_.clear();
    member_tickets_ = members;
    try {
      StoreCall call(*this);
      for (size_t i = 0; i < members.size(); ++i) {
        std::istringstream v(str_of(store_->get(round_key(k) + "node/" + std::to_string(members[i]))));
        std::string host_flag, prev, host, addr;
        v >> host_flag >> prev >> host >> addr;
        node_desc_[static_cast<int>(i)] = host + " " + addr;
        last_beat_[static_cast<int>(i)] = {-1, Clock::now()};
      }
    } catch (const std::exception& e) {
      lost_store(e);
    }
    plan_.node_rank = static_cast<int>(mine - members.begin());
    round_ = static_cast<int>(k);
    plan_.nnodes = static_cast<int>(members.size());
    std::string all;
    for (int r = 0; r < plan_.nnodes; ++r) all += (r ? ", " : "") + describe(r);
    warn("rendezvous round " + std::to_string(k) + " complete: this is node " + std::to_string(plan_.node_rank) +
         " of " + std::to_string(plan_.nnodes) + " (--nnodes " + std::to_string(plan_.min_nodes) + ":" +
         std::to_string(plan_.max_nodes) + "; " + all + "); the store is at " + store_desc);
    return;
  }
}

void Nodes::take_ticket() {
  StoreCall call(*this);
  const int prev_rank = node_desc_.empty() ? -1 : plan_.node_rank;  // -1: not a member of any round yet
  const int64_t k = store_->add(prefix_ + "rdzv/open", 0);
  const int64_t ticket = store_->add(round_key(k) + "count", 1);
  store_->set(round_key(k) + "node/" + std::to_string(ticket),
              bytes_of(std::string(hosts_store_ ? "1" : "0") + " " + std::to_string(prev_rank) + " " + hostname_ +
                       " " + my_addr_));
  store_->add(round_key(k) + "hb/" + std::to_string(ticket), 1);
  ticket_ = {k, ticket};
}

void Nodes::rejoin() {
  // The round ends for everyone (a failed attempt sets no change by itself): the next one may close.
  try {
    StoreCall call(*this);
    store_->compareSet(round_key(round_) + "change", {}, bytes_of("attempt " + std::to_string(round_) + " ended"));
  } catch (const std::exception&) {
  }
  join_round();
}

void Nodes::mark_done() {
  if (!plan_.elastic()) return;
  StoreCall call(*this);
  try {
    // The next round can no longer form (its waiting agents read "done" and exit 0).
    store_->compareSet(round_key(round_ + 1) + "closed", {}, bytes_of("done"));
    store_->set(prefix_ + "done", bytes_of("1"));
  } catch (const std::exception&) {
  }
  ticket_.reset();
}

}  // namespace fsdprun
