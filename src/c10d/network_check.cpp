// The network check before Gloo's rendezvous (see network_check.h).
//
// Why a check of our own: Gloo connects every pair of ranks to the address each advertises, the one of
// GLOO_SOCKET_IFNAME or else of the hostname (loopback when the hostname is not an address of the host).
// On a host whose hostname or default route belongs to another network than the one connecting the hosts,
// those connects hang until the process-group timeout (30 min) and fail with "Connection timed out"
// naming no interface. Here each rank tries, within seconds, the very address Gloo will use, and every rank
// fails with one message naming the interface and the variable.
#include "c10d/network_check.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <sstream>
#include <thread>
#include <vector>

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "util.h"

namespace fsdp::detail {
namespace {

struct IfAddr {
  std::string ifname;
  sockaddr_storage sa{};
  socklen_t len = 0;
  bool up = false;
};

/// This host's IPv4/IPv6 addresses in getifaddrs' order (the order Gloo picks from).
std::vector<IfAddr> local_addresses() {
  std::vector<IfAddr> out;
  ifaddrs* ifa = nullptr;
  if (::getifaddrs(&ifa) != 0) return out;
  for (ifaddrs* p = ifa; p; p = p->ifa_next) {
    if (!p->ifa_addr || (p->ifa_addr->sa_family != AF_INET && p->ifa_addr->sa_family != AF_INET6)) continue;
    IfAddr a;
    a.ifname = p->ifa_name;
    a.len = p->ifa_addr->sa_family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
    std::memcpy(&a.sa, p->ifa_addr, a.len);
    a.up = (p->ifa_flags & IFF_UP) != 0;
    out.push_back(a);
  }
  ::freeifaddrs(ifa);
  return out;
}

std::vector<std::string> interface_names() {
  std::vector<std::string> names;
  if (auto* idx = ::if_nameindex()) {
    for (auto* p = idx; p->if_index != 0; ++p) names.emplace_back(p->if_name);
    ::if_freenameindex(idx);
  }
  return names;
}

std::string host_name() {
  char h[256] = "?";
  ::gethostname(h, sizeof h - 1);
  return h;
}

/// "lo (127.0.0.1), data0 (10.201.0.1), eth3 (no address)": what an error message offers instead.
std::string describe_interfaces() {
  std::map<std::string, std::string> ips;
  for (const auto& n : interface_names()) ips[n];
  for (const auto& a : local_addresses()) {
    std::string ip = ip_of(reinterpret_cast<const sockaddr*>(&a.sa));
    if (ip.rfind("fe80", 0) == 0) continue;  // link-local IPv6: on every interface, never the answer
    auto& s = ips[a.ifname];
    s += (s.empty() ? "" : ", ") + ip + (a.up ? "" : " down");
  }
  std::string out;
  for (const auto& [name, s] : ips) out += (out.empty() ? "" : ", ") + name + " (" + (s.empty() ? "no address" : s) + ")";
  return out;
}

std::vector<std::string> split_commas(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

[[noreturn]] void bad_ifname(const char* var, const std::string& value, const std::string& name, const std::string& why) {
  TORCH_CHECK(false, "init_process_group: ", var, "=", value, ": interface '", name, "' ", why, " on this host (",
              host_name(), "; its interfaces: ", describe_interfaces(), "). Fix: set ", var,
              " to the interface of the network that connects the hosts, on every host");
}

/// The address Gloo will listen on (its first device) and how it was chosen. Throws for a bad
/// GLOO_SOCKET_IFNAME.
std::pair<IfAddr, std::string> gloo_address(bool local_master) {
  const char* env = std::getenv("GLOO_SOCKET_IFNAME");
  if (env && *env) {
    check_socket_ifname("GLOO_SOCKET_IFNAME");
    const std::string first = split_commas(env).front();
    for (const auto& a : local_addresses())
      if (a.ifname == first) return {a, "GLOO_SOCKET_IFNAME=" + std::string(env) + " -> " + first + " " +
                                            ip_of(reinterpret_cast<const sockaddr*>(&a.sa))};
  }
  // As make_gloo_group: loopback for a one-host job; otherwise as ProcessGroupGloo::createDefaultDevice,
  // the hostname's first bindable address, else loopback.
  const std::string host = host_name();
  IfAddr lo;
  auto* in = reinterpret_cast<sockaddr_in*>(&lo.sa);
  in->sin_family = AF_INET;
  in->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  lo.len = sizeof(sockaddr_in);
  if (local_master) return {lo, "GLOO_SOCKET_IFNAME unset, MASTER_ADDR loopback -> 127.0.0.1"};
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &res) == 0) {
    for (addrinfo* p = res; p; p = p->ai_next) {
      int fd = ::socket(p->ai_family, p->ai_socktype | SOCK_CLOEXEC, p->ai_protocol);
      if (fd < 0) continue;
      const bool ok = ::bind(fd, p->ai_addr, p->ai_addrlen) == 0;
      ::close(fd);
      if (!ok) continue;
      IfAddr a;
      a.len = p->ai_addrlen;
      std::memcpy(&a.sa, p->ai_addr, p->ai_addrlen);
      ::freeaddrinfo(res);
      return {a, "GLOO_SOCKET_IFNAME unset -> the address of hostname '" + host + "', " +
                     ip_of(reinterpret_cast<const sockaddr*>(&a.sa))};
    }
    ::freeaddrinfo(res);
  }
  return {lo, "GLOO_SOCKET_IFNAME unset -> loopback 127.0.0.1 (hostname '" + host +
                  "' is not an address of this host)"};
}

void set_port(sockaddr_storage& sa, uint16_t port) {
  if (sa.ss_family == AF_INET) reinterpret_cast<sockaddr_in*>(&sa)->sin_port = htons(port);
  else reinterpret_cast<sockaddr_in6*>(&sa)->sin6_port = htons(port);
}

/// Listens on an address, answering every connection with `token` until destroyed.
class Listener {
 public:
  Listener(IfAddr addr, std::string token) : token_(std::move(token) + "\n") {
    fd_ = ::socket(addr.sa.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    TORCH_CHECK(fd_ >= 0, "init_process_group: network check: socket(): ", std::strerror(errno));
    set_port(addr.sa, 0);
    if (::bind(fd_, reinterpret_cast<sockaddr*>(&addr.sa), addr.len) != 0 || ::listen(fd_, 128) != 0) {
      const std::string err = std::strerror(errno);
      ::close(fd_);
      TORCH_CHECK(false, "cannot listen on ", ip_of(reinterpret_cast<sockaddr*>(&addr.sa)), ": ", err);
    }
    sockaddr_storage bound{};
    socklen_t len = sizeof bound;
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&bound), &len);
    port_ = ntohs(bound.ss_family == AF_INET ? reinterpret_cast<sockaddr_in*>(&bound)->sin_port
                                             : reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port);
    thread_ = std::thread([this] { serve(); });
  }
  ~Listener() {
    stop_ = true;
    thread_.join();
    ::close(fd_);
  }
  uint16_t port() const { return port_; }

 private:
  void serve() {
    while (!stop_) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, 50) <= 0) continue;
      int c = ::accept4(fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (c < 0) continue;
      (void)!::write(c, token_.data(), token_.size());
      ::close(c);
    }
  }
  std::string token_;
  int fd_ = -1;
  uint16_t port_ = 0;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

/// Connects to ip:port and reads the listener's token; "" when it answered with `token`, else why not.
std::string try_connect(const std::string& ip, uint16_t port, const std::string& token, std::chrono::milliseconds limit) {
  addrinfo hints{};
  hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(ip.c_str(), std::to_string(port).c_str(), &hints, &res) != 0) return "bad address";
  int fd = ::socket(res->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  std::string err;
  const auto deadline = std::chrono::steady_clock::now() + limit;
  auto left_ms = [&] {
    auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
    return static_cast<int>(std::max<long>(ms, 0));
  };
  const std::string timed_out = "no answer within " + std::to_string(limit.count() / 1000.0).substr(0, 4) + " s";
  if (fd < 0) {
    err = std::strerror(errno);
  } else if (::connect(fd, res->ai_addr, res->ai_addrlen) != 0 && errno != EINPROGRESS) {
    err = std::strerror(errno);
  } else {
    pollfd p{fd, POLLOUT, 0};
    int so_error = 0;
    socklen_t sl = sizeof so_error;
    if (::poll(&p, 1, left_ms()) <= 0) {
      err = timed_out;
    } else if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &so_error, &sl) != 0 || so_error != 0) {
      err = std::strerror(so_error ? so_error : errno);
    } else {
      std::string got;
      char buf[128];
      for (;;) {
        pollfd r{fd, POLLIN, 0};
        if (::poll(&r, 1, left_ms()) <= 0) break;
        ssize_t n = ::read(fd, buf, sizeof buf);
        if (n <= 0) break;
        got.append(buf, static_cast<size_t>(n));
        if (got.find('\n') != std::string::npos) break;
      }
      if (got != token + "\n")
        err = got.empty() ? timed_out + " after connecting" : "another process answered there (not that rank)";
    }
  }
  if (fd >= 0) ::close(fd);
  ::freeaddrinfo(res);
  return err;
}

std::string str_of(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }
std::vector<uint8_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }

}  // namespace

std::string ip_of(const sockaddr* sa) {
  char buf[INET6_ADDRSTRLEN] = "?";
  const void* a = sa->sa_family == AF_INET ? static_cast<const void*>(&reinterpret_cast<const sockaddr_in*>(sa)->sin_addr)
                                           : static_cast<const void*>(&reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr);
  ::inet_ntop(sa->sa_family, a, buf, sizeof buf);
  return buf;
}


void check_socket_ifname(const char* var) {
  const char* env = std::getenv(var);
  if (!env || !*env || env[0] == '^') return;  // unset, or NCCL's exclusion list: nothing named to find
  const bool nccl = std::strncmp(var, "NCCL", 4) == 0;
  const auto names = interface_names();
  const auto addrs = local_addresses();
  for (std::string want : split_commas(env)) {
    // NCCL matches prefixes ("eth" matches eth0) unless the name starts with '='; Gloo exact names.
    const bool exact = !nccl || want[0] == '=';
    if (want[0] == '=') want.erase(0, 1);
    auto matches = [&](const std::string& n) { return exact ? n == want : n.rfind(want, 0) == 0; };
    bool found = false, up = false, has_ip = false;
    for (const auto& n : names) found = found || matches(n);
    for (const auto& a : addrs) {
      if (!matches(a.ifname)) continue;
      has_ip = true;
      up = up || a.up;
    }
    if (!found && !has_ip) bad_ifname(var, env, want, nccl && !exact ? "(a prefix) matches no interface" : "does not exist");
    if (!has_ip) bad_ifname(var, env, want, "has no IP address");
    if (!up) bad_ifname(var, env, want, "is down");
  }
}

void check_gloo_network(const c10::intrusive_ptr<c10d::Store>& parent, int rank, int size,
                        std::chrono::milliseconds timeout, bool local_master) {
  if (size <= 1) {
    check_socket_ifname("GLOO_SOCKET_IFNAME");
    return;
  }
  if (const char* off = std::getenv("FSDP_NIC_CHECK"); off && std::string(off) == "0") return;
  const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
  if (local_master && !(ifname && *ifname)) return;  // one host on loopback: nothing can be unreachable
  long limit_s = 5;
  if (const char* t = std::getenv("FSDP_NIC_CHECK_TIMEOUT_S")) limit_s = std::max(1L, std::atol(t));
  auto store = c10::make_intrusive<c10d::PrefixStore>("fsdp_nic_check", parent);
  const std::string host = host_name();
  auto key = [](const char* what, int r) { return std::string(what) + "/" + std::to_string(r); };

  // This rank's address; a bad interface is published as this rank's result, so that the others fail now
  // with it instead of waiting for this rank's address.
  std::unique_ptr<Listener> listener;
  std::string mine, local_error;
  try {
    auto [addr, how] = gloo_address(local_master);
    std::random_device rd;
    const std::string token = std::to_string(rd()) + std::to_string(rd()) + "-rank" + std::to_string(rank);
    listener = std::make_unique<Listener>(addr, token);
    mine = ip_of(reinterpret_cast<sockaddr*>(&addr.sa)) + " " + std::to_string(listener->port()) + " " + token +
           "\n" + how + " on host " + host;
  } catch (const std::exception& e) {
    local_error = "rank " + std::to_string(rank) + " (host " + host + "): " + message_of(e);
    store->set(key("result", rank), bytes_of(local_error));
    store->set(key("addr", rank), bytes_of("error"));
    throw;
  }
  store->set(key("addr", rank), bytes_of(mine));

  // Connect to the next rank's address.
  const int next = (rank + 1) % size;
  std::string result = "ok";
  store->wait({key("addr", next)}, timeout);
  const std::string theirs = str_of(store->get(key("addr", next)));
  if (theirs != "error") {
    std::istringstream in(theirs);
    std::string ip, token, how;
    uint16_t port = 0;
    in >> ip >> port >> token;
    std::getline(in, how);  // the rest of the first line
    std::getline(in, how);
    std::string err = try_connect(ip, port, token, std::chrono::seconds(limit_s));
    if (!err.empty()) {
      result = "rank " + std::to_string(rank) + " (" + mine.substr(mine.find('\n') + 1) + ") cannot connect to rank " +
               std::to_string(next) + " at " + ip + ":" + std::to_string(port) + " (" + how + "): " + err;
    }
  }
  store->set(key("result", rank), bytes_of(result));

  // Everyone's verdict, so that every rank fails (or none does).
  std::vector<std::string> keys;
  for (int r = 0; r < size; ++r) keys.push_back(key("result", r));
  store->wait(keys, timeout);
  std::vector<std::string> failures;
  for (int r = 0; r < size; ++r) {
    std::string v = str_of(store->get(keys[r]));
    if (v != "ok") failures.push_back(v);
  }
  listener.reset();
  if (failures.empty()) return;
  std::string all;
  for (size_t i = 0; i < failures.size() && i < 4; ++i) all += "\n  " + failures[i];
  if (failures.size() > 4) all += "\n  ... (" + std::to_string(failures.size()) + " ranks failed in all)";
  TORCH_CHECK(false, "init_process_group: network check before Gloo's rendezvous failed (this is rank ", rank, " of ",
              size, ", host ", host, "):", all,
              "\nFix: set GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME for NCCL) on every host to the interface of the "
              "network that connects the hosts; this host's interfaces: ", describe_interfaces(),
              ". (FSDP_NIC_CHECK=0 skips this check.)");
}

}  // namespace fsdp::detail
