// The CPU buffer pool of FSDP's transient buffers (see fsdp_buffer_pool.h).
#include "fsdp/fsdp_buffer_pool.h"

#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/EmptyTensor.h>
#include <c10/core/CPUAllocator.h>

namespace fsdp::detail {

// The footprint's bound, in high-water marks. Blocks are exact-size, so 1 would not do: the moment with the
// most bytes in use is not the moment that needs every size at its largest count (a step may need two blocks
// of size a early and one of size 2a later: 2a in use at most, 4a to serve both from the pool). FSDP's
// steady state fits in 2 on the models measured (tests/test_fsdp_buffer_pool.cpp); beyond it the pool
// evicts and the evicted sizes are allocated afresh (page-faulted) when next needed.
constexpr uint64_t kFootprintFactor = 2;

struct BufferPool::State {
  std::mutex mu;
  bool enabled = true;
  std::map<size_t, std::vector<at::DataPtr>> idle;  // exact size -> idle blocks (LIFO: warm pages first)
  BufferPoolStats stats;

  // Gives idle blocks back (largest first) until the footprint plus `incoming` fits under the bound or
  // nothing is idle. Called with `mu` held; the blocks are freed by the caller after unlocking.
  void evict_for(size_t incoming, std::vector<at::DataPtr>& freed) {
    while (!idle.empty() && stats.in_use_bytes + stats.idle_bytes + incoming > kFootprintFactor * stats.high_water_bytes) {
      auto it = std::prev(idle.end());
      freed.push_back(std::move(it->second.back()));
      it->second.pop_back();
      stats.idle_bytes -= it->first;
      ++stats.evictions;
      if (it->second.empty()) idle.erase(it);
    }
  }
};

namespace {

// The context of a handed-out block: the underlying block and the pool's state to return it to.
struct Block {
  at::DataPtr raw;
  size_t nbytes;
  std::shared_ptr<BufferPool::State> state;
};

void return_block(void* ctx) {
  std::unique_ptr<Block> b(static_cast<Block*>(ctx));
  auto state = std::move(b->state);  // destroyed after the lock is released (it may be the last owner)
  std::lock_guard<std::mutex> lock(state->mu);
  state->stats.in_use_bytes -= b->nbytes;
  // Kept while the footprint stays within the high-water mark (always true here: in use + idle only
  // shrank by this return), so every block is kept; eviction happens when a fresh block is needed.
  state->idle[b->nbytes].push_back(std::move(b->raw));
  state->stats.idle_bytes += b->nbytes;
}

// Off by default: the pool trades memory for page faults (on the parameter-heavy model of
// tests/test_memory_estimate.cpp the peak grows by 17-42%, see docs/BENCHMARKS.md).
bool pool_wanted() {
  const char* v = std::getenv("FSDP_CPU_BUFFER_POOL");
  if (v == nullptr || !*v || std::string(v) == "0") return false;
  TORCH_CHECK(std::string(v) == "1", "FSDP_CPU_BUFFER_POOL=", v,
              " is invalid: expected \"1\" (FSDP's CPU buffers are reused across steps: no page faults per step, "
              "more memory held) or \"0\" (the default: every buffer is allocated and freed through the CPU "
              "allocator)");
  return true;
}

}  // namespace

BufferPool::BufferPool() : state_(std::make_shared<State>()) { state_->enabled = pool_wanted(); }

BufferPoolPtr make_buffer_pool() { return BufferPoolPtr(new BufferPool()); }

bool BufferPool::enabled() const { return state_->enabled; }

at::DataPtr BufferPool::allocate(size_t nbytes) {
  if (!state_->enabled) return c10::GetCPUAllocator()->allocate(nbytes);
  if (nbytes == 0) return at::DataPtr(nullptr, at::Device(at::kCPU));
  at::DataPtr raw;
  std::vector<at::DataPtr> freed;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    auto& s = state_->stats;
    auto it = state_->idle.find(nbytes);
    if (it != state_->idle.end()) {
      raw = std::move(it->second.back());
      it->second.pop_back();
      if (it->second.empty()) state_->idle.erase(it);
      s.idle_bytes -= nbytes;
      ++s.hits;
    } else {
      state_->evict_for(nbytes, freed);
      ++s.misses;
    }
    s.in_use_bytes += nbytes;
    s.high_water_bytes = std::max(s.high_water_bytes, s.in_use_bytes);
  }
  freed.clear();  // evicted blocks go back to the CPU allocator here, outside the lock
  if (!raw) {
    try {
      raw = c10::GetCPUAllocator()->allocate(nbytes);
    } catch (...) {
      std::lock_guard<std::mutex> lock(state_->mu);
      state_->stats.in_use_bytes -= nbytes;
      throw;
    }
  }
  void* data = raw.get();
  auto* block = new Block{std::move(raw), nbytes, state_};
  return at::DataPtr(data, block, &return_block, at::Device(at::kCPU));
}

void BufferPool::copy_data(void* dest, const void* src, std::size_t count) const {
  if (count > 0) std::memcpy(dest, src, count);
}

torch::Tensor BufferPool::empty(at::IntArrayRef sizes, torch::ScalarType dtype) {
  if (!state_->enabled) return torch::empty(sizes, torch::TensorOptions().dtype(dtype));
  return at::detail::empty_generic(sizes, this, c10::DispatchKeySet(c10::DispatchKey::CPU), dtype, std::nullopt);
}

BufferPoolStats BufferPool::stats() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->stats;
}

void BufferPool::release_idle() {
  std::map<size_t, std::vector<at::DataPtr>> freed;
  std::lock_guard<std::mutex> lock(state_->mu);
  for (auto& [n, v] : state_->idle) state_->stats.evictions += v.size();
  freed.swap(state_->idle);
  state_->stats.idle_bytes = 0;
}

}  // namespace fsdp::detail
