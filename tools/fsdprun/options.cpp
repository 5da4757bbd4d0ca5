// fsdprun's command line (CLI11, torchrun's flags and PET_* variables) and the plan it yields.
#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <random>
#include <sstream>
#include <thread>

#include <sys/stat.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <torch/cuda.h>

#include "fsdprun.h"

namespace fsdprun {
namespace {

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

/// --nnodes N or MIN:MAX (torchrun's syntax): {MIN, MAX}.
std::pair<int, int> parse_nnodes(const std::string& s) {
  auto colon = s.find(':');
  std::string lo = s.substr(0, colon), hi = colon == std::string::npos ? lo : s.substr(colon + 1);
  auto number = [&](const std::string& v) {
    char* end = nullptr;
    long n = std::strtol(v.c_str(), &end, 10);
    if (v.empty() || *end != '\0' || n < 1 || n > 100000)
      die("--nnodes " + s + ": expected a positive integer N or an elastic range MIN:MAX (e.g. 1:4)");
    return static_cast<int>(n);
  };
  const int a = number(lo), b = number(hi);
  if (a > b) die("--nnodes " + s + ": MIN must be <= MAX");
  return {a, b};
}

/// Seconds of a --rdzv-conf value (`what` names the key in the error).
std::chrono::milliseconds conf_seconds(const std::string& key, const std::string& v) {
  char* end = nullptr;
  const double d = v.empty() ? -1 : std::strtod(v.c_str(), &end);
  if (v.empty() || *end != '\0' || !std::isfinite(d) || d <= 0 || d > 86400 * 7)
    die("--rdzv-conf " + key + "=" + v + ": expected a number of seconds > 0");
  return std::chrono::milliseconds(static_cast<long>(d * 1000));
}

/// --rdzv-conf k=v,...: torchrun's c10d rendezvous settings (join_timeout, last_call_timeout, read_timeout,
/// keep_alive_interval, keep_alive_max_attempt, is_host); an unknown key is refused by name.
void apply_rdzv_conf(const std::string& conf, Plan& plan) {
  if (conf.empty()) return;
  std::stringstream ss(conf);
  std::chrono::milliseconds keep_alive{0};
  int keep_alive_attempts = 0;
  for (std::string item; std::getline(ss, item, ',');) {
    const auto eq = item.find('=');
    if (eq == std::string::npos || eq == 0)
      die("--rdzv-conf " + conf + ": expected KEY=VALUE,... (e.g. join_timeout=600,last_call_timeout=30), got '" +
          item + "'");
    const std::string k = item.substr(0, eq), v = item.substr(eq + 1);
    if (k == "join_timeout" || k == "timeout") {
      plan.rdzv_timeout = conf_seconds(k, v);
    } else if (k == "last_call_timeout") {
      plan.last_call_timeout = conf_seconds(k, v);
    } else if (k == "read_timeout") {
      plan.read_timeout = conf_seconds(k, v);
    } else if (k == "keep_alive_interval") {
      keep_alive = conf_seconds(k, v);
    } else if (k == "keep_alive_max_attempt") {
      char* end = nullptr;
      const long n = std::strtol(v.c_str(), &end, 10);
      if (v.empty() || *end != '\0' || n < 1 || n > 1000)
        die("--rdzv-conf keep_alive_max_attempt=" + v + ": expected an integer from 1 to 1000");
      keep_alive_attempts = static_cast<int>(n);
    } else if (k == "is_host") {
      std::string l = v;
      std::transform(l.begin(), l.end(), l.begin(), [](unsigned char c) { return std::tolower(c); });
      if (l == "1" || l == "true" || l == "yes") plan.is_host = true;
      else if (l == "0" || l == "false" || l == "no") plan.is_host = false;
      else die("--rdzv-conf is_host=" + v + ": expected true or false");
    } else if (k == "close_timeout" || k == "use_libuv" || k == "store_type") {
      // torchrun's, accepted so that its command lines run: fsdprun has no close phase after the last call,
      // and its store is LibTorch's TCPStore whatever the backend.
    } else {
      die("--rdzv-conf: unknown key '" + k + "'; expected join_timeout, last_call_timeout, read_timeout, "
          "keep_alive_interval, keep_alive_max_attempt or is_host (close_timeout, use_libuv and store_type are "
          "accepted and ignored)");
    }
  }
  if (keep_alive.count() > 0 || keep_alive_attempts > 0) {
    // torchrun's c10d keep-alive: a node is dead after keep_alive_max_attempt missed intervals (5 s x 3).
    const auto interval = keep_alive.count() > 0 ? keep_alive : std::chrono::milliseconds(5000);
    plan.heartbeat_timeout = interval * (keep_alive_attempts > 0 ? keep_alive_attempts : 3);
    plan.heartbeat_interval = std::min(plan.heartbeat_interval, interval);
  }
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

}  // namespace

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
  app.add_option("--nnodes", o.nnodes, "Number of nodes N, or MIN:MAX for an elastic job (c10d: nodes may leave and join)")->envname("PET_NNODES")->capture_default_str();
  auto* node_rank = app.add_option("--node-rank,--node_rank", o.node_rank,
                                   "Rank of this node (0 hosts the store); with --rdzv-backend c10d ranks are "
                                   "assigned in order of arrival and this is ignored (with a warning)")
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
  app.add_option("--rdzv-backend,--rdzv_backend", o.rdzv_backend,
                 "static (node 0 hosts the store at --master-addr:--master-port) or c10d (the agent on the "
                 "--rdzv-endpoint host hosts it, node ranks assigned on arrival)")
      ->envname("PET_RDZV_BACKEND")->capture_default_str();
  app.add_option("--rdzv-endpoint,--rdzv_endpoint", o.rdzv_endpoint, "c10d: HOST[:PORT] of the rendezvous (Default port: 29400)")
      ->envname("PET_RDZV_ENDPOINT");
  app.add_option("--rdzv-id,--rdzv_id", o.rdzv_id, "c10d: the job's id, the same on every node (TORCHELASTIC_RUN_ID)")
      ->envname("PET_RDZV_ID")->capture_default_str();
  app.add_option("--rdzv-timeout,--rdzv_timeout", o.rdzv_timeout,
                 "Seconds to wait for every node to join (and, under c10d, for the endpoint's store)")
      ->envname("FSDPRUN_RDZV_TIMEOUT")->capture_default_str()->check(number_in(0.1, 86400 * 7, false));
  app.add_option("--rdzv-conf,--rdzv_conf", o.rdzv_conf,
                 "c10d: KEY=VALUE,... with join_timeout (s, as --rdzv-timeout), last_call_timeout (s to wait for "
                 "more nodes once MIN joined; Default: 30), read_timeout (s, a store call), keep_alive_interval "
                 "and keep_alive_max_attempt (a node is lost after interval x attempts without a heartbeat; "
                 "Default: 10 s), is_host (host the store here)")
      ->envname("PET_RDZV_CONF");
  app.add_option("--monitor-interval,--monitor_interval", o.monitor_interval,
                 "Seconds between the agent's checks of the other nodes (heartbeats, failures, nodes waiting to "
                 "join) (Default: 0.2)")
      ->envname("PET_MONITOR_INTERVAL")->check(number_in(0.01, 60, false));
  app.add_option("--local-addr,--local_addr", o.local_addr,
                 "The address this node is known by in the rendezvous and the messages (Default: the address it "
                 "reaches the store from)")
      ->envname("PET_LOCAL_ADDR");
  app.add_flag("--no-python,--no_python", o.no_python, "Accepted for torchrun compatibility (always the case)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) std::exit(app.exit(e));  // --help
    std::string what = e.what();
    std::replace(what.begin(), what.end(), '\n', ' ');
    die(what + " (see fsdprun --help)");
  }
  o.node_rank_given = node_rank->count() > 0;
  o.command = app.remaining();
  if (!o.command.empty() && o.command.front() == "--") o.command.erase(o.command.begin());
  if (o.command.empty()) die("no PROGRAM given (see fsdprun --help)");
  if (o.command.front().size() > 1 && o.command.front()[0] == '-')
    die("unknown option " + o.command.front() + " (see fsdprun --help; put PROGRAM after --)");
  return o;
}

namespace {

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


/// --local-ranks-filter: the local ranks shown on the console (empty: all).
std::set<int> parse_console_ranks(const std::string& filter) {
  std::set<int> ranks;
  if (filter.empty()) return ranks;
  std::stringstream ss(filter);
  for (std::string item; std::getline(ss, item, ',');) {
    char* end = nullptr;
    long lr = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || *end != '\0' || lr < 0)
      die("--local-ranks-filter " + filter + ": expected comma-separated local ranks, e.g. 0,2");
    ranks.insert(static_cast<int>(lr));
  }
  return ranks;
}

}  // namespace

Plan make_plan(const Options& opt) {
  Plan plan;
  plan.argv = opt.command;
  plan.nproc = parse_nproc(opt.nproc_per_node);
  const auto [min_nodes, max_nodes] = opt.standalone ? std::pair<int, int>{1, 1} : parse_nnodes(opt.nnodes);
  plan.min_nodes = min_nodes;
  plan.max_nodes = max_nodes;
  plan.nnodes = max_nodes;  // elastic: set by each round
  plan.node_rank = opt.standalone ? 0 : opt.node_rank;
  if (plan.node_rank >= plan.nnodes && opt.rdzv_backend != "c10d")
    die("--node-rank " + std::to_string(plan.node_rank) + " must be < --nnodes " + std::to_string(plan.nnodes));
  plan.max_restarts = opt.max_restarts;
  plan.program_path = resolve_program(opt.command.front());
  plan.role = opt.role;
  // As torchrun: --standalone is a c10d rendezvous on localhost:0 with a fresh uuid run id; otherwise
  // the static one at --master-addr:--master-port with run id "none".
  plan.run_id = opt.standalone ? uuid4() : "none";
  plan.master_addr = opt.standalone ? "localhost" : opt.master_addr;
  plan.master_port = opt.standalone ? 0 : opt.master_port.value_or(29500);
  plan.rdzv_timeout = std::chrono::milliseconds(static_cast<long>(opt.rdzv_timeout * 1000));
  if (opt.rdzv_backend == "c10d" && !opt.standalone) {
    // torchrun's c10d rendezvous: the store at the endpoint (hosted by the agent on that host), the
    // node ranks in order of arrival, the run id from --rdzv-id.
    if (opt.rdzv_endpoint.empty())
      die("--rdzv-backend c10d needs --rdzv-endpoint HOST[:PORT] (the same on every node, e.g. node0:29400)");
    const auto colon = opt.rdzv_endpoint.rfind(':');
    plan.master_addr = opt.rdzv_endpoint.substr(0, colon);
    plan.master_port = 29400;
    if (colon != std::string::npos) {
      const std::string port = opt.rdzv_endpoint.substr(colon + 1);
      char* end = nullptr;
      const long p = std::strtol(port.c_str(), &end, 10);
      if (port.empty() || *end != '\0' || p < 1 || p > 65535)
        die("--rdzv-endpoint " + opt.rdzv_endpoint + ": expected HOST[:PORT] with a port in 1-65535, got '" + port + "'");
      plan.master_port = static_cast<int>(p);
    }
    if (plan.master_addr.empty()) die("--rdzv-endpoint " + opt.rdzv_endpoint + ": expected HOST[:PORT], the host is empty");
    plan.c10d = true;
    plan.run_id = opt.rdzv_id;
    plan.node_rank = 0;  // assigned by the rendezvous
    // As torchrun: c10d assigns node ranks in order of arrival. Never silently: a user who gave one is told.
    if (opt.node_rank_given) {
      warn("--node-rank " + std::to_string(opt.node_rank) + " is ignored with --rdzv-backend c10d: node ranks are "
           "assigned in order of arrival at the rendezvous (the rank this node gets is printed when the rendezvous "
           "completes). Fix: drop --node-rank, or use the static rendezvous (--master-addr, --master-port, "
           "--node-rank) to fix each node's rank");
    }
  } else if (opt.rdzv_backend != "static" && opt.rdzv_backend != "c10d") {
    die("--rdzv-backend " + opt.rdzv_backend + ": expected static or c10d");
  }
  if (plan.elastic() && !plan.c10d)
    die("--nnodes " + opt.nnodes + ": an elastic range needs --rdzv-backend c10d (and --rdzv-endpoint, --rdzv-id): "
        "the static rendezvous has fixed node ranks");
  if (!opt.rdzv_conf.empty() && !plan.c10d) die("--rdzv-conf needs --rdzv-backend c10d");
  if (const char* v = std::getenv("FSDPRUN_HEARTBEAT_TIMEOUT_S"))
    plan.heartbeat_timeout = std::chrono::milliseconds(static_cast<long>(std::max(1.0, std::atof(v)) * 1000));
  apply_rdzv_conf(opt.rdzv_conf, plan);
  if (opt.monitor_interval) plan.monitor_interval = std::chrono::milliseconds(static_cast<long>(*opt.monitor_interval * 1000));
  plan.local_addr = opt.local_addr;
  if (plan.master_port == 0 && plan.nnodes > 1) die("--master-port 0 needs --nnodes 1: other nodes must know the port");
  plan.redirects = parse_std(opt.redirects, plan.nproc, "--redirects");
  plan.tee = parse_std(opt.tee, plan.nproc, "--tee");
  plan.console_ranks = parse_console_ranks(opt.local_ranks_filter);
  const char* tmpl = std::getenv("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE");
  plan.prefix_template = tmpl && *tmpl ? tmpl : "[${role_name}${local_rank}]:";
  double grace_s = 30;
  if (const char* g = std::getenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT")) grace_s = std::atof(g);
  if (const char* g = std::getenv("FSDPRUN_GRACE_S")) grace_s = std::atof(g);
  if (opt.shutdown_timeout) grace_s = *opt.shutdown_timeout;
  plan.grace = std::chrono::milliseconds(static_cast<long>(std::max(0.0, grace_s) * 1000));
  return plan;
}

}  // namespace fsdprun
