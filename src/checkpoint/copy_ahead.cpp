// See [Note: copy ahead] in copy_ahead.h.
#include "checkpoint/copy_ahead.h"

#include <algorithm>
#include <atomic>

#include <torch/torch.h>

namespace fsdp::dcp::detail {

namespace {
std::atomic<int64_t> g_last_peak{0};

int64_t bytes_of(const torch::Tensor& t) { return static_cast<int64_t>(t.nbytes()); }
}  // namespace

int64_t last_copy_ahead_peak_bytes() { return g_last_peak.load(); }

void record_copy_ahead_peak_bytes(int64_t bytes, bool reset) {
  if (reset) {
    g_last_peak = bytes;
    return;
  }
  int64_t seen = g_last_peak.load();
  while (bytes > seen && !g_last_peak.compare_exchange_weak(seen, bytes)) {
  }
}

CopyAhead::CopyAhead(std::vector<torch::Tensor> sources, int64_t budget)
    : sources_(std::move(sources)),
      copies_(sources_.size()),
      errors_(sources_.size()),
      ready_(sources_.size(), false),
      budget_(budget) {
  bool any = false;
  for (const auto& s : sources_) any = any || needs_copy(s);
  if (any) thread_ = std::thread([this] { copier(); });
}

CopyAhead::~CopyAhead() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void CopyAhead::copier() {
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < sources_.size(); ++i) {
    const auto& src = sources_[i];
    if (!needs_copy(src)) continue;  // get() hands it out as it is
    const int64_t n = bytes_of(src);
    {
      std::unique_lock<std::mutex> lock(mu_);
      // Room for this copy: within the budget, or nothing else held (an item larger than the budget
      // goes alone).
      cv_.wait(lock, [&] { return stop_ || held_ == 0 || held_ + n <= budget_; });
      if (stop_) return;
      if (i < released_) continue;  // the writer gave up before reaching it
      held_ += n;
      peak_ = std::max(peak_, held_);
    }
    torch::Tensor dst;
    std::exception_ptr error;
    try {
      // Pinned host memory for CUDA sources: the copy is a DMA at full bus speed, and the caching host
      // allocator reuses the blocks of released items.
      auto options = src.options().device(torch::kCPU).memory_format(c10::MemoryFormat::Contiguous);
      dst = torch::empty(src.sizes(), src.is_cuda() ? options.pinned_memory(true) : options);
      dst.copy_(src);
    } catch (...) {
      error = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (i < released_) {  // released while copying (the writer failed): not held any more
        held_ -= n;
      } else {
        copies_[i] = std::move(dst);
        errors_[i] = error;
        ready_[i] = true;
      }
    }
    cv_.notify_all();
  }
}

torch::Tensor CopyAhead::get(size_t i) {
  TORCH_INTERNAL_ASSERT(i < sources_.size() && i >= released_, "CopyAhead::get: item ", i, " out of order");
  std::unique_lock<std::mutex> lock(mu_);
  for (; released_ < i; ++released_) {
    if (ready_[released_]) held_ -= bytes_of(sources_[released_]);  // counted when its copy began
    copies_[released_] = torch::Tensor();
  }
  cv_.notify_all();
  if (!needs_copy(sources_[i])) return sources_[i];
  cv_.wait(lock, [&] { return ready_[i]; });
  if (errors_[i]) std::rethrow_exception(errors_[i]);
  return copies_[i];
}

int64_t CopyAhead::peak_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return peak_;
}

}  // namespace fsdp::dcp::detail
