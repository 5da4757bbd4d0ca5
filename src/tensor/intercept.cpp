// The fallback of kInterceptKey and its layers (tensor/intercept.h).
#include "tensor/intercept.h"

#include <array>
#include <atomic>
#include <mutex>
#include <string_view>
#include <unordered_map>

#include <torch/library.h>

namespace fsdp::detail {
namespace {

// The handlers of the highest layer installed so far (read on every intercepted op, hence atomics).
std::atomic<InterceptFn> current_fallback{nullptr};
std::atomic<InterceptFn> current_composite{nullptr};
std::mutex install_mu;
int highest_installed = -1;

void fallback(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  current_fallback.load(std::memory_order_acquire)(op, ks, stack);
}

void composite_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  current_composite.load(std::memory_order_acquire)(op, ks, stack);
}

}  // namespace

bool is_metadata_op(const c10::OperatorHandle& op) {
  thread_local std::unordered_map<const c10::FunctionSchema*, bool> cache;
  const auto& schema = op.schema();
  auto it = cache.find(&schema);
  if (it != cache.end()) return it->second;
  const std::string_view name = schema.name();
  auto ends_with = [&](std::string_view suffix) {
    return name.size() >= suffix.size() && name.substr(name.size() - suffix.size()) == suffix;
  };
  // Factories that take a tensor only for its shape and options (optimizer state: zeros_like(p)), and
  // queries of metadata (set_data's compatibility check).
  const bool meta = ends_with("_like") || name == "aten::_has_compatible_shallow_copy_type" ||
                    name == "aten::is_same_size" || name == "aten::_version" || name == "aten::is_set_to" ||
                    name == "aten::sym_size" || name == "aten::sym_stride" || name == "aten::sym_numel" ||
                    name == "aten::size" || name == "aten::stride" || name == "aten::dim";
  return cache.emplace(&schema, meta).first->second;
}

void redispatch_below_intercept(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  static const auto after = c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kInterceptKey);
  op.redispatchBoxed(ks & after, stack);
}

void install_intercept_layer(InterceptLayer layer, InterceptFn fallback_fn, InterceptFn composite_fn) {
  std::lock_guard<std::mutex> lock(install_mu);
  const int level = static_cast<int>(layer);
  if (level <= highest_installed) return;
  current_fallback.store(fallback_fn, std::memory_order_release);
  current_composite.store(composite_fn, std::memory_order_release);
  if (highest_installed < 0) {
    // Registered once, after the first handlers are in place. The libraries live for the process.
    static auto* lib = new torch::Library(torch::Library::IMPL, "_", kInterceptKey, __FILE__, __LINE__);
    lib->fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
    static auto* aten = new torch::Library(torch::Library::IMPL, "aten", kInterceptKey, __FILE__, __LINE__);
    aten->impl("linear", torch::CppFunction::makeFromBoxedFunction<&composite_kernel>());
    aten->impl("matmul", torch::CppFunction::makeFromBoxedFunction<&composite_kernel>());
  }
  highest_installed = level;
}

torch::Tensor intercepted(const torch::Tensor& t) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(t.storage()), t.key_set() | c10::DispatchKeySet(kInterceptKey),
                                                   t.dtype());
  impl->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  return torch::Tensor(std::move(impl));
}

}  // namespace fsdp::detail
