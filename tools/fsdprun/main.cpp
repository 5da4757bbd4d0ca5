// fsdprun: a torchrun-compatible launcher for C++ programs (what `torchrun --no-python` does, without
// Python).
//
//   fsdprun [--standalone] [--nnodes M] [--node-rank R] --nproc-per-node N [--master-addr A]
//           [--master-port P] [--max-restarts K] [--log-dir DIR] [-r/--redirects S] [-t/--tee S]
//           [--local-ranks-filter 0,2] [--role NAME] [--shutdown-timeout S] [--] PROGRAM [ARGS...]
//
//   fsdprun --standalone --nproc-per-node 4 build/bin/train_gpt --steps 100
//   fsdprun --nnodes 2 --node-rank 0 --nproc-per-node 8 --master-addr node0 --master-port 29500 PROGRAM
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
//  * on the first failure (non-zero exit or death by signal) stops the other workers (SIGTERM, SIGKILL
//    after --shutdown-timeout, default 30 s) and restarts the whole group up to --max-restarts times;
//    then exits 1 with a summary naming the failed rank, its exit code (-N for signal N, as torchrun)
//    or signal, the message it left in TORCHELASTIC_ERROR_FILE ({"message": ...}) and its last stderr
//    lines;
//  * forwards SIGINT/SIGTERM/SIGHUP/SIGQUIT to every worker (a second one sends SIGKILL) and exits
//    128+signal once they are gone. It is a child subreaper, so no descendant of a worker outlives it.
//
// Multi-node (--nnodes > 1) assumes the same --nproc-per-node on every node; restarts are per node
// (a failure elsewhere reaches this node as failing collectives).
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <deque>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/cuda.h>

extern char** environ;

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

void warn(const std::string& msg) { std::fprintf(stderr, "fsdprun: %s\n", msg.c_str()); }
[[noreturn]] void die(const std::string& msg) {
  warn(msg);
  std::exit(1);
}

std::string signame(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev ? std::string("SIG") + abbrev : "signal " + std::to_string(sig);
}

// Returns false if the write failed (e.g. EPIPE: fsdprun ignores SIGPIPE).
bool write_all(int fd, const char* p, size_t n) {
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<size_t>(w);
  }
  return true;
}

// Set when writing to our stdout (1) or stderr (2) failed with EPIPE, as after `fsdprun ... | head`.
bool g_console_broken[3] = {false, false, false};

// ---- Signals: handlers only write the signal number to a self-pipe that the poll loop reads.
int g_self_pipe[2] = {-1, -1};
// The forwarded ones (torchrun's --signals-to-handle default), SIGCHLD, and SIGPIPE (ignored).
constexpr int kHandled[] = {SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGCHLD, SIGPIPE};
struct sigaction g_orig_action[NSIG];  // restored in the workers before exec

void on_signal(int sig) {
  int saved = errno;
  unsigned char c = static_cast<unsigned char>(sig);
  (void)!::write(g_self_pipe[1], &c, 1);
  errno = saved;
}

void install_signal_handlers() {
  if (::pipe2(g_self_pipe, O_CLOEXEC | O_NONBLOCK) != 0) die("pipe2: " + std::string(std::strerror(errno)));
  for (int sig : kHandled) {
    struct sigaction sa {};
    sa.sa_handler = sig == SIGPIPE ? SIG_IGN : on_signal;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    sigaction(sig, &sa, &g_orig_action[sig]);
    // A signal ignored by whoever started us (e.g. SIGHUP under nohup) stays ignored, here and in workers.
    if (g_orig_action[sig].sa_handler == SIG_IGN && sig != SIGCHLD) sigaction(sig, &g_orig_action[sig], nullptr);
  }
}

// ---- Command line.
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

// torchrun's Std syntax: "3" (all local ranks) or "0:1,1:2" (per local rank); 1 = stdout, 2 = stderr.
std::vector<int> parse_std(const std::string& spec, int nproc, const char* flag) {
  std::vector<int> out(nproc, 0);
  auto bad = [&] { die(std::string(flag) + " " + spec + ": expected 0-3 or LOCAL_RANK:0-3,... (e.g. 0:1,1:2)"); };
  if (spec.find(':') == std::string::npos) {
    if (spec.size() != 1 || spec[0] < '0' || spec[0] > '3') bad();
    std::fill(out.begin(), out.end(), spec[0] - '0');
    return out;
  }
  std::stringstream ss(spec);
  for (std::string item; std::getline(ss, item, ',');) {
    auto colon = item.find(':');
    if (colon == std::string::npos || colon + 2 != item.size() || item.back() < '0' || item.back() > '3') bad();
    int lr = std::atoi(item.substr(0, colon).c_str());
    if (lr < 0 || lr >= nproc) bad();
    out[lr] = item.back() - '0';
  }
  return out;
}

int parse_nproc(const std::string& s) {
  int cpus = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (s == "cpu") return cpus;
  if (s == "gpu" || s == "auto") {
    int gpus = static_cast<int>(torch::cuda::device_count());
    if (gpus == 0 && s == "gpu") die("--nproc-per-node gpu: no CUDA device is visible");
    return gpus > 0 ? gpus : cpus;
  }
  char* end = nullptr;
  long n = std::strtol(s.c_str(), &end, 10);
  if (s.empty() || *end != '\0' || n < 1)
    die("--nproc-per-node " + s + ": expected a positive integer, cpu, gpu or auto");
  return static_cast<int>(n);
}

int parse_nnodes(const std::string& s) {
  // torchrun accepts MIN:MAX for elastic jobs; only a fixed size is supported here.
  auto colon = s.find(':');
  std::string lo = s.substr(0, colon), hi = colon == std::string::npos ? lo : s.substr(colon + 1);
  char* end = nullptr;
  long n = std::strtol(lo.c_str(), &end, 10);
  if (lo.empty() || *end != '\0' || n < 1 || lo != hi)
    die("--nnodes " + s + ": expected a positive integer (elastic MIN:MAX ranges are not supported)");
  return static_cast<int>(n);
}

// Numeric flags fail with one line naming what is expected (CLI11's own checks print the type's whole
// range, 1.8e308 written out, and let NaN through).
CLI::Validator number_in(double lo, double hi, bool integer) {
  std::ostringstream desc;
  desc << "expected " << (integer ? "an integer" : "a finite number") << " >= " << lo;
  if (!integer || hi < 1e6) desc << " and <= " << hi;
  const std::string expected = desc.str();
  return CLI::Validator(
      [=](std::string& s) -> std::string {
        char* end = nullptr;
        const double v = s.empty() ? 0.0 : std::strtod(s.c_str(), &end);
        const bool ok = !s.empty() && !std::isspace(static_cast<unsigned char>(s[0])) && *end == '\0' &&
                        std::isfinite(v) && v >= lo && (!integer || v == std::floor(v));
        if (!ok) return expected + ", got '" + s + "'";
        return v <= hi ? "" : expected + ", got " + s + ", which is out of range";
      },
      "", "");
}

// PROGRAM and its arguments are not CLI11 positionals (see prefix_command), so say them in the usage.
struct UsageFormatter : CLI::Formatter {
  std::string make_usage(const CLI::App*, std::string) const override {
    return "\nUsage: fsdprun [OPTIONS] [--] PROGRAM [ARGS...]\n";
  }
};

Options parse_args(int argc, char** argv) {
  Options o;
  constexpr double kIntMax = std::numeric_limits<int>::max();
  CLI::App app{
      "Launches PROGRAM as N ranks per node with torchrun's environment (what `torchrun --no-python` does),\n"
      "hosts their rendezvous store, prefixes and collects their output, and stops or restarts them all\n"
      "when one fails."};
  app.footer(
      "Example: fsdprun --standalone --nproc-per-node 4 build/bin/fsdp_hello\n"
      "Workers see RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_* as\n"
      "under torchrun. Environment: FSDPRUN_GRACE_S or TORCH_ELASTIC_SHUTDOWN_TIMEOUT set --shutdown-timeout;\n"
      "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE sets the output prefix (default '[${role_name}${local_rank}]:').\n"
      "Exit status: 0 if every worker succeeded, 1 if one failed (after the restarts), 128+N on signal N.");
  app.formatter(std::make_shared<UsageFormatter>());
  app.prefix_command();  // everything from PROGRAM on belongs to PROGRAM
  app.add_flag("--standalone", o.standalone,
               "Single node: host the store on a free port of localhost (ignores --nnodes/--master-*)");
  app.add_option("--nnodes", o.nnodes, "Number of nodes")->envname("PET_NNODES")->capture_default_str();
  app.add_option("--node-rank,--node_rank", o.node_rank, "Rank of this node (0 hosts the store)")
      ->envname("PET_NODE_RANK")->capture_default_str()->check(number_in(0, kIntMax, true));
  app.add_option("--nproc-per-node,--nproc_per_node", o.nproc_per_node,
                 "Workers on this node: an integer, cpu, gpu or auto")
      ->envname("PET_NPROC_PER_NODE")->capture_default_str();
  app.add_option("--master-addr,--master_addr", o.master_addr, "Host of node 0 (the store)")
      ->envname("PET_MASTER_ADDR")->capture_default_str();
  app.add_option("--master-port,--master_port", o.master_port, "Port of the store; 0 picks a free one (Default: 29500)")
      ->envname("PET_MASTER_PORT")->check(number_in(0, 65535, true));
  app.add_option("--max-restarts,--max_restarts", o.max_restarts, "Restarts of the worker group before failing")
      ->envname("PET_MAX_RESTARTS")->capture_default_str()->check(number_in(0, kIntMax, true));
  app.add_option("--log-dir,--log_dir", o.log_dir,
                 "Also write DIR/<run_id>_XXXXXX/attempt_<k>/<local_rank>/{stdout,stderr}.log and error.json")
      ->envname("PET_LOG_DIR");
  app.add_option("-r,--redirects", o.redirects,
                 "Streams kept off the console (log files only): 1 stdout, 2 stderr, 3 both, or e.g. 0:1,1:2")
      ->envname("PET_REDIRECTS")->capture_default_str();
  app.add_option("-t,--tee", o.tee, "Streams shown on the console despite --redirects (same syntax)")
      ->envname("PET_TEE")->capture_default_str();
  app.add_option("--local-ranks-filter,--local_ranks_filter", o.local_ranks_filter,
                 "Show only these local ranks' output on the console, e.g. 0,2 (log files get all)")
      ->envname("PET_LOCAL_RANKS_FILTER");
  app.add_option("--role", o.role, "Role name (ROLE_NAME and the output prefix)")->capture_default_str();
  app.add_option("--shutdown-timeout,--shutdown_timeout", o.shutdown_timeout,
                 "Seconds between SIGTERM and SIGKILL when stopping workers (Default: 30)")
      ->envname("PET_SHUTDOWN_TIMEOUT")->check(number_in(0, 86400, false));
  app.add_flag("--no-python,--no_python", o.no_python, "Accepted for torchrun compatibility (always the case)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) std::exit(app.exit(e));  // --help
    std::string what = e.what();
    std::replace(what.begin(), what.end(), '\n', ' ');
    die(what + " (see fsdprun --help)");
  }
  o.command = app.remaining();
  if (!o.command.empty() && o.command.front() == "--") o.command.erase(o.command.begin());
  if (o.command.empty()) die("no PROGRAM given (see fsdprun --help)");
  if (o.command.front().size() > 1 && o.command.front()[0] == '-')
    die("unknown option " + o.command.front() + " (see fsdprun --help; put PROGRAM after --)");
  return o;
}

// ---- Small helpers.
std::string uuid4() {
  std::random_device rd;
  unsigned char b[16];
  for (auto& x : b) x = static_cast<unsigned char>(rd());
  b[6] = (b[6] & 0x0f) | 0x40;
  b[8] = (b[8] & 0x3f) | 0x80;
  char s[37];
  std::snprintf(s, sizeof s, "%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1], b[2],
                b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
  return s;
}

std::string now_str() {  // torchrun's failure timestamps: 2025-01-31_12:34:56
  std::time_t t = std::time(nullptr);
  char s[32];
  std::strftime(s, sizeof s, "%Y-%m-%d_%H:%M:%S", std::localtime(&t));
  return s;
}

std::string make_temp_dir(const std::string& parent, const std::string& prefix) {
  std::string templ = parent + "/" + prefix + "XXXXXX";
  if (!::mkdtemp(templ.data())) die("cannot create a directory in " + parent + ": " + std::strerror(errno));
  return templ;
}

// execvp's PATH search, done before fork() so that the child only makes async-signal-safe calls.
std::string resolve_program(const std::string& prog) {
  if (prog.find('/') != std::string::npos) return prog;
  const char* path = std::getenv("PATH");
  std::stringstream ss(path ? path : "/usr/local/bin:/usr/bin:/bin");
  for (std::string dir; std::getline(ss, dir, ':');) {
    std::string cand = (dir.empty() ? "." : dir) + "/" + prog;
    struct stat st {};
    if (::stat(cand.c_str(), &st) == 0 && S_ISREG(st.st_mode) && ::access(cand.c_str(), X_OK) == 0) return cand;
  }
  die(prog + ": command not found (searched PATH)");
}

// Python's string.Template.safe_substitute for ${name} and $name.
std::string substitute(std::string s, const std::map<std::string, std::string>& vars) {
  for (const auto& [k, v] : vars) {
    for (const std::string& key : {"${" + k + "}", "$" + k}) {
      for (size_t p; (p = s.find(key)) != std::string::npos;) s.replace(p, key.size(), v);
    }
  }
  return s;
}

// The message a worker left in TORCHELASTIC_ERROR_FILE: {"message": "..."} or, as torch's @record
// writes it, {"message": {"message": "...", "extraInfo": {"py_callstack": "..."}}}.
std::string read_error_file(const std::string& path) {
  std::ifstream f(path);
  if (!f) return "";
  std::stringstream ss;
  ss << f.rdbuf();
  std::string raw = ss.str();
  try {
    auto j = nlohmann::json::parse(raw);
    const auto& m = j.at("message");
    if (m.is_string()) return m.get<std::string>();
    if (m.is_object() && m.contains("message") && m["message"].is_string()) {
      std::string msg = m["message"].get<std::string>();
      if (m.contains("extraInfo") && m["extraInfo"].contains("py_callstack"))
        msg += "\n" + m["extraInfo"]["py_callstack"].get<std::string>();
      return msg;
    }
    return m.dump();
  } catch (const std::exception&) {
    return raw.substr(0, 4000);
  }
}

// ---- Workers.
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

void emit(Worker& w, Stream& s, const std::string& line) {
  if (s.console && !g_console_broken[s.console_fd]) {
    std::string text = w.prefix + line + "\n";
    if (!write_all(s.console_fd, text.data(), text.size()) && errno == EPIPE) g_console_broken[s.console_fd] = true;
  }
  if (s.console_fd == 2) {
    s.tail.push_back(line);
    if (s.tail.size() > kTailLines) s.tail.pop_front();
  }
}

// Reads what is available on s.fd. Returns 1 after reading, 0 at EOF (and closes s.fd), -1 when
// nothing is available yet.
int pump(Worker& w, Stream& s) {
  char buf[65536];
  ssize_t n = ::read(s.fd, buf, sizeof buf);
  if (n < 0 && (errno == EINTR || errno == EAGAIN)) return -1;
  if (n <= 0) {
    if (!s.partial.empty()) emit(w, s, s.partial);
    s.partial.clear();
    ::close(s.fd);
    s.fd = -1;
    return 0;
  }
  if (s.log_fd >= 0) write_all(s.log_fd, buf, static_cast<size_t>(n));
  s.partial.append(buf, static_cast<size_t>(n));
  size_t start = 0;
  for (size_t nl; (nl = s.partial.find('\n', start)) != std::string::npos; start = nl + 1)
    emit(w, s, s.partial.substr(start, nl - start));
  s.partial.erase(0, start);
  if (s.partial.size() > sizeof buf) {  // a very long line without newline: flush it as is
    emit(w, s, s.partial);
    s.partial.clear();
  }
  return 1;
}

// Once our console stream is a broken pipe, close the read end of the workers' pipes that only fed it,
// so that they get SIGPIPE/EPIPE as they would writing to it directly under torchrun (instead of
// running on unseen). With --log-dir we keep reading into the log files.
void detach_broken_console(Stream& s) {
  if (!s.console || !g_console_broken[s.console_fd]) return;
  s.console = false;
  if (s.log_fd < 0 && s.fd >= 0) {
    ::close(s.fd);
    s.fd = -1;
  }
}

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

// torchrun's LocalElasticAgent._start_workers: our environment plus these.
std::vector<std::string> worker_env(const Plan& plan, const Worker& w, int restart) {
  std::map<std::string, std::string> env;
  for (char** e = environ; *e; ++e) {
    std::string kv = *e;
    auto eq = kv.find('=');
    if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  const int world = plan.nnodes * plan.nproc;
  env["LOCAL_RANK"] = std::to_string(w.local_rank);
  env["RANK"] = std::to_string(w.rank);
  env["GROUP_RANK"] = std::to_string(plan.node_rank);
  env["ROLE_RANK"] = std::to_string(w.rank);
  env["ROLE_NAME"] = plan.role;
  env["LOCAL_WORLD_SIZE"] = std::to_string(plan.nproc);
  env["WORLD_SIZE"] = std::to_string(world);
  env["GROUP_WORLD_SIZE"] = std::to_string(plan.nnodes);
  env["ROLE_WORLD_SIZE"] = std::to_string(world);
  env["MASTER_ADDR"] = plan.master_addr;
  env["MASTER_PORT"] = std::to_string(plan.master_port);
  env["TORCHELASTIC_RESTART_COUNT"] = std::to_string(restart);
  env["TORCHELASTIC_MAX_RESTARTS"] = std::to_string(plan.max_restarts);
  env["TORCHELASTIC_RUN_ID"] = plan.run_id;
  env["TORCHELASTIC_USE_AGENT_STORE"] = "True";
  env["TORCHELASTIC_ERROR_FILE"] = w.error_file;
  env.emplace("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1");  // unless already set
  std::vector<std::string> flat;
  for (const auto& [k, v] : env) flat.push_back(k + "=" + v);
  return flat;
}

pid_t spawn(const Plan& plan, const std::vector<std::string>& env, int out_w, int err_w) {
  std::vector<char*> argv, envp;
  for (const auto& a : plan.argv) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  for (const auto& e : env) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  const char* path = plan.program_path.c_str();

  // Block signals across fork() so that the child cannot run our handlers (which write to the
  // parent's self-pipe) before it has restored the original dispositions.
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  pid_t parent = ::getpid();
  pid_t pid = ::fork();
  if (pid == 0) {  // child: async-signal-safe calls only (the store runs threads in the parent)
    ::setsid();  // own session and process group, as torchrun's start_new_session=True
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // if fsdprun is SIGKILLed, do not outlive it
    if (::getppid() != parent) ::_exit(1);
    ::dup2(out_w, 1);
    ::dup2(err_w, 2);
    for (int sig : kHandled) ::sigaction(sig, &g_orig_action[sig], nullptr);
    ::sigprocmask(SIG_SETMASK, &old, nullptr);
    ::execve(path, argv.data(), envp.data());
    const char* parts[] = {"fsdprun: cannot execute ", path, ": ", std::strerror(errno), "\n"};
    for (const char* p : parts) (void)!::write(2, p, std::strlen(p));
    ::_exit(127);
  }
  int fork_errno = errno;
  pthread_sigmask(SIG_SETMASK, &old, nullptr);
  if (pid < 0) die(std::string("fork: ") + std::strerror(fork_errno));
  return pid;
}

// Signals a worker's whole process group (it and what it started).
void signal_worker(const Worker& w, int sig) {
  if (w.pid <= 0) return;
  // ESRCH before the child's setsid(): signal the child itself (it applies once it unblocks signals).
  if (::killpg(w.pid, sig) != 0 && errno == ESRCH && !w.exited) ::kill(w.pid, sig);
}

struct Attempt {
  std::vector<Worker> workers;
  int root = -1;         // index of the first failed worker
  int interrupted = 0;   // signal fsdprun received
};

Attempt run_attempt(const Plan& plan, int restart) {
  Attempt a;
  std::string attempt_dir = plan.run_dir + "/attempt_" + std::to_string(restart);
  std::error_code ec;
  fs::remove_all(attempt_dir, ec);

  a.workers.resize(plan.nproc);
  for (int lr = 0; lr < plan.nproc; ++lr) {
    Worker& w = a.workers[lr];
    w.local_rank = lr;
    w.rank = plan.node_rank * plan.nproc + lr;
    std::string dir = attempt_dir + "/" + std::to_string(lr);
    fs::create_directories(dir, ec);
    if (ec) die("cannot create " + dir + ": " + ec.message());
    w.error_file = dir + "/error.json";
    w.prefix = substitute(plan.prefix_template, {{"role_name", plan.role}, {"rank", std::to_string(w.rank)},
                                                 {"local_rank", std::to_string(lr)}});
    std::vector<std::string> env = worker_env(plan, w, restart);

    int out_pipe[2], err_pipe[2];
    if (::pipe2(out_pipe, O_CLOEXEC) != 0 || ::pipe2(err_pipe, O_CLOEXEC) != 0)
      die(std::string("pipe2: ") + std::strerror(errno));
    bool shown = plan.console_ranks.empty() || plan.console_ranks.count(lr);
    w.out.console_fd = 1;
    w.err.console_fd = 2;
    w.out.console = shown && (!(plan.redirects[lr] & 1) || (plan.tee[lr] & 1));
    w.err.console = shown && (!(plan.redirects[lr] & 2) || (plan.tee[lr] & 2));
    if (plan.log_files) {
      w.out.log_fd = ::open((dir + "/stdout.log").c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
      w.err.log_fd = ::open((dir + "/stderr.log").c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    }
    w.pid = spawn(plan, env, out_pipe[1], err_pipe[1]);
    ::close(out_pipe[1]);
    ::close(err_pipe[1]);
    w.out.fd = out_pipe[0];
    w.err.fd = err_pipe[0];
  }

  // Stopping: first `sig` to every group, SIGKILL once the grace period is over.
  bool stopping = false, killed = false, leftovers_termed = false;
  Clock::time_point kill_at = Clock::time_point::max(), give_up = Clock::time_point::max();
  auto stop = [&](int sig) {
    for (auto& w : a.workers) signal_worker(w, sig);
    if (!stopping) kill_at = Clock::now() + plan.grace;
    stopping = true;
  };
  auto kill_all = [&] {
    for (auto& w : a.workers) signal_worker(w, SIGKILL);
    killed = true;
    give_up = Clock::now() + std::chrono::seconds(5);  // for descendants that left their process group
  };

  for (;;) {
    std::vector<pollfd> fds{{g_self_pipe[0], POLLIN, 0}};
    std::vector<std::pair<Worker*, Stream*>> owners{{nullptr, nullptr}};
    for (auto& w : a.workers) {
      for (Stream* s : {&w.out, &w.err}) {
        detach_broken_console(*s);
        if (s->fd < 0) continue;
        fds.push_back({s->fd, POLLIN, 0});
        owners.emplace_back(&w, s);
      }
    }
    // SIGCHLD and the forwarded signals wake us through the self-pipe; deadlines through the timeout.
    auto wake = std::min({kill_at, give_up, Clock::now() + std::chrono::seconds(1)});
    auto timeout_ms = std::chrono::duration_cast<std::chrono::milliseconds>(wake - Clock::now()).count() + 1;
    ::poll(fds.data(), fds.size(), static_cast<int>(std::max<long>(timeout_ms, 0)));

    if (fds[0].revents & POLLIN) {
      unsigned char sigs[64];
      for (ssize_t n; (n = ::read(g_self_pipe[0], sigs, sizeof sigs)) > 0;) {
        for (ssize_t i = 0; i < n; ++i) {
          int sig = sigs[i];
          if (sig == SIGCHLD) continue;  // reaped below
          if (!a.interrupted) {
            a.interrupted = sig;
            warn("received " + signame(sig) + ": forwarding it to the workers");
            stop(sig);
          } else if (!killed) {
            warn("received " + signame(sig) + " again: killing the workers");
            kill_all();
          }
        }
      }
    }
    for (size_t i = 1; i < fds.size(); ++i)
      if (fds[i].revents) pump(*owners[i].first, *owners[i].second);

    // Reap. As a subreaper, orphaned descendants of the workers are our children too.
    bool no_children = false;
    for (;;) {
      int status = 0;
      pid_t pid = ::waitpid(-1, &status, WNOHANG);
      if (pid <= 0) {
        no_children = pid < 0 && errno == ECHILD;
        break;
      }
      for (size_t i = 0; i < a.workers.size(); ++i) {
        Worker& w = a.workers[i];
        if (w.pid != pid) continue;
        w.exited = true;
        w.exitcode = WIFSIGNALED(status) ? -WTERMSIG(status) : WEXITSTATUS(status);
        w.time = now_str();
        w.stopped_by_us = stopping;
        if (w.exitcode != 0 && !stopping) {
          a.root = static_cast<int>(i);
          stop(SIGTERM);
        }
      }
    }
    bool all_exited = std::all_of(a.workers.begin(), a.workers.end(), [](const Worker& w) { return w.exited; });
    if (all_exited) {
      if (no_children) break;
      // Descendants the workers left behind (e.g. background jobs, which ignore SIGINT): SIGTERM them
      // even if the group was stopped with another signal.
      if (!leftovers_termed) stop(SIGTERM);
      leftovers_termed = true;
    }
    if (stopping && !killed && Clock::now() >= kill_at) {
      warn("workers still running " + std::to_string(plan.grace.count()) + " ms after being stopped: sending SIGKILL");
      kill_all();
    }
    if (all_exited && Clock::now() >= give_up) break;
  }

  // Every writer is gone: drain what is left in the pipes.
  for (auto& w : a.workers) {
    for (Stream* s : {&w.out, &w.err}) {
      if (s->fd >= 0) ::fcntl(s->fd, F_SETFL, O_NONBLOCK);
      while (s->fd >= 0) {
        if (pump(w, *s) < 0) {  // a writer escaped us (left our process tree): stop reading
          if (!s->partial.empty()) emit(w, *s, s->partial);
          ::close(s->fd);
          s->fd = -1;
        }
      }
      if (s->log_fd >= 0) ::close(s->log_fd);
    }
  }
  return a;
}

std::string describe_exit(int exitcode) {
  if (exitcode >= 0) return "exit code " + std::to_string(exitcode);
  return "signal " + std::to_string(-exitcode) + " (" + signame(-exitcode) + ")";
}

// torchrun's ChildFailedError report, plus the failed rank's last stderr lines.
void print_summary(const Plan& plan, const Attempt& a, int restart) {
  char host[256] = "localhost";
  ::gethostname(host, sizeof host - 1);
  const Worker& r = a.workers[a.root];
  std::ostringstream s;
  const std::string rule(60, '='), thin(60, '-');
  s << "fsdprun: worker group failed (attempt " << restart << ", --max-restarts " << plan.max_restarts << ")\n"
    << rule << "\n" << plan.argv[0] << " FAILED\n" << thin << "\nFailures:\n";
  bool others = false;
  for (const auto& w : a.workers) {
    if (&w == &r || w.exitcode == 0) continue;
    others = true;
    s << "  rank " << w.rank << " (local_rank " << w.local_rank << "): exitcode " << w.exitcode
      << (w.exitcode < 0 ? " (" + signame(-w.exitcode) + ")" : "") << (w.stopped_by_us ? ", stopped by fsdprun" : "")
      << "\n";
  }
  if (!others) s << "  <NO_OTHER_FAILURES>\n";
  s << thin << "\nRoot Cause (first observed failure):\n"
    << "  time      : " << r.time << "\n"
    << "  host      : " << host << "\n"
    << "  rank      : " << r.rank << " (local_rank: " << r.local_rank << ")\n"
    << "  exitcode  : " << r.exitcode << " (pid: " << r.pid << ")"
    << (r.exitcode < 0 ? "  (" + signame(-r.exitcode) + ")" : "") << "\n";
  std::string msg = read_error_file(r.error_file);
  if (!msg.empty()) {
    s << "  error_file: " << r.error_file << "\n  message   : ";
    for (char c : msg) s << (c == '\n' ? std::string("\n              ") : std::string(1, c));
    s << "\n";
  } else {
    s << "  error_file: <N/A>\n";
  }
  if (!r.err.tail.empty()) {
    s << "  stderr    : (last " << r.err.tail.size() << " lines)\n";
    for (const auto& line : r.err.tail) s << "    " << line << "\n";
  }
  s << rule << "\n";
  std::string text = s.str();
  write_all(2, text.data(), text.size());
}

// With several nodes, node 0's store must outlive every node's workers (torchrun's exit barrier).
void exit_barrier(c10d::TCPStore& store, const Plan& plan) {
  if (plan.nnodes == 1) return;
  const std::string key = "/fsdprun/" + plan.run_id + "/exited";
  try {
    store.add(key, 1);
    auto deadline = Clock::now() + std::chrono::minutes(5);
    while (plan.node_rank == 0 && store.add(key, 0) < plan.nnodes && Clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
  } catch (const std::exception& e) {
    warn(std::string("exit barrier: ") + e.what());
  }
}

}  // namespace

int main(int argc, char** argv) {
  for (int fd = 0; fd <= 2; ++fd)  // keep pipes and files off fds 0-2
    if (::fcntl(fd, F_GETFD) == -1) ::open("/dev/null", O_RDWR);
  Options opt = parse_args(argc, argv);

  Plan plan;
  plan.argv = opt.command;
  plan.nproc = parse_nproc(opt.nproc_per_node);
  plan.nnodes = opt.standalone ? 1 : parse_nnodes(opt.nnodes);
  plan.node_rank = opt.standalone ? 0 : opt.node_rank;
  if (plan.node_rank >= plan.nnodes)
    die("--node-rank " + std::to_string(plan.node_rank) + " must be < --nnodes " + std::to_string(plan.nnodes));
  plan.max_restarts = opt.max_restarts;
  plan.program_path = resolve_program(opt.command.front());
  plan.role = opt.role;
  // As torchrun: --standalone is a c10d rendezvous on localhost:0 with a fresh uuid run id; otherwise
  // the static one at --master-addr:--master-port with run id "none".
  plan.run_id = opt.standalone ? uuid4() : "none";
  plan.master_addr = opt.standalone ? "localhost" : opt.master_addr;
  plan.master_port = opt.standalone ? 0 : opt.master_port.value_or(29500);
  if (plan.master_port == 0 && plan.nnodes > 1) die("--master-port 0 needs --nnodes 1: other nodes must know the port");
  plan.redirects = parse_std(opt.redirects, plan.nproc, "--redirects");
  plan.tee = parse_std(opt.tee, plan.nproc, "--tee");
  if (!opt.local_ranks_filter.empty()) {
    std::stringstream ss(opt.local_ranks_filter);
    for (std::string item; std::getline(ss, item, ',');) {
      char* end = nullptr;
      long lr = std::strtol(item.c_str(), &end, 10);
      if (item.empty() || *end != '\0' || lr < 0)
        die("--local-ranks-filter " + opt.local_ranks_filter + ": expected comma-separated local ranks, e.g. 0,2");
      plan.console_ranks.insert(static_cast<int>(lr));
    }
  }
  const char* tmpl = std::getenv("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE");
  plan.prefix_template = tmpl && *tmpl ? tmpl : "[${role_name}${local_rank}]:";
  double grace_s = 30;
  if (const char* g = std::getenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")) grace_s = std::atof(g);
  if (const char* g = std::getenv("FSDPRUN_GRACE_S")) grace_s = std::atof(g);
  if (opt.shutdown_timeout) grace_s = *opt.shutdown_timeout;
  plan.grace = std::chrono::milliseconds(static_cast<long>(std::max(0.0, grace_s) * 1000));

  // Environment every worker inherits, as torchrun sets it in its own process.
  if (!std::getenv("OMP_NUM_THREADS") && plan.nproc > 1) {
    // torchrun's policy (one intra-op thread per worker unless the user chose), in one line of our own.
    warn("OMP_NUM_THREADS is unset: each of this node's " + std::to_string(plan.nproc) +
         " workers gets 1 thread so that they do not oversubscribe the CPUs; set OMP_NUM_THREADS to choose "
         "another number");
    ::setenv("OMP_NUM_THREADS", "1", 1);
  }
  ::setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT", 1);

  // The agent store. Node 0 hosts it (multi-tenant, so that every worker and agent can connect);
  // port 0 binds a free port, which the workers then get as MASTER_PORT.
  c10::intrusive_ptr<c10d::TCPStore> store;
  try {
    c10d::TCPStoreOptions so;
    so.port = static_cast<std::uint16_t>(plan.master_port);
    so.isServer = plan.node_rank == 0;
    so.multiTenant = true;
    so.waitWorkers = false;
    so.timeout = std::chrono::minutes(15);  // how long other nodes wait for node 0's store
    if (!so.isServer) warn("waiting for node 0's store at " + plan.master_addr + ":" + std::to_string(so.port));
    store = c10::make_intrusive<c10d::TCPStore>(plan.master_addr, so);
    plan.master_port = store->getPort();
  } catch (const std::exception& e) {
    auto c10_error = dynamic_cast<const c10::Error*>(&e);
    die((plan.node_rank == 0 ? "cannot host the TCPStore on port " : "cannot reach the TCPStore at " +
         plan.master_addr + ":") + std::to_string(plan.master_port) + ": " +
        (c10_error ? c10_error->what_without_backtrace() : e.what()) +
        (plan.node_rank == 0 ? "\nFix: pick another --master-port, or use --standalone / --master-port 0" : ""));
  }

  // After the store: until then there are no workers, and the default dispositions let Ctrl-C end a
  // node that waits for node 0.
  install_signal_handlers();
  ::prctl(PR_SET_CHILD_SUBREAPER, 1);

  // Directories: DIR/<run_id>_XXXXXX/attempt_<k>/<local_rank>/ (error.json, and the logs with --log-dir).
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

  int rc = 1;
  for (int restart = 0;; ++restart) {
    Attempt a = run_attempt(plan, restart);
    if (a.interrupted) {
      warn("stopped by " + signame(a.interrupted));
      rc = 128 + a.interrupted;
      break;
    }
    if (a.root < 0) {
      rc = 0;
      break;
    }
    if (restart == plan.max_restarts) {
      print_summary(plan, a, restart);
      rc = 1;
      break;
    }
    const Worker& r = a.workers[a.root];
    warn("attempt " + std::to_string(restart) + " failed: rank " + std::to_string(r.rank) + " ended with " +
         describe_exit(r.exitcode) + "; restarting the worker group (restart " + std::to_string(restart + 1) +
         " of " + std::to_string(plan.max_restarts) + ")");
  }
  exit_barrier(*store, plan);
  store.reset();
  if (!temp_root.empty()) {
    std::error_code ec;
    fs::remove_all(temp_root, ec);
  }
  return rc;
}
