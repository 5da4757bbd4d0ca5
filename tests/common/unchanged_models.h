// Models of the unchanged_models tests (issue 13), written exactly as a LibTorch user writes them: plain
// TORCH_MODULE holders and Impls, torch::nn containers, no libfsdp type anywhere in the model code. FSDP
// reaches their modules only through fully_shard(module_ptr) / fully_shard_tree(root, policy).
//
// Every model maps token ids [B, T] (kVocab) to logits [B, T, kClasses] (fsdp_test_model.h), so one
// harness (below) trains them all. Shapes are chosen for uneven rows on 2 and 3 ranks and at least one
// dim 0 smaller than 3 (an empty shard on rank 2), e.g. head.weight [2, 6] (1, 1, 0 rows on 3 ranks).
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <unordered_set>
#include <vector>

#include <torch/torch.h>

#include "fsdp/fsdp_state.h"
#include "fully_shard_test_util.h"

namespace fsdp::testing {

// ---- The models ------------------------------------------------------------------------------------

/// Sequential elements: wte [11, 6]; body = Linear(6,5) [5, 6], GELU, Linear(5,2) [2, 5] (empty shard on
/// 3 ranks), Linear(2,6), LayerNorm(6); head [2, 6].
struct SeqNetImpl : torch::nn::Module {
  torch::nn::Embedding wte{nullptr};
  torch::nn::Sequential body{nullptr};
  torch::nn::Linear head{nullptr};
  SeqNetImpl() {
    wte = register_module("wte", torch::nn::Embedding(kVocab, kDim));
    body = register_module("body", torch::nn::Sequential(torch::nn::Linear(kDim, kHidden), torch::nn::GELU(),
                                                         torch::nn::Linear(kHidden, 2), torch::nn::Linear(2, kDim),
                                                         torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim}))));
    head = register_module("head", torch::nn::Linear(kDim, kClasses));
  }
  torch::Tensor forward(torch::Tensor idx) { return head(body->forward(wte(idx))); }
};
TORCH_MODULE(SeqNet);

/// The layout of fsdp_test_model.h's Net (same parameter names, so the same initial weights and a
/// direct comparison with the holder path), its blocks held in a plain ModuleList and reached through
/// as<>(), as LibTorch users iterate one.
struct PlainNetImpl : torch::nn::Module {
  torch::nn::Embedding wte{nullptr};
  torch::nn::ModuleList blocks{nullptr};
  torch::nn::Linear head{nullptr};
  int calls_per_block = 1;         // > 1: every block runs several times in one forward
  int call_style = 0;              // 0: range-for + m->as<Block>(); 1: (*blocks)[i]->as<BlockImpl>()
  bool checkpoint_blocks = false;  // activation checkpointing at the call site (the only place it can go)
  /// Called on the activation before the first block (i = -1) and after block i; may register hooks.
  std::function<torch::Tensor(int, torch::Tensor)> tap;
  explicit PlainNetImpl(int n_blocks = 2) {
    wte = register_module("wte", torch::nn::Embedding(kVocab, kDim));
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < n_blocks; ++i) blocks->push_back(Block());
    head = register_module("head", torch::nn::Linear(kDim, kClasses));
  }
  torch::Tensor run_block(BlockImpl* blk, torch::Tensor x) {
    for (int c = 0; c < calls_per_block; ++c) {
      if (checkpoint_blocks) {
        x = fsdp::checkpoint([blk](torch::Tensor t) { return blk->forward(t); }, x);
      } else {
        x = blk->forward(x);
      }
    }
    return x;
  }
  torch::Tensor forward(torch::Tensor idx) {
    auto x = wte(idx);
    if (tap) x = tap(-1, x);
    if (call_style == 0) {
      int i = 0;
      for (const auto& m : *blocks) {
        x = run_block(m->as<Block>(), x);
        if (tap) x = tap(i, x);
        ++i;
      }
    } else {
      for (size_t i = 0; i < blocks->size(); ++i) {
        x = run_block((*blocks)[i]->as<BlockImpl>(), x);
        if (tap) x = tap(static_cast<int>(i), x);
      }
    }
    return head(x);
  }
};
TORCH_MODULE(PlainNet);

/// ModuleDict entries, one reached through operator[] + as<>(), the other through at<>().
struct DictNetImpl : torch::nn::Module {
  torch::nn::Embedding wte{nullptr};
  torch::nn::ModuleDict blocks{nullptr};
  torch::nn::Linear head{nullptr};
  DictNetImpl() {
    wte = register_module("wte", torch::nn::Embedding(kVocab, kDim));
    blocks = register_module("blocks", torch::nn::ModuleDict());
    blocks->update({{"first", Block().ptr()}, {"second", Block().ptr()}});
    head = register_module("head", torch::nn::Linear(kDim, kClasses));
  }
  torch::Tensor forward(torch::Tensor idx) {
    auto x = wte(idx);
    x = blocks["first"]->as<Block>()->forward(x);
    x = blocks->at<BlockImpl>("second").forward(x);
    return head(x);
  }
};
TORCH_MODULE(DictNet);

/// Plain holder members: Embedding, LayerNorm, Linear, Conv2d (weight [2, 1, 3, 3]: empty shard on 3 ranks).
struct MembersNetImpl : torch::nn::Module {
  torch::nn::Embedding emb{nullptr};
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::Linear fc{nullptr};
  torch::nn::Conv2d conv{nullptr};
  torch::nn::Linear head{nullptr};
  MembersNetImpl() {
    emb = register_module("emb", torch::nn::Embedding(kVocab, kDim));
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({kDim})));
    fc = register_module("fc", torch::nn::Linear(kDim, kDim));
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 2, 3).padding(1)));
    head = register_module("head", torch::nn::Linear(2 * kDim, kClasses));
  }
  torch::Tensor forward(torch::Tensor idx) {
    auto x = fc(ln(emb(idx)));                        // [B, T, D]
    x = conv(x.unsqueeze(1));                         // [B, 2, T, D]
    x = x.permute({0, 2, 1, 3}).reshape({x.size(0), x.size(2), 2 * kDim});
    return head(torch::gelu(x));
  }
};
TORCH_MODULE(MembersNet);

/// LSTM, MultiheadAttention and Conv1d (weight [2, 4, 3]: empty shard on 3 ranks) after an Embedding.
struct RichNetImpl : torch::nn::Module {
  torch::nn::Embedding wte{nullptr};
  torch::nn::LSTM lstm{nullptr};
  torch::nn::MultiheadAttention mha{nullptr};
  torch::nn::Conv1d conv{nullptr};
  torch::nn::Linear head{nullptr};
  RichNetImpl() {
    wte = register_module("wte", torch::nn::Embedding(kVocab, kDim));
    lstm = register_module("lstm", torch::nn::LSTM(torch::nn::LSTMOptions(kDim, 4).batch_first(true)));
    mha = register_module("mha", torch::nn::MultiheadAttention(4, 2));
    conv = register_module("conv", torch::nn::Conv1d(torch::nn::Conv1dOptions(4, 2, 3).padding(1)));
    head = register_module("head", torch::nn::Linear(2, kClasses));
  }
  torch::Tensor forward(torch::Tensor idx) {
    auto x = std::get<0>(lstm(wte(idx)));  // [B, T, 4]
    auto q = x.transpose(0, 1);            // MultiheadAttention takes [T, B, E]
    x = x + std::get<0>(mha(q, q, q)).transpose(0, 1);
    x = conv(x.transpose(1, 2)).transpose(1, 2);  // [B, T, 2]
    return head(x);
  }
};
TORCH_MODULE(RichNet);

// ---- The harness -------------------------------------------------------------------------------------

/// A model as the harness sees it: its root module and its forward.
struct Model {
  std::shared_ptr<torch::nn::Module> module;
  std::function<torch::Tensor(const torch::Tensor&)> forward;
};

/// Constructs `Holder` from a fixed seed: the same weights on every rank and in the reference. The
/// global generator is shared by the rank threads, hence the lock.
template <typename Holder>
Holder seeded() {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  torch::manual_seed(11);
  return Holder();
}

template <typename Holder>
Model as_model(Holder h) {
  return {h.ptr(), [h](const torch::Tensor& x) mutable { return h->forward(x); }};
}

/// How a case shards its model.
enum class How { MANUAL, TREE_TYPES, TREE_SIZE };

/// One model shape and its three shardings.
struct Case {
  std::string name;
  std::function<Model()> make;
  /// fully_shard on each submodule (bottom-up), then the root.
  std::function<void(const Model&, const FullyShardOptions&)> shard_manual;
  std::unordered_set<std::string> types;      // fully_shard_tree by module_types ...
  std::vector<std::string> types_wrapped;     // ... and what it must return
  int64_t min_num_params = 0;                 // fully_shard_tree by min_num_params ...
  std::vector<std::string> size_wrapped;      // ... and what it must return
};

/// Shards `m` as the case says; checks what fully_shard_tree wrapped.
inline void shard(const Case& c, How how, const Model& m, const FullyShardOptions& opts) {
  switch (how) {
    case How::MANUAL:
      c.shard_manual(m, opts);
      break;
    case How::TREE_TYPES:
      EXPECT_EQ(fully_shard_tree(m.module, AutoWrapPolicy().module_types(c.types), opts), c.types_wrapped) << c.name;
      break;
    case How::TREE_SIZE:
      EXPECT_EQ(fully_shard_tree(m.module, AutoWrapPolicy().min_num_params(c.min_num_params), opts), c.size_wrapped)
          << c.name;
      break;
  }
}

/// The single-process run on the global batches (AdamW, make_optimizer of fully_shard_test_util.h).
inline Reference reference_run(const std::function<Model()>& make, const std::vector<Batch>& batches) {
  Model m = make();
  auto opt = make_optimizer(m.module->parameters(), Opt::ADAMW);
  Reference ref;
  for (const auto& b : batches) {
    opt->zero_grad();
    auto loss = loss_fn(m.forward(b.idx), b.targets);
    loss.backward();
    std::map<std::string, torch::Tensor> grads;
    for (const auto& p : m.module->named_parameters()) grads[p.key()] = p.value().grad().clone();
    ref.grads.push_back(std::move(grads));
    opt->step();
    ref.losses.push_back(loss.item<float>());
  }
  ref.final_params = snapshot(*m.module);
  return ref;
}

/// Full gradients of every parameter of a sharded model (sharded_grad gathered: a collective, in
/// named_parameters order on every rank). A parameter without a sharded gradient fails the test and
/// is left out (its rank may then fail in a collective: bounded by the ranks' collective timeout).
inline std::map<std::string, torch::Tensor> full_grads(const torch::nn::Module& module) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& p : module.named_parameters()) {
    auto g = sharded_grad(p.value());
    if (!g) {
      ADD_FAILURE() << p.key() << " has no sharded gradient";
      continue;
    }
    out[p.key()] = g->full_tensor();
  }
  return out;
}

/// Full parameters of a sharded model (get_model_state_dict with full_state_dict: a collective).
inline std::map<std::string, torch::Tensor> full_params(const torch::nn::Module& module) {
  std::map<std::string, torch::Tensor> out;
  for (const auto& [k, v] : get_model_state_dict(module, StateDictOptions().full_state_dict(true))) {
    if (const auto* t = std::get_if<torch::Tensor>(&v)) out[k] = t->clone();
  }
  return out;
}

/// Loss of this rank's slice averaged over the ranks.
inline float global_loss(const torch::Tensor& loss, ProcessGroup& pg) {
  auto g = loss.detach().to(torch::kFloat).clone();  // bf16 losses too
  all_reduce(g, pg, ReduceOp::AVG);
  return g.item<float>();
}

/// What one sharded run saw (rank-independent: every entry is global).
struct Trace {
  std::vector<float> losses;
  std::vector<std::map<std::string, torch::Tensor>> grads;
  std::map<std::string, torch::Tensor> final_params;
};

/// Trains an already sharded model on this rank's slices of `batches` (AdamW); records the global
/// losses, full gradients and final full parameters.
inline Trace train_sharded(const Model& m, ProcessGroupPtr pg, const std::vector<Batch>& batches) {
  const int64_t local = batches.at(0).idx.size(0) / pg->size();
  auto opt = make_optimizer(m.module->parameters(), Opt::ADAMW);
  Trace t;
  for (const auto& global : batches) {
    auto b = global.slice(pg->rank() * local, local);
    opt->zero_grad();
    auto loss = loss_fn(m.forward(b.idx), b.targets);
    loss.backward();
    t.grads.push_back(full_grads(*m.module));
    opt->step();
    t.losses.push_back(global_loss(loss, *pg));
  }
  t.final_params = full_params(*m.module);
  return t;
}

/// Checks a trace against the single-process reference: losses (kRtol relative), full gradients
/// (kGradRtol/kGradAtol: the reduce-scatter sums in another order) and final parameters (kRtol/kAtol).
inline void expect_parity(const Trace& t, const Reference& ref, const std::string& what) {
  ASSERT_EQ(t.losses.size(), ref.losses.size()) << what;
  for (size_t s = 0; s < ref.losses.size(); ++s) {
    EXPECT_LE(std::abs(t.losses[s] - ref.losses[s]), kRtol * std::abs(ref.losses[s]))
        << what << ": loss at step " << s << " " << t.losses[s] << " vs reference " << ref.losses[s];
    EXPECT_EQ(t.grads[s].size(), ref.grads[s].size()) << what << ": gradients at step " << s;
    for (const auto& [k, g] : ref.grads[s]) {
      auto it = t.grads[s].find(k);
      if (it == t.grads[s].end()) continue;  // reported by full_grads
      EXPECT_TRUE(torch::allclose(it->second, g, kGradRtol, kGradAtol))
          << what << ": gradient of " << k << " at step " << s << ": max |diff| " << max_abs_diff(it->second, g)
          << ", reference max |g| " << g.abs().max().item<double>();
    }
  }
  // Elements whose reference gradient is pure round-off at every step (e.g. MultiheadAttention's key
  // bias: softmax is invariant to it, measured |g| ~1e-13): AdamW normalises that noise into an update,
  // so they are compared with kRoundOffAtol (still far below one lost or doubled step, lr = 1e-2).
  constexpr double kRoundOffGrad = 1e-10, kRoundOffAtol = 1e-4;
  EXPECT_EQ(t.final_params.size(), ref.final_params.size()) << what;
  for (const auto& [k, p] : ref.final_params) {
    auto it = t.final_params.find(k);
    if (it == t.final_params.end()) {
      ADD_FAILURE() << what << ": " << k << " missing from the full state dict";
      continue;
    }
    auto noise = torch::ones_like(p, torch::kBool);
    for (const auto& g : ref.grads) noise &= g.at(k).abs() < kRoundOffGrad;
    auto diff = (it->second.to(torch::kDouble) - p.to(torch::kDouble)).abs();
    auto tol = torch::where(noise, torch::full_like(diff, kRoundOffAtol), kAtol + kRtol * p.to(torch::kDouble).abs());
    EXPECT_TRUE((diff <= tol).all().item<bool>())
        << what << ": final " << k << ": max |diff| " << max_abs_diff(it->second, p) << " ("
        << noise.sum().item<int64_t>() << " elements with round-off gradients)";
  }
}

/// "" when both traces are bit-identical, else the first difference. The two paths issue the same
/// collectives and the same ops on the same data, so any difference is a bug. (A rare last-bit
/// difference seen before came from LibTorch's first-use race in MKL's vector math, worked around in
/// the library: [Note: math kernels warmed up once], src/c10d/distributed.cpp.)
inline std::string diff_traces(const Trace& a, const Trace& b) {
  if (a.losses.size() != b.losses.size()) return "loss counts differ";
  for (size_t i = 0; i < a.losses.size(); ++i) {
    if (a.losses[i] != b.losses[i]) {
      char buf[160];
      std::snprintf(buf, sizeof(buf), "losses differ at step %zu: %.9g vs %.9g", i, a.losses[i], b.losses[i]);
      return buf;
    }
  }
  auto diff_maps = [](const std::map<std::string, torch::Tensor>& x,
                      const std::map<std::string, torch::Tensor>& y) -> std::string {
    if (x.size() != y.size()) return "entry counts differ";
    for (const auto& [k, v] : x) {
      auto it = y.find(k);
      if (it == y.end()) return "'" + k + "' missing";
      if (v.sizes() != it->second.sizes() || !torch::equal(v, it->second)) {
        return "'" + k + "' differs: max |diff| " + std::to_string(max_abs_diff(v, it->second));
      }
    }
    return "";
  };
  for (size_t s = 0; s < a.grads.size() && s < b.grads.size(); ++s) {
    auto d = diff_maps(a.grads[s], b.grads[s]);
    if (!d.empty()) return "gradient at step " + std::to_string(s) + ": " + d;
  }
  auto d = diff_maps(a.final_params, b.final_params);
  return d.empty() ? "" : "final parameter " + d;
}

/// Whether a state is driven at tensor level (issue 13's "implicit" groups).
inline bool is_implicit(const FSDPModuleAPI& api) { return detail::fsdp_state(api).implicit; }

}  // namespace fsdp::testing
