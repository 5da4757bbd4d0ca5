#include "model.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <sstream>
#include <stdexcept>
#include <unordered_set>

namespace train_gpt {
namespace {

// Presets, smallest first. "small" is the default: it visibly learns English in a couple of minutes on
// two CPU cores (see scripts/train.sh); "tiny" keeps the tests to seconds.
const std::map<std::string, GPTConfig>& presets() {
  static const std::map<std::string, GPTConfig> p = [] {
    std::map<std::string, GPTConfig> m;
    GPTConfig c;
    c.n_layer = 2, c.n_head = 2, c.n_embd = 32, c.block_size = 32;
    m["tiny"] = c;
    c.n_layer = 4, c.n_head = 4, c.n_embd = 128, c.block_size = 128;
    m["small"] = c;
    c.n_layer = 6, c.n_head = 8, c.n_embd = 256, c.block_size = 256;
    m["medium"] = c;
    // GPT-2 small's shape (12 layers, 768 wide, 12 heads, context 1024) over bytes: for GPU runs (issue 12).
    c.n_layer = 12, c.n_head = 12, c.n_embd = 768, c.block_size = 1024;
    m["gpt2-small"] = c;
    // ~302M parameters (24 x 1024, as GPT-2 medium's blocks): 1.2 GB of fp32 weights, 4.8 GB with AdamW's
    // state and gradients - built sharded (fsdp::deferred_init), each rank holds 1/N (issue 14).
    c.n_layer = 24, c.n_head = 16, c.n_embd = 1024, c.block_size = 256;
    m["large"] = c;
    // Llama (model_llama.h): RMSNorm, RoPE, SwiGLU, grouped-query attention, untied head.
    GPTConfig l;
    l.arch = "llama", l.tie_weights = false;
    // Tests: 2 layers, 4 heads sharing 2 key/value heads, an MLP width that is no multiple of the width.
    l.n_layer = 2, l.n_head = 4, l.n_kv_head = 2, l.n_embd = 32, l.intermediate_size = 88, l.block_size = 32;
    m["llama-tiny"] = l;
    // Benchmarks on this machine: 151M parameters over bytes (24 x 768, 12 heads, 4 key/value heads, MLP 2048).
    l.n_layer = 24, l.n_head = 12, l.n_kv_head = 4, l.n_embd = 768, l.intermediate_size = 2048, l.block_size = 512;
    m["llama-150m"] = l;
    // Llama 3.1 8B and 70B (meta-llama/Llama-3.1-8B's and -70B's config.json): for --estimate-memory and GPU
    // runs (no weights are built by --estimate-memory: meta tensors only). Context 8192 (Llama 3's original).
    l.vocab_size = 128256, l.n_layer = 32, l.n_head = 32, l.n_kv_head = 8, l.n_embd = 4096;
    l.intermediate_size = 14336, l.block_size = 8192, l.max_positions = 131072, l.rope_theta = 500000.0;
    l.rope_type = "llama3", l.rope_factor = 8.0, l.rope_low_freq_factor = 1.0, l.rope_high_freq_factor = 4.0;
    l.rope_original_max_positions = 8192;
    m["llama3-8b"] = l;
    l.n_layer = 80, l.n_head = 64, l.n_kv_head = 8, l.n_embd = 8192, l.intermediate_size = 28672;
    m["llama3-70b"] = l;
    return m;
  }();
  return p;
}

// The linear layers' forward. torch::nn::Linear's own forward (torch::nn::functional::linear) multiplies
// and then adds the bias in a second pass when the input has more than 2 dims: in bf16 that rounds twice
// (and sweeps the output once more). at::linear, which PyTorch's nn.Linear calls, fuses the bias into the
// matmul (addmm): one rounding, and PyTorch's numbers to the bit (bench/compare_fsdp2.py checks it).
torch::Tensor linear(const torch::nn::Linear& layer, const torch::Tensor& x) {
  return at::linear(x, layer->weight, layer->bias);
}

}  // namespace

const std::vector<std::string>& preset_names() {
  static const std::vector<std::string> names = {"tiny",       "small",      "medium",    "gpt2-small", "large",
                                                  "llama-tiny", "llama-150m", "llama3-8b", "llama3-70b"};
  return names;
}

GPTConfig preset(const std::string& name) {
  auto it = presets().find(name);
  if (it == presets().end()) {
    std::string known;
    for (const auto& n : preset_names()) known += (known.empty() ? "" : "|") + n;
    throw std::invalid_argument("unknown preset --model " + name + ": expected one of " + known +
                                " (or set --n-layer --n-head --n-embd --block-size explicitly)");
  }
  return it->second;
}

void validate(const GPTConfig& cfg) {
  auto positive = [](const char* flag, int64_t v) {
    if (v < 1) throw std::invalid_argument(std::string(flag) + "=" + std::to_string(v) + " must be >= 1");
  };
  positive("--n-layer", cfg.n_layer);
  positive("--n-head", cfg.n_head);
  positive("--n-embd", cfg.n_embd);
  positive("--block-size", cfg.block_size);
  if (cfg.n_embd % cfg.n_head != 0) {
    throw std::invalid_argument("--n-embd=" + std::to_string(cfg.n_embd) + " is not divisible by --n-head=" +
                                std::to_string(cfg.n_head) + ": each head gets n_embd / n_head dims. Fix: pick " +
                                "--n-embd a multiple of --n-head (e.g. --n-embd " +
                                std::to_string((cfg.n_embd / cfg.n_head + 1) * cfg.n_head) + ")");
  }
  if (!(cfg.dropout >= 0.0 && cfg.dropout < 1.0)) {  // written so that NaN fails too
    throw std::invalid_argument("--dropout=" + std::to_string(cfg.dropout) + " must be in [0, 1)");
  }
  if (cfg.arch != "gpt2" && cfg.arch != "llama") {
    throw std::invalid_argument("model architecture '" + cfg.arch + "' is not supported: expected gpt2 or llama");
  }
  if (!cfg.is_llama()) return;
  if (cfg.n_head % cfg.kv_heads() != 0) {
    throw std::invalid_argument("num_key_value_heads=" + std::to_string(cfg.kv_heads()) +
                                " does not divide num_attention_heads=" + std::to_string(cfg.n_head) +
                                ": each key/value head serves n_head / n_kv_head query heads");
  }
  if (cfg.head_dim() % 2 != 0) {
    throw std::invalid_argument("head_dim=" + std::to_string(cfg.head_dim()) +
                                " is odd: rotary embeddings rotate pairs of dims. Fix: an even n_embd / n_head");
  }
  if (cfg.rope_type != "default" && cfg.rope_type != "llama3") {
    throw std::invalid_argument("rope type '" + cfg.rope_type + "' is not supported: expected default or llama3");
  }
  if (!(cfg.norm_eps > 0.0) || !(cfg.rope_theta > 0.0)) {
    throw std::invalid_argument("rms_norm_eps and rope_theta must be > 0");
  }
}

std::string describe(const GPTConfig& cfg) {
  std::ostringstream os;
  if (cfg.is_llama()) os << "Llama: ";
  os << cfg.n_layer << (cfg.n_layer == 1 ? " layer, " : " layers, ") << cfg.n_head << " heads, ";
  if (cfg.is_llama()) os << cfg.kv_heads() << " key/value heads, MLP " << cfg.mlp_width() << ", ";
  os << cfg.n_embd << " dims, context " << cfg.block_size << ", vocab " << cfg.vocab_size
     << (cfg.tie_weights ? ", tied head" : ", untied head");
  if (cfg.is_llama() && cfg.rope_type != "default") os << ", rope " << cfg.rope_type;
  if (cfg.dropout > 0) os << ", dropout " << cfg.dropout;
  return os.str();
}

int64_t init_gpt2_weights(torch::nn::Module& model, const GPTConfig& cfg) {
  // GPT-2 initialisation: every weight ~ N(0, 0.02), biases 0, LayerNorm (1, 0); the projections that
  // write into the residual stream (attn.c_proj, mlp.c_proj) scaled by 1/sqrt(2 * n_layer), since each
  // block adds two of them to it. Parameters are visited in registration order, so a seed fixes them.
  torch::NoGradGuard no_grad;
  const double std_proj = 0.02 / std::sqrt(2.0 * static_cast<double>(cfg.n_layer));
  std::unordered_set<const void*> seen;
  int64_t num_params = 0;
  for (auto& p : model.named_parameters()) {
    const auto& name = p.key();
    auto& t = p.value();
    if (!seen.insert(t.unsafeGetTensorImpl()).second) continue;  // tied: initialised once, as wte
    auto ends_with = [&](const std::string& s) {
      return name.size() >= s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0;
    };
    if (name.find(".ln_") != std::string::npos || name.rfind("ln_f.", 0) == 0) {
      ends_with("weight") ? t.fill_(1.0) : t.zero_();
    } else if (ends_with("bias")) {
      t.zero_();
    } else if (ends_with("c_proj.weight")) {
      t.normal_(0.0, std_proj);
    } else {
      t.normal_(0.0, 0.02);
    }
    num_params += t.numel();
  }
  return num_params;
}

std::vector<torch::Tensor> unique_parameters(const torch::nn::Module& model) {
  std::vector<torch::Tensor> out;
  std::unordered_set<const void*> seen;
  for (const auto& p : model.parameters()) {
    if (seen.insert(p.unsafeGetTensorImpl()).second) out.push_back(p);
  }
  return out;
}

// ---- Modules -----------------------------------------------------------------------------------------

CausalSelfAttentionImpl::CausalSelfAttentionImpl(const GPTConfig& cfg) : n_head(cfg.n_head), dropout(cfg.dropout) {
  c_attn = register_module("c_attn", torch::nn::Linear(cfg.n_embd, 3 * cfg.n_embd));
  c_proj = register_module("c_proj", torch::nn::Linear(cfg.n_embd, cfg.n_embd));
  resid_dropout = register_module("resid_dropout", torch::nn::Dropout(cfg.dropout));
}

torch::Tensor CausalSelfAttentionImpl::forward(const torch::Tensor& x) {
  const auto B = x.size(0), C = x.size(2);
  // 3 x [B, T, C]; under TP 3 x [B, T, C / tp], this rank's heads (T: the whole sequence, also when x is
  // sequence-sharded: the column-parallel c_attn gathers it).
  auto qkv = tp_mesh ? fsdp::tp::local_heads_of_fused(linear(c_attn, x), tp_mesh)
                     : linear(c_attn, x).split(C, /*dim=*/2);
  const auto T = qkv[0].size(1), local_C = qkv[0].size(2);
  const int64_t heads_here = n_head * local_C / C;
  auto heads = [&](const torch::Tensor& t) { return t.view({B, T, heads_here, C / n_head}).transpose(1, 2); };
  torch::Tensor y;
  if (rng && is_training() && dropout > 0) {
    // SDPA's math with the DTensor RNG's mask on this rank's heads (SDPA would draw from the default generator).
    auto q = heads(qkv[0]), k = heads(qkv[1]), v = heads(qkv[2]);
    auto att = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(q.size(-1))));
    auto future = torch::ones({T, T}, torch::TensorOptions(torch::kBool).device(x.device())).triu(1);
    att = torch::softmax(att.masked_fill(future, -std::numeric_limits<float>::infinity()), -1);
    y = torch::matmul((*rng)(att, dropout, true, rng->heads), v);
  } else {
    // [B, H, T, D]; is_causal masks the future (no explicit mask tensor).
    y = torch::scaled_dot_product_attention(heads(qkv[0]), heads(qkv[1]), heads(qkv[2]), /*attn_mask=*/{},
                                            /*dropout_p=*/is_training() ? dropout : 0.0, /*is_causal=*/true);
  }
  y = y.transpose(1, 2).contiguous().view({B, T, local_C});
  if (rng) return (*rng)(linear(c_proj, y), resid_dropout->options.p(), is_training(), rng->residual);
  return resid_dropout(linear(c_proj, y));
}

MLPImpl::MLPImpl(const GPTConfig& cfg) {
  c_fc = register_module("c_fc", torch::nn::Linear(cfg.n_embd, 4 * cfg.n_embd));
  c_proj = register_module("c_proj", torch::nn::Linear(4 * cfg.n_embd, cfg.n_embd));
  dropout = register_module("dropout", torch::nn::Dropout(cfg.dropout));
}

torch::Tensor MLPImpl::forward(const torch::Tensor& x) {
  auto y = linear(c_proj, torch::gelu(linear(c_fc, x), "tanh"));
  return rng ? (*rng)(y, dropout->options.p(), is_training(), rng->residual) : dropout(y);
}

BlockImpl::BlockImpl(const GPTConfig& cfg) {
  ln_1 = register_module("ln_1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({cfg.n_embd})));
  attn = register_module("attn", CausalSelfAttention(cfg));
  ln_2 = register_module("ln_2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({cfg.n_embd})));
  mlp = register_module("mlp", MLP(cfg));
}

torch::Tensor BlockImpl::forward(torch::Tensor x) {
  x = x + attn(ln_1(x));
  return x + mlp(ln_2(x));
}

LMHeadImpl::LMHeadImpl(const GPTConfig& cfg, torch::Tensor tied) {
  weight = register_parameter("weight", tied.defined() ? tied : torch::empty({cfg.vocab_size, cfg.n_embd}));
}

GPTImpl::GPTImpl(const GPTConfig& config) : cfg(config) {
  validate(cfg);
  wte = register_module("wte", torch::nn::Embedding(cfg.vocab_size, cfg.n_embd));
  wpe = register_module("wpe", torch::nn::Embedding(cfg.block_size, cfg.n_embd));
  drop = register_module("drop", torch::nn::Dropout(cfg.dropout));
  h = register_module("h", torch::nn::ModuleList());
  for (int64_t i = 0; i < cfg.n_layer; ++i) {
    blocks.push_back(Block(cfg));
    h->push_back(blocks.back());
  }
  ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({cfg.n_embd})));
  lm_head = register_module("lm_head", LMHead(cfg, cfg.tie_weights ? wte->weight : torch::Tensor()));

  num_params_ = init_gpt2_weights(*this, cfg);
}

torch::Tensor GPTImpl::forward(const torch::Tensor& idx) {
  const auto T = idx.size(1);
  TORCH_CHECK(T <= cfg.block_size, "GPT: sequence of ", T, " tokens exceeds the context of ", cfg.block_size);
  auto pos = positions.defined() ? positions : torch::arange(T, idx.options());  // (--cp: this rank's positions)
  auto x = wte(idx) + wpe(pos);  // [B, T, C]
  x = rng ? (*rng)(x, drop->options.p(), is_training(), rng->replicated) : drop(x);
  // Through FSDP: unshard before, reshard after each block. With --sequence-parallel the plan's
  // PrepareModuleInput on h.0 splits the sequence and PrepareModuleOutput on the last block gathers it
  // (parallelize.cpp), at the holders' call boundary: nothing to do here.
  for (auto& b : blocks) x = b(x);
  auto logits = lm_head(ln_f(x));  // [B, T, vocab], or [B, T, vocab / tp] under loss_parallel
  // Training: the loss takes the vocabulary-sharded logits (lm_loss); evaluation and sampling the whole.
  if (loss_parallel_mesh && !is_training()) logits = fsdp::tp::gather_sequence(logits, loss_parallel_mesh, -1);
  return logits;
}

// ---- Pipeline stages (--pp) --------------------------------------------------------------------------

std::pair<int64_t, int64_t> stage_layers(int64_t n_layer, int stage, int num_stages) {
  const int64_t base = n_layer / num_stages, extra = n_layer % num_stages;
  const int64_t begin = stage * base + std::min<int64_t>(stage, extra);
  return {begin, begin + base + (stage < extra ? 1 : 0)};
}

GPTStageImpl::GPTStageImpl(const GPTImpl& model, int64_t first_layer, int64_t end_layer, bool is_first, bool is_last)
    : block_size(model.cfg.block_size) {
  TORCH_CHECK(0 <= first_layer && first_layer < end_layer && end_layer <= model.cfg.n_layer, "GPTStage: blocks [",
              first_layer, ", ", end_layer, ") out of the model's ", model.cfg.n_layer);
  // Registration order as GPTImpl's, so that parameters() lists them in the whole model's order.
  if (is_first) {
    wte = register_module("wte", model.wte);
    wpe = register_module("wpe", model.wpe);
    drop = register_module("drop", model.drop);
  }
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> named;
  for (int64_t i = first_layer; i < end_layer; ++i) {
    blocks.push_back(model.blocks[i]);
    named.emplace_back(std::to_string(i), model.blocks[i].ptr());
  }
  h = register_module("h", torch::nn::ModuleDict(named));
  if (is_last) {
    ln_f = register_module("ln_f", model.ln_f);
    lm_head = register_module("lm_head", stage_head(model.cfg, model.lm_head, is_first));
  }
}

LMHead stage_head(const GPTConfig& cfg, const LMHead& head, bool is_first) {
  if (!cfg.tie_weights || is_first) return head;
  // [Note: tied weights across stages] A copy of the tied weight, a parameter of its own: the first stage's wte
  // and this head live in different fully_shard roots (on different ranks, or both on rank 0 under ZBV), which
  // cannot share one tensor. train_gpt keeps the copies equal by summing their gradients (pipeline.cpp).
  return LMHead(cfg, head->weight.detach().clone());
}

torch::Tensor GPTStageImpl::forward(const torch::Tensor& input) {
  torch::Tensor x = input;
  if (wte) {  // as GPTImpl::forward
    const auto T = x.size(1);
    TORCH_CHECK(T <= block_size, "GPTStage: sequence of ", T, " tokens exceeds the context of ", block_size);
    auto pos = torch::arange(T, x.options());
    x = drop(wte(x) + wpe(pos));
  }
  // Through FSDP; the sequence is split at h.0 and gathered after the model's last block by the plan (as GPTImpl).
  for (auto& b : blocks) x = b(x);
  if (lm_head) x = lm_head(ln_f(x));
  return x;
}

}  // namespace train_gpt
