#include "c10d/slurm_env.h"

#include <c10/util/Exception.h>

#include <cstdlib>
#include <string_view>

namespace fsdp::detail {
namespace {

constexpr size_t kMaxHosts = 1000000;  // a bound on what a typo like n[1-999999999] may allocate

/// Throws the message every malformed hostlist gets: the variable, the list, the position and the fix.
[[noreturn]] void bad_hostlist(const std::string& what, const std::string& list, size_t pos, const std::string& why) {
  TORCH_CHECK(false, "init_process_group: ", what, "=", list, " is not a Slurm hostlist: ", why, " at position ", pos,
              ": expected host names and bracketed ranges such as node[01-03,07],gpu-a[1-2]. Fix: let srun set ",
              what, ", or export MASTER_ADDR=<host of rank 0>");
}

/// Parses the digits of one range bound; `pos` is where `s` starts in the list (for messages).
unsigned long long parse_bound(std::string_view s, const std::string& what, const std::string& list, size_t pos) {
  if (s.empty()) bad_hostlist(what, list, pos, "an empty range bound");
  if (s.size() > 18) bad_hostlist(what, list, pos, "the number '" + std::string(s) + "' is too long");
  unsigned long long v = 0;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] < '0' || s[i] > '9') {
      bad_hostlist(what, list, pos + i, "'" + std::string(s) + "' is not a number");
    }
    v = v * 10 + static_cast<unsigned long long>(s[i] - '0');
  }
  return v;
}

/// `v` in decimal, zero-padded to `width` digits (Slurm pads a range to the width of its lower bound).
std::string padded(unsigned long long v, size_t width) {
  std::string s = std::to_string(v);
  if (s.size() < width) s.insert(0, width - s.size(), '0');
  return s;
}

/// The numbers a bracket's content names, e.g. "01-03,07" -> 01 02 03 07. `pos` is the content's start.
std::vector<std::string> expand_ranges(std::string_view body, const std::string& what, const std::string& list,
                                       size_t pos) {
  if (body.empty()) bad_hostlist(what, list, pos, "empty brackets");
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= body.size()) {
    size_t comma = body.find(',', start);
    if (comma == std::string_view::npos) comma = body.size();
    std::string_view range = body.substr(start, comma - start);
    if (range.empty()) bad_hostlist(what, list, pos + start, "an empty range");
    size_t dash = range.find('-');
    std::string_view lo_s = range.substr(0, dash);
    auto lo = parse_bound(lo_s, what, list, pos + start);
    auto hi = lo;
    if (dash != std::string_view::npos) hi = parse_bound(range.substr(dash + 1), what, list, pos + start + dash + 1);
    if (hi < lo) {
      bad_hostlist(what, list, pos + start, "the range " + std::string(range) + " is reversed");
    }
    if (hi - lo >= kMaxHosts || out.size() + (hi - lo + 1) > kMaxHosts) {
      bad_hostlist(what, list, pos + start, "it names more than " + std::to_string(kMaxHosts) + " hosts");
    }
    for (auto v = lo; v <= hi; ++v) out.push_back(padded(v, lo_s.size()));
    start = comma + 1;
  }
  return out;
}

/// One comma-free host expression ("rack[1-2]-n[01-02]"): the product of its literal parts and brackets.
std::vector<std::string> expand_one(std::string_view item, const std::string& what, const std::string& list,
                                    size_t pos) {
  if (item.empty()) bad_hostlist(what, list, pos, "an empty host name");
  std::vector<std::string> hosts{""};
  size_t i = 0;
  while (i < item.size()) {
    if (item[i] == ']') bad_hostlist(what, list, pos + i, "']' without '['");
    if (item[i] != '[') {
      size_t next = item.find_first_of("[]", i);
      if (next == std::string_view::npos) next = item.size();
      for (auto& h : hosts) h.append(item.substr(i, next - i));
      i = next;
      continue;
    }
    size_t close = item.find_first_of("[]", i + 1);
    if (close == std::string_view::npos || item[close] != ']') bad_hostlist(what, list, pos + i, "'[' without ']'");
    auto numbers = expand_ranges(item.substr(i + 1, close - i - 1), what, list, pos + i + 1);
    if (hosts.size() * numbers.size() > kMaxHosts) {
      bad_hostlist(what, list, pos + i, "it names more than " + std::to_string(kMaxHosts) + " hosts");
    }
    std::vector<std::string> product;
    product.reserve(hosts.size() * numbers.size());
    for (const auto& h : hosts) {
      for (const auto& n : numbers) product.push_back(h + n);
    }
    hosts = std::move(product);
    i = close + 1;
  }
  return hosts;
}

/// An environment variable, or nullptr when unset or empty.
const char* env_or_null(const char* name) {
  const char* v = std::getenv(name);
  return (v != nullptr && *v != '\0') ? v : nullptr;
}

/// A non-negative integer variable; nullopt when unset or not a number (the callers fall back).
std::optional<long> env_long(const char* name) {
  const char* v = env_or_null(name);
  if (v == nullptr) return std::nullopt;
  char* end = nullptr;
  long x = std::strtol(v, &end, 10);
  if (end == nullptr || *end != '\0' || x < 0) return std::nullopt;
  return x;
}

}  // namespace

std::vector<std::string> expand_slurm_hostlist(const std::string& hostlist, const std::string& what) {
  if (hostlist.empty()) bad_hostlist(what, hostlist, 0, "an empty list");
  std::vector<std::string> hosts;
  // Items are separated by commas outside brackets ("a[1,2],b": two items).
  size_t start = 0;
  size_t open = 0;  // position of the '[' being inside of, for messages
  int depth = 0;
  for (size_t i = 0; i <= hostlist.size(); ++i) {
    const char c = i < hostlist.size() ? hostlist[i] : ',';
    if (c == '[') {
      if (depth > 0) bad_hostlist(what, hostlist, i, "nested '['");
      ++depth;
      open = i;
    } else if (c == ']') {
      if (depth == 0) bad_hostlist(what, hostlist, i, "']' without '['");
      --depth;
    } else if (c == ',' && (depth == 0 || i == hostlist.size())) {
      if (depth > 0) bad_hostlist(what, hostlist, open, "'[' without ']'");
      auto item = expand_one(std::string_view(hostlist).substr(start, i - start), what, hostlist, start);
      if (hosts.size() + item.size() > kMaxHosts) {
        bad_hostlist(what, hostlist, start, "it names more than " + std::to_string(kMaxHosts) + " hosts");
      }
      hosts.insert(hosts.end(), item.begin(), item.end());
      start = i + 1;
    }
  }
  return hosts;
}

std::vector<int> expand_slurm_tasks_per_node(const std::string& list, const std::string& what) {
  auto bad = [&](const std::string& why) {
    TORCH_CHECK(false, "init_process_group: ", what, "=", list, " is not a Slurm tasks-per-node list: ", why,
                ": expected counts such as 2(x3),1. Fix: let srun set ", what);
  };
  if (list.empty()) bad("an empty list");
  std::vector<int> out;
  size_t start = 0;
  while (start <= list.size()) {
    size_t comma = list.find(',', start);
    if (comma == std::string::npos) comma = list.size();
    const std::string item = list.substr(start, comma - start);
    // "N" or "N(xM)": N tasks on each of M nodes.
    char* end = nullptr;
    long n = std::strtol(item.c_str(), &end, 10);
    if (item.empty() || end == item.c_str() || n < 0) bad("'" + item + "' is not a count");
    long repeat = 1;
    if (*end == '(') {
      std::string rest(end);
      char* rend = nullptr;
      if (rest.size() < 4 || rest[1] != 'x') bad("'" + item + "' is not N(xM)");
      repeat = std::strtol(rest.c_str() + 2, &rend, 10);
      if (rend == rest.c_str() + 2 || std::string(rend) != ")" || repeat <= 0) bad("'" + item + "' is not N(xM)");
    } else if (*end != '\0') {
      bad("'" + item + "' is not a count");
    }
    if (out.size() + static_cast<size_t>(repeat) > kMaxHosts) bad("it names more than 1000000 nodes");
    out.insert(out.end(), static_cast<size_t>(repeat), static_cast<int>(n));
    start = comma + 1;
  }
  return out;
}

int slurm_master_port(long job_id, long step_id) {
  return 20000 + 10 * static_cast<int>(job_id % 1000) + static_cast<int>(step_id % 10);
}

std::optional<SlurmRendezvous> slurm_master_addr_from_env() {
  for (const char* var : {"SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"}) {
    const char* v = env_or_null(var);
    if (v == nullptr) continue;
    auto hosts = expand_slurm_hostlist(v, var);
    return SlurmRendezvous{hosts.front(), std::string("the first host of ") + var + "=" + v};
  }
  return std::nullopt;
}

std::optional<int> slurm_local_world_size_from_env() {
  for (const char* var : {"SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"}) {
    const char* v = env_or_null(var);
    if (v == nullptr) continue;
    auto per_node = expand_slurm_tasks_per_node(v, var);
    // SLURM_NODEID is this node's index among the step's nodes. Should it ever index another list (a step
    // on some of the job's nodes, with only the job's list set), the next source answers: this count only
    // informs (LaunchEnv::local_world_size), it must not fail a launch that is otherwise right.
    const long node = env_long("SLURM_NODEID").value_or(0);
    if (node < static_cast<long>(per_node.size())) return per_node[static_cast<size_t>(node)];
  }
  if (auto n = env_long("SLURM_NTASKS_PER_NODE")) return static_cast<int>(*n);
  return std::nullopt;
}

std::string rendezvous_host_from_env() {
  if (const char* addr = env_or_null("MASTER_ADDR")) return addr;
  if (env_or_null("SLURM_PROCID") != nullptr && env_or_null("RANK") == nullptr) {
    try {
      if (auto r = slurm_master_addr_from_env()) return r->addr;
    } catch (const c10::Error&) {
      // read_launch_env reports a malformed list; here only the transport is chosen.
    }
  }
  return "127.0.0.1";
}

}  // namespace fsdp::detail
