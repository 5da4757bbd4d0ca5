// The fallback of kInterceptKey and its layers (utils/intercept.h).
#include "utils/intercept.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>

#include <torch/library.h>

namespace fsdp::detail {
namespace {

constexpr int kLayers = 3;
// Each layer's handlers (null until installed), and the highest layer's, read on every intercepted op (hence
// atomics; a layer is installed once and never removed).
std::array<std::atomic<InterceptFn>, kLayers> layer_fallback{};
std::array<std::atomic<InterceptFn>, kLayers> layer_composite{};
std::atomic<InterceptFn> current_fallback{nullptr};
std::atomic<InterceptFn> current_composite{nullptr};
std::atomic<SdpaHandler> sdpa_handler{nullptr};
std::atomic<CrossEntropyHandler> cross_entropy_handler{nullptr};
std::mutex install_mu;
int highest_installed = -1;

void fallback(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const InterceptFn fn = current_fallback.load(std::memory_order_acquire);
  fn ? fn(op, ks, stack) : redispatch_below_intercept(op, ks, stack);  // (no layer yet: no tensor carries the key)
}

void composite_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const InterceptFn fn = current_composite.load(std::memory_order_acquire);
  fn ? fn(op, ks, stack) : redispatch_below_intercept(op, ks, stack);
}

// aten::scaled_dot_product_attention: context parallelism first, then the layers as for any other op (without a
// kernel of its own it reached the fallback as it does now when the handler declines).
void sdpa_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const SdpaHandler handler = sdpa_handler.load(std::memory_order_acquire);
  if (handler && handler(op, ks, stack)) return;
  fallback(op, ks, stack);
}

// aten::cross_entropy_loss: loss parallelism first, then the layers (as SDPA above).
void cross_entropy_kernel(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  const CrossEntropyHandler handler = cross_entropy_handler.load(std::memory_order_acquire);
  if (handler && handler(op, ks, stack)) return;
  fallback(op, ks, stack);
}

// The key's kernels are registered when libfsdp is loaded (before main: no other thread dispatches yet), not when
// the first layer is installed: a registration updates the dispatch tables of every op while other threads may be
// reading them (ranks run as threads in the tests; LibTorch's dispatcher then failed an internal assert, seen when
// a selective checkpoint region installed the first layer on one rank while the other ran ops). A registration
// that fails (another library, e.g. torchdistx, owns the key) is reported by install_intercept_layer.
struct Registration {
  std::unique_ptr<torch::Library> fallback, aten;
  std::string error;
};

const Registration& registration() {
  static const Registration r = [] {
    Registration reg;
    try {
      reg.fallback = std::make_unique<torch::Library>(torch::Library::IMPL, "_", kInterceptKey, __FILE__, __LINE__);
      reg.fallback->fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
      reg.aten = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", kInterceptKey, __FILE__, __LINE__);
      reg.aten->impl("linear", torch::CppFunction::makeFromBoxedFunction<&composite_kernel>());
      reg.aten->impl("matmul", torch::CppFunction::makeFromBoxedFunction<&composite_kernel>());
      reg.aten->impl("scaled_dot_product_attention", torch::CppFunction::makeFromBoxedFunction<&sdpa_kernel>());
      reg.aten->impl("cross_entropy_loss", torch::CppFunction::makeFromBoxedFunction<&cross_entropy_kernel>());
    } catch (const c10::Error& e) {
      reg.error = e.what_without_backtrace();
    }
    return reg;
  }();
  return r;
}

const bool registered_at_load = (registration(), true);

// Throws if the key's kernels could not be registered at load; `users` names who needs them (may be empty).
void check_registered(const char* users) {
  TORCH_CHECK(registered_at_load && registration().error.empty(), "libfsdp: the kernels of dispatch key ",
              kInterceptKey, users, " could not be registered when libfsdp was loaded: ", registration().error,
              ". Another library in this process owns the key (torchdistx's deferred_init?); load only one of them");
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

void call_layer_below(InterceptLayer layer, bool composite, const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                      torch::jit::Stack* stack) {
  for (int level = static_cast<int>(layer) - 1; level >= 0; --level) {
    const InterceptFn fn = (composite ? layer_composite : layer_fallback)[level].load(std::memory_order_acquire);
    if (fn) return fn(op, ks, stack);
  }
  redispatch_below_intercept(op, ks, stack);
}

void install_intercept_layer(InterceptLayer layer, InterceptFn fallback_fn, InterceptFn composite_fn) {
  check_registered(" (implicit FSDP groups, tensor parallelism, selective checkpointing)");
  const int level = static_cast<int>(layer);
  if (layer_fallback[level].load(std::memory_order_acquire)) return;  // (the fast path of every later call)
  std::lock_guard<std::mutex> lock(install_mu);
  if (layer_fallback[level].load(std::memory_order_relaxed)) return;
  layer_composite[level].store(composite_fn, std::memory_order_release);
  layer_fallback[level].store(fallback_fn, std::memory_order_release);
  if (level > highest_installed) {
    current_fallback.store(fallback_fn, std::memory_order_release);
    current_composite.store(composite_fn, std::memory_order_release);
  }
  highest_installed = std::max(highest_installed, level);
}

void install_sdpa_handler(SdpaHandler handler) {
  check_registered("");
  SdpaHandler expected = nullptr;
  sdpa_handler.compare_exchange_strong(expected, handler, std::memory_order_acq_rel);
}

void install_cross_entropy_handler(CrossEntropyHandler handler) {
  check_registered("");
  CrossEntropyHandler expected = nullptr;
  cross_entropy_handler.compare_exchange_strong(expected, handler, std::memory_order_acq_rel);
}

torch::Tensor intercepted(const torch::Tensor& t) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(c10::Storage(t.storage()), t.key_set() | c10::DispatchKeySet(kInterceptKey),
                                                   t.dtype());
  impl->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  return torch::Tensor(std::move(impl));
}

}  // namespace fsdp::detail
