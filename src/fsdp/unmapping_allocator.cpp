// [Note: materialisation memory]
// materialize_module replays a constructor op by op, and each parameter's full-size values live only
// until its rows are copied into its shard, so the live bytes stay within the shards plus the largest
// parameter. With glibc's malloc the process did not give those temporaries back: after a large mmap'd
// block is freed glibc raises its mmap threshold (up to 32 MiB), the next full-size temporaries come
// from the heap, and blocks allocated above them keep the heap from shrinking. Measured (issue 28,
// item 3): a deferred 8 x Linear(2048, 2048) on 2 ranks grew RSS by 146-162 MiB per rank during
// materialisation, against 1.1 x (shards + largest parameter) = 88 MiB, and more than eager construction
// (137 MiB); malloc_trim brought it to 66 MiB. So while a replay runs, LibTorch's default CPU allocator is
// replaced by this one: blocks of 1 MiB and more are mmap'd and munmap'd when freed (their pages go back
// to the kernel at once, whatever glibc's thresholds), smaller ones come from LibTorch's own alloc_cpu.
// The blocks it made stay valid after it is uninstalled (the deleter finds them in its table). It is not
// installed over a CPU allocator the process chose itself.
#include "fsdp/unmapping_allocator.h"

#include <sys/mman.h>

#include <cstring>
#include <mutex>
#include <unordered_map>

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>

namespace fsdp::detail {
namespace {

constexpr size_t kMinMapped = size_t(1) << 20;

struct Mapped {
  std::mutex mu;
  std::unordered_map<void*, size_t> sizes;  // mapped blocks and their lengths
};
Mapped& mapped() {
  static auto* m = new Mapped();  // never destroyed: blocks can be freed at any time, exit included
  return *m;
}

struct UnmappingAllocator final : c10::Allocator {
  // A "simple" DataPtr (context == data), as the default CPU allocator's: raw_allocate requires it.
  c10::DataPtr allocate(size_t n) override {
    if (n < kMinMapped) {
      void* p = c10::alloc_cpu(n == 0 ? 1 : n);
      return {p, p, &deallocate, c10::Device(c10::kCPU)};
    }
    void* p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {  // e.g. the map count limit: the ordinary allocator is still right
      p = c10::alloc_cpu(n);
      return {p, p, &deallocate, c10::Device(c10::kCPU)};
    }
    {
      std::lock_guard<std::mutex> lock(mapped().mu);
      mapped().sizes[p] = n;
    }
    return {p, p, &deallocate, c10::Device(c10::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &deallocate; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }

  static void deallocate(void* p) {
    if (!p) return;
    size_t len = 0;
    {
      std::lock_guard<std::mutex> lock(mapped().mu);
      auto it = mapped().sizes.find(p);
      if (it != mapped().sizes.end()) {
        len = it->second;
        mapped().sizes.erase(it);
      }
    }
    if (len > 0) {
      ::munmap(p, len);
    } else {
      c10::free_cpu(p);
    }
  }
};

struct Install {
  std::mutex mu;
  int scopes = 0;
  c10::Allocator* previous = nullptr;  // set while installed
};
Install& install() {
  static auto* i = new Install();
  return *i;
}
UnmappingAllocator& allocator() {
  static auto* a = new UnmappingAllocator();
  return *a;
}

}  // namespace

ScopedUnmappingAllocator::ScopedUnmappingAllocator() {
  auto& in = install();
  std::lock_guard<std::mutex> lock(in.mu);
  if (in.scopes++ > 0) return;
  c10::Allocator* current = c10::GetCPUAllocator();
  if (current != c10::GetDefaultCPUAllocator()) return;  // the process chose its own: keep it
  in.previous = current;
  c10::SetCPUAllocator(&allocator(), /*priority=*/0);
}

ScopedUnmappingAllocator::~ScopedUnmappingAllocator() {
  auto& in = install();
  std::lock_guard<std::mutex> lock(in.mu);
  if (--in.scopes > 0 || !in.previous) return;
  c10::SetCPUAllocator(in.previous, /*priority=*/0);
  in.previous = nullptr;
}

}  // namespace fsdp::detail
