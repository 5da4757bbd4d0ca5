// fsdprun: a torchrun-compatible launcher for C++ programs (what `torchrun --no-python` does, without
// Python).
//
//   fsdprun [--standalone] [--nnodes M] [--node-rank R] --nproc-per-node N [--master-addr A]
//           [--master-port P] [--max-restarts K] [--log-dir DIR] [-r/--redirects S] [-t/--tee S]
//           [--local-ranks-filter 0,2] [--role NAME] [--shutdown-timeout S] [--] PROGRAM [ARGS...]
//
//   fsdprun --standalone --nproc-per-node 4 build/bin/train_gpt --steps 100
//   fsdprun --nnodes 2 --node-rank 0 --nproc-per-node 8 --master-addr node0 --master-port 29500 PROGRAM
//   fsdprun --nnodes 2 --rdzv-backend c10d --rdzv-endpoint node0:29400 --rdzv-id job1 --nproc-per-node 8 PROGRAM
//
// As torchrun's agent, fsdprun
//  * hosts the c10d TCPStore (the "agent store") at MASTER_ADDR:MASTER_PORT (node 0 only; other nodes
//    connect to it). Workers get TORCHELASTIC_USE_AGENT_STORE=True and rendezvous as its clients under
//    PrefixStore("/worker/attempt_<TORCHELASTIC_RESTART_COUNT>"), as fsdp::init_process_group does;
//  * starts N workers, each in its own session (so that killing its process group also kills what it
//    started), with torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, ..., TORCHELASTIC_*);
//  * reads their stdout/stderr through pipes and writes them line by line to its own stdout/stderr,
//    prefixed as torchrun's --tee does: `[default0]:` (role name + local rank; the template can be
//    changed with TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE, e.g. '[${role_name}${rank}]:'). With
//    --log-dir, also to DIR/<run_id>_XXXXXX/attempt_<k>/<local_rank>/{stdout,stderr}.log;
//  * on the first failure (non-zero exit or death by signal) stops the other workers 2 s later (so that
//    a fault hitting every rank is reported by each; torchrun stops them at once) (SIGTERM, SIGKILL
//    after --shutdown-timeout, default 30 s) and restarts the whole group up to --max-restarts times;
//    then exits 1 with a summary naming the failed rank, its exit code (-N for signal N, as torchrun)
//    or signal, the message it left in TORCHELASTIC_ERROR_FILE ({"message": ...}) and its last stderr
//    lines;
//  * forwards SIGINT/SIGTERM/SIGHUP/SIGQUIT to every worker (a second one sends SIGKILL) and exits
//    128+signal once they are gone. It is a child subreaper, so no descendant of a worker outlives it.
//
//
//  * with several nodes (one fsdprun each), rendezvous with the other agents (static or c10d), and
//    agrees with them on every attempt's outcome: a failure on one node stops and restarts every node,
//    a lost node (no heartbeat) or a lost store ends the job on all of them (nodes.cpp).
//
// The parts: options.cpp (command line, plan), workers.cpp (one attempt's workers), nodes.cpp (the agent
// store, the rendezvous, the agents' coordination), rounds.cpp (elastic rounds), this file (the run folder,
// restarts).
#include <fcntl.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "fsdprun.h"

namespace fsdprun {
namespace {

std::string make_temp_dir(const std::string& parent, const std::string& prefix) {
  std::string templ = parent + "/" + prefix + "XXXXXX";
  if (!::mkdtemp(templ.data())) die("cannot create a directory in " + parent + ": " + std::strerror(errno));
  return templ;
}

/// Environment every worker inherits, as torchrun sets it in its own process.
void export_worker_defaults(const Plan& plan) {
  if (!std::getenv("OMP_NUM_THREADS") && plan.nproc > 1) {
    // torchrun's policy (one intra-op thread per worker unless the user chose), in one line of our own.
    warn("OMP_NUM_THREADS is unset: each of this node's " + std::to_string(plan.nproc) +
         " workers gets 1 thread so that they do not oversubscribe the CPUs; set OMP_NUM_THREADS to choose "
         "another number");
    ::setenv("OMP_NUM_THREADS", "1", 1);
  }
  ::setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT", 1);
}

/// DIR/<run_id>_XXXXXX/attempt_<k>/<local_rank>/ (error.json, and the logs with --log-dir): sets
/// plan.run_dir and plan.log_files; returns the temporary folder to remove at exit ("" with --log-dir).
std::string make_run_dir(const Options& opt, Plan& plan) {
  std::string temp_root;
  if (opt.log_dir.empty()) {
    const char* tmp = std::getenv("TMPDIR");
    temp_root = make_temp_dir(tmp && *tmp ? tmp : "/tmp", "fsdprun_");
    plan.run_dir = make_temp_dir(temp_root, plan.run_id + "_");
    bool redirected = std::any_of(plan.redirects.begin(), plan.redirects.end(), [](int r) { return r != 0; });
    if (redirected) warn("--redirects without --log-dir: the redirected output is discarded");
  } else {
    std::error_code ec;
    fs::create_directories(opt.log_dir, ec);
    if (ec) die("--log-dir " + opt.log_dir + ": " + ec.message());
    plan.run_dir = make_temp_dir(opt.log_dir, plan.run_id + "_");
    plan.log_files = true;
  }
  return temp_root;
}

/// Runs attempts until one succeeds (on every node), is interrupted, or the restarts are spent; returns
/// the exit status. With several nodes the agents agree through `nodes` on each attempt's outcome, so
/// that all restart together (or all stop).
int run_attempts(Plan& plan, Nodes& nodes) {
  const bool multi = plan.nnodes > 1;
  for (int restart = 0;; ++restart) {
    if (multi) {
      plan.peer_check = [&nodes, restart] { return nodes.poll(restart); };
      plan.on_failure = [&nodes, restart](const std::string& what) { nodes.report_failure(restart, what); };
    }
    Attempt a = run_attempt(plan, restart);
    if (a.interrupted) {
      warn("stopped by " + signame(a.interrupted));
      if (multi) nodes.abort(nodes.describe(plan.node_rank) + ": its fsdprun was stopped by " + signame(a.interrupted));
      return 128 + a.interrupted;
    }
    const std::string mine = a.root >= 0 ? "failed" : !a.stopped_for.empty() ? "stopped" : "ok";
    if (multi && a.root >= 0) {  // this node's own view (the attempt's first failure may be another node's)
      const Worker& r = a.workers[a.root];
      warn(nodes.describe(plan.node_rank) + ": rank " + std::to_string(r.rank) + " (local_rank " +
           std::to_string(r.local_rank) + ") ended with " + describe_exit(r.exitcode));
    }
    const Nodes::Outcome o = nodes.finish_attempt(restart, mine);
    if (!o.fatal.empty()) {
      if (a.root >= 0) print_summary(plan, a, restart);
      warn(o.fatal + ": the job cannot go on without it (no restart); exiting");
      return 1;
    }
    if (o.ok) return 0;
    std::string what;
    if (!multi) {
      const Worker& r = a.workers[a.root];
      what = "rank " + std::to_string(r.rank) + " ended with " + describe_exit(r.exitcode);
    } else {
      what = o.failure.empty() ? "a node's workers failed" : o.failure;
    }
    if (restart == plan.max_restarts) {
      if (a.root >= 0) print_summary(plan, a, restart);
      if (multi) warn("worker group failed on attempt " + std::to_string(restart) + " (--max-restarts " +
                      std::to_string(plan.max_restarts) + "): " + what);
      return 1;
    }
    // Every worker of this node with how it ended, as the final summary lists them.
    warn("attempt " + std::to_string(restart) + " failed: " + what + "; restarting the worker group" +
         (multi ? " on every node" : "") + " (restart " + std::to_string(restart + 1) + " of " +
         std::to_string(plan.max_restarts) + "). " + (multi ? nodes.describe(plan.node_rank) + "'s" : "The") +
         " workers ended with:" + describe_workers(a));
  }
}

/// Elastic jobs (--nnodes MIN:MAX): every attempt is one round of the rendezvous ([Note: elastic rounds]
/// in rounds.cpp), numbered alike on every node; after a failure, a lost node or nodes waiting to join,
/// the agents stop their workers and form the next round, at whatever size it has.
int run_elastic(Plan& plan, Nodes& nodes) {
  int failures = 0;  // attempts that failed or lost a node (--max-restarts); nodes joining are free
  for (;;) {
    const int k = nodes.round();
    plan.peer_check = [&nodes, k] { return nodes.poll(k); };
    plan.on_failure = [&nodes, k](const std::string& what) { nodes.report_failure(k, what); };
    Attempt a = run_attempt(plan, k);
    if (a.interrupted) {
      // As torchrun: a signaled agent leaves without ending the job (a preempted node); the others find it
      // lost and go on at the size that is left.
      warn("stopped by " + signame(a.interrupted) + "; this node leaves the job (the others go on without it)");
      return 128 + a.interrupted;
    }
    const std::string mine = a.root >= 0 ? "failed" : !a.stopped_for.empty() ? "stopped" : "ok";
    if (a.root >= 0) {
      const Worker& r = a.workers[a.root];
      warn(nodes.describe(plan.node_rank) + ": rank " + std::to_string(r.rank) + " (local_rank " +
           std::to_string(r.local_rank) + ") ended with " + describe_exit(r.exitcode));
    }
    const Nodes::Outcome o = nodes.finish_attempt(k, mine);
    if (o.signal) {
      warn(o.fatal + "; this node leaves the job (the others go on without it)");
      return 128 + o.signal;
    }
    if (!o.fatal.empty()) {
      if (a.root >= 0) print_summary(plan, a, k);
      warn(o.fatal + ": the job cannot go on without it (no restart); exiting");
      return 1;
    }
    if (o.ok) {
      nodes.mark_done();
      return 0;
    }
    const bool counts = o.change.empty() || o.lost || a.root >= 0 || !o.failure.empty();
    const std::string what = !o.failure.empty() ? o.failure : !o.change.empty() ? o.change : "a node's workers failed";
    if (counts && failures == plan.max_restarts) {
      if (a.root >= 0) print_summary(plan, a, k);
      warn("worker group failed in round " + std::to_string(k) + " (--max-restarts " +
           std::to_string(plan.max_restarts) + " used): " + what);
      nodes.abort("the worker group failed in round " + std::to_string(k) + " and --max-restarts " +
                  std::to_string(plan.max_restarts) + " is used up: " + what);
      return 1;
    }
    if (counts) ++failures;
    warn("round " + std::to_string(k) + " ended: " + what + "; stopping the workers and joining the next round (" +
         (counts ? "restart " + std::to_string(failures) + " of " + std::to_string(plan.max_restarts)
                 : std::string("a membership change: no restart used")) +
         "). " + nodes.describe(plan.node_rank) + "'s workers ended with:" + describe_workers(a));
    nodes.rejoin();
  }
}

}  // namespace
}  // namespace fsdprun

int main(int argc, char** argv) {
  using namespace fsdprun;  // NOLINT
  for (int fd = 0; fd <= 2; ++fd)  // keep pipes and files off fds 0-2
    if (::fcntl(fd, F_GETFD) == -1) ::open("/dev/null", O_RDWR);
  Options opt = parse_args(argc, argv);
  Plan plan = make_plan(opt);
  export_worker_defaults(plan);
  Nodes nodes(plan);  // the agent store and, across nodes, the rendezvous
  // After the store: until then there are no workers, and the default dispositions let Ctrl-C end a
  // node that waits for node 0.
  install_signal_handlers();
  ::prctl(PR_SET_CHILD_SUBREAPER, 1);
  const std::string temp_root = make_run_dir(opt, plan);
  const int rc = plan.elastic() ? run_elastic(plan, nodes) : run_attempts(plan, nodes);
  nodes.finish();
  if (!temp_root.empty()) {
    std::error_code ec;
    fs::remove_all(temp_root, ec);
  }
  return rc;
}
