// [Note: copy ahead] A blocking dcp::save of tensors that are not already contiguous CPU memory (GPU
// shards, strided views) used to stage all of them before writing the first byte: the rank's whole shard
// once more in host memory (pinned, for CUDA), and the copy and the write one after the other. With
// SaveOptions::per_thread_copy_ahead, each writer thread instead has a copier thread that copies its
// items in write order, at most that many bytes ahead of the item being written: host memory is bounded
// by the budget (or the largest single item), and the copy of the next items overlaps the write of this
// one. PyTorch's FileSystemWriter does the same with its _OverlappingCpuLoader (CUDA streams only).
//
// The copies read the sources on the copier thread. That is safe because save() blocks its caller: the
// sources cannot change during the save, and the caller's CUDA stream is synchronized once before the
// copier starts (so the copier, on its own thread's stream, reads what the caller's kernels wrote).
// async_save does not use this: it must copy everything before it returns.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include <torch/types.h>

namespace fsdp::dcp::detail {

/// Whether `t` must be copied before it can be written (it is not contiguous CPU memory).
inline bool needs_copy(const torch::Tensor& t) { return !t.device().is_cpu() || !t.is_contiguous(); }

/// Hands out `sources` as contiguous CPU tensors in order, copying those that need it on a thread of its
/// own at most `budget` bytes ahead (one item at a time when an item alone exceeds it). get(i) must be
/// called with i = 0, 1, 2...; asking for item i releases items < i (the writer is done with them).
/// An exception of a copy is rethrown by get() of that item. The destructor stops the copier.
class CopyAhead {
 public:
  CopyAhead(std::vector<torch::Tensor> sources, int64_t budget);
  ~CopyAhead();
  CopyAhead(const CopyAhead&) = delete;
  CopyAhead& operator=(const CopyAhead&) = delete;

  /// Item `i`, contiguous and on the CPU (waits for its copy). Throws what the copy threw.
  torch::Tensor get(size_t i);
  /// The most bytes of copies held at once so far.
  int64_t peak_bytes() const;

 private:
  void copier();

  std::vector<torch::Tensor> sources_;
  std::vector<torch::Tensor> copies_;
  std::vector<std::exception_ptr> errors_;
  std::vector<bool> ready_;
  const int64_t budget_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  size_t released_ = 0;  // items < released_ are done with
  int64_t held_ = 0;     // bytes of copies not yet released
  int64_t peak_ = 0;
  bool stop_ = false;
  std::thread thread_;
};

/// The largest CopyAhead::peak_bytes() of the writers of this process's last blocking dcp::save (for
/// tests of the bound).
int64_t last_copy_ahead_peak_bytes();
void record_copy_ahead_peak_bytes(int64_t bytes, bool reset);

}  // namespace fsdp::dcp::detail
