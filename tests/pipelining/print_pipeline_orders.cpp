// Prints libfsdp's per-rank action orders (src/pipelining/schedule_orders.cpp) as JSON, for
// tests/python/test_pipelining_orders.py to compare with PyTorch's schedules.
//
// Usage: print_pipeline_orders SCHEDULE:P:V:M ...   (SCHEDULE: gpipe, 1f1b, interleaved-1f1b,
// interleaved-zero-bubble, zbv-zero-bubble; P ranks, V stages per rank, M microbatches)
// Output: one JSON object, {"SCHEDULE:P:V:M": {"0": ["0F0", "0F1", ...], "1": [...]}, ...}: each rank's
// compute actions in order, idle slots left out.
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "pipelining/schedule_orders.h"

using fsdp::pipelining::RankOrder;
namespace orders = fsdp::pipelining::detail;

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: print_pipeline_orders SCHEDULE:P:V:M ...\n";
    return 2;
  }
  std::cout << "{";
  for (int i = 1; i < argc; ++i) {
    const std::string spec = argv[i];
    std::stringstream ss(spec);
    std::string name, field;
    std::vector<int> nums;
    std::getline(ss, name, ':');
    while (std::getline(ss, field, ':')) nums.push_back(std::stoi(field));
    if (nums.size() != 3) {
      std::cerr << "print_pipeline_orders: bad spec '" << spec << "' (expected SCHEDULE:P:V:M)\n";
      return 2;
    }
    const int p = nums[0], v = nums[1], m = nums[2];
    std::map<int, RankOrder> order;
    if (name == "gpipe") {
      order = orders::gpipe_order(p, m);
    } else if (name == "1f1b") {
      order = orders::one_f_one_b_order(p, m);
    } else if (name == "interleaved-1f1b") {
      order = orders::interleaved_order(p, v, m, false);
    } else if (name == "interleaved-zero-bubble") {
      order = orders::interleaved_order(p, v, m, true);
    } else if (name == "zbv-zero-bubble") {
      order = orders::zbv_order(p, m);
    } else {
      std::cerr << "print_pipeline_orders: unknown schedule '" << name << "'\n";
      return 2;
    }
    std::cout << (i > 1 ? ",\n" : "\n") << " \"" << spec << "\": {";
    bool first_rank = true;
    for (const auto& [rank, actions] : order) {
      std::cout << (first_rank ? "" : ", ") << "\"" << rank << "\": [";
      first_rank = false;
      bool first = true;
      for (const auto& a : actions) {
        if (!a) continue;
        std::cout << (first ? "" : ", ") << "\"" << a->str() << "\"";
        first = false;
      }
      std::cout << "]";
    }
    std::cout << "}";
  }
  std::cout << "\n}\n";
  return 0;
}
