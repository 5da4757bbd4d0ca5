// fsdprun's nodes: the agent store, the rendezvous of the agents (static or c10d), and what the agents of
// a multi-node job tell each other through the store (heartbeats, a failed attempt, the end of an
// attempt), so that all nodes restart together and a lost node stops every node instead of leaving its
// workers hung in a collective.
//
// Keys (all under /fsdprun/<run_id>/ in the agent store; the workers use /worker/attempt_<k>/):
//   rdzv/count               c10d: tickets; node rank = ticket - 1
//   node/<r>                 "host addr" of node r, set once it joined (the rendezvous waits for all)
//   hb/<k>/<r>               node r's heartbeat counter in round k (0 unless elastic), bumped every second
//   rdzv/open, rdzv/<k>/...  elastic rounds: see [Note: elastic rounds] in rounds.cpp
//   done                     elastic: the job succeeded (nodes still waiting to join exit 0)
//   abort                    why the job must end now (a lost node, an agent that could not start)
//   attempt/<k>/failed       the first failure of attempt k ("node 1 (...): rank 3 ended with ...")
//   attempt/<k>/outcome/<r>  node r's end of attempt k: ok, failed, stopped
//   exited                   agents done (the store host waits for all before closing the store)
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <sstream>
#include <thread>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "fsdprun.h"
#include "agent_store.h"
#include "c10d/network_check.h"
#include "util.h"

namespace fsdprun {
namespace {

using fsdp::detail::ip_of;
using fsdp::detail::message_of;


/// The addresses `host` resolves to.
std::vector<std::string> resolve(const std::string& host) {
  std::vector<std::string> out;
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0) return out;
  for (addrinfo* p = res; p; p = p->ai_next) out.push_back(ip_of(p->ai_addr));
  ::freeaddrinfo(res);
  return out;
}

/// torchrun's _matches_machine_hostname: localhost, this host's name, or one of its addresses.
bool is_this_host(const std::string& host) {
  if (host == "localhost" || host == "127.0.0.1" || host == "::1") return true;
  char name[256] = "";
  ::gethostname(name, sizeof name - 1);
  if (host == name) return true;
  std::vector<std::string> mine;
  ifaddrs* ifa = nullptr;
  if (::getifaddrs(&ifa) == 0) {
    for (ifaddrs* p = ifa; p; p = p->ifa_next)
      if (p->ifa_addr && (p->ifa_addr->sa_family == AF_INET || p->ifa_addr->sa_family == AF_INET6))
        mine.push_back(ip_of(p->ifa_addr));
    ::freeifaddrs(ifa);
  }
  for (const auto& ip : resolve(host))
    if (std::find(mine.begin(), mine.end(), ip) != mine.end()) return true;
  return false;
}

/// The local address this host uses to reach `host` (what the other nodes know it by).
std::string source_address_to(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0) return "?";
  std::string out = "?";
  int fd = ::socket(res->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd >= 0 && ::connect(fd, res->ai_addr, res->ai_addrlen) == 0) {  // UDP: no packet sent
    sockaddr_storage me{};
    socklen_t len = sizeof me;
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&me), &len) == 0) out = ip_of(reinterpret_cast<sockaddr*>(&me));
  }
  if (fd >= 0) ::close(fd);
  ::freeaddrinfo(res);
  return out;
}

}  // namespace

Nodes::~Nodes() {
  stop_watchdog_ = true;
  if (watchdog_.joinable()) watchdog_.join();
}

Nodes::Nodes(Plan& plan) : plan_(plan), prefix_("/fsdprun/" + plan.run_id + "/") {
  char name[256] = "localhost";
  ::gethostname(name, sizeof name - 1);
  hostname_ = name;
  connect_store();
  my_addr_ = plan_.local_addr.empty() ? source_address_to(plan_.master_addr, plan_.master_port) : plan_.local_addr;
  const auto limit = plan_.read_timeout.count() > 0 ? plan_.read_timeout : plan_.heartbeat_timeout;
  watchdog_ = std::thread([this, limit] {
    auto ms = [] { return std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now().time_since_epoch()).count(); };
    int64_t last = ms();
    while (!stop_watchdog_) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      const int64_t now = ms();
      if (now - last > 1000) {
        // This process did not run for a while (SIGSTOP, a frozen VM): the call under way gets a fresh window.
        int64_t since = call_since_ms_;
        if (since > 0) call_since_ms_.compare_exchange_strong(since, now);
      }
      last = now;
      const int64_t since = call_since_ms_;
      if (since > 0 && now - since > limit.count()) {
        warn("lost the store at " + plan_.master_addr + ":" + std::to_string(plan_.master_port) + ": a call to it has "
             "not returned for " + fmt_s((now - since) / 1000.0) + " (its host, or the link to it, is down); stopping "
             "this node's workers and exiting");
        std::fflush(nullptr);
        ::_exit(1);  // the workers follow (PR_SET_PDEATHSIG)
      }
    }
  });
  if (plan.elastic()) {
    try {
      store_->setTimeout(plan_.read_timeout.count() > 0 ? plan_.read_timeout : plan_.heartbeat_timeout);
    } catch (const std::exception&) {
    }
    join_round();
  } else if (plan.nnodes > 1 || plan.c10d) {
    rendezvous();
  }
}

void Nodes::connect_store() {
  // Static: node 0 hosts the store at --master-addr:--master-port. c10d: the agent on the endpoint's host
  // (as torchrun); if another process already holds the port there, this agent joins as a client.
  bool host = plan_.c10d ? plan_.is_host.value_or(is_this_host(plan_.master_addr)) : plan_.node_rank == 0;
  const auto connect_timeout = plan_.c10d ? plan_.rdzv_timeout : std::chrono::milliseconds(std::chrono::minutes(15));
  for (int tries = 0; tries < 2; ++tries) {
    try {
      c10d::TCPStoreOptions so;
      so.port = static_cast<std::uint16_t>(plan_.master_port);
      so.isServer = host;
      so.multiTenant = true;
      so.waitWorkers = false;
      // How long the other nodes wait for the store's host (the host's own client connects at once).
      so.timeout = host ? std::chrono::milliseconds(std::chrono::minutes(15)) : connect_timeout;
      if (!host && (plan_.nnodes > 1 || plan_.elastic()))
        warn("waiting for the store at " + plan_.master_addr + ":" + std::to_string(so.port) +
             (plan_.c10d ? " (rendezvous '" + plan_.run_id + "')" : " (node 0)"));
      store_ = c10::make_intrusive<c10d::TCPStore>(plan_.master_addr, so);
      plan_.master_port = store_->getPort();
      hosts_store_ = host;
      return;
    } catch (const std::exception& e) {
      if (host && plan_.c10d && tries == 0) {
        warn("cannot host the rendezvous store on port " + std::to_string(plan_.master_port) + " (" + message_of(e) +
             "): joining it as a client");
        host = false;
        continue;
      }
      die((host ? "cannot host the TCPStore on port " + std::to_string(plan_.master_port)
                : "cannot reach the TCPStore at " + plan_.master_addr + ":" + std::to_string(plan_.master_port) +
                      " within " + fmt_s(connect_timeout.count() / 1000.0)) +
          ": " + message_of(e) +
          (host ? "\nFix: pick another " + std::string(plan_.c10d ? "--rdzv-endpoint port" : "--master-port") +
                      (plan_.nnodes == 1 ? ", or use --standalone / --master-port 0" : "")
                : "\nFix: start fsdprun on " + plan_.master_addr + " (" +
                      (plan_.c10d ? "the --rdzv-endpoint host" : "--node-rank 0") +
                      ") and check that it is reachable from this host"));
    }
  }
}

std::string Nodes::describe(int node) const {
  auto it = node_desc_.find(node);
  return "node " + std::to_string(node) + (it != node_desc_.end() ? " (" + it->second + ")" : "");
}

void Nodes::rendezvous() {
  const std::string me = hostname_ + " " +
                         (plan_.local_addr.empty() ? source_address_to(plan_.master_addr, plan_.master_port) : plan_.local_addr);
  try {
    // A store op that hangs is a lost store host.
    store_->setTimeout(plan_.read_timeout.count() > 0 ? plan_.read_timeout : plan_.heartbeat_timeout);
    if (plan_.c10d) {
      const int64_t ticket = store_->add(prefix_ + "rdzv/count", 1);
      if (ticket > plan_.nnodes)
        die("rendezvous '" + plan_.run_id + "' at " + plan_.master_addr + ":" + std::to_string(plan_.master_port) +
            " is full: " + std::to_string(plan_.nnodes) + " nodes (--nnodes) joined already. Fix: give this job its "
            "own --rdzv-id, or raise --nnodes");
      plan_.node_rank = static_cast<int>(ticket - 1);
    } else if (store_->check({prefix_ + "node/" + std::to_string(plan_.node_rank)})) {
      die("--node-rank " + std::to_string(plan_.node_rank) + " is taken: " +
          str_of(store_->get(prefix_ + "node/" + std::to_string(plan_.node_rank))) +
          " joined with it already. Fix: give every node its own --node-rank (0 to --nnodes - 1)");
    }
    store_->set(prefix_ + "node/" + std::to_string(plan_.node_rank), bytes_of(me));
  } catch (const std::exception& e) {
    die("rendezvous through the store at " + plan_.master_addr + ":" + std::to_string(plan_.master_port) +
        " failed: " + message_of(e));
  }
  // Wait for every node (heartbeats go on: a node that waits is not lost).
  const auto start = Clock::now();
  std::vector<bool> arrived(plan_.nnodes, false);
  for (;;) {
    int n = 0;
    std::string abort;
    try {
      beat(true);
      for (int r = 0; r < plan_.nnodes; ++r) {
        if (!arrived[r] && store_->check({prefix_ + "node/" + std::to_string(r)})) {
          arrived[r] = true;
          node_desc_[r] = str_of(store_->get(prefix_ + "node/" + std::to_string(r)));
          last_beat_[r] = {-1, Clock::now()};
        }
        n += arrived[r];
      }
      if (store_->check({prefix_ + "abort"})) abort = str_of(store_->get(prefix_ + "abort"));
    } catch (const std::exception& e) {
      die("lost the store at " + plan_.master_addr + ":" + std::to_string(plan_.master_port) +
          " during the rendezvous: " + message_of(e));
    }
    if (!abort.empty()) die(abort);
    if (n == plan_.nnodes) break;
    if (Clock::now() - start > plan_.rdzv_timeout) {
      std::string have, missing;
      for (int r = 0; r < plan_.nnodes; ++r) {
        if (arrived[r]) have += (have.empty() ? "" : ", ") + describe(r);
        else if (!plan_.c10d) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      }
      std::string msg = (plan_.c10d ? "rendezvous '" + plan_.run_id + "'" : std::string("the static rendezvous")) +
                        " at " + plan_.master_addr + ":" + std::to_string(plan_.master_port) + " timed out after " +
                        fmt_s(seconds_since(start)) + ": " + std::to_string(n) + " of " +
                        std::to_string(plan_.nnodes) + " nodes arrived (" + have + ")" +
                        (missing.empty() ? "" : "; missing node rank(s) " + missing) +
                        ". Fix: start fsdprun on every node with the same " +
                        (plan_.c10d ? "--rdzv-endpoint and --rdzv-id" : "--master-addr and --master-port") +
                        ", or raise --rdzv-timeout";
      abort_job(msg);
      die(msg);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  if (plan_.nnodes > 1) {
    std::string all;
    for (int r = 0; r < plan_.nnodes; ++r) all += (r ? ", " : "") + describe(r);
    warn("rendezvous complete: this is node " + std::to_string(plan_.node_rank) + " of " + std::to_string(plan_.nnodes) +
         " (" + all + "); the store is at " + plan_.master_addr + ":" + std::to_string(plan_.master_port));
  }
}

void Nodes::abort_job(const std::string& msg) {
  StoreCall call(*this);
  try {
    store_->compareSet(prefix_ + "abort", {}, bytes_of(msg));
  } catch (const std::exception&) {
  }
}

void Nodes::beat(bool force) {
  if (!force && Clock::now() - last_own_beat_ < plan_.heartbeat_interval) return;
  last_own_beat_ = Clock::now();
  if (!plan_.elastic() || !member_tickets_.empty()) store_->add(hb_key(plan_.node_rank), 1);
  // Elastic: the ticket taken for the next round beats too (while this node stops its workers and waits).
  if (ticket_) store_->add(round_key(ticket_->first) + "hb/" + std::to_string(ticket_->second), 1);
}

std::string Nodes::lost_node() {
  // Each node watches the next one's heartbeat (r watches r + 1 mod n): n reads a second in all, not
  // n^2, and every node is watched by one other, so the store's host can be lost and noticed too (by
  // the store's failure). What a watcher finds goes under abort (or, elastic, the round's change), which
  // every agent reads.
  if (plan_.nnodes < 2 || Clock::now() - last_watch_ < plan_.heartbeat_interval) return "";
  last_watch_ = Clock::now();
  const int r = (plan_.node_rank + 1) % plan_.nnodes;
  auto& [value, since] = last_beat_[r];
  const int64_t v = store_->add(hb_key(r), 0);
  if (v != value) {
    value = v;
    since = Clock::now();
  } else if (Clock::now() - since > plan_.heartbeat_timeout) {
    return "lost " + describe(r) + ": no heartbeat from its fsdprun for " + fmt_s(seconds_since(since)) +
           " (its agent was killed or stopped, or its host went down or off the network)";
  }
  return "";
}

std::string Nodes::poll(int attempt) {
  // The poll loop wakes for every chunk of worker output: a few store round trips 5 times a second suffice.
  if (!multi() || Clock::now() - last_poll_ < plan_.monitor_interval) return "";
  last_poll_ = Clock::now();
  StoreCall call(*this);
  try {
    beat(false);
    if (store_->check({prefix_ + "abort"})) {
      aborted_ = true;
      return str_of(store_->get(prefix_ + "abort"));
    }
    std::string lost = lost_node();
    if (plan_.elastic()) {
      // A lost node or nodes waiting to join end the round: every member stops its workers and joins the
      // next one ([Note: elastic rounds]). A loss is recorded whatever ended the round (it changes what
      // the members wait for, and costs a restart).
      const std::string change = round_key(round_) + "change";
      if (!lost.empty()) {
        store_->compareSet(round_key(round_) + "lost", {}, bytes_of(lost));
        store_->compareSet(change, {}, bytes_of(lost));
      }
      if (!store_->check({change}) && plan_.nnodes < plan_.max_nodes) {
        const int64_t waiting = store_->add(round_key(round_ + 1) + "count", 0);
        if (waiting > 0) {
          store_->compareSet(change, {}, bytes_of(std::to_string(waiting) + " node(s) waiting to join (" +
                                                  std::to_string(plan_.nnodes) + " of at most " +
                                                  std::to_string(plan_.max_nodes) + " nodes now)"));
        }
      }
      if (store_->check({change})) {
        if (!ticket_) take_ticket();
        return str_of(store_->get(change));
      }
    } else if (!lost.empty()) {
      abort_job(lost);
    }
    if (store_->check({prefix_ + "abort"})) {
      aborted_ = true;
      return str_of(store_->get(prefix_ + "abort"));
    }
    const std::string failed = prefix_ + "attempt/" + std::to_string(attempt) + "/failed";
    if (store_->check({failed})) return str_of(store_->get(failed));
  } catch (const std::exception& e) {
    aborted_ = true;
    return "lost the store at " + plan_.master_addr + ":" + std::to_string(plan_.master_port) + " (hosted by " +
           (plan_.c10d ? "the agent on " + plan_.master_addr : describe(0)) + "): " + message_of(e);
  }
  return "";
}

void Nodes::report_failure(int attempt, const std::string& what) {
  if (!multi()) return;
  StoreCall call(*this);
  try {
    store_->compareSet(prefix_ + "attempt/" + std::to_string(attempt) + "/failed", {},
                       bytes_of(describe(plan_.node_rank) + ": " + what));
  } catch (const std::exception&) {
  }
}

Nodes::Outcome Nodes::finish_attempt(int attempt, const std::string& mine) {
  Outcome out;
  if (!multi()) {
    out.ok = mine == "ok";
    return out;
  }
  const std::string key = prefix_ + "attempt/" + std::to_string(attempt) + "/";
  try {
    StoreCall call(*this);
    store_->set(key + "outcome/" + std::to_string(plan_.node_rank), bytes_of(mine));
  } catch (const std::exception&) {
  }
  // Every node's end of this attempt: then all agree on what comes next (restart, done, or fail).
  for (;;) {
    std::string why = poll(attempt);
    if (aborted_) {
      out.fatal = why;
      return out;
    }
    if (plan_.elastic()) {
      try {
        StoreCall call(*this);
        const std::string change = round_key(round_) + "change";
        if (store_->check({change})) out.change = str_of(store_->get(change));
        // A lost node never reports its end: go on without it. Nodes waiting to join: every member
        // reports, and if all succeeded the job is done all the same.
        if (store_->check({round_key(round_) + "lost"})) {
          out.lost = true;
          out.change = str_of(store_->get(round_key(round_) + "lost"));
        }
        if (const int sig = take_pending_signal()) {
          out.fatal = "stopped by " + signame(sig);
          out.signal = sig;
          return out;
        }
      } catch (const std::exception&) {
      }
      if (out.lost) return out;
    }
    int n = 0;
    bool all_ok = true;
    try {
      StoreCall call(*this);
      for (int r = 0; r < plan_.nnodes; ++r) {
        const std::string k = key + "outcome/" + std::to_string(r);
        if (!store_->check({k})) continue;
        ++n;
        all_ok = all_ok && str_of(store_->get(k)) == "ok";
      }
      if (n == plan_.nnodes) {
        out.ok = all_ok;
        if (!all_ok && store_->check({key + "failed"})) out.failure = str_of(store_->get(key + "failed"));
        return out;
      }
    } catch (const std::exception& e) {
      out.fatal = "lost the store at " + plan_.master_addr + ":" + std::to_string(plan_.master_port) + ": " + message_of(e);
      return out;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

void Nodes::finish() {
  if (!multi() || aborted_) return;
  // The store's host keeps it until every agent has read the last outcome (torchrun's exit barrier).
  const std::string key = prefix_ + "exited";
  try {
    store_->add(key, 1);
    const auto deadline = Clock::now() + plan_.heartbeat_timeout * 3;
    while (hosts_store_ && store_->add(key, 0) < plan_.nnodes && Clock::now() < deadline) {
      StoreCall call(*this);
      beat(false);
      if (!lost_node().empty()) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    // Elastic: agents still waiting to join read "done" every 100 ms; keep the store up for them a moment.
    if (hosts_store_ && plan_.elastic()) std::this_thread::sleep_for(std::chrono::milliseconds(500));
  } catch (const std::exception& e) {
    warn(std::string("exit barrier: ") + message_of(e));
  }
}

}  // namespace fsdprun
