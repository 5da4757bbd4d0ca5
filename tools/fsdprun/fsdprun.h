// fsdprun's parts (see main.cpp for what it does): the command line and the plan it yields
// (options.cpp), the workers of one attempt (workers.cpp), the nodes (nodes.cpp, rounds.cpp), and main
// (main.cpp).
#pragma once

#include <atomic>
#include <chrono>
#include <deque>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/TCPStore.hpp>

namespace fsdprun {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

void warn(const std::string& msg);
[[noreturn]] void die(const std::string& msg);
std::string signame(int sig);
// Returns false if the write failed (e.g. EPIPE: fsdprun ignores SIGPIPE).
bool write_all(int fd, const char* p, size_t n);

// ---- Command line (options.cpp).
struct Options {
  bool standalone = false;
  std::string nnodes = "1";
  int node_rank = 0;
  bool node_rank_given = false;  // --node-rank or PET_NODE_RANK was set (ignored under c10d: warned)
  std::string nproc_per_node = "1";
  std::string master_addr = "127.0.0.1";
  std::optional<int> master_port;
  int max_restarts = 0;
  std::string log_dir;
  std::string redirects = "0";
  std::string tee = "0";
  std::string local_ranks_filter;
  std::string role = "default";
  std::optional<double> shutdown_timeout;
  bool no_python = false;
  std::string rdzv_backend = "static";
  std::string rdzv_endpoint;
  std::string rdzv_id = "none";
  double rdzv_timeout = 900;
  std::string rdzv_conf;  // --rdzv-conf k=v,... (torchrun's rdzv_configs)
  std::optional<double> monitor_interval;
  std::string local_addr;
  std::vector<std::string> command;
};


Options parse_args(int argc, char** argv);

// Everything an attempt needs to spawn workers.
struct Plan {
  std::string program_path;
  std::vector<std::string> argv;
  int nproc = 1, nnodes = 1, node_rank = 0, max_restarts = 0;
  std::string role, run_id, master_addr, prefix_template, run_dir;
  int master_port = 0;
  bool log_files = false;
  std::vector<int> redirects, tee;
  std::set<int> console_ranks;  // empty: all
  std::chrono::milliseconds grace{30000};
  // c10d rendezvous: the store is at master_addr:master_port (the endpoint), hosted by the agent on that
  // host, and node_rank is assigned by the rendezvous.
  bool c10d = false;
  std::chrono::milliseconds rdzv_timeout{900000};  // --rdzv-timeout, or --rdzv-conf join_timeout
  // Elastic membership (--nnodes MIN:MAX with MIN < MAX, c10d only): see [Note: elastic rounds] in
  // rounds.cpp. nnodes and node_rank then change at every round.
  int min_nodes = 1, max_nodes = 1;
  bool elastic() const { return min_nodes < max_nodes; }
  std::chrono::milliseconds last_call_timeout{30000};  // --rdzv-conf last_call_timeout (torchrun: 30 s)
  // A node whose agent sent no heartbeat for this long is lost (--rdzv-conf keep_alive_interval x
  // keep_alive_max_attempt, or FSDPRUN_HEARTBEAT_TIMEOUT_S; default 10 s); heartbeats every
  // min(1 s, keep_alive_interval).
  std::chrono::milliseconds heartbeat_timeout{10000}, heartbeat_interval{1000};
  std::chrono::milliseconds read_timeout{0};  // --rdzv-conf read_timeout: a store call's limit (0: heartbeat_timeout)
  std::optional<bool> is_host;                 // --rdzv-conf is_host: host the store (else: the endpoint's host does)
  std::chrono::milliseconds monitor_interval{200};  // --monitor-interval: how often the agent checks its peers
  std::string local_addr;                      // --local-addr: the address this node is known by
  /// Called by the attempt's poll loop at least every second (multi-node: heartbeats, the other nodes'
  /// failures): a non-empty answer stops this node's workers, with that reason.
  std::function<std::string()> peer_check;
  /// Called once when this node's first worker fails (multi-node: tells the other nodes).
  std::function<void(const std::string&)> on_failure;
};


/// The plan of this node's run from the command line and the environment (TORCHELASTIC_*,
/// TORCH_ELASTIC_SHUTDOWN_TIMEOUT, FSDPRUN_GRACE_S); master_port and run_dir are set later by main.
Plan make_plan(const Options& opt);

// ---- Workers (workers.cpp).
struct Stream {
  int fd = -1;      // read end of the worker's pipe; -1 after EOF
  int log_fd = -1;  // {stdout,stderr}.log with --log-dir
  int console_fd;   // 1 or 2
  bool console = true;
  std::string partial;          // bytes after the last newline
  std::deque<std::string> tail;  // last lines of stderr, for the failure summary
};

struct Worker {
  int local_rank = 0, rank = 0;
  pid_t pid = -1;
  bool exited = false;
  int exitcode = 0;  // torchrun's convention: -N when killed by signal N
  bool stopped_by_us = false;  // exited after fsdprun began stopping the group
  std::string time, error_file, prefix;
  Stream out, err;
};

constexpr size_t kTailLines = 20;

struct Attempt {
  std::vector<Worker> workers;
  int root = -1;         // index of the first failed worker
  int interrupted = 0;   // signal fsdprun received
  std::string stopped_for;  // why plan.peer_check stopped the workers (another node failed or was lost)
};

/// Makes the signals fsdprun forwards (and SIGCHLD) wake the attempt's poll loop (a self-pipe).
void install_signal_handlers();
/// A forwarded signal (SIGINT, SIGTERM, ...) that arrived while no attempt runs (0 if none): for the loops
/// that wait for other nodes between attempts.
int take_pending_signal();
/// Starts plan.nproc workers, forwards their output and signals, stops them all on the first failure;
/// returns once every worker (and what it started) is gone.
Attempt run_attempt(const Plan& plan, int restart);
/// "exit code 3" or "signal 9 (SIGKILL)".
std::string describe_exit(int exitcode);
/// How each of the attempt's workers ended, one line each ("  rank 1 (local_rank 1): exit code 1, the
/// first failure"), for the message of a failed attempt that is restarted.
std::string describe_workers(const Attempt& a);
/// torchrun's ChildFailedError report, plus the failed rank's last stderr lines.
void print_summary(const Plan& plan, const Attempt& a, int restart);

// ---- Nodes (nodes.cpp; the elastic rounds in rounds.cpp): the agent store, the agents' rendezvous, and their
// coordination.
class Nodes {
 public:
  /// Hosts or joins the agent store (static: node 0 at --master-addr:--master-port; c10d: the agent on
  /// the --rdzv-endpoint host) and, with several nodes or c10d, waits until --nnodes agents joined
  /// (plan.rdzv_timeout), assigning plan.node_rank under c10d. Exits with a message on failure.
  explicit Nodes(Plan& plan);
  ~Nodes();
  /// At least every second during an attempt: sends this node's heartbeat and returns why this node's
  /// workers must stop ("" if they need not): another node's failure in `attempt`, a lost node, a lost store.
  std::string poll(int attempt);
  /// This node's workers failed in `attempt` (`what`): the other nodes stop theirs.
  void report_failure(int attempt, const std::string& what);
  struct Outcome {
    bool ok = false;       // every node's workers succeeded
    std::string failure;   // the attempt's first failure, as reported by its node
    std::string fatal;     // the job cannot go on (a lost node or store): no restart
    // Elastic: why the round's membership changes ("lost node 1 ...", "1 node waiting to join ..."),
    // and whether a node was lost (that uses a restart; nodes joining do not, as under torchrun).
    std::string change;
    bool lost = false;
    int signal = 0;  // elastic: this agent was stopped by a signal while waiting for the others
  };
  /// After this node's attempt ended (`mine`: ok, failed, stopped): waits for every node's.
  Outcome finish_attempt(int attempt, const std::string& mine);
  /// The exit barrier: the store's host keeps the store until every agent is done.
  void finish();
  /// The job must end now (`msg` says why): every agent stops its workers and exits 1.
  void abort(const std::string& msg) { abort_job(msg); }
  /// "node 1 (host 10.201.0.2)".
  std::string describe(int node) const;
  /// Elastic: joins the next round of the rendezvous after a change or a failed attempt; sets
  /// plan.nnodes and plan.node_rank. Exits 0 if the job finished meanwhile, 1 when no round forms within
  /// the join timeout.
  void rejoin();
  /// Elastic: the current round (the attempt number and TORCHELASTIC_RESTART_COUNT of its workers).
  int round() const { return round_; }
  /// Elastic: every node's workers succeeded; nodes still waiting to join learn it and exit.
  void mark_done();

 private:
  void connect_store();
  void rendezvous();
  void join_round();
  void take_ticket();
  std::string round_key(int64_t k) const { return prefix_ + "rdzv/" + std::to_string(k) + "/"; }
  /// Node `node`'s heartbeat key: elastic, its ticket's in the current round; else hb/0/<node>.
  std::string hb_key(int node) const {
    if (plan_.elastic()) return round_key(round_) + "hb/" + std::to_string(member_tickets_.at(static_cast<size_t>(node)));
    return prefix_ + "hb/0/" + std::to_string(node);
  }
  bool multi() const { return plan_.nnodes > 1 || plan_.elastic(); }
  void beat(bool force);
  std::string lost_node();
  void abort_job(const std::string& msg);

  Plan& plan_;
  const std::string prefix_;
  std::string hostname_;
  c10::intrusive_ptr<c10d::TCPStore> store_;
  bool hosts_store_ = false, aborted_ = false;
  int round_ = 0;  // elastic: the round this node is a member of (0 otherwise)
  // The store-call watchdog (see StoreCall in agent_store.h): when the call under way started (ms since the
  // steady clock's epoch; 0: none).
  std::atomic<int64_t> call_since_ms_{0};
  std::atomic<bool> stop_watchdog_{false};
  std::thread watchdog_;
  friend struct StoreCall;
  // Elastic: the round and ticket this node took for the next round, as soon as it saw the current one
  // end (before stopping its workers, which can take the whole --shutdown-timeout), so that the next
  // round's last call waits for it.
  std::optional<std::pair<int64_t, int64_t>> ticket_;
  std::vector<int64_t> member_tickets_;  // elastic: the current round's members' tickets, by node rank
  std::string my_addr_;                  // the address this node is known by (--local-addr, or the route's)
  std::map<int, std::string> node_desc_;
  std::map<int, std::pair<int64_t, Clock::time_point>> last_beat_;
  Clock::time_point last_own_beat_{}, last_watch_{}, last_poll_{};
};

}  // namespace fsdprun
