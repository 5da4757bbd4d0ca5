// fsdprun's workers: signals, spawning, output forwarding, the poll loop of one attempt, and the
// failure summary.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "fsdprun.h"

extern char** environ;

namespace fsdprun {

void warn(const std::string& msg) { std::fprintf(stderr, "fsdprun: %s\n", msg.c_str()); }
[[noreturn]] void die(const std::string& msg) {
  warn(msg);
  std::exit(1);
}

std::string signame(int sig) {
  const char* abbrev = sigabbrev_np(sig);
  return abbrev ? std::string("SIG") + abbrev : "signal " + std::to_string(sig);
}

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

namespace {

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

}  // namespace

int take_pending_signal() {
  if (g_self_pipe[0] < 0) return 0;
  unsigned char sigs[64];
  int found = 0;
  for (ssize_t n; !found && (n = ::read(g_self_pipe[0], sigs, sizeof sigs)) > 0;) {
    for (ssize_t i = 0; i < n && !found; ++i)
      if (sigs[i] != SIGCHLD) found = sigs[i];
  }
  return found;
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

namespace {

std::string now_str() {  // torchrun's failure timestamps: 2025-01-31_12:34:56
  std::time_t t = std::time(nullptr);
  char s[32];
  std::strftime(s, sizeof s, "%Y-%m-%d_%H:%M:%S", std::localtime(&t));
  return s;
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
      if (m.contains("extraInfo") && m["extraInfo"].contains("py_callstack") &&
          !m["extraInfo"]["py_callstack"].get<std::string>().empty())
        msg += "\n" + m["extraInfo"]["py_callstack"].get<std::string>();
      return msg;
    }
    return m.dump();
  } catch (const std::exception&) {
    return raw.substr(0, 4000);
  }
}

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

/// Creates the attempt's folders and starts its workers, their output on pipes.
void start_workers(const Plan& plan, int restart, Attempt& a) {
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
}

/// The poll loop of one attempt: forwards output and signals, reaps exits, and stops the whole group
/// on the first failure (first `sig` to every worker's process group, SIGKILL once the grace period
/// is over).
class Supervisor {
 public:
  Supervisor(const Plan& plan, Attempt& a) : plan_(plan), a_(a) {}

  /// Returns once every worker has exited and no descendant is left (or those that escaped were
  /// given up on).
  void run() {
    for (;;) {
      poll_once();
      const bool no_children = reap();
      check_peers();
      check_failure_grace();
      bool all_exited = std::all_of(a_.workers.begin(), a_.workers.end(), [](const Worker& w) { return w.exited; });
      if (all_exited) {
        if (no_children) break;
        // Descendants the workers left behind (e.g. background jobs, which ignore SIGINT): SIGTERM them
        // even if the group was stopped with another signal.
        if (!leftovers_termed_) stop(SIGTERM);
        leftovers_termed_ = true;
      }
      if (stopping_ && !killed_ && Clock::now() >= kill_at_) {
        warn("workers still running " + std::to_string(plan_.grace.count()) + " ms after being stopped: sending SIGKILL");
        kill_all();
      }
      if (all_exited && Clock::now() >= give_up_) break;
    }
  }

 private:
  void stop(int sig) {
    for (auto& w : a_.workers) signal_worker(w, sig);
    if (!stopping_) kill_at_ = Clock::now() + plan_.grace;
    stopping_ = true;
  }
  /// Multi-node: another node failed or was lost (plan.peer_check, also while stopping: it carries this
  /// node's heartbeat). Stopping waits kFailureGrace, as for a local failure (reap()).
  void check_peers() {
    if (!plan_.peer_check) return;
    std::string why = plan_.peer_check();
    if (stopping_ || failure_seen_) return;
    if (!why.empty()) {
      a_.stopped_for = why;
      begin_failure_grace();
    }
  }
  /// A failure (a worker of this node, or another node) stops this node's workers kFailureGrace later,
  /// not at once: a fault that hits every rank (a wrong GLOO_SOCKET_IFNAME, a bad flag, a collective's
  /// joint verdict) then makes every worker fail with its own message, instead of being SIGTERMed by
  /// the launcher before it could say it. Workers that still run after it (e.g. blocked in a
  /// collective with a dead peer) are stopped then.
  static constexpr std::chrono::milliseconds kFailureGrace{2000};
  void begin_failure_grace() {
    failure_seen_ = true;
    stop_at_ = Clock::now() + kFailureGrace;
  }
  void check_failure_grace() {
    if (!failure_seen_ || stopping_ || Clock::now() < stop_at_) return;
    if (a_.root < 0) warn(a_.stopped_for + ": stopping this node's workers");
    stop(SIGTERM);
  }
  bool failure_seen_ = false;
  Clock::time_point stop_at_ = Clock::time_point::max();
  void kill_all() {
    for (auto& w : a_.workers) signal_worker(w, SIGKILL);
    killed_ = true;
    give_up_ = Clock::now() + std::chrono::seconds(5);  // for descendants that left their process group
  }

  /// Waits for output, a signal or the next deadline, and handles what came.
  void poll_once() {
    std::vector<pollfd> fds{{g_self_pipe[0], POLLIN, 0}};
    std::vector<std::pair<Worker*, Stream*>> owners{{nullptr, nullptr}};
    for (auto& w : a_.workers) {
      for (Stream* s : {&w.out, &w.err}) {
        detach_broken_console(*s);
        if (s->fd < 0) continue;
        fds.push_back({s->fd, POLLIN, 0});
        owners.emplace_back(&w, s);
      }
    }
    // SIGCHLD and the forwarded signals wake us through the self-pipe; deadlines through the timeout.
    // At least every monitor interval and heartbeat interval: a quiet node still beats and checks its peers.
    const auto tick = std::min<std::chrono::milliseconds>(
        {std::chrono::milliseconds(1000), plan_.monitor_interval, plan_.heartbeat_interval});
    auto wake = std::min({kill_at_, give_up_, stop_at_, Clock::now() + tick});
    auto timeout_ms = std::chrono::duration_cast<std::chrono::milliseconds>(wake - Clock::now()).count() + 1;
    ::poll(fds.data(), fds.size(), static_cast<int>(std::max<long>(timeout_ms, 0)));
    if (fds[0].revents & POLLIN) read_signals();
    for (size_t i = 1; i < fds.size(); ++i)
      if (fds[i].revents) pump(*owners[i].first, *owners[i].second);
  }

  /// The first signal is forwarded to the workers; a second one kills them.
  void read_signals() {
    unsigned char sigs[64];
    for (ssize_t n; (n = ::read(g_self_pipe[0], sigs, sizeof sigs)) > 0;) {
      for (ssize_t i = 0; i < n; ++i) {
        int sig = sigs[i];
        if (sig == SIGCHLD) continue;  // reaped by reap()
        if (!a_.interrupted) {
          a_.interrupted = sig;
          warn("received " + signame(sig) + ": forwarding it to the workers");
          stop(sig);
        } else if (!killed_) {
          warn("received " + signame(sig) + " again: killing the workers");
          kill_all();
        }
      }
    }
  }

  /// Reaps what exited; the first failure stops the group. As a subreaper, orphaned descendants of the
  /// workers are our children too. Returns true when no child is left.
  bool reap() {
    for (;;) {
      int status = 0;
      pid_t pid = ::waitpid(-1, &status, WNOHANG);
      if (pid <= 0) return pid < 0 && errno == ECHILD;
      for (size_t i = 0; i < a_.workers.size(); ++i) {
        Worker& w = a_.workers[i];
        if (w.pid != pid) continue;
        w.exited = true;
        w.exitcode = WIFSIGNALED(status) ? -WTERMSIG(status) : WEXITSTATUS(status);
        w.time = now_str();
        w.stopped_by_us = stopping_;
        // Elastic: once the round is ending (another node's change), workers that fail are collateral (a
        // peer's workers were stopped first and broke their collectives): not this attempt's failure.
        const bool collateral = plan_.elastic() && !a_.stopped_for.empty();
        if (w.exitcode != 0 && !stopping_ && a_.root < 0 && !collateral) {
          a_.root = static_cast<int>(i);
          if (!failure_seen_) begin_failure_grace();
          if (plan_.on_failure)
            plan_.on_failure("rank " + std::to_string(w.rank) + " (local_rank " + std::to_string(w.local_rank) +
                             ") ended with " + describe_exit(w.exitcode));
        }
      }
    }
  }

  const Plan& plan_;
  Attempt& a_;
  bool stopping_ = false, killed_ = false, leftovers_termed_ = false;
  Clock::time_point kill_at_ = Clock::time_point::max(), give_up_ = Clock::time_point::max();
};

/// Every writer is gone: drains what is left in the pipes and closes the log files.
void drain(Attempt& a) {
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
}

}  // namespace

Attempt run_attempt(const Plan& plan, int restart) {
  Attempt a;
  start_workers(plan, restart, a);
  Supervisor(plan, a).run();
  drain(a);
  return a;
}

std::string describe_exit(int exitcode) {
  if (exitcode >= 0) return "exit code " + std::to_string(exitcode);
  return "signal " + std::to_string(-exitcode) + " (" + signame(-exitcode) + ")";
}

std::string describe_workers(const Attempt& a) {
  std::ostringstream s;
  for (size_t i = 0; i < a.workers.size(); ++i) {
    const Worker& w = a.workers[i];
    s << "\n  rank " << w.rank << " (local_rank " << w.local_rank << "): " << describe_exit(w.exitcode);
    if (static_cast<int>(i) == a.root) {
      s << ", the first failure";
    } else if (w.stopped_by_us) {
      s << ", after fsdprun began stopping the group";
    }
  }
  return s.str();
}

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
      << (w.exitcode < 0 ? " (" + signame(-w.exitcode) + ")" : "")
      << (w.stopped_by_us ? ", after fsdprun began stopping the group" : "") << "\n";
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


}  // namespace fsdprun
