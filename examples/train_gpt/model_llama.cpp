#include "model_llama.h"

#include <cmath>
#include <stdexcept>
#include <unordered_set>

namespace train_gpt {

// ---- The formulas ---------------------------------------------------------------------------------------

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  // In fp32 whatever the compute dtype, then back (LlamaRMSNorm): bf16's mean of squares loses the small rows.
  const auto h = x.to(torch::kFloat32);
  const auto variance = h.pow(2).mean(-1, /*keepdim=*/true);
  return weight * (h * torch::rsqrt(variance + eps)).to(x.scalar_type());
}

torch::Tensor rope_inv_freq(const GPTConfig& cfg) {
  const int64_t D = cfg.head_dim();
  // 1 / theta^(2i / D) in fp32: transformers computes the exponent as arange(0, D, 2).float() / D and the power
  // in fp32, which this reproduces bit for bit (the same ops in the same dtype).
  auto exponent = torch::arange(0, D, 2, torch::kInt64).to(torch::kFloat32) / static_cast<double>(D);
  auto inv_freq = 1.0 / torch::pow(cfg.rope_theta, exponent);
  if (cfg.rope_type == "default") return inv_freq;
  if (cfg.rope_type != "llama3") throw std::invalid_argument("rope type '" + cfg.rope_type + "' is not supported");
  // Llama 3.1: low frequencies (long wavelengths) slowed down by `factor`, high ones kept, a smooth ramp between.
  const double factor = cfg.rope_factor, low = cfg.rope_low_freq_factor, high = cfg.rope_high_freq_factor;
  const double old_context = static_cast<double>(cfg.rope_original_max_positions);
  const double low_freq_wavelen = old_context / low, high_freq_wavelen = old_context / high;
  auto wavelen = 2 * M_PI / inv_freq;
  auto scaled = torch::where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq);
  auto smooth = (old_context / wavelen - low) / (high - low);
  auto smoothed = (1 - smooth) * scaled / factor + smooth * scaled;
  auto medium = (wavelen >= high_freq_wavelen).logical_and(wavelen <= low_freq_wavelen);
  return torch::where(medium, smoothed, scaled);
}

std::pair<torch::Tensor, torch::Tensor> rope_cos_sin(const torch::Tensor& inv_freq, int64_t T) {
  auto pos = torch::arange(T, torch::kInt64).to(torch::kFloat32);
  auto freqs = pos.unsqueeze(1) * inv_freq.unsqueeze(0);  // [T, D / 2], as position_ids[..., None] * inv_freq
  auto emb = torch::cat({freqs, freqs}, -1);               // [T, D]
  return {emb.cos(), emb.sin()};
}

torch::Tensor rotate_half(const torch::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

torch::Tensor apply_rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  return x * cos + rotate_half(x) * sin;
}

torch::Tensor gqa_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, double dropout_p) {
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "gqa_attention: ", k.size(1), " key/value heads do not divide ", q.size(1),
              " query heads");
  // enable_gqa: SDPA maps query head h to key/value head h / (H / KV), transformers' repeat_kv, without
  // materialising the repeated k and v (the flash kernels read them in place).
  return torch::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, dropout_p, /*is_causal=*/true,
                                             /*scale=*/std::nullopt, /*enable_gqa=*/k.size(1) != q.size(1));
}

// ---- Modules ----------------------------------------------------------------------------------------------

RMSNormImpl::RMSNormImpl(int64_t dim, double eps_) : eps(eps_) {
  weight = register_parameter("weight", torch::ones({dim}));
}

std::pair<torch::Tensor, torch::Tensor> RotaryCache::get(int64_t T, const torch::Device& device,
                                                         torch::ScalarType dtype) {
  if (cos_.defined() && cos_.size(0) == T && cos_.device() == device && cos_.scalar_type() == dtype) return {cos_, sin_};
  if (!inv_freq_.defined()) inv_freq_ = rope_inv_freq(cfg_);
  auto [cos, sin] = rope_cos_sin(inv_freq_, T);
  cos_ = cos.to(device, dtype);
  sin_ = sin.to(device, dtype);
  return {cos_, sin_};
}

LlamaAttentionImpl::LlamaAttentionImpl(const GPTConfig& cfg, std::shared_ptr<RotaryCache> rope_)
    : n_head(cfg.n_head), n_kv_head(cfg.kv_heads()), head_dim(cfg.head_dim()), dropout(cfg.dropout),
      rope(std::move(rope_)) {
  auto linear = [](int64_t in, int64_t out) { return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false)); };
  q_proj = register_module("q_proj", linear(cfg.n_embd, n_head * head_dim));
  k_proj = register_module("k_proj", linear(cfg.n_embd, n_kv_head * head_dim));
  v_proj = register_module("v_proj", linear(cfg.n_embd, n_kv_head * head_dim));
  o_proj = register_module("o_proj", linear(n_head * head_dim, cfg.n_embd));
}

torch::Tensor LlamaAttentionImpl::forward(const torch::Tensor& x) {
  // Sizes from the projections' outputs, not x: under tensor parallelism (--tp) this rank computes n_head / tp
  // heads, and under sequence parallelism x holds this rank's positions while q, k, v hold the whole sequence.
  auto qf = at::linear(x, q_proj->weight);
  const auto B = qf.size(0), T = qf.size(1);
  auto heads = [&](const torch::Tensor& t) { return t.view({B, T, -1, head_dim}).transpose(1, 2); };
  auto q = heads(qf);  // [B, H, T, D]
  auto k = heads(at::linear(x, k_proj->weight));
  auto v = heads(at::linear(x, v_proj->weight));
  auto [cos, sin] = rope->get(T, x.device(), x.scalar_type());
  q = apply_rotary(q, cos, sin);
  k = apply_rotary(k, cos, sin);
  auto y = gqa_attention(q, k, v, is_training() ? dropout : 0.0);  // [B, H, T, D]
  return at::linear(y.transpose(1, 2).reshape({B, T, -1}), o_proj->weight);
}

LlamaMLPImpl::LlamaMLPImpl(const GPTConfig& cfg) {
  auto linear = [](int64_t in, int64_t out) { return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false)); };
  gate_proj = register_module("gate_proj", linear(cfg.n_embd, cfg.mlp_width()));
  up_proj = register_module("up_proj", linear(cfg.n_embd, cfg.mlp_width()));
  down_proj = register_module("down_proj", linear(cfg.mlp_width(), cfg.n_embd));
}

torch::Tensor LlamaMLPImpl::forward(const torch::Tensor& x) {
  return at::linear(torch::silu(at::linear(x, gate_proj->weight)) * at::linear(x, up_proj->weight), down_proj->weight);
}

LlamaDecoderLayerImpl::LlamaDecoderLayerImpl(const GPTConfig& cfg, std::shared_ptr<RotaryCache> rope) {
  // Hugging Face's registration order (self_attn, mlp, then the norms): the same order of named_parameters().
  self_attn = register_module("self_attn", LlamaAttention(cfg, std::move(rope)));
  mlp = register_module("mlp", LlamaMLP(cfg));
  input_layernorm = register_module("input_layernorm", RMSNorm(cfg.n_embd, cfg.norm_eps));
  post_attention_layernorm = register_module("post_attention_layernorm", RMSNorm(cfg.n_embd, cfg.norm_eps));
}

torch::Tensor LlamaDecoderLayerImpl::forward(torch::Tensor x) {
  x = x + self_attn(input_layernorm(x));
  return x + mlp(post_attention_layernorm(x));
}

LlamaModelImpl::LlamaModelImpl(const GPTConfig& cfg, const std::shared_ptr<RotaryCache>& rope) {
  embed_tokens = register_module("embed_tokens", torch::nn::Embedding(cfg.vocab_size, cfg.n_embd));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < cfg.n_layer; ++i) layers->push_back(LlamaDecoderLayer(cfg, rope));
  norm = register_module("norm", RMSNorm(cfg.n_embd, cfg.norm_eps));
}

namespace {

// Hugging Face's _init_weights for Llama: Linear and Embedding weights ~ N(0, initializer_range 0.02), RMSNorm
// weights 1 (already). Registration order, a tied weight once, so a seed fixes the weights. Returns the number of
// distinct parameter elements.
int64_t init_llama_weights(torch::nn::Module& model) {
  torch::NoGradGuard no_grad;
  std::unordered_set<const void*> seen;
  int64_t n = 0;
  for (auto& p : model.named_parameters()) {
    auto& t = p.value();
    if (!seen.insert(t.unsafeGetTensorImpl()).second) continue;
    if (t.dim() >= 2) t.normal_(0.0, 0.02);
    n += t.numel();
  }
  return n;
}

}  // namespace

LlamaImpl::LlamaImpl(const GPTConfig& config) : cfg(config) {
  validate(cfg);
  TORCH_CHECK(cfg.is_llama(), "Llama: the config's arch is '", cfg.arch, "', not llama");
  rope_ = std::make_shared<RotaryCache>(cfg);
  model = register_module("model", LlamaModel(cfg, rope_));
  for (const auto& layer : *model->layers) {
    blocks.push_back(LlamaDecoderLayer(std::dynamic_pointer_cast<LlamaDecoderLayerImpl>(layer)));
  }
  lm_head = register_module("lm_head", LMHead(cfg, cfg.tie_weights ? model->embed_tokens->weight : torch::Tensor()));
  embed = model->embed_tokens;
  head = lm_head;
  num_params_ = init_llama_weights(*this);
}

torch::Tensor LlamaImpl::forward(const torch::Tensor& idx) {
  TORCH_CHECK(idx.size(1) <= cfg.block_size, "Llama: sequence of ", idx.size(1), " tokens exceeds the context of ",
              cfg.block_size);
  auto x = embed(idx);              // [B, T, C]
  for (auto& b : blocks) x = b(x);  // through FSDP: unshard before, reshard after each layer
  return head(model->norm(x));      // [B, T, vocab]
}

PlainLlamaImpl::PlainLlamaImpl(const GPTConfig& config) : cfg(config) {
  validate(cfg);
  TORCH_CHECK(cfg.is_llama(), "PlainLlama: the config's arch is '", cfg.arch, "', not llama");
  rope_ = std::make_shared<RotaryCache>(cfg);
  model = register_module("model", LlamaModel(cfg, rope_));
  lm_head = register_module("lm_head", LMHead(cfg, cfg.tie_weights ? model->embed_tokens->weight : torch::Tensor()));
  num_params_ = init_llama_weights(*this);
}

torch::Tensor PlainLlamaImpl::forward(const torch::Tensor& idx) {
  TORCH_CHECK(idx.size(1) <= cfg.block_size, "Llama: sequence of ", idx.size(1), " tokens exceeds the context of ",
              cfg.block_size);
  auto x = model->embed_tokens(idx);
  // --sequence-parallel: no call boundary in this unchanged model ([Note: sequence boundaries in train_gpt]).
  if (sequence_parallel_mesh) x = fsdp::tp::distribute_sequence(x, sequence_parallel_mesh);  // [B, T / tp, C]
  for (const auto& layer : *model->layers) x = layer->as<LlamaDecoderLayerImpl>()->forward(x);
  if (sequence_parallel_mesh) x = fsdp::tp::gather_sequence(x, sequence_parallel_mesh);
  return lm_head(model->norm(x));
}

// ---- Pipeline stages (--pp) --------------------------------------------------------------------------

namespace {
/// The decoder layers [first, end) of `layers` under their index, for a stage's "model.layers".
torch::nn::ModuleDict stage_layers_of(const torch::nn::ModuleList& layers, int64_t first, int64_t end) {
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> named;
  for (int64_t i = first; i < end; ++i) named.emplace_back(std::to_string(i), layers->ptr(i));
  return torch::nn::ModuleDict(named);
}
}  // namespace

LlamaStageImpl::LlamaStageImpl(const LlamaImpl& m, int64_t first_layer, int64_t end_layer, bool is_first, bool is_last)
    : cfg(m.cfg) {
  TORCH_CHECK(0 <= first_layer && first_layer < end_layer && end_layer <= cfg.n_layer, "LlamaStage: layers [",
              first_layer, ", ", end_layer, ") out of the model's ", cfg.n_layer);
  // Registration order as LlamaImpl's: model.embed_tokens, model.layers, model.norm, lm_head.
  model = register_module("model", std::make_shared<torch::nn::Module>("LlamaModel"));
  if (is_first) embed = model->register_module("embed_tokens", m.model->embed_tokens);
  layers = model->register_module("layers", stage_layers_of(m.model->layers, first_layer, end_layer));
  for (int64_t i = first_layer; i < end_layer; ++i) blocks.push_back(m.blocks[i]);
  if (is_last) {
    norm = model->register_module("norm", m.model->norm);
    lm_head = register_module("lm_head", stage_head(cfg, m.lm_head, is_first));
    head = lm_head;
  }
}

torch::Tensor LlamaStageImpl::forward(const torch::Tensor& input) {
  torch::Tensor x = input;
  if (!embed.is_empty()) {  // as LlamaImpl::forward
    TORCH_CHECK(x.size(1) <= cfg.block_size, "Llama: sequence of ", x.size(1), " tokens exceeds the context of ",
                cfg.block_size);
    x = embed(x);
  }
  for (auto& b : blocks) x = b(x);  // through FSDP: unshard before, reshard after each layer
  if (!head.is_empty()) x = head(norm(x));
  return x;
}

PlainLlamaStageImpl::PlainLlamaStageImpl(const PlainLlamaImpl& m, int64_t first_layer, int64_t end_layer, bool is_first,
                                         bool is_last)
    : cfg(m.cfg) {
  TORCH_CHECK(0 <= first_layer && first_layer < end_layer && end_layer <= cfg.n_layer, "PlainLlamaStage: layers [",
              first_layer, ", ", end_layer, ") out of the model's ", cfg.n_layer);
  model = register_module("model", std::make_shared<torch::nn::Module>("LlamaModel"));
  if (is_first) embed_tokens = model->register_module("embed_tokens", m.model->embed_tokens);
  layers = model->register_module("layers", stage_layers_of(m.model->layers, first_layer, end_layer));
  if (is_last) {
    norm = model->register_module("norm", m.model->norm);
    lm_head = register_module("lm_head", stage_head(cfg, m.lm_head, is_first));
  }
}

torch::Tensor PlainLlamaStageImpl::forward(const torch::Tensor& input) {
  torch::Tensor x = input;
  if (embed_tokens) {
    TORCH_CHECK(x.size(1) <= cfg.block_size, "Llama: sequence of ", x.size(1), " tokens exceeds the context of ",
                cfg.block_size);
    x = embed_tokens(x);
    if (sequence_parallel_mesh) x = fsdp::tp::distribute_sequence(x, sequence_parallel_mesh);
  }
  for (const auto& layer : layers->values()) x = layer->as<LlamaDecoderLayerImpl>()->forward(x);
  if (lm_head) {
    if (sequence_parallel_mesh) x = fsdp::tp::gather_sequence(x, sequence_parallel_mesh);
    x = lm_head(norm(x));
  }
  return x;
}

}  // namespace train_gpt
