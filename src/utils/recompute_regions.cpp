// The registry of regions a recomputation re-enters ([Note: regions a recomputation re-enters],
// recompute_regions.h).
#include "utils/recompute_regions.h"

#include <mutex>

namespace fsdp::detail {
namespace {

struct Captures {
  std::mutex mu;
  std::vector<RegionCapture> fns;
};
Captures& captures() {
  static auto* c = new Captures();  // never destroyed: read by checkpoints until the process ends
  return *c;
}

}  // namespace

void register_region_capture(RegionCapture capture) {
  auto& c = captures();
  std::lock_guard<std::mutex> lock(c.mu);
  for (auto fn : c.fns) {
    if (fn == capture) return;
  }
  c.fns.push_back(capture);
}

std::vector<RegionReentry> capture_regions() {
  auto& c = captures();
  std::vector<RegionCapture> fns;
  {
    std::lock_guard<std::mutex> lock(c.mu);
    fns = c.fns;
  }
  std::vector<RegionReentry> out;
  out.reserve(fns.size());
  for (auto fn : fns) out.push_back(fn());
  return out;
}

ReenterRegions::ReenterRegions(const std::vector<RegionReentry>& regions) {
  entered_.reserve(regions.size());
  for (const auto& enter : regions) entered_.push_back(enter());
}

ReenterRegions::~ReenterRegions() {
  while (!entered_.empty()) entered_.pop_back();  // innermost first
}

}  // namespace fsdp::detail
