// Selective activation checkpointing (torch.utils.checkpoint's create_selective_checkpoint_contexts) for
// non-reentrant regions.
#include "fsdp/utils/selective_checkpoint.h"

#include <algorithm>
#include <mutex>
#include <set>
#include <sstream>

#include <ATen/core/Tensor.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/autograd/variable.h>

#include "utils/implicit_checkpoint.h"
#include "utils/intercept.h"
#include "utils/rng_states.h"
#include "utils/selective_checkpoint_internal.h"

// [Note: selective checkpoint]
// PyTorch runs a selective region under two TorchDispatchModes (below autograd): the first run stores the
// outputs of the ops its policy saves, the recomputation returns them instead of running those ops. C++ has no
// dispatch modes; libfsdp's interception key (utils/intercept.h, above autograd) is put in the thread's
// included keys while a selective region runs, so that every op of the region reaches this layer of the
// fallback first. An op counts when it is the region's own: grad mode on, not nested in another op (the layers
// below run an op's decomposition unintercepted, or inside our depth count), not library code
// (SuspendSelective), not a metadata query.
//   First run: the policy decides; a saved op runs normally (autograd records it: the region's graph is the
// graph without checkpointing) and its outputs are kept, detached, with their versions and requires_grad.
// The tensors the op's own autograd nodes save go through the region's pack hook (positional indices, see
// [Note: non-reentrant checkpoint]); since the recomputation will not run the op, each is described by where
// the recomputation finds it: one of the op's arguments (same storage: a view of it, rebuilt with as_strided on
// the recomputed argument), one of its outputs (the kept output), or else kept as it is (an op's own
// temporary, e.g. linear's transposed weight: memory that the graph without checkpointing holds too). A saved
// random op (tag nondeterministic_seeded) notes the generators' states after it.
//   Recomputation: top-level ops are counted in the same order; at a saved op's ordinal the op is not run:
// its saved tensors are handed to the frame under their indices, its kept outputs are returned (marked as
// requiring grad as in the first run, so that the ops after it save what they saved then), and the generators
// are set to their states after the op (else the next dropout would draw the skipped one's mask). The policy
// is not asked again: the first run's decisions are followed, so a counting policy stays aligned. A saved
// output modified in place since (its version moved) is refused unless allow_cache_entry_mutation; except that an
// in-place or out= op of the region's own first run (not nested in another op) that writes a saved output first
// copies the saved value (copy on write: torch::nn::Linear on a 3-D input adds its bias in place to matmul's
// output), and the recomputation then gets a fresh copy of it each time, to apply that op to again.
//   Differences from PyTorch: linear and matmul reach the policy whole (they are composite: the key's
// registrations see them before they decompose, as FSDP's and TP's layers need); ops run with grad disabled
// are always recomputed (they save nothing for backward); the saved outputs stay for a second backward over
// a retained graph (PyTorch's are popped: a second backward raises); an op whose output aliases an input (view,
// in-place, out=) is recomputed whatever the policy says.
namespace fsdp {
namespace detail {

enum class SlotKind { Arg, Out, Kept };

// Where the recomputation finds one tensor that a saved op's nodes saved.
struct SavedSlot {
  size_t index = 0;
  SlotKind kind = SlotKind::Kept;
  size_t position = 0;  // the argument's or output's position
  int64_t element = -1; // in a tensor list, else -1
  std::vector<int64_t> sizes, strides;
  int64_t offset = 0;
};

struct CachedOp {
  c10::OperatorName name{"", ""};
  size_t ordinal = 0;
  std::vector<c10::IValue> outputs;  // tensors detached
  std::vector<int64_t> versions;     // per tensor of `outputs`, in order
  std::vector<bool> requires_grad;   // per tensor of `outputs`, in order
  std::vector<bool> copied;          // per tensor of `outputs`: a copy taken before an in-place op changed it
  std::vector<SavedSlot> slots;
  std::vector<torch::Tensor> rng_after;
};

struct SelectiveRun {
  SelectiveRegion* region = nullptr;
  SelectiveRegion::Fill fill;  // empty: the first run
  size_t ordinal = 0;
  size_t cursor = 0;
  int depth = 0;
  std::vector<std::pair<size_t, torch::Tensor>>* pending = nullptr;  // the running saved op's packs

  void first_run(bool composite, const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack);
  void copy_before_write(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args);
  void recompute(bool composite, const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack);
};

namespace {

thread_local SelectiveRun* t_run = nullptr;

struct DepthGuard {
  explicit DepthGuard(SelectiveRun* r) : run(r) { ++run->depth; }
  ~DepthGuard() { --run->depth; }
  SelectiveRun* run;
};

void lower(bool composite, const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  call_layer_below(InterceptLayer::Checkpoint, composite, op, ks, stack);
}

// Calls `f(tensor, element)` for a tensor IValue (element -1) or each tensor of a list.
template <typename F>
void for_tensors(const c10::IValue& v, F&& f) {
  if (v.isTensor()) {
    f(v.toTensor(), int64_t{-1});
  } else if (v.isList()) {
    const auto& list = v.toListRef();
    for (size_t e = 0; e < list.size(); ++e) {
      if (list[e].isTensor()) f(list[e].toTensor(), static_cast<int64_t>(e));
    }
  }
}

const torch::Tensor* tensor_at(const c10::IValue& v, int64_t element, torch::Tensor& tmp) {
  if (element < 0) return v.isTensor() ? &v.toTensor() : nullptr;
  if (!v.isList()) return nullptr;
  const auto& list = v.toListRef();
  if (static_cast<size_t>(element) >= list.size() || !list[element].isTensor()) return nullptr;
  tmp = list[element].toTensor();
  return &tmp;
}

bool same_storage(const torch::Tensor& a, const torch::Tensor& b) {
  return a.defined() && b.defined() && a.has_storage() && b.has_storage() && a.dtype() == b.dtype() &&
         a.storage().unsafeGetStorageImpl() == b.storage().unsafeGetStorageImpl();
}

std::string op_string(const c10::OperatorName& name) {
  return name.overload_name.empty() ? name.name : name.name + "." + name.overload_name;
}

}  // namespace

void selective_handle(bool composite, const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                      torch::jit::Stack* stack) {
  SelectiveRun* run = t_run;
  if (!run || run->depth > 0 || !torch::GradMode::is_enabled() || is_metadata_op(op)) {
    return lower(composite, op, ks, stack);
  }
  if (run->fill) return run->recompute(composite, op, ks, stack);
  run->first_run(composite, op, ks, stack);
}

// Where the k-th tensor of `values` (tensors and tensor lists, in order) is: its value and its element in a list
// (-1: the value is the tensor), or a null value.
std::pair<c10::IValue*, int64_t> locate_tensor(std::vector<c10::IValue>& values, size_t k) {
  for (auto& v : values) {
    if (v.isTensor()) {
      if (k-- == 0) return {&v, -1};
    } else if (v.isTensorList()) {
      const size_t n = v.toTensorList().size();
      if (k < n) return {&v, static_cast<int64_t>(k)};
      k -= n;
    }
  }
  return {nullptr, -1};
}

// An in-place (or out=) op of the first run about to change a saved output (LibTorch's torch::nn::Linear adds its
// bias in place to matmul's output): the saved value is copied first, so that the recomputation gets the output as
// the op made it and applies the change again itself.
void SelectiveRun::copy_before_write(const c10::OperatorHandle& op, const std::vector<c10::IValue>& args) {
  const auto& schema_args = op.schema().arguments();
  for (size_t a = 0; a < schema_args.size() && a < args.size(); ++a) {
    const auto* alias = schema_args[a].alias_info();
    if (!alias || !alias->isWrite()) continue;
    for_tensors(args[a], [&](const torch::Tensor& t, int64_t) {
      if (!t.defined() || !t.has_storage()) return;
      auto it = region->saved_storages_.find(t.storage().unsafeGetStorageImpl());
      if (it == region->saved_storages_.end()) return;
      auto [op_index, k] = it->second;
      region->saved_storages_.erase(it);
      CachedOp& cached = region->cached_[op_index];
      auto [value, element] = locate_tensor(cached.outputs, k);
      torch::Tensor tmp;
      const torch::Tensor* saved = value ? tensor_at(*value, element, tmp) : nullptr;
      if (!saved || static_cast<int64_t>(saved->_version()) != cached.versions[k]) return;  // (changed already: refused later)
      torch::Tensor copy = saved->clone();
      cached.versions[k] = static_cast<int64_t>(copy._version());
      cached.copied[k] = true;
      if (element < 0) {
        *value = copy;
      } else {
        value->toTensorList().set(element, copy);
      }
    });
  }
}

void SelectiveRun::first_run(bool composite, const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                             torch::jit::Stack* stack) {
  const size_t ordinal_here = ordinal++;
  // Everything below, the op and this function's own ops (detach, the policy's), is not the region's.
  DepthGuard depth_guard(this);
  const size_t nargs = op.schema().arguments().size();
  std::vector<c10::IValue> args(stack->end() - static_cast<std::ptrdiff_t>(nargs), stack->end());
  if (!region->saved_storages_.empty()) copy_before_write(op, args);
  const CheckpointPolicy policy = region->contexts_.policy(SelectiveCheckpointContext{}, op, args);
  // An op whose output aliases an input (a view, an in-place or out= op) is always recomputed: a view costs
  // nothing to recompute, and serving an in-place op's saved output would leave its input unmodified.
  const auto& returns = op.schema().returns();
  const bool aliases = std::any_of(returns.begin(), returns.end(), [](const c10::Argument& r) { return r.alias_info(); });
  if ((policy != CheckpointPolicy::MUST_SAVE && policy != CheckpointPolicy::PREFER_SAVE) || aliases) {
    return lower(composite, op, ks, stack);
  }
  std::vector<std::pair<size_t, torch::Tensor>> packs;
  {
    pending = &packs;
    struct Reset {
      SelectiveRun* r;
      ~Reset() { r->pending = nullptr; }
    } reset{this};
    lower(composite, op, ks, stack);
  }
  CachedOp cached;
  cached.name = op.operator_name();
  cached.ordinal = ordinal_here;
  const size_t nret = op.schema().returns().size();
  for (auto it = stack->end() - static_cast<std::ptrdiff_t>(nret); it != stack->end(); ++it) {
    if (it->isTensor()) {
      const auto& t = it->toTensor();
      cached.outputs.emplace_back(t.defined() ? t.detach() : t);
    } else if (it->isTensorList()) {
      std::vector<torch::Tensor> list;
      for (const auto& t : it->toTensorVector()) list.push_back(t.defined() ? t.detach() : t);
      cached.outputs.emplace_back(c10::List<torch::Tensor>(list));
    } else {
      cached.outputs.push_back(*it);
    }
    for_tensors(*it, [&](const torch::Tensor& t, int64_t) {
      if (t.defined() && t.has_storage()) {
        region->saved_storages_.insert_or_assign(t.storage().unsafeGetStorageImpl(),
                                                 std::make_pair(region->cached_.size(), cached.versions.size()));
      }
      cached.versions.push_back(t.defined() ? static_cast<int64_t>(t._version()) : 0);
      cached.requires_grad.push_back(t.defined() && t.requires_grad());
      cached.copied.push_back(false);
    });
  }
  for (auto& [index, t] : packs) {
    SavedSlot slot;
    slot.index = index;
    auto find_in = [&](const std::vector<c10::IValue>& values, SlotKind kind) {
      for (size_t p = 0; p < values.size() && slot.kind == SlotKind::Kept; ++p) {
        for_tensors(values[p], [&](const torch::Tensor& v, int64_t element) {
          if (slot.kind != SlotKind::Kept || !same_storage(v, t)) return;
          slot.kind = kind;
          slot.position = p;
          slot.element = element;
          slot.sizes = t.sizes().vec();
          slot.strides = t.strides().vec();
          slot.offset = t.storage_offset();
        });
      }
    };
    find_in(args, SlotKind::Arg);
    find_in(cached.outputs, SlotKind::Out);
    if (slot.kind == SlotKind::Kept) region->kept_.emplace(index, std::move(t));
    cached.slots.push_back(std::move(slot));
  }
  if (region->restore_rng_ && op.hasTag(at::Tag::nondeterministic_seeded)) cached.rng_after = get_states(region->gens_);
  region->cached_.push_back(std::move(cached));
}

void SelectiveRun::recompute(bool composite, const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                             torch::jit::Stack* stack) {
  const size_t ordinal_here = ordinal++;
  DepthGuard depth_guard(this);  // (as in first_run)
  auto& cached_ops = region->cached_;
  if (cursor >= cached_ops.size() || cached_ops[cursor].ordinal != ordinal_here) {
    return lower(composite, op, ks, stack);
  }
  CachedOp& cached = cached_ops[cursor++];
  TORCH_CHECK(cached.name == op.operator_name(), "checkpoint (selective): op #", ordinal_here,
              " of the region's recomputation is ", op_string(op.operator_name()), ", but the first run saved ",
              op_string(cached.name), " there. The region's ops depend on state that changed between forward and ",
              "backward; make them depend on the inputs only");
  const size_t nargs = op.schema().arguments().size();
  const auto args_begin = stack->end() - static_cast<std::ptrdiff_t>(nargs);
  for (const auto& slot : cached.slots) {
    if (slot.kind == SlotKind::Kept) {
      fill(slot.index, nullptr);
      continue;
    }
    torch::Tensor tmp;
    const c10::IValue& holder = slot.kind == SlotKind::Arg ? *(args_begin + static_cast<std::ptrdiff_t>(slot.position))
                                                           : cached.outputs[slot.position];
    const torch::Tensor* base = tensor_at(holder, slot.element, tmp);
    TORCH_CHECK(base && base->defined(), "checkpoint (selective): the recomputation of ", op_string(cached.name),
                " (op #", ordinal_here, ") lacks the tensor its first run saved from its ",
                slot.kind == SlotKind::Arg ? "argument " : "output ", slot.position,
                "; the region's ops depend on state that changed between forward and backward");
    torch::Tensor t = base->detach();
    if (t.sizes() != c10::IntArrayRef(slot.sizes) || t.strides() != c10::IntArrayRef(slot.strides) ||
        t.storage_offset() != slot.offset) {
      t = t.as_strided(slot.sizes, slot.strides, slot.offset);
    }
    fill(slot.index, &t);
  }
  stack->erase(args_begin, stack->end());
  size_t k = 0;
  for (const auto& out : cached.outputs) {
    auto serve = [&](const torch::Tensor& t) -> torch::Tensor {
      const size_t i = k++;
      if (!t.defined()) return t;
      TORCH_CHECK(region->contexts_.allow_cache_entry_mutation || static_cast<int64_t>(t._version()) == cached.versions[i],
                  "checkpoint (selective): the output of ", op_string(cached.name), " (op #", ordinal_here,
                  " of the region) that the first run saved was modified in place afterwards, so the backward ",
                  "would use the modified value. Fix: recompute this op (return PREFER_RECOMPUTE for it), or pass ",
                  "allow_cache_entry_mutation=true to create_selective_checkpoint_contexts if the change is harmless");
      // A copy taken before an in-place op: the recomputation applies that op again, to a copy of its own.
      auto served = cached.copied[i] ? t.clone() : t.detach();
      if (cached.requires_grad[i]) {
        // A non-leaf (a leaf would refuse the in-place ops the region may apply to it), from a node that never
        // runs: the recomputation's graph is not backpropagated.
        c10::intrusive_ptr<torch::autograd::Node> node = c10::make_intrusive<torch::autograd::Error>(
            "checkpoint (selective): the graph of a recomputation was backpropagated (internal error)",
            torch::autograd::edge_list{});
        node->add_input_metadata(served);
        torch::autograd::impl::set_gradient_edge(served, torch::autograd::Edge(std::move(node), uint32_t{0}));
      }
      return served;
    };
    if (out.isTensor()) {
      stack->emplace_back(serve(out.toTensor()));
    } else if (out.isTensorList()) {
      std::vector<torch::Tensor> list;
      for (const auto& t : out.toTensorVector()) list.push_back(serve(t));
      stack->emplace_back(c10::List<torch::Tensor>(list));
    } else {
      stack->push_back(out);
    }
  }
  if (!cached.rng_after.empty()) set_states(region->gens_, cached.rng_after);
}

SelectiveRegion::SelectiveRegion(SelectiveCheckpointContexts contexts, std::vector<at::Generator> gens,
                                 bool restore_rng, bool check)
    : contexts_(std::move(contexts)), gens_(std::move(gens)), restore_rng_(restore_rng), check_(check) {
  TORCH_CHECK(contexts_.policy, "checkpoint: context_fn returned a selective policy without a function");
}

SelectiveRegion::~SelectiveRegion() = default;

void SelectiveRegion::on_pack(size_t index, const torch::Tensor& t) {
  SelectiveRun* run = t_run;
  if (run && run->region == this && run->pending) run->pending->emplace_back(index, t);
}

const torch::Tensor* SelectiveRegion::kept(size_t index) const {
  auto it = kept_.find(index);
  return it == kept_.end() ? nullptr : &it->second;
}

SelectiveRegion::Scope::Scope(SelectiveRegion* region, Fill fill) : previous_(t_run) {
  if (region) {
    install_checkpoint_layer();
    run_ = std::make_unique<SelectiveRun>();
    run_->region = region;
    run_->fill = std::move(fill);
    include_.emplace(kInterceptKey);
  }
  t_run = run_.get();
}

SelectiveRegion::Scope::~Scope() { t_run = previous_; }

void SelectiveRegion::Scope::finish() const {
  if (!run_ || !run_->fill || !run_->region->check_) return;
  const auto& cached = run_->region->cached_;
  TORCH_CHECK(run_->cursor == cached.size(), "checkpoint (selective): the recomputation ran ", run_->ordinal,
              " ops and reached ", run_->cursor, " of the ", cached.size(), " ops the first run saved (the next: ",
              op_string(cached[run_->cursor].name), ", op #", cached[run_->cursor].ordinal, "). The region's ops ",
              "depend on state that changed between forward and backward; make them depend on the inputs only");
}

SuspendSelective::SuspendSelective() : previous_(t_run) { t_run = nullptr; }
SuspendSelective::~SuspendSelective() { t_run = previous_; }

}  // namespace detail

SelectiveCheckpointContexts create_selective_checkpoint_contexts(SelectiveCheckpointPolicyFn policy,
                                                                 bool allow_cache_entry_mutation) {
  TORCH_CHECK(policy, "create_selective_checkpoint_contexts: expected a policy function, got an empty one");
  return {std::move(policy), allow_cache_entry_mutation};
}

SelectiveCheckpointContexts create_selective_checkpoint_contexts(const std::vector<std::string>& ops_to_save,
                                                                 bool allow_cache_entry_mutation) {
  // Every entry must name a registered op (all overloads) or overload.
  std::set<std::string> known;
  for (const auto& name : c10::Dispatcher::singleton().getAllOpNames()) {
    known.insert(name.name);
    known.insert(detail::op_string(name));
  }
  for (const auto& entry : ops_to_save) {
    TORCH_CHECK(known.count(entry), "create_selective_checkpoint_contexts: no registered op is named '", entry,
                "'. Expected a name as the dispatcher spells it, with its namespace: 'aten::mm' (every overload) or ",
                "'aten::add.Tensor' (one overload)");
  }
  auto save = std::make_shared<const std::set<std::string>>(ops_to_save.begin(), ops_to_save.end());
  // (The overload's full name is built only when some entry names one overload: the policy runs for every op.)
  const bool overloads = std::any_of(ops_to_save.begin(), ops_to_save.end(),
                                     [](const std::string& e) { return e.find('.') != std::string::npos; });
  return create_selective_checkpoint_contexts(
      [save, overloads](const SelectiveCheckpointContext&, const c10::OperatorHandle& op, const std::vector<c10::IValue>&) {
        const auto& name = op.operator_name();
        return save->count(name.name) || (overloads && save->count(detail::op_string(name)))
                   ? CheckpointPolicy::MUST_SAVE
                   : CheckpointPolicy::PREFER_RECOMPUTE;
      },
      allow_cache_entry_mutation);
}

std::vector<std::string> default_selective_save_list() {
  std::vector<std::string> ops = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear",
                                  "aten::matmul", "aten::_scaled_dot_product_flash_attention",
                                  "aten::_scaled_dot_product_efficient_attention",
                                  "aten::_scaled_dot_product_cudnn_attention",
                                  "aten::_scaled_dot_product_flash_attention_for_cpu", "aten::max"};
  // The functional collectives are registered only where their library is loaded.
  for (const auto& name : c10::Dispatcher::singleton().getAllOpNames()) {
    if (name.name == "_c10d_functional::reduce_scatter_tensor") {
      ops.push_back(name.name);
      break;
    }
  }
  return ops;
}

}  // namespace fsdp
