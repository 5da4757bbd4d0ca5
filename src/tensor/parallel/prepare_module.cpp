// PrepareModuleInput / PrepareModuleOutput / PrepareModuleInputOutput and user-defined styles: the styles that
// act at a module's call boundary (fsdp/tensor/parallel/style.h).
//
// [Note: module boundaries]
// PyTorch's PrepareModuleInput registers a forward pre-hook; LibTorch modules have none, and a parent calls a
// child's forward statically (`attn(x)` on a TORCH_MODULE holder is `attn->forward(x)`). The library owns a call
// boundary in two places only, and these are the boundaries the styles use:
//  1. fsdp::FSDPModule<T> holders: FSDPModule<T>::forward runs the module through
//     tp::detail::call_with_boundary (include/fsdp/tensor/parallel/detail/module_boundary.h), inside FSDP's own
//     pre/post-forward. It works without fully_shard (the holder then calls the module straight).
//  2. torch::nn::Sequential entries: the Sequential calls its AnyModule entries; parallelize_module replaces the
//     entry (not the registered child: names, parameters and state dicts are unchanged) by a BoundaryEntry that
//     runs the hooks around the original entry. One tensor in, one tensor out.
// Every other module is refused at parallelize_module (validation, before anything changes, from the model's
// structure alone: the same error on every rank) naming its FQN and the two fixes. The interception of the ops
// on a module's parameters (how ColwiseParallel works) is no boundary for these styles: the module's input also
// feeds ops that involve no parameter (a block's residual add `x + attn(ln_1(x))`), so redistributing the input
// of the first parameter op would leave those ops with the old layout and be silently wrong.
// A module with a live FSDPModule holder that the model then calls around the holder (`block->forward(x)`) runs
// without its hooks. libfsdp cannot see that call itself, but it sees the ops that run a tensor-parallel Linear or
// Embedding: each parameter of a module with hooks is recorded (unless the model also holds it outside the module,
// a tied weight), the boundary counts the calls open on its thread (run_pre_hooks opens, run_post_hooks closes),
// and such an op on a recorded weight while no call of its module is open throws naming the module and the
// parameter (check_boundary_use). Not checked: a module without a ColwiseParallel/RowwiseParallel weight inside
// (other ops on parameters, e.g. an optimizer step or a norm's `* weight`, also run outside forwards); a forward
// that threw leaves its call counted open (that only hides a later bypass, it never raises).
//
// The hooks are a registry Module* -> hooks (held weakly by module), read by call_with_boundary; the moves
// between layouts are autograd functions over the TP group (below), with the gradients PyTorch's differentiable
// DTensor.redistribute gives.
#include "tensor/parallel/prepare_module.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <sstream>
#include <unordered_map>

#include <torch/autograd.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>

#include "fsdp/c10d/collectives.h"
#include "fsdp/tensor/parallel/detail/module_boundary.h"
#include "fsdp/tensor/parallel/style.h"
#include "utils/intercept.h"

namespace fsdp::tp {

namespace detail {

struct BoundaryHooks {
  std::string fqn;  // for messages
  const torch::nn::Module* module = nullptr;
  std::vector<BoundaryHook> pre, post;
};

std::atomic<bool> any_boundary_hooks{false};

namespace {

struct HookEntry {
  std::weak_ptr<torch::nn::Module> module;
  std::shared_ptr<BoundaryHooks> hooks;
};
struct HookRegistry {
  std::mutex mu;
  std::unordered_map<const torch::nn::Module*, HookEntry> entries;
};
HookRegistry& hook_registry() {
  static auto* r = new HookRegistry();  // never destroyed: read by forwards until the process ends
  return *r;
}

std::atomic<HolderQuery> holder_query{nullptr};
thread_local std::shared_ptr<torch::nn::Module> parallelize_root;

// The calls of modules with hooks open on this thread (module -> depth).
thread_local std::unordered_map<const torch::nn::Module*, int> open_calls;

// Parameter -> the modules with hooks that hold it (with the parameter's name in the model), for check_boundary_use.
struct ParamOwner {
  c10::weak_intrusive_ptr<c10::TensorImpl> param;
  std::weak_ptr<torch::nn::Module> module;
  std::string module_fqn, param_fqn;
};
std::mutex owners_mu;
std::unordered_multimap<const c10::TensorImpl*, ParamOwner>& param_owners() {
  static auto* m = new std::unordered_multimap<const c10::TensorImpl*, ParamOwner>();
  return *m;
}

std::vector<torch::Tensor> run_hooks(const std::vector<BoundaryHook>& hooks, std::vector<torch::Tensor> v,
                                     const std::string& fqn, const char* what) {
  for (const auto& hook : hooks) {
    auto r = hook(v);
    TORCH_CHECK(r.size() == v.size(), "parallelize_module: a forward ", what, " hook of '", fqn, "' returned ",
                r.size(), " tensors for ", v.size(), " ", what == std::string("pre") ? "arguments" : "outputs",
                "; return one per argument (an undefined tensor keeps the original)");
    for (size_t i = 0; i < v.size(); ++i)
      if (r[i].defined()) v[i] = std::move(r[i]);
  }
  return v;
}

}  // namespace

std::shared_ptr<const BoundaryHooks> boundary_hooks(const torch::nn::Module& module) {
  auto& r = hook_registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.entries.find(&module);
  if (it == r.entries.end()) return nullptr;
  auto m = it->second.module.lock();
  if (!m || m.get() != &module) return nullptr;  // a new module at a freed one's address has no hooks
  return it->second.hooks;
}

std::vector<torch::Tensor> run_pre_hooks(const BoundaryHooks& hooks, std::vector<torch::Tensor> inputs) {
  auto out = run_hooks(hooks.pre, std::move(inputs), hooks.fqn, "pre");
  ++open_calls[hooks.module];  // after the hooks: a hook that threw opened nothing
  return out;
}
std::vector<torch::Tensor> run_post_hooks(const BoundaryHooks& hooks, std::vector<torch::Tensor> outputs) {
  auto it = open_calls.find(hooks.module);
  if (it != open_calls.end() && --it->second == 0) open_calls.erase(it);
  return run_hooks(hooks.post, std::move(outputs), hooks.fqn, "post");
}

void check_boundary_use(const torch::Tensor& param) {
  if (!any_boundary_hooks.load(std::memory_order_relaxed) || !param.defined()) return;
  std::lock_guard<std::mutex> lock(owners_mu);
  auto range = param_owners().equal_range(param.unsafeGetTensorImpl());
  for (auto it = range.first; it != range.second; ++it) {
    const auto& o = it->second;
    auto m = o.module.lock();
    if (!m || o.param.expired()) continue;
    TORCH_CHECK(open_calls.count(m.get()), "parallelize_module: '", o.module_fqn, "' has boundary styles ",
                "(PrepareModuleInput/Output or forward hooks), but its parameter '", o.param_fqn,
                "' was used in a forward outside a call through its boundary: the module was called around its ",
                "fsdp::FSDPModule holder or torch::nn::Sequential (e.g. `block->forward(x)` or ",
                "`list[i]->as<Block>()->forward(x)`), so its inputs and outputs were not redistributed. Fix: call it ",
                "through the holder (`block(x)`) or the Sequential; see [Note: module boundaries]");
  }
}

void set_holder_query(HolderQuery q) { holder_query.store(q); }

ParallelizeContext::ParallelizeContext(std::shared_ptr<torch::nn::Module> root) : previous_(parallelize_root) {
  if (!parallelize_root) parallelize_root = std::move(root);
}
ParallelizeContext::~ParallelizeContext() { parallelize_root = std::move(previous_); }

}  // namespace detail

namespace {

using detail::BoundaryHooks;

// ---- The Sequential boundary ------------------------------------------------------------------------------------

// Access to Sequential's entries (private `modules_`, which its forward calls) through an explicit instantiation,
// which the language exempts from access checking: the only way to wrap an entry without re-registering the child.
struct SequentialModules {
  using type = std::vector<torch::nn::AnyModule> torch::nn::SequentialImpl::*;
  friend type sequential_modules(SequentialModules);
};
template <typename Tag, typename Tag::type Member>
struct ExposeMember {
  friend typename Tag::type sequential_modules(Tag) { return Member; }
};
template struct ExposeMember<SequentialModules, &torch::nn::SequentialImpl::modules_>;

// A Sequential entry that runs the boundary hooks of `inner`'s module around it.
struct BoundaryEntryImpl : torch::nn::Module {
  explicit BoundaryEntryImpl(torch::nn::AnyModule inner) : torch::nn::Module("BoundaryEntry"), inner(std::move(inner)) {}
  torch::Tensor forward(torch::Tensor x) {
    return detail::call_with_boundary(
        *inner.ptr(), [this](const torch::Tensor& t) { return inner.forward<torch::Tensor>(t); }, x);
  }
  torch::nn::AnyModule inner;
};

// The Sequential of `root` that has `module` as an entry, and the entry's index; {nullptr, 0} if none.
std::pair<torch::nn::SequentialImpl*, size_t> find_sequential_entry(const std::shared_ptr<torch::nn::Module>& root,
                                                                    const torch::nn::Module* module) {
  if (!root) return {nullptr, 0};
  for (const auto& m : root->modules(/*include_self=*/true)) {
    auto* seq = dynamic_cast<torch::nn::SequentialImpl*>(m.get());
    if (!seq) continue;
    auto& entries = seq->*sequential_modules(SequentialModules{});
    for (size_t i = 0; i < entries.size(); ++i) {
      auto p = entries[i].ptr();
      if (p.get() == module) return {seq, i};
      if (auto* b = dynamic_cast<BoundaryEntryImpl*>(p.get()); b && b->inner.ptr().get() == module) return {seq, i};
    }
  }
  return {nullptr, 0};
}

std::string fqn_in_root(const std::shared_ptr<torch::nn::Module>& root, const torch::nn::Module* module) {
  if (!root) return "?";
  for (const auto& item : root->named_modules("", /*include_self=*/true))
    if (item.value().get() == module) return item.key();
  return "?";
}

// Throws unless `module` (of the model being parallelised) has a boundary: a Sequential entry or a holder.
void check_boundary(const std::string& what, const std::string& fqn, const torch::nn::Module& module) {
  const auto& root = detail::parallelize_root;
  if (find_sequential_entry(root, &module).first) return;
  const auto q = detail::holder_query.load();
  if (q && q(module)) return;
  TORCH_CHECK(false, what, " on '", fqn, "' (a ", module.name(),
              "): this module has no call boundary where its inputs or outputs could be redistributed: LibTorch has no "
              "forward hooks, and it is called neither through an fsdp::FSDPModule holder nor as an entry of a "
              "torch::nn::Sequential (a ModuleList/ModuleDict entry or a TORCH_MODULE member is called directly). "
              "Redistributing at its first parameter op instead would be silently wrong (its input also feeds ops on "
              "no parameter, e.g. a residual add). Fix: declare it as fsdp::FSDPModule<", module.name(),
              "> where its parent declares it and call it through that holder (no fully_shard needed), or call it "
              "inside a torch::nn::Sequential; see [Note: module boundaries]");
}

void add_hook(const std::shared_ptr<torch::nn::Module>& module, BoundaryHook hook, bool pre) {
  TORCH_CHECK(module, "register_forward_", pre ? "pre_" : "", "hook: expected a module, got null");
  TORCH_CHECK(detail::parallelize_root, "register_forward_", pre ? "pre_" : "",
              "hook: only inside parallelize_module (a UserParallelStyle's _apply), which knows the model and so "
              "where the module is called from");
  const std::string fqn = fqn_in_root(detail::parallelize_root, module.get());
  check_boundary(pre ? "register_forward_pre_hook" : "register_forward_hook", fqn, *module);
  // The Sequential boundary: wrap the entry once.
  auto [seq, index] = find_sequential_entry(detail::parallelize_root, module.get());
  if (seq) {
    auto& entries = seq->*sequential_modules(SequentialModules{});
    if (!dynamic_cast<BoundaryEntryImpl*>(entries[index].ptr().get())) {
      entries[index] = torch::nn::AnyModule(std::make_shared<BoundaryEntryImpl>(entries[index]));
    }
  }
  auto& r = detail::hook_registry();
  std::lock_guard<std::mutex> lock(r.mu);
  for (auto it = r.entries.begin(); it != r.entries.end();)
    it = it->second.module.expired() ? r.entries.erase(it) : std::next(it);
  auto& e = r.entries[module.get()];
  if (e.module.lock() != module) {
    e = detail::HookEntry{module, std::make_shared<BoundaryHooks>()};
    // Record the module's parameters for check_boundary_use (once per module).
    std::lock_guard<std::mutex> owners_lock(detail::owners_mu);
    auto& owners = detail::param_owners();
    for (auto it = owners.begin(); it != owners.end();)
      it = it->second.param.expired() || it->second.module.expired() ? owners.erase(it) : std::next(it);
    // A parameter the model also holds outside the module (a tied weight) may be used outside its calls: not
    // recorded.
    std::unordered_map<const c10::TensorImpl*, bool> only_inside;
    const std::string prefix = fqn.empty() ? "" : fqn + ".";
    for (const auto& item : detail::parallelize_root->named_parameters(/*recurse=*/true)) {
      const bool inside = item.key().compare(0, prefix.size(), prefix) == 0;
      auto [it, fresh] = only_inside.emplace(item.value().unsafeGetTensorImpl(), inside);
      if (!fresh) it->second = it->second && inside;
    }
    for (const auto& item : module->named_parameters(/*recurse=*/true)) {
      const auto& p = item.value();
      if (!only_inside[p.unsafeGetTensorImpl()]) continue;
      owners.emplace(p.unsafeGetTensorImpl(),
                     detail::ParamOwner{c10::weak_intrusive_ptr<c10::TensorImpl>(p.getIntrusivePtr()), module, fqn,
                                        fqn.empty() ? item.key() : fqn + "." + item.key()});
    }
  }
  e.hooks->fqn = fqn;
  e.hooks->module = module.get();
  (pre ? e.hooks->pre : e.hooks->post).push_back(std::move(hook));
  detail::any_boundary_hooks = true;
}

// ---- The moves between layouts (1-D mesh) ------------------------------------------------------------------------

// Meshes used by a move stay alive for the process (few): the autograd nodes hold their group as a raw pointer.
int64_t keep_group(const DeviceMeshPtr& mesh) {
  static std::mutex mu;
  static auto* meshes = new std::vector<DeviceMeshPtr>();
  std::lock_guard<std::mutex> lock(mu);
  if (std::find(meshes->begin(), meshes->end(), mesh) == meshes->end()) meshes->push_back(mesh);
  return reinterpret_cast<int64_t>(mesh->get_group(0).get());
}
ProcessGroup& pg_of(int64_t g) { return *reinterpret_cast<ProcessGroup*>(g); }

// All-gather along `dim` of chunks whose sizes along `dim` are `sizes` (rank order; uneven and empty allowed):
// padded to the largest for the collective, trimmed after.
torch::Tensor gather_chunks(const torch::Tensor& x, int64_t dim, const std::vector<int64_t>& sizes, ProcessGroup& pg) {
  const int64_t c = *std::max_element(sizes.begin(), sizes.end());
  auto front = x.movedim(dim, 0);
  if (front.size(0) < c) {
    auto shape = front.sizes().vec();
    shape[0] = c - front.size(0);
    front = torch::cat({front, torch::zeros(shape, front.options())}, 0);
  }
  front = front.contiguous();
  auto shape = front.sizes().vec();
  shape[0] = c * pg.size();
  auto out = torch::empty(shape, front.options());
  all_gather_into_tensor(out, front, pg);
  std::vector<torch::Tensor> pieces;
  for (size_t r = 0; r < sizes.size(); ++r) pieces.push_back(out.narrow(0, static_cast<int64_t>(r) * c, sizes[r]));
  return torch::cat(pieces, 0).movedim(0, dim).contiguous();
}

std::vector<int64_t> chunk_sizes(int64_t n, int64_t k) {
  std::vector<int64_t> s;
  for (int64_t r = 0; r < k; ++r) s.push_back(chunk_range(n, k, r).length);
  return s;
}

// Replicate -> Shard(dim): this rank's torch.chunk; backward all-gathers the gradient (every rank's full gradient).
struct ChunkFn : torch::autograd::Function<ChunkFn> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, int64_t g, int64_t dim) {
    auto& pg = pg_of(g);
    ctx->saved_data["g"] = g;
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["n"] = x.size(dim);
    const auto range = chunk_range(x.size(dim), pg.size(), pg.rank());
    // A tensor of its own, never a view of x (the caller may modify it in place).
    return x.narrow(dim, range.offset, range.length).clone(at::MemoryFormat::Contiguous);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto& pg = pg_of(ctx->saved_data["g"].toInt());
    const int64_t dim = ctx->saved_data["dim"].toInt();
    auto sizes = chunk_sizes(ctx->saved_data["n"].toInt(), pg.size());
    return {gather_chunks(grads[0], dim, sizes, pg), torch::Tensor(), torch::Tensor()};
  }
};

// Shard(dim) -> Replicate: all-gather (chunk sizes exchanged first, so uneven chunks are exact); backward keeps
// this rank's rows of the gradient.
struct GatherFn : torch::autograd::Function<GatherFn> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, int64_t g, int64_t dim) {
    auto& pg = pg_of(g);
    auto mine = torch::full({1}, x.size(dim), x.options().dtype(torch::kLong));
    auto all = torch::empty({pg.size()}, mine.options());
    all_gather_into_tensor(all, mine, pg);
    auto cpu = all.cpu();
    std::vector<int64_t> sizes(cpu.data_ptr<int64_t>(), cpu.data_ptr<int64_t>() + pg.size());
    int64_t offset = 0;
    for (int r = 0; r < pg.rank(); ++r) offset += sizes[r];
    ctx->saved_data["dim"] = dim;
    ctx->saved_data["offset"] = offset;
    ctx->saved_data["len"] = x.size(dim);
    return gather_chunks(x, dim, sizes, pg);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {grads[0].narrow(ctx->saved_data["dim"].toInt(), ctx->saved_data["offset"].toInt(),
                            ctx->saved_data["len"].toInt()).contiguous(),
            torch::Tensor(), torch::Tensor()};
  }
};

// Partial -> Replicate: all-reduce (sum); backward identity (each summand's gradient is the sum's).
struct AllReduceFn : torch::autograd::Function<AllReduceFn> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, const torch::Tensor& x, int64_t g) {
    auto y = x.contiguous().clone();
    all_reduce(y, pg_of(g), ReduceOp::SUM);
    return y;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list grads) {
    return {grads[0], torch::Tensor()};
  }
};

// Checks a move (from a rank-identical description) and names what is wrong.
void check_move(const std::string& what, const Placement& from, const Placement& to) {
  TORCH_CHECK(!to.is_partial() || from.is_partial(), what, ": a move from ", from.str(), " to ", to.str(),
              " is not supported (nothing produces a Partial input); use Replicate() or Shard(d)");
}

int64_t norm_dim(const std::string& what, const Placement& p, const torch::Tensor& x) {
  const int64_t d = p.dim < 0 ? p.dim + x.dim() : p.dim;
  TORCH_CHECK(d >= 0 && d < x.dim(), what, ": ", p.str(), " names a dim that a tensor of shape ", x.sizes(),
              " does not have");
  return d;
}

torch::Tensor move_layout(const std::string& what, const torch::Tensor& x, const DeviceMeshPtr& mesh, const Placement& from,
                   const Placement& to) {
  check_move(what, from, to);
  if (from == to) return x;
  const int64_t g = keep_group(mesh);
  fsdp::detail::NoInterception no_interception;
  torch::Tensor y = x;
  if (from.is_partial()) {
    y = AllReduceFn::apply(y, g);
  } else if (from.is_shard()) {
    y = GatherFn::apply(y, g, norm_dim(what, from, y));
  }
  if (to.is_shard()) y = ChunkFn::apply(y, g, norm_dim(what, to, y));
  return y;
}

std::string layouts_str(const Layouts& l) {
  std::ostringstream os;
  os << "(";
  for (const auto& p : l) os << (p ? p->str() : "None") << ",";
  os << ")";
  return os.str();
}

// The hook of one direction: moves each argument (or output) i from `from[i]` to `to[i]`.
BoundaryHook layout_hook(const std::string& what, const Layouts& from, const Layouts& to, const DeviceMeshPtr& mesh) {
  return [what, from, to, mesh](const std::vector<torch::Tensor>& v) {
    TORCH_CHECK(v.size() == from.size(), what, ": expected ", from.size(), " ",
                what.find("Input") != std::string::npos ? "arguments" : "outputs", " (one per layout entry of ",
                layouts_str(from), "), got ", v.size(), "; give one entry per ",
                what.find("Input") != std::string::npos ? "forward argument (std::nullopt for a non-tensor one)"
                                                        : "output tensor");
    std::vector<torch::Tensor> out(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
      if (!from[i]) continue;
      TORCH_CHECK(v[i].defined(), what, ": entry ", i, " has layout ", from[i]->str(),
                  " but is not a (defined) tensor; use std::nullopt for it");
      out[i] = move_layout(what, v[i], mesh, *from[i], *to[i]);
    }
    return out;
  };
}

void validate_layouts(const std::string& what, const Layouts& from, const Layouts& to, const char* from_name,
                      const char* to_name) {
  TORCH_CHECK(from.size() == to.size(), what, ": ", from_name, " ", layouts_str(from), " and ", to_name, " ",
              layouts_str(to), " have different lengths; give one entry per argument in both");
  for (size_t i = 0; i < from.size(); ++i) {
    TORCH_CHECK(from[i].has_value() == to[i].has_value(), what, ": entry ", i, " is ",
                from[i] ? from[i]->str() : "None", " in ", from_name, " but ", to[i] ? to[i]->str() : "None", " in ",
                to_name, "; both must be a placement or both std::nullopt");
    if (from[i]) check_move(what + " (entry " + std::to_string(i) + ")", *from[i], *to[i]);
  }
}

// PrepareModuleInput/Output/InputOutput as one user style.
class PrepareStyle : public UserParallelStyle {
 public:
  PrepareStyle(std::optional<PrepareModuleInput> in, std::optional<PrepareModuleOutput> out)
      : in_(std::move(in)), out_(std::move(out)) {}

  std::string str() const override {
    std::ostringstream os;
    if (in_ && out_) os << "PrepareModuleInputOutput(";
    else os << (in_ ? "PrepareModuleInput(" : "PrepareModuleOutput(");
    if (in_) os << "input_layouts=" << layouts_str(in_->input_layouts_) << ", desired_input_layouts="
                << layouts_str(in_->desired_input_layouts_) << (out_ ? ", " : "");
    if (out_) os << "output_layouts=" << layouts_str(out_->output_layouts_) << ", desired_output_layouts="
                 << layouts_str(out_->desired_output_layouts_);
    os << ")";
    return os.str();
  }

  void validate(const std::string& fqn, const std::shared_ptr<torch::nn::Module>& module,
                const DeviceMeshPtr& mesh) const override {
    const std::string what = "parallelize_module: " + str() + " on '" + fqn + "'";
    if (in_) validate_layouts(what, in_->input_layouts_, in_->desired_input_layouts_, "input_layouts",
                              "desired_input_layouts");
    if (out_) validate_layouts(what, out_->output_layouts_, out_->desired_output_layouts_, "output_layouts",
                               "desired_output_layouts");
    check_boundary("parallelize_module: " + str(), fqn, *module);
  }

  void _apply(const std::shared_ptr<torch::nn::Module>& module, const DeviceMeshPtr& mesh) const override {
    const std::string fqn = fqn_in_root(detail::parallelize_root, module.get());
    if (in_) {
      add_hook(module, layout_hook("PrepareModuleInput on '" + fqn + "'", in_->input_layouts_,
                                   in_->desired_input_layouts_, mesh), /*pre=*/true);
    }
    if (out_) {
      add_hook(module, layout_hook("PrepareModuleOutput on '" + fqn + "'", out_->output_layouts_,
                                   out_->desired_output_layouts_, mesh), /*pre=*/false);
    }
  }

 private:
  std::optional<PrepareModuleInput> in_;
  std::optional<PrepareModuleOutput> out_;
};

ParallelStyle custom_entry(std::shared_ptr<const UserParallelStyle> s) {
  ParallelStyle style;
  style.kind = ParallelStyle::Kind::CUSTOM;
  style.custom = std::move(s);
  return style;
}

}  // namespace

ParallelStyle user_style(std::shared_ptr<const UserParallelStyle> style) {
  TORCH_CHECK(style, "user_style: expected a UserParallelStyle, got null");
  return custom_entry(std::move(style));
}

PrepareModuleInput::operator ParallelStyle() const {
  return custom_entry(std::make_shared<PrepareStyle>(*this, std::nullopt));
}
PrepareModuleOutput::operator ParallelStyle() const {
  return custom_entry(std::make_shared<PrepareStyle>(std::nullopt, *this));
}
PrepareModuleInputOutput::operator ParallelStyle() const {
  return custom_entry(std::make_shared<PrepareStyle>(in, out));
}

void register_forward_pre_hook(const std::shared_ptr<torch::nn::Module>& module, BoundaryHook hook) {
  add_hook(module, std::move(hook), /*pre=*/true);
}
void register_forward_hook(const std::shared_ptr<torch::nn::Module>& module, BoundaryHook hook) {
  add_hook(module, std::move(hook), /*pre=*/false);
}

torch::Tensor redistribute_local(const torch::Tensor& x, const DeviceMeshPtr& mesh, const Placement& from,
                                 const Placement& to) {
  TORCH_CHECK(mesh && mesh->ndim() == 1, "redistribute_local: expected a 1-D mesh (e.g. mesh[\"tp\"]), got ",
              mesh ? mesh->str() : std::string("null"));
  return move_layout("redistribute_local", x, mesh, from, to);
}

}  // namespace fsdp::tp
