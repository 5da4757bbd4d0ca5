// A CPU buffer pool for FSDP's transient buffers (issue 16, part 2): the all-gather output, the unsharded
// parameters' storage, the reduce-scatter input, output and scratch. Their sizes repeat every step, but
// glibc hands big blocks back to the kernel when they are freed, so every step page-faulted the same
// zeroed pages in again (thousands of minor faults per step on a few-MB model). The pool keeps freed
// blocks in exact-size free lists and hands them out again.
//
// Bound: the pool's footprint (blocks in use + idle blocks) never exceeds twice the most bytes FSDP ever
// had in use at once from it (the high-water mark; twice because blocks are exact-size, see
// kFootprintFactor): a fresh block that would push the footprint above it first evicts idle blocks. So the
// idle bytes stay below 2 x the high-water mark minus what is in use, and nothing like one persistent
// buffer per group (the whole unsharded model) is held. Blocks come from the CPU allocator current when
// they are made (c10::GetCPUAllocator()), so allocator-level memory figures count idle bytes as held.
//
// Blocks are at::DataPtrs whose deleter returns them to the pool; the pool's state is shared by every
// block it handed out, so tensors may outlive the pool's owner (the CommContext). Off by default: it holds
// memory between steps (on a parameter-heavy model the peak grew by 17-42%, docs/BENCHMARKS.md);
// FSDP_CPU_BUFFER_POOL=1 turns it on. Off, every allocation goes straight to the CPU allocator.
//
// No PyTorch counterpart: on CUDA the caching allocator does this for FSDP2; this is its CPU analogue,
// scoped to FSDP's own buffers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include <c10/core/Allocator.h>
#include <torch/types.h>

namespace fsdp::detail {

/// Counters of a BufferPool (for tests and benchmarks).
struct BufferPoolStats {
  uint64_t hits = 0;          // allocations served from an idle block
  uint64_t misses = 0;        // allocations that made a fresh block
  uint64_t evictions = 0;     // idle blocks given back to the CPU allocator
  uint64_t in_use_bytes = 0;  // bytes of blocks handed out and not yet returned
  uint64_t idle_bytes = 0;    // bytes of blocks kept for reuse
  uint64_t high_water_bytes = 0;  // most bytes ever in use at once; in_use + idle <= 2 x this
};

/// An exact-size caching allocator for CPU tensors (see the file comment). Thread-safe: blocks may be
/// freed on any thread (autograd's, the user's). Create with make_buffer_pool().
class BufferPool : public c10::Allocator {
 public:
  /// A block of `nbytes` (0: a null DataPtr) on the CPU; its deleter returns it to the pool.
  at::DataPtr allocate(size_t nbytes) override;
  at::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* dest, const void* src, std::size_t count) const override;

  /// An uninitialised contiguous CPU tensor of `sizes` and `dtype` whose storage comes from the pool (and
  /// whose storage's allocator is the pool, so a storage freed to 0 bytes and re-allocated through
  /// its allocator reuses pool blocks too). When the pool is disabled: torch::empty.
  torch::Tensor empty(at::IntArrayRef sizes, torch::ScalarType dtype);

  BufferPoolStats stats() const;
  /// Gives every idle block back to the CPU allocator (blocks in use are unaffected).
  void release_idle();
  bool enabled() const;

  struct State;  // shared by the pool and every block it handed out

 private:
  friend std::shared_ptr<BufferPool> make_buffer_pool();
  BufferPool();
  std::shared_ptr<State> state_;
};
using BufferPoolPtr = std::shared_ptr<BufferPool>;

/// A new pool; enabled when the environment sets FSDP_CPU_BUFFER_POOL=1 (throws c10::Error for a value
/// other than 0 or 1).
BufferPoolPtr make_buffer_pool();

}  // namespace fsdp::detail
