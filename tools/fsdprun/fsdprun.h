// fsdprun's parts (see main.cpp for what it does): the command line and the plan it yields
// (options.cpp), the workers of one attempt (workers.cpp), and main (main.cpp).
#pragma once

#include <chrono>
#include <filesystem>
#include <optional>
#include <set>
#include <string>
#include <vector>

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
};

/// Makes the signals fsdprun forwards (and SIGCHLD) wake the attempt's poll loop (a self-pipe).
void install_signal_handlers();
/// Starts plan.nproc workers, forwards their output and signals, stops them all on the first failure;
/// returns once every worker (and what it started) is gone.
Attempt run_attempt(const Plan& plan, int restart);
/// "exit code 3" or "signal 9 (SIGKILL)".
std::string describe_exit(int exitcode);
/// torchrun's ChildFailedError report, plus the failed rank's last stderr lines.
void print_summary(const Plan& plan, const Attempt& a, int restart);

}  // namespace fsdprun
