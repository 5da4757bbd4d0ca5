// Saved-tensor hooks for C++ (torch.autograd.graph.saved_tensors_hooks, save_on_cpu) through libfsdp's
// autograd engine.
#include "fsdp/utils/saved_tensor_hooks.h"

#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <torch/csrc/autograd/engine.h>
#include <torch/cuda.h>

#include "utils/implicit_checkpoint.h"
#include "utils/saved_tensor_hooks_internal.h"

// [Note: saved-tensor hooks]
// Every SavedVariable that autograd creates asks Engine::get_default_engine().get_default_saved_variable_hooks()
// for hooks (when saved-tensor hooks are enabled, LibTorch's default). LibTorch's base engine answers none;
// PyTorch's Python engine answers the Python hooks of torch.autograd.graph.saved_tensors_hooks. C++ has no
// such registry, so libfsdp installs, when it is loaded, an engine of its own as LibTorch's default (the
// documented indirection, set_default_engine_stub, by which Python replaces the base engine): the base
// engine's behaviour, plus an answer from this thread's stack of hook factories. Loading happens before any
// autograd work (before main), so the base engine is never built and exactly one engine exists, as the
// engine requires. Cost: one virtual call and one thread-local read per saved tensor. Limit: a process that
// ran a backward before loading libfsdp (dlopen later) keeps the base engine; the hooks then refuse to start
// (HooksEngine::is_default) instead of silently saving nothing. A Python process has the Python engine:
// libfsdp is not meant to be loaded there.
namespace fsdp {
namespace detail {
namespace {

thread_local std::vector<SavedHooksFactory> t_factories;
thread_local SavedHooksFactory t_region_factory;  // an implicit checkpoint region's
thread_local size_t t_region_depth = 0;            // t_factories' size when it was set

struct HooksEngine : torch::autograd::Engine {
  static torch::autograd::Engine& instance() {
    static HooksEngine engine;
    return engine;
  }
  static bool is_default() { return &torch::autograd::Engine::get_default_engine() == &instance(); }
  ~HooksEngine() override { stop(); }  // (before the base destructor: see Engine::stop)
  std::unique_ptr<torch::autograd::SavedVariableHooks> get_default_saved_variable_hooks() override {
    if (t_region_factory && t_factories.size() <= t_region_depth) return t_region_factory();
    if (t_factories.empty()) return nullptr;
    return t_factories.back()();
  }
  // A backward begins: the implicit checkpoint region open on this thread (the forward's last) ends before it
  // ([Note: implicit checkpoint regions]).
  torch::autograd::variable_list execute(const torch::autograd::edge_list& roots,
                                         const torch::autograd::variable_list& inputs, bool keep_graph,
                                         bool create_graph, bool accumulate_grad,
                                         const torch::autograd::edge_list& outputs) override {
    close_implicit_region();
    return torch::autograd::Engine::execute(roots, inputs, keep_graph, create_graph, accumulate_grad, outputs);
  }
};

const bool installed = [] {
  torch::autograd::set_default_engine_stub(&HooksEngine::instance);
  return true;
}();

}  // namespace

void push_saved_hooks(SavedHooksFactory factory, const char* api) {
  TORCH_CHECK(installed && HooksEngine::is_default(), api, ": LibTorch's autograd engine is not libfsdp's (the process "
              "ran a backward before libfsdp was loaded, or another library replaced the engine), so saved-tensor ",
              "hooks cannot run. Fix: link libfsdp into the program (not dlopen after autograd ran), or use ",
              "fsdp::CheckpointOptions().use_reentrant(true)");
  close_implicit_region();  // (the region's saved tensors would go to these hooks in forward, not in the replay)
  t_factories.push_back(std::move(factory));
}

void pop_saved_hooks() {
  close_implicit_region();
  t_factories.pop_back();
}

void set_region_saved_hooks(SavedHooksFactory factory) {
  if (factory) {
    TORCH_CHECK(installed && HooksEngine::is_default(), "apply_activation_checkpointing: LibTorch's autograd engine is ",
                "not libfsdp's (the process ran a backward before libfsdp was loaded, or another library replaced the ",
                "engine), so the regions of unchanged modules cannot run. Fix: link libfsdp into the program (not ",
                "dlopen after autograd ran)");
  }
  t_region_depth = t_factories.size();
  t_region_factory = std::move(factory);
}

}  // namespace detail

namespace {

struct Fns {
  saved_tensors_hooks::Pack pack;
  saved_tensors_hooks::Unpack unpack;
};

struct UserHooks : torch::autograd::SavedVariableHooks {
  explicit UserHooks(std::shared_ptr<Fns> f) : fns(std::move(f)) {}
  void call_pack_hook(const at::Tensor& tensor) override { packed = fns->pack(tensor); }
  at::Tensor call_unpack_hook() override { return fns->unpack(packed); }
  std::shared_ptr<Fns> fns;
  c10::IValue packed;
};

}  // namespace

saved_tensors_hooks::saved_tensors_hooks(Pack pack, Unpack unpack) {
  TORCH_CHECK(pack && unpack, "saved_tensors_hooks: expected a pack and an unpack function");
  auto fns = std::make_shared<Fns>(Fns{std::move(pack), std::move(unpack)});
  detail::push_saved_hooks([fns] { return std::make_unique<UserHooks>(fns); }, "saved_tensors_hooks");
}

saved_tensors_hooks::~saved_tensors_hooks() { detail::pop_saved_hooks(); }

namespace detail {
c10::Stream offload_stream(c10::Device device) {
  static std::mutex mu;
  static std::map<std::pair<int, int>, c10::Stream> streams;  // (device type, index) -> its side stream
  std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_pair(static_cast<int>(device.type()), static_cast<int>(device.index()));
  auto it = streams.find(key);
  if (it == streams.end()) {
    c10::impl::VirtualGuardImpl impl(device.type());
    it = streams.emplace(key, impl.getStreamFromGlobalPool(device, /*isHighPriority=*/false)).first;
  }
  return it->second;
}
}  // namespace detail

namespace {

// The end of a saved tensor's device-to-host copy on the offload stream.
struct CopyDone : torch::CustomClassHolder {
  explicit CopyDone(c10::DeviceType type) : event(type) {}
  c10::Event event;
};

// [Note: save_on_cpu on a side stream]
// On a GPU with pin_memory, a saved tensor's copy to host memory runs on a side stream (detail::offload_stream), so
// that the forward's kernels do not wait for it: the side stream first waits for the compute stream (an event: the
// tensor is written), copies into pinned memory asynchronously, and the tensor's memory is recorded as in use on the
// side stream (the caching allocator does not hand it out again before the copy ran, though the forward drops the
// tensor at once). In backward the compute stream waits for the copy's event before copying back (asynchronously:
// pinned memory; the host allocator keeps the host block until that copy ran). No host synchronisation either way.
// On the CPU (and without pinning) the copy is a plain copy, as PyTorch's save_on_cpu. Device-generic (c10 streams and
// events through the device guard registry), so it compiles against a CPU-only LibTorch.
saved_tensors_hooks::Pack save_on_cpu_pack(bool pin_memory) {
  return [pin = pin_memory && torch::cuda::is_available()](const torch::Tensor& t) -> c10::IValue {
    // A copy in host memory (pinned: asynchronous copies back), with the tensor's strides (a transposed weight stays
    // transposed, so the backward's kernels, and their roundings, are those without the hooks); the device to
    // return to.
    auto packed = at::empty_like(t, t.options().device(torch::kCPU).pinned_memory(pin && !t.is_sparse()),
                                 at::MemoryFormat::Preserve);
    if (!pin || t.is_sparse() || t.device().is_cpu()) {
      packed.copy_(t);
      return c10::ivalue::Tuple::create({c10::IValue(t.device()), c10::IValue(packed)});
    }
    c10::impl::VirtualGuardImpl impl(t.device().type());
    const c10::Stream compute = impl.getStream(t.device());
    const c10::Stream side = detail::offload_stream(t.device());
    c10::Event written(t.device().type());
    written.record(compute);
    written.block(side);
    {
      c10::StreamGuard on_side(side);
      packed.copy_(t, /*non_blocking=*/true);
    }
    impl.recordDataPtrOnStream(t.storage().data_ptr(), side);
    auto done = c10::make_intrusive<CopyDone>(t.device().type());
    done->event.record(side);
    return c10::ivalue::Tuple::create({c10::IValue(t.device()), c10::IValue(packed), c10::IValue::make_capsule(done)});
  };
}

saved_tensors_hooks::Unpack save_on_cpu_unpack(bool pin_memory) {
  return [pin = pin_memory && torch::cuda::is_available()](const c10::IValue& v) {
    const auto& items = v.toTupleRef().elements();
    const c10::Device device = items[0].toDevice();
    if (items.size() > 2) {
      auto done = c10::static_intrusive_pointer_cast<CopyDone>(items[2].toCapsule());
      c10::impl::VirtualGuardImpl impl(device.type());
      done->event.block(impl.getStream(device));  // the copy back waits for the copy out
    }
    return items[1].toTensor().to(device, /*non_blocking=*/pin);
  };
}
}  // namespace

namespace detail {
SavedHooksFactory save_on_cpu_hooks(bool pin_memory) {
  auto fns = std::make_shared<Fns>(Fns{save_on_cpu_pack(pin_memory), save_on_cpu_unpack(pin_memory)});
  return [fns] { return std::make_unique<UserHooks>(fns); };
}
}  // namespace detail

save_on_cpu::save_on_cpu(bool pin_memory)
    : saved_tensors_hooks(save_on_cpu_pack(pin_memory), save_on_cpu_unpack(pin_memory)) {}

}  // namespace fsdp
