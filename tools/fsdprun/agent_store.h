// What nodes.cpp and rounds.cpp share: the agent store's byte conversions, time formatting, and the
// store-call watchdog's guard.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "fsdprun.h"

namespace fsdprun {

inline std::string str_of(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }
inline std::vector<uint8_t> bytes_of(const std::string& s) { return {s.begin(), s.end()}; }
inline double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }
inline std::string fmt_s(double s) {
  char b[32];
  std::snprintf(b, sizeof b, "%.0f s", s);
  return b;
}

// A store call that does not return is a lost store (its host, or the link to it, is down): TCPStore's
// client socket can block for the whole connect timeout (minutes) when packets are dropped rather than
// refused, and the agent would hang with its workers. Each group of store calls of the agent's loops
// runs under a StoreCall; a watchdog thread ends the agent (and with it its workers, through their
// PDEATHSIG) when one has not returned within the store read timeout.
struct StoreCall {
  explicit StoreCall(Nodes& n) : n_(n), outer_(n.call_since_ms_) {
    if (outer_ == 0)  // nested calls (take_ticket inside poll) keep the outermost start
      n_.call_since_ms_ = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now().time_since_epoch()).count();
  }
  ~StoreCall() { n_.call_since_ms_ = outer_; }
  Nodes& n_;
  int64_t outer_;
};

}  // namespace fsdprun
