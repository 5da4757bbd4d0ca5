// parallelize_module: matches the plan's FQN patterns, validates everything, then shards the planned
// weights in place and registers them for the op side (tp_ops.cpp). See docs/TENSOR_PARALLEL.md.
#include "fsdp/tensor/parallel/tensor_parallel.h"

#include <atomic>
#include <sstream>

#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/modules/linear.h>

#include "fsdp/tensor/parallel/style.h"
#include "utils/intercept.h"
#include "tensor/parallel/prepare_module.h"
#include "tensor/parallel/tp_ops.h"

namespace fsdp::tp {

std::string ParallelStyle::str() const {
  std::ostringstream os;
  if (kind == Kind::CUSTOM) return custom ? custom->str() : "UserParallelStyle(null)";
  if (kind == Kind::SEQUENCE) {
    os << "SequenceParallel(sequence_dim=" << input_layout.dim << ")";
    return os.str();
  }
  os << (kind == Kind::COLWISE ? "ColwiseParallel" : "RowwiseParallel") << "(input_layouts=" << input_layout.str()
     << ", output_layouts=" << output_layout.str() << ")";
  return os.str();
}

namespace {

// fnmatch of one path segment: '*' any run of characters, '?' one character.
bool glob(const char* p, const char* s) {
  if (*p == '\0') return *s == '\0';
  if (*p == '*') return glob(p + 1, s) || (*s != '\0' && glob(p, s + 1));
  return *s != '\0' && (*p == '?' || *p == *s) && glob(p + 1, s + 1);
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  if (s.empty()) return out;
  std::string cur;
  for (char c : s) {
    if (c == '.') {
      out.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  out.push_back(cur);
  return out;
}

bool fqn_matches(const std::string& pattern, const std::string& fqn) {
  auto p = split(pattern), f = split(fqn);
  if (p.size() != f.size()) return false;
  for (size_t i = 0; i < p.size(); ++i)
    if (!glob(p[i].c_str(), f[i].c_str())) return false;
  return true;
}

using tp::detail::style_name;

std::string in_quotes(const std::string& fqn) { return "'" + fqn + "'"; }

// One module to parallelise, with everything apply_work() needs, computed during validation.
struct Work {
  std::string fqn;
  std::shared_ptr<torch::nn::Module> module;
  bool is_embedding = false;
  bool is_norm = false;         // SequenceParallel on a LayerNorm (replicated weight and bias)
  torch::Tensor partial_bias;   // a rowwise Linear's bias under a Shard(d) output (replicated, partial grad)
  ParallelStyle style;
  torch::Tensor weight, bias;   // bias undefined when absent or not sharded
  int64_t weight_dim = 0;       // the weight dim that is sharded
  bool tied_head = false;       // a second (Linear) use of a RowwiseParallel Embedding's weight: [Note: tied TP styles]
};

// [Note: tied TP styles]
// The TP registry holds one record per parameter, and a record has one style. A tied head (GPT-2's lm_head,
// whose weight is wte.weight) uses one parameter in two modules: the Embedding looks rows up (RowwiseParallel:
// Shard(0), vocabulary rows) and the head multiplies by it through F::linear (ColwiseParallel: Shard(0), the
// output features, i.e. the same vocabulary rows). The two shardings agree, so one shard serves both: the
// record keeps the Embedding's style and adds the head's (TPParam::tied_linear_style); the op side runs
// aten::embedding with the first and linear/matmul/addmm on the weight's transpose with the second. Its
// gradient is the sum of both uses' gradients of the same rows, as one process's. Only this pairing is
// accepted (an Embedding ColwiseParallel would shard dim 1, a Linear RowwiseParallel dim 1 too, but nothing
// needs it yet): the head is any module whose only parameter is that weight and which uses it through
// F::linear (a custom module such as train_gpt's LMHead; not a torch::nn::Linear, whose weight is its own),
// planned ColwiseParallel with a Replicate() input, in the same plan as the Embedding or a later one. Its Shard(-1) output (the default) is the vocabulary-sharded
// logits that vocab_parallel_cross_entropy takes (loss.h).
Work validate_tied_head(const std::string& fqn, const std::shared_ptr<torch::nn::Module>& m, const ParallelStyle& style,
                        const std::vector<Work>& planned) {
  const std::string what = std::string(style_name(style)) + " on " + in_quotes(fqn);
  auto params = m->named_parameters(/*recurse=*/false);
  Work w;
  w.fqn = fqn;
  w.module = m;
  w.style = style;
  w.tied_head = true;
  w.weight = params.contains("weight") ? params["weight"] : torch::Tensor();
  TORCH_CHECK(params.size() == 1 && w.weight.defined() && w.weight.dim() == 2 && m->children().empty(),
              "parallelize_module: ", what, " (a ", m->name(), "): expected a torch::nn::Linear or torch::nn::Embedding, "
              "or a head whose only parameter, 'weight', is the weight of an Embedding planned RowwiseParallel (a tied "
              "head); plan the Linear/Embedding modules inside it instead (e.g. ", in_quotes(fqn.empty() ? "*" : fqn + ".*"),
              ")");
  bool tied = false;
  for (const auto& o : planned) {
    tied = tied || (o.is_embedding && !o.tied_head && o.weight.unsafeGetTensorImpl() == w.weight.unsafeGetTensorImpl() &&
                    o.style.kind == ParallelStyle::Kind::ROWWISE);
  }
  const auto* rec = tp::detail::find_tp_param(w.weight);
  tied = tied || (rec && rec->is_embedding && rec->style.kind == ParallelStyle::Kind::ROWWISE && !rec->tied_linear_style);
  TORCH_CHECK(tied, "parallelize_module: ", what, " (a ", m->name(), "): its weight ", c10::str(w.weight.sizes()),
              " is not the weight of an Embedding planned RowwiseParallel, so it is not a tied head; expected a "
              "torch::nn::Linear or torch::nn::Embedding (or plan the tied Embedding RowwiseParallel in the same plan)");
  TORCH_CHECK(style.kind == ParallelStyle::Kind::COLWISE && style.input_layout.is_replicate() &&
                  (style.output_layout.is_replicate() || (style.output_layout.is_shard() && style.output_layout.dim == -1)),
              "parallelize_module: ", what, ": a tied head (its weight is a RowwiseParallel Embedding's, sharded on the "
              "vocabulary rows) must be ColwiseParallel with input_layouts Replicate() and output_layouts Shard(-1) or "
              "Replicate(), which shard the same rows; got ", style.str());
  return w;
}

// fully_shard first, then parallelize_module: FSDP's shards are rows of the whole tensor, not of this
// rank's TP part, so the two cannot compose in this order. Refused before anything changes, naming the
// parameter and the order that works (also for a deferred model, issue 28 item 2).
void check_not_fully_sharded(const torch::Tensor& t, const std::string& what, const std::string& name) {
  const auto sharded = detail::fully_sharded_query.load();
  TORCH_CHECK(!t.defined() || !sharded || !sharded(t), "parallelize_module: ", what, ": parameter ",
              in_quotes(name), " is already sharded by fully_shard. Fix: apply tensor parallelism first: ",
              "parallelize_module(model, mesh[\"tp\"], plan), then fully_shard(module, FullyShardOptions().mesh(",
              "mesh[\"dp\"])); for a deferred model: deferred_init, parallelize_module, fully_shard, materialize_module");
}

// SequenceParallel: LayerNorm (its affine parameters become replicated TP parameters) or Dropout.
Work validate_sequence(const std::string& fqn, const std::shared_ptr<torch::nn::Module>& m, const ParallelStyle& style) {
  const std::string what = std::string(style_name(style)) + " on " + in_quotes(fqn);
  Work w;
  w.fqn = fqn;
  w.module = m;
  w.style = style;
  TORCH_CHECK(style.input_layout.is_shard() && style.input_layout.dim >= 0, "parallelize_module: ", what,
              ": expected a sequence_dim >= 0, got ", style.input_layout.str());
  if (auto* ln = dynamic_cast<torch::nn::LayerNormImpl*>(m.get())) {
    w.is_norm = true;
    w.weight = ln->weight;
    w.bias = ln->bias;
    check_not_fully_sharded(w.weight, what, fqn.empty() ? "weight" : fqn + ".weight");
    check_not_fully_sharded(w.bias, what, fqn.empty() ? "bias" : fqn + ".bias");
    TORCH_CHECK(!(w.weight.defined() && tp::detail::find_tp_param(w.weight)), "parallelize_module: ", in_quotes(fqn),
                " is already parallelised; plan each module once");
  } else if (!dynamic_cast<torch::nn::DropoutImpl*>(m.get())) {
    // [Note: SequenceParallel on a user's norm]
    // LibTorch 2.13 has no torch::nn::RMSNorm, so a Llama-style model brings its own norm module. Accepted: a
    // module without submodules whose parameters are a 1-D `weight` and optionally a 1-D `bias`. They become
    // replicated TP parameters marked partial_grad, exactly as a LayerNorm's: each op that takes one of them in a
    // forward (the module's `x * weight`, whatever ops it uses) gets it through copy_to_tp, so its gradient, a
    // partial sum over this rank's positions, is all-reduced over the TP group (tp_ops.h,
    // wrap_partial_grad_params). This marks the uses at the interception, not a grad-accumulation hook on the
    // parameter: it composes with FSDP's own hooks and holds for a weight used several times (each use's
    // partial gradient is all-reduced, and all-reduce is linear). The module must be position-wise (PyTorch's
    // SequenceParallel assumes it too); one that mixes positions would see only this rank's.
    const auto params = m->named_parameters(/*recurse=*/false);
    bool ok = m->children().empty() && params.contains("weight") && params.size() <= 2 &&
              (params.size() == 1 || params.contains("bias"));
    for (const auto& item : params) ok = ok && item.value().dim() == 1;
    std::ostringstream names;
    for (const auto& item : params) names << " " << item.key() << item.value().sizes();
    TORCH_CHECK(ok, "parallelize_module: ", what, " (a ", m->name(),
                "): expected a torch::nn::LayerNorm, a torch::nn::Dropout, or a norm module without submodules whose "
                "parameters are a 1-D `weight` and optionally a 1-D `bias` (e.g. an RMSNorm); it has parameters [",
                names.str(), " ] and ", m->children().size(), " submodules. Fix: apply SequenceParallel to the norm "
                "modules themselves");
    w.is_norm = true;
    w.weight = params["weight"];
    if (params.contains("bias")) w.bias = params["bias"];
    check_not_fully_sharded(w.weight, what, fqn.empty() ? "weight" : fqn + ".weight");
    check_not_fully_sharded(w.bias, what, fqn.empty() ? "bias" : fqn + ".bias");
    TORCH_CHECK(!tp::detail::find_tp_param(w.weight), "parallelize_module: ", in_quotes(fqn),
                " is already parallelised; plan each module once");
  }
  return w;
}

Work validate_one(const std::string& fqn, const std::shared_ptr<torch::nn::Module>& m, const ParallelStyle& style,
                  const DeviceMeshPtr& mesh) {
  const int64_t tp = mesh->size(0);
  if (style.kind == ParallelStyle::Kind::CUSTOM) {  // PrepareModule* or a user's style (style.h)
    TORCH_CHECK(style.custom, "parallelize_module: the plan entry for ", in_quotes(fqn),
                " has kind CUSTOM but no style; build it with tp::user_style(std::make_shared<MyStyle>())");
    style.custom->validate(fqn, m, mesh);
    Work w;
    w.fqn = fqn;
    w.module = m;
    w.style = style;
    return w;
  }
  const std::string what = std::string(style_name(style)) + " on " + in_quotes(fqn);
  TORCH_CHECK(style.use_local_output, "parallelize_module: ", what,
              ": use_local_output(false) is not supported: a LibTorch module returns a torch::Tensor, not a DTensor");
  if (style.kind == ParallelStyle::Kind::SEQUENCE) return validate_sequence(fqn, m, style);
  Work w;
  w.fqn = fqn;
  w.module = m;
  w.style = style;
  const bool colwise = style.kind == ParallelStyle::Kind::COLWISE;
  if (auto* lin = dynamic_cast<torch::nn::LinearImpl*>(m.get())) {
    w.weight = lin->weight;
    // Colwise with a Shard(-1) output shards the bias with the features. With a Replicate output the
    // bias stays whole and is added after the all-gather: F::linear adds it after matmul for inputs
    // of more than 2 dims, outside the op the interception sees.
    if (colwise && lin->bias.defined() && !style.output_layout.is_replicate()) w.bias = lin->bias;
    // Rowwise with a sequence-sharded output: each rank adds the whole bias to its own positions.
    if (!colwise && lin->bias.defined() && style.output_layout.is_shard()) w.partial_bias = lin->bias;
  } else if (auto* emb = dynamic_cast<torch::nn::EmbeddingImpl*>(m.get())) {
    w.is_embedding = true;
    w.weight = emb->weight;
    TORCH_CHECK(!emb->options.sparse() && !emb->options.scale_grad_by_freq(), "parallelize_module: ", what,
                ": sparse=true and scale_grad_by_freq=true are not supported for a tensor-parallel Embedding");
  } else {
    TORCH_CHECK(false, "parallelize_module: ", what, " (a ", m->name(),
                "): expected a torch::nn::Linear or torch::nn::Embedding; plan the Linear/Embedding modules inside it "
                "instead (e.g. ", in_quotes(fqn.empty() ? "*" : fqn + ".*"), ")");
  }
  TORCH_CHECK(w.weight.defined() && w.weight.dim() == 2, "parallelize_module: ", what,
              ": expected a 2-D weight, got ", w.weight.defined() ? c10::str(w.weight.sizes()) : "none");
  TORCH_CHECK(!tp::detail::find_tp_param(w.weight), "parallelize_module: ", in_quotes(fqn),
              " is already parallelised (its weight is a TP parameter); plan each module once");
  check_not_fully_sharded(w.weight, what, fqn.empty() ? "weight" : fqn + ".weight");
  check_not_fully_sharded(w.bias.defined() ? w.bias : w.partial_bias, what, fqn.empty() ? "bias" : fqn + ".bias");
  // Supported layouts. Shard(d >= 0) is a sequence-sharded activation (sequence parallelism).
  const auto& in = style.input_layout;
  const auto& out = style.output_layout;
  auto is_last = [](const Placement& p) { return p.is_shard() && p.dim == -1; };
  auto is_seq = [](const Placement& p) { return p.is_shard() && p.dim >= 0; };
  if (colwise) {
    TORCH_CHECK(in.is_replicate() || (is_seq(in) && !w.is_embedding), "parallelize_module: ", what,
                ": input_layouts ", in.str(), " is not supported; use Replicate(), or Shard(1) (a sequence-sharded ",
                "input, Linear only)");
    TORCH_CHECK(is_last(out) || out.is_replicate(), "parallelize_module: ", what, ": output_layouts ", out.str(),
                " is not supported; use Shard(-1) (local features) or Replicate() (all-gathered)");
  } else {
    TORCH_CHECK(out.is_replicate() || is_seq(out), "parallelize_module: ", what, ": output_layouts ", out.str(),
                " is not supported; use Replicate() (all-reduced) or Shard(1) (reduce-scattered along the sequence)");
    TORCH_CHECK(w.is_embedding ? in.is_replicate() || is_last(in) : (is_last(in) || in.is_replicate()),
                "parallelize_module: ", what, ": input_layouts ", in.str(),
                " is not supported; use Shard(-1) (the local output of a colwise module) or Replicate()");
  }
  // Linear weight [out, in]: colwise shards out (dim 0), rowwise in (dim 1).
  // Embedding weight [num, dim]: colwise shards dim (dim 1), rowwise num (dim 0).
  w.weight_dim = (colwise != w.is_embedding) ? 0 : 1;
  const char* dim_name = w.is_embedding ? (w.weight_dim == 0 ? "num_embeddings" : "embedding_dim")
                                        : (w.weight_dim == 0 ? "out_features" : "in_features");
  const int64_t n = w.weight.size(w.weight_dim);
  TORCH_CHECK(n % tp == 0, "parallelize_module: ", what, " shards ", dim_name, " = ", n, " (weight dim ", w.weight_dim,
              ") over a TP mesh of ", tp, " ranks, but ", n, " is not divisible by ", tp,
              "; use a TP size that divides ", n, " or resize the layer");
  return w;
}

torch::Tensor chunk(const torch::Tensor& t, int64_t dim, int64_t tp, int64_t rank) {
  const int64_t c = t.size(dim) / tp;
  return t.detach().narrow(dim, rank * c, c).contiguous().clone();
}

// Gives `param` (the Parameter object the module and any optimizer hold) the data `data`, keeping the
// object. A deferred parameter (fsdp::deferred_init: a meta tensor until materialize_module) takes the
// meta data's metadata directly: set_data refuses a change of tensor type (the interception key), and
// materialize_module later fills this rank's part (tp::detail::local_part). See [Note: deferred init].
void replace_data(torch::Tensor param, const torch::Tensor& data) {
  if (param.is_meta()) {
    param.unsafeGetTensorImpl()->shallow_copy_from(data.getIntrusivePtr());
  } else {
    param.set_data(data);
  }
}

void apply_work(const Work& w, const DeviceMeshPtr& mesh) {
  if (w.style.kind == ParallelStyle::Kind::CUSTOM) return w.style.custom->_apply(w.module, mesh);
  const int64_t tp = mesh->size(0), rank = mesh->get_local_rank(0);
  tp::detail::ensure_tp_interception();
  torch::NoGradGuard no_grad;
  tp::detail::TPParam info;
  info.fqn = w.fqn;
  info.is_embedding = w.is_embedding;
  info.is_norm = w.is_norm;
  info.style = w.style;
  info.mesh = mesh;
  if (w.style.kind == ParallelStyle::Kind::SEQUENCE) {
    // Replicated: whole data, tagged so that their uses all-reduce their gradients (partial sums over
    // each rank's positions: tp_ops.h, wrap_partial_grad_params).
    if (!w.is_norm) return;  // Dropout: each rank drops its own positions, nothing to change
    info.placement = Replicate();
    info.partial_grad = true;
    for (auto t : {w.weight, w.bias}) {
      if (!t.defined()) continue;
      info.global_shape = t.sizes().vec();
      info.is_weight = false;  // not a matrix the op side runs: only its gradient is handled
      replace_data(t, fsdp::detail::intercepted(t.detach().clone()));
      tp::detail::register_tp_param(t, info);
    }
    return;
  }
  info.placement = Shard(w.weight_dim);
  info.global_shape = w.weight.sizes().vec();
  auto weight = w.weight;  // the Parameter object the module and any optimizer hold: kept, data replaced
  replace_data(weight, fsdp::detail::intercepted(chunk(weight, w.weight_dim, tp, rank)));
  tp::detail::register_tp_param(weight, info);
  if (w.partial_bias.defined()) {  // replicated, tagged so that its uses all-reduce its gradient
    auto bias = w.partial_bias;
    auto binfo = info;
    binfo.is_weight = false;
    binfo.partial_grad = true;
    binfo.placement = Replicate();
    binfo.global_shape = bias.sizes().vec();
    replace_data(bias, fsdp::detail::intercepted(bias.detach().clone()));
    tp::detail::register_tp_param(bias, binfo);
  }
  if (w.bias.defined()) {  // colwise Linear: bias sharded with the output features, no interception needed
    auto bias = w.bias;
    info.is_weight = false;
    info.placement = Shard(0);
    info.global_shape = bias.sizes().vec();
    replace_data(bias, chunk(bias, 0, tp, rank));
    tp::detail::register_tp_param(bias, info);
  }
}

// The second style of a tied Embedding weight ([Note: tied TP styles]): same shard, one more use.
void apply_tied_head(const Work& w) {
  const auto* rec = tp::detail::find_tp_param(w.weight);
  TORCH_CHECK(rec && rec->is_embedding, "parallelize_module: internal error: tied head '", w.fqn, "' without its Embedding");
  auto info = *rec;
  info.tied_linear_style = w.style;
  info.tied_linear_fqn = w.fqn;
  tp::detail::register_tp_param(w.weight, std::move(info));
}

void check_mesh(const DeviceMeshPtr& mesh) {
  TORCH_CHECK(mesh, "parallelize_module: expected a TP mesh, got null");
  TORCH_CHECK(mesh->ndim() == 1, "parallelize_module: expected a 1-D TP mesh, got ", mesh->str(),
              "; pass the TP dimension's sub-mesh, e.g. mesh[\"tp\"]");
}

}  // namespace

void parallelize_module(const std::shared_ptr<torch::nn::Module>& module, const DeviceMeshPtr& tp_mesh,
                        const ParallelizePlan& plan) {
  TORCH_CHECK(module, "parallelize_module: expected a module, got null");
  check_mesh(tp_mesh);
  tp::detail::ParallelizeContext context(module);  // the model, for the boundary styles (prepare_module.cpp)
  auto modules = module->named_modules("", /*include_self=*/true);
  std::vector<Work> work;
  std::vector<std::string> matched_by;  // per work item: the plan key
  for (const auto& [pattern, style] : plan) {
    bool any = false;
    for (const auto& item : modules) {
      if (!fqn_matches(pattern, item.key())) continue;
      any = true;
      for (size_t i = 0; i < work.size(); ++i) {
        TORCH_CHECK(work[i].fqn != item.key(), "parallelize_module: module ", in_quotes(item.key()),
                    " is matched by plan keys ", in_quotes(matched_by[i]), " and ", in_quotes(pattern),
                    "; plan each module once");
      }
      const auto& mod = item.value();
      const bool head = style.kind == ParallelStyle::Kind::COLWISE && !dynamic_cast<torch::nn::LinearImpl*>(mod.get()) &&
                        !dynamic_cast<torch::nn::EmbeddingImpl*>(mod.get());
      work.push_back(head ? validate_tied_head(item.key(), mod, style, work) : validate_one(item.key(), mod, style, tp_mesh));
      matched_by.push_back(pattern);
    }
    if (!any) {
      std::ostringstream names;
      int shown = 0;
      for (const auto& item : modules) {
        if (item.key().empty()) continue;
        if (shown == 30) {
          names << ", ...";
          break;
        }
        names << (shown++ ? ", " : "") << item.key();
      }
      TORCH_CHECK(false, "parallelize_module: plan key ", in_quotes(pattern),
                  " matches no module of the model (its modules: ", names.str(),
                  "); use names from named_modules(), with '*' for one path segment");
    }
  }
  // Everything is valid: change the model (tied heads last: they extend their Embedding's record).
  for (const auto& w : work)
    if (!w.tied_head) apply_work(w, tp_mesh);
  for (const auto& w : work)
    if (w.tied_head) apply_tied_head(w);
}

void parallelize_module(const std::shared_ptr<torch::nn::Module>& module, const DeviceMeshPtr& tp_mesh,
                        const ParallelStyle& style) {
  TORCH_CHECK(module, "parallelize_module: expected a module, got null");
  check_mesh(tp_mesh);
  tp::detail::ParallelizeContext context(module);
  apply_work(validate_one("", module, style, tp_mesh), tp_mesh);
}

torch::Tensor distribute_sequence(const torch::Tensor& x, const DeviceMeshPtr& tp_mesh, int64_t dim) {
  return tp::detail::chunk_sequence(x, tp_mesh, dim);
}

torch::Tensor gather_sequence(const torch::Tensor& x, const DeviceMeshPtr& tp_mesh, int64_t dim) {
  return tp::detail::unchunk_sequence(x, tp_mesh, dim);
}

std::vector<torch::Tensor> local_heads_of_fused(const torch::Tensor& local, const DeviceMeshPtr& tp_mesh,
                                                int64_t n_fused) {
  return tp::detail::fused_heads(local, tp_mesh, n_fused);
}

DTensor tp_param_dtensor(const torch::Tensor& param) {
  const auto* p = tp::detail::find_tp_param(param);
  TORCH_CHECK(p, "tp_param_dtensor: expected a parameter parallelised by parallelize_module, got a tensor of shape ",
              param.sizes(), " that is not one");
  fsdp::detail::NoInterception no_interception;
  return DTensor(param.detach(), p->mesh, {p->placement}, p->global_shape);
}

namespace detail {
std::atomic<FullyShardedQuery> fully_sharded_query{nullptr};

void set_fully_sharded_query(FullyShardedQuery q) { fully_sharded_query.store(q); }

torch::Tensor local_part(const TPParam& p, const torch::Tensor& full) {
  if (!p.placement.is_shard()) return full;
  return chunk(full, p.placement.dim, p.mesh->size(0), p.mesh->get_local_rank(0));
}
}  // namespace detail

}  // namespace fsdp::tp
