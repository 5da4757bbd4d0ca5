#include "fsdp/fsdp_streams.h"

#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include <c10/core/impl/VirtualGuardImpl.h>

namespace fsdp::detail {
namespace {

bool streams_wanted() {
  const char* v = std::getenv("FSDP_CUDA_STREAMS");
  return v == nullptr || std::string(v) != "0";
}

}  // namespace

CommContext::CommContext(torch::Device device) : device_(device) {
  enabled_ = device.is_cuda() && streams_wanted();
  if (!enabled_) return;
  if (!device_.has_index()) device_ = torch::Device(device.type(), 0);
  c10::impl::VirtualGuardImpl impl(device_.type());
  // High priority, as FSDP2's: communication should not queue behind compute kernels.
  copy_in_ = impl.getStreamFromGlobalPool(device_, /*isHighPriority=*/true);
  all_gather_ = impl.getStreamFromGlobalPool(device_, /*isHighPriority=*/true);
  reduce_scatter_ = impl.getStreamFromGlobalPool(device_, /*isHighPriority=*/true);
}

torch::Tensor CommContext::empty(at::IntArrayRef sizes, torch::ScalarType dtype, torch::Device device) const {
  if (device.is_cpu()) return pool_->empty(sizes, dtype);
  return torch::empty(sizes, torch::TensorOptions().dtype(dtype).device(device));
}

c10::Stream CommContext::stream(CommStream kind) const {
  TORCH_INTERNAL_ASSERT(enabled_, "CommContext::stream on a disabled context");
  switch (kind) {
    case CommStream::kAllGatherCopyIn:
      return *copy_in_;
    case CommStream::kAllGather:
      return *all_gather_;
    case CommStream::kReduceScatter:
      return *reduce_scatter_;
  }
  TORCH_INTERNAL_ASSERT(false, "unknown CommStream");
}

c10::Stream CommContext::current() const {
  TORCH_INTERNAL_ASSERT(enabled_, "CommContext::current on a disabled context");
  return c10::impl::VirtualGuardImpl(device_.type()).getStream(device_);
}

std::shared_ptr<c10::Event> CommContext::record(CommStream kind) const {
  if (!enabled_) return nullptr;
  auto e = std::make_shared<c10::Event>(device_.type());
  e->record(stream(kind));
  return e;
}

std::shared_ptr<c10::Event> CommContext::record_current() const {
  if (!enabled_) return nullptr;
  auto e = std::make_shared<c10::Event>(device_.type());
  e->record(current());
  return e;
}

void CommContext::current_wait(const std::shared_ptr<c10::Event>& event) const {
  if (enabled_ && event) event->block(current());
}

void CommContext::stream_wait(CommStream kind, const std::shared_ptr<c10::Event>& event) const {
  if (enabled_ && event) event->block(stream(kind));
}

void CommContext::wait_current(CommStream kind) const {
  if (!enabled_) return;
  stream_wait(kind, record_current());
}

void CommContext::wait(CommStream waiter, CommStream signaller) const {
  if (!enabled_) return;
  stream_wait(waiter, record(signaller));
}

void CommContext::record_stream(const torch::Tensor& t, CommStream kind) const {
  if (enabled_ && t.defined() && t.device().type() == device_.type() && t.storage().data() != nullptr) {
    t.record_stream(stream(kind));
  }
}

void CommContext::record_stream_current(const torch::Tensor& t) const {
  if (enabled_ && t.defined() && t.device().type() == device_.type() && t.storage().data() != nullptr) {
    t.record_stream(current());
  }
}

void CommContext::retire_all_gather_output(torch::Tensor output) {
  if (!enabled_) return;  // CPU: the output is freed by its last reference, as before
  if (held_output_.defined()) {
    // The previous copy-out must finish before its buffer can be reused by the all-gather streams (the
    // allocator hands it to the copy-in stream, where it was allocated): they wait for its event.
    stream_wait(CommStream::kAllGatherCopyIn, held_event_);
    stream_wait(CommStream::kAllGather, held_event_);
  }
  held_output_ = std::move(output);
  held_event_ = record_current();
}

void CommContext::release_all_gather_output() {
  if (!enabled_ || !held_output_.defined()) return;
  stream_wait(CommStream::kAllGatherCopyIn, held_event_);
  stream_wait(CommStream::kAllGather, held_event_);
  held_output_ = torch::Tensor();
  held_event_.reset();
}

StreamScope::StreamScope(const CommContext* ctx, CommStream kind, bool wait_previous) {
  if (ctx == nullptr || !ctx->enabled()) return;
  if (wait_previous) {
    auto e = ctx->record_current();
    ctx->stream_wait(kind, e);
  }
  guard_.emplace(ctx->stream(kind));
}

CommContextPtr comm_context_for(const void* key, torch::Device device) {
  static std::mutex mu;
  static std::map<std::pair<const void*, std::string>, std::weak_ptr<CommContext>> contexts;
  std::lock_guard<std::mutex> lock(mu);
  auto k = std::make_pair(key, device.str());
  if (auto existing = contexts[k].lock()) return existing;
  auto ctx = std::make_shared<CommContext>(device);
  contexts[k] = ctx;
  return ctx;
}

}  // namespace fsdp::detail
