// FSDP2's CUDA streams (issue 12): the all-gather copy-in, the all-gather and the reduce-scatter (with the
// HSDP all-reduce) each run on a stream of their own, ordered against the compute (current) stream by
// events, never by a device-wide or host synchronisation.
//
// Mirrors torch.distributed.fsdp._fully_shard._fsdp_param_group.FSDPCommContext and the stream logic of
// FSDPParamGroup.{unshard, wait_for_unshard, post_backward} and foreach_reduce.
//
// Everything here is device-generic (c10::Stream / c10::Event through the device guard registry), so it
// compiles against a CPU-only LibTorch too; on a CPU device every function is a no-op (enabled() is false)
// and the CPU path stays exactly as before.
//
// Buffer lifetimes across streams (what keeps a buffer from being reused before its collective finished):
// - all-gather output: allocated on the copy-in stream; read by the copy-out on the compute stream. It is
//   not freed at the copy-out: the context keeps it until the next all-gather's wait_for_unshard, where the
//   all-gather streams first wait for that copy-out's event (FSDP2's AllGatherState). This is also the
//   limiter: a new all-gather's copy-in cannot run ahead of the previous copy-out, so at most one all-gather
//   output is in flight beside the one in use.
// - unsharded gradients: produced on the compute stream, read by the reduce-scatter copy-in on the
//   reduce-scatter stream: record_stream() on that stream before they are dropped.
// - reduce-scatter output: allocated on the reduce-scatter stream, read on the compute stream after an
//   event wait: record_stream() on the compute stream before it is dropped.
#pragma once

#include <memory>
#include <optional>

#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <torch/types.h>

#include "fsdp/fsdp_buffer_pool.h"

namespace fsdp::detail {

/// The side streams of FSDP2.
enum class CommStream { kAllGatherCopyIn, kAllGather, kReduceScatter };

/// The streams of one FSDP tree on one device, shared by its groups (FSDP2's FSDPCommContext).
/// Thread-safe for the uses below (forward hooks run on the caller's thread, backward hooks on
/// autograd's device thread, never at the same time for one tree).
class CommContext {
 public:
  /// Streams on `device` when it is a CUDA device and FSDP_CUDA_STREAMS is not "0"; otherwise disabled,
  /// and every member below is a no-op.
  explicit CommContext(torch::Device device);

  bool enabled() const { return enabled_; }
  torch::Device device() const { return device_; }
  /// The stream of `kind` (requires enabled()).
  c10::Stream stream(CommStream kind) const;
  /// The current (compute) stream of the device (requires enabled()).
  c10::Stream current() const;

  /// `kind` waits for everything queued so far on the current stream (an event; the host does not wait).
  void wait_current(CommStream kind) const;
  /// `waiter` waits for everything queued so far on `signaller`.
  void wait(CommStream waiter, CommStream signaller) const;
  /// Records an event on `kind` (null when disabled).
  std::shared_ptr<c10::Event> record(CommStream kind) const;
  /// Records an event on the current stream (null when disabled).
  std::shared_ptr<c10::Event> record_current() const;
  /// The current stream waits for `event` (no-op for null).
  void current_wait(const std::shared_ptr<c10::Event>& event) const;
  /// Stream `kind` waits for `event` (no-op for null).
  void stream_wait(CommStream kind, const std::shared_ptr<c10::Event>& event) const;
  /// Marks `t`'s memory as used by `kind`: the caching allocator does not reuse it before the work queued
  /// on that stream so far completed (Tensor.record_stream).
  void record_stream(const torch::Tensor& t, CommStream kind) const;
  /// Same for the current stream.
  void record_stream_current(const torch::Tensor& t) const;

  /// The all-gather limiter (see the file comment): called by wait_for_unshard after its copy-out with
  /// the all-gather output it used. Waits the all-gather streams for the previous copy-out and releases
  /// the previous output, then keeps this one with the event of this copy-out.
  void retire_all_gather_output(torch::Tensor output);
  /// Drops the kept all-gather output after a final wait of the all-gather streams (end of backward).
  void release_all_gather_output();

  /// The CPU buffer pool of this tree's transient buffers (see fsdp_buffer_pool.h); used on CPU devices.
  BufferPool& pool() const { return *pool_; }
  const BufferPoolPtr& pool_ptr() const { return pool_; }
  /// An uninitialised contiguous tensor for one of FSDP's transient buffers on `device`: from the pool on
  /// the CPU, from the device's allocator otherwise (CUDA's caching allocator already reuses blocks).
  torch::Tensor empty(at::IntArrayRef sizes, torch::ScalarType dtype, torch::Device device) const;

  /// Whether each all-gather copy-in first waits for the compute stream (default). set_post_optim_event
  /// turns it off for one iteration: the all-gather streams waited on the user's event at the root's
  /// pre-forward instead, and the shards do not change until the next optimizer step (FSDP2 waits once per
  /// iteration, too).
  bool copy_in_waits_current() const { return copy_in_waits_current_; }
  void set_copy_in_waits_current(bool v) { copy_in_waits_current_ = v; }

  /// Number of all-gather outputs held by the limiter (0 or 1), for tests.
  int held_all_gather_outputs() const { return held_output_.defined() ? 1 : 0; }

 private:
  torch::Device device_;
  bool enabled_ = false;
  std::optional<c10::Stream> copy_in_, all_gather_, reduce_scatter_;
  bool copy_in_waits_current_ = true;
  torch::Tensor held_output_;
  std::shared_ptr<c10::Event> held_event_;
  BufferPoolPtr pool_ = make_buffer_pool();
};
using CommContextPtr = std::shared_ptr<CommContext>;

/// Makes `kind`'s stream current for the scope (no-op when `ctx` is disabled or null). A scope first
/// makes its stream wait for the stream that was current before it, unless `wait_previous` is false.
class StreamScope {
 public:
  StreamScope(const CommContext* ctx, CommStream kind, bool wait_previous = true);
  StreamScope(const StreamScope&) = delete;
  StreamScope& operator=(const StreamScope&) = delete;

 private:
  std::optional<c10::StreamGuard> guard_;
};

/// The context of `device` for the FSDP tree identified by `key` (e.g. its mesh): one per (key, device).
/// Contexts are created on first use and live as long as a group holds them.
CommContextPtr comm_context_for(const void* key, torch::Device device);

}  // namespace fsdp::detail
