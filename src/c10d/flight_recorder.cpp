#include "fsdp/c10d/flight_recorder.h"

#include <cstdlib>
#include <fstream>

#include <nlohmann/json.hpp>
#include <sys/stat.h>

namespace fsdp {
namespace {
double now_s() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}
}  // namespace

FlightRecorder::FlightRecorder(size_t capacity) : capacity_(capacity) {
  if (capacity_ == 0) {
    const char* env = std::getenv("FSDP_FLIGHT_RECORDER_SIZE");
    capacity_ = env ? std::strtoul(env, nullptr, 10) : 256;
    if (capacity_ == 0) capacity_ = 256;
  }
  ring_.resize(capacity_);
}

void FlightRecorder::issued(uint64_t seq, std::string op, std::string shapes) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& r = ring_[next_];
  r = FlightRecord{seq, std::move(op), std::move(shapes), "issued", now_s(), 0};
  next_ = (next_ + 1) % capacity_;
  count_ = std::min(count_ + 1, capacity_);
}

FlightRecord* FlightRecorder::find(uint64_t seq) {
  for (size_t i = 0; i < count_; ++i) {
    auto& r = ring_[(next_ + capacity_ - 1 - i) % capacity_];  // newest first: the usual case
    if (r.seq == seq) return &r;
  }
  return nullptr;
}

void FlightRecorder::completed(uint64_t seq) {
  std::lock_guard<std::mutex> lock(mu_);
  if (auto* r = find(seq)) {
    r->state = "completed";
    r->completed_s = now_s();
  }
}

void FlightRecorder::failed(uint64_t seq, const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  if (auto* r = find(seq)) r->state = "failed: " + reason;
}

std::vector<FlightRecord> FlightRecorder::records() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<FlightRecord> out;
  for (size_t i = 0; i < count_; ++i) out.push_back(ring_[(next_ + capacity_ - count_ + i) % capacity_]);
  return out;
}

std::string FlightRecorder::dump(const std::string& group, int rank, int size, std::string dir) const {
  try {
    if (dir.empty()) {
      const char* env = std::getenv("FSDP_FLIGHT_RECORDER_DIR");
      if (!env || !*env) return "";
      dir = env;
    }
    ::mkdir(dir.c_str(), 0755);  // may exist
    nlohmann::json j;
    j["group"] = group;
    j["rank"] = rank;
    j["size"] = size;
    j["records"] = nlohmann::json::array();
    for (const auto& r : records()) {
      j["records"].push_back({{"seq", r.seq}, {"op", r.op}, {"shapes", r.shapes}, {"state", r.state},
                              {"issued_s", r.issued_s}, {"completed_s", r.completed_s}});
    }
    std::string name = group;
    for (auto& c : name) c = (c == '/' ? '_' : c);
    std::string path = dir + "/fsdp_flight_recorder_" + name + "_rank" + std::to_string(rank) + ".json";
    std::ofstream f(path);
    f << j.dump(2) << "\n";
    return f.good() ? path : "";
  } catch (...) {
    return "";  // a dump must never hide the error being reported
  }
}

}  // namespace fsdp
