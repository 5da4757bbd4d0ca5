// Bytes glibc's allocator holds for the process (malloc'd + mmapped): what a forward keeps alive for backward, read
// before and after it by the activation-memory tests.
#pragma once

#include <malloc.h>

#include <cstdint>

namespace fsdp::testing {

inline int64_t heap_in_use() {
  auto mi = mallinfo2();
  return static_cast<int64_t>(mi.uordblks + mi.hblkhd);
}

}  // namespace fsdp::testing
