// The CPU allocator of materialize_module: see [Note: materialisation memory] in unmapping_allocator.cpp.
#pragma once

namespace fsdp::detail {

/// While it lives (on any thread; nested and concurrent scopes count), LibTorch's CPU allocations of
/// 1 MiB and more are mapped straight from the kernel and unmapped when freed. Does nothing if the
/// process installed a CPU allocator of its own (c10::SetCPUAllocator): that one stays in charge.
class ScopedUnmappingAllocator {
 public:
  ScopedUnmappingAllocator();
  ~ScopedUnmappingAllocator();
  ScopedUnmappingAllocator(const ScopedUnmappingAllocator&) = delete;
  ScopedUnmappingAllocator& operator=(const ScopedUnmappingAllocator&) = delete;
};

}  // namespace fsdp::detail
