// loss_parallel(): the RAII region in which cross_entropy on a ColwiseParallel head's output is the
// vocab-parallel loss (loss.h). The loss itself is vocab_parallel_cross_entropy (loss.cpp).
//
// [Note: loss_parallel guard]
// PyTorch's loss_parallel is a context manager that adds DTensor op handlers for aten.nll_loss_forward /
// _log_softmax (and their backwards): the logits are a DTensor with a Shard(-1) placement, so the op knows
// they are vocabulary-sharded. libfsdp's TP ops return the local tensor, which carries nothing, so:
// - Which tensors: the TP op (tp_ops.cpp, tp_handle_op) registers the output of every ColwiseParallel Linear
//   with output layout Shard(-1) (a plain colwise Linear, or the tied head of [Note: tied TP styles]) here:
//   its StorageImpl, held weakly ([Note: identity by address] in fsdp/fsdp_interception.cpp), the TP mesh and
//   the local vocabulary V_r. The storage, not the TensorImpl, because the loss is computed on a view
//   (logits.flatten(0, 1), .view({-1, V_r}), .reshape) which keeps the storage. A view that keeps the storage
//   but not the rows (a slice of the class dim, a transpose) would compute a wrong loss: the region throws for
//   it (last dim != V_r, class stride != 1, row stride != V_r). A copy (contiguous() of a non-contiguous slice,
//   .to(dtype)) has a new storage and is an ordinary tensor: cross_entropy on it is the local one, as PyTorch's
//   to_local() would give. Every colwise output is registered (q/k/v projections too: the op cannot tell a head
//   from them); an entry is a map insert, and dead entries are erased when the map doubles.
// - Seeing cross_entropy: aten::cross_entropy_loss is CompositeImplicitAutograd (it decomposes into
//   log_softmax + nll_loss at Autograd), and the logits carry no dispatch key of ours. As context parallelism
//   does for SDPA ([Note: context parallel interception] in tensor/experimental/context_parallel.cpp), the key
//   has a kernel of its own for cross_entropy_loss (utils/intercept.cpp, registered at load), and the region
//   puts kInterceptKey in the thread's included keys (restoring the previous state at its end, so regions nest
//   with each other and with a context_parallel region). The kernel asks the handler below first; the handler
//   declines outside a region (another region, CP's, may have included the key) and for any unregistered input,
//   and the op then goes to the layers as any other op: an unrelated cross_entropy is computed as without the
//   region.
// - Cost: outside a region none for any op (no key on activations; the registration is one map insert per
//   colwise Linear). Inside, every op of the thread goes once through the key's boxed fallback, as under CP.
// - The loss: vocab_parallel_cross_entropy with the cross_entropy's reduction, ignore_index and
//   label_smoothing; it is an autograd function, so backward reaches the head's weight and input through the
//   view. Class weights are refused (vocab_parallel_cross_entropy has none). Every check reads local shapes that
//   agree across ranks (the same view of every rank's head output), so every rank throws alike, before any
//   collective.
// - Checkpointing: a checkpointed function recomputed in backward sees the region as its forward did ([Note:
//   regions a recomputation re-enters] in utils/recompute_regions.h), whether backward runs inside the region
//   (PyTorch's usage), after it, or on another thread.
#include "tensor/parallel/loss_parallel.h"

#include <algorithm>
#include <iterator>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

#include <ATen/core/Reduction.h>
#include <c10/core/impl/LocalDispatchKeySet.h>

#include "fsdp/tensor/parallel/loss.h"
#include "utils/implicit_checkpoint.h"
#include "utils/intercept.h"
#include "utils/recompute_regions.h"

namespace fsdp::tp {
namespace detail {
namespace {

struct VocabEntry {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  DeviceMeshPtr mesh;
  int64_t local_vocab = 0;
};
struct VocabRegistry {
  std::mutex mu;
  std::unordered_map<const c10::StorageImpl*, VocabEntry> entries;
  size_t prune_at = 64;
};
VocabRegistry& vocab_registry() {
  static auto* r = new VocabRegistry();  // never destroyed: read by TP ops until the process ends
  return *r;
}

}  // namespace

void register_vocab_sharded_output(const torch::Tensor& out, const DeviceMeshPtr& tp_mesh, int64_t local_vocab) {
  if (!out.defined() || !out.has_storage()) return;
  auto* storage = out.storage().unsafeGetStorageImpl();
  auto& r = vocab_registry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (r.entries.size() >= r.prune_at) {
    for (auto it = r.entries.begin(); it != r.entries.end();) it = it->second.storage.expired() ? r.entries.erase(it) : std::next(it);
    r.prune_at = std::max<size_t>(64, 2 * r.entries.size());
  }
  r.entries.insert_or_assign(storage, VocabEntry{c10::weak_intrusive_ptr<c10::StorageImpl>(out.storage().getWeakStorageImpl()),
                                                 tp_mesh, local_vocab});
}

namespace {

// The entry of `t`'s storage if it is a live registered one.
std::optional<VocabEntry> find_vocab_sharded(const torch::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return std::nullopt;
  auto& r = vocab_registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.entries.find(t.storage().unsafeGetStorageImpl());
  if (it == r.entries.end() || it->second.storage.expired()) return std::nullopt;
  return it->second;
}

thread_local int tls_depth = 0;  // live loss_parallel regions on this thread

int64_t to_int(const c10::IValue& v) { return v.isInt() ? v.toInt() : v.toSymInt().guard_int(__FILE__, __LINE__); }

// aten::cross_entropy_loss(Tensor self, Tensor target, Tensor? weight, int reduction, SymInt ignore_index,
// float label_smoothing) on the intercept key ([Note: loss_parallel guard]).
bool loss_parallel_cross_entropy(const c10::OperatorHandle&, c10::DispatchKeySet, torch::jit::Stack* stack) {
  if (tls_depth == 0) return false;
  auto args = torch::jit::last(*stack, 6);
  const torch::Tensor x = args[0].toTensor();
  const auto entry = find_vocab_sharded(x);
  if (!entry) return false;
  const torch::Tensor target = args[1].toTensor();
  const auto weight = args[2].toOptional<torch::Tensor>();
  const int64_t reduction = args[3].toInt();
  const int64_t v_r = entry->local_vocab;
  const std::string where = "loss_parallel: cross_entropy on the vocabulary-sharded output of a ColwiseParallel head "
                            "(local logits of shape " + c10::str(x.sizes()) + ", strides " + c10::str(x.strides()) +
                            ", " + std::to_string(v_r) + " local classes on TP mesh " + entry->mesh->str() + ")";
  TORCH_CHECK(!weight || !weight->defined(), where, ": class weights are not supported (found a weight of shape ",
              weight->sizes(), "); call cross_entropy without weight, or gather the logits ",
              "(output_layouts(Replicate()) on the head) and call it outside the loss_parallel region");
  TORCH_CHECK(x.dim() == 1 || x.dim() == 2, where, ": expected [N, ", v_r, "] or [", v_r, "] logits (class dim last), ",
              "found ", x.dim(), " dims; flatten a [B, T, V_r] head output with logits.flatten(0, 1) and the target with "
              "view(-1)");
  const bool rows_kept = x.size(-1) == v_r && (v_r <= 1 || x.stride(-1) == 1) &&
                         (x.dim() == 1 || x.size(0) <= 1 || v_r == 0 || x.stride(0) == v_r);
  TORCH_CHECK(rows_kept, where, ": expected a view that keeps the head's rows, last dim ", v_r, " with strides [",
              v_r, ", 1]; found a view of another layout (a slice or transpose of the class dim?): flatten the head "
              "output with view/reshape/flatten so the class dim stays last and whole");
  LossParallelOptions options;
  options.reduction = reduction == at::Reduction::None ? "none" : reduction == at::Reduction::Sum ? "sum" : "mean";
  options.ignore_index = to_int(args[4]);
  options.label_smoothing = args[5].toDouble();
  auto loss = vocab_parallel_cross_entropy(x, target, entry->mesh, options);
  torch::jit::drop(*stack, 6);
  torch::jit::push(*stack, std::move(loss));
  return true;
}

// A checkpoint's recomputation sees this thread's region depth as its forward did ([Note: regions a recomputation
// re-enters]): cross_entropy inside a checkpointed function is recomputed as the loss it was.
class DepthReentry {
 public:
  explicit DepthReentry(int depth)
      : depth_before_(tls_depth), key_was_included_(c10::impl::tls_is_dispatch_key_included(fsdp::detail::kInterceptKey)) {
    tls_depth = depth;
    if (depth > 0) c10::impl::tls_set_dispatch_key_included(fsdp::detail::kInterceptKey, true);
  }
  ~DepthReentry() {
    tls_depth = depth_before_;
    c10::impl::tls_set_dispatch_key_included(fsdp::detail::kInterceptKey, key_was_included_);
  }
  DepthReentry(const DepthReentry&) = delete;
  DepthReentry& operator=(const DepthReentry&) = delete;

 private:
  int depth_before_;
  bool key_was_included_;
};

fsdp::detail::RegionReentry capture_depth() {
  const int depth = tls_depth;
  return [depth]() -> std::shared_ptr<void> { return std::make_shared<DepthReentry>(depth); };
}

const bool capture_registered = (fsdp::detail::register_region_capture(&capture_depth), true);

}  // namespace
}  // namespace detail

LossParallelGuard::LossParallelGuard() {
  fsdp::detail::install_cross_entropy_handler(&detail::loss_parallel_cross_entropy);
  // An implicit checkpoint region open on this thread (a checkpoint_wrapper'd module without a holder) captured
  // the thread's regions when it opened: it ends here, so that the loss is not recorded into it and replayed
  // without the guard ([Note: regions a recomputation re-enters]). The same at the guard's end.
  fsdp::detail::close_implicit_region();
  key_was_included_ = c10::impl::tls_is_dispatch_key_included(fsdp::detail::kInterceptKey);
  c10::impl::tls_set_dispatch_key_included(fsdp::detail::kInterceptKey, true);
  ++detail::tls_depth;
}

LossParallelGuard::~LossParallelGuard() {
  fsdp::detail::close_implicit_region();
  --detail::tls_depth;
  c10::impl::tls_set_dispatch_key_included(fsdp::detail::kInterceptKey, key_was_included_);
}

LossParallelGuard loss_parallel() { return LossParallelGuard(); }

}  // namespace fsdp::tp
