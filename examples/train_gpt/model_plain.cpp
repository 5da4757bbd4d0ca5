#include "model_plain.h"

#include "fsdp/utils/activation_checkpoint.h"

namespace train_gpt {

PlainBlockImpl::PlainBlockImpl(const GPTConfig& cfg) {
  ln_1 = register_module("ln_1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({cfg.n_embd})));
  attn = register_module("attn", CausalSelfAttention(cfg));
  ln_2 = register_module("ln_2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({cfg.n_embd})));
  mlp = register_module("mlp", torch::nn::Sequential({
                                   {"c_fc", torch::nn::Linear(cfg.n_embd, 4 * cfg.n_embd)},
                                   {"gelu", torch::nn::GELU(torch::nn::GELUOptions().approximate("tanh"))},
                                   {"c_proj", torch::nn::Linear(4 * cfg.n_embd, cfg.n_embd)},
                                   {"dropout", torch::nn::Dropout(cfg.dropout)},
                               }));
}

torch::Tensor PlainBlockImpl::forward(torch::Tensor x) {
  x = x + attn(ln_1(x));
  // The MLP on [B*T, C]: torch::nn::Linear fuses its bias into the matmul (addmm, one rounding, as
  // at::linear and PyTorch's nn.Linear do for any input) only for 2-D inputs. So both variants compute
  // the same bits, in bf16 too.
  const auto h = ln_2(x);
  return x + mlp->forward(h.flatten(0, 1)).view_as(h);
}

PlainGPTImpl::PlainGPTImpl(const GPTConfig& config) : cfg(config) {
  validate(cfg);
  wte = register_module("wte", torch::nn::Embedding(cfg.vocab_size, cfg.n_embd));
  wpe = register_module("wpe", torch::nn::Embedding(cfg.block_size, cfg.n_embd));
  drop = register_module("drop", torch::nn::Dropout(cfg.dropout));
  h = register_module("h", torch::nn::ModuleList());
  for (int64_t i = 0; i < cfg.n_layer; ++i) h->push_back(PlainBlock(cfg));
  ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({cfg.n_embd})));
  lm_head = register_module("lm_head", LMHead(cfg, cfg.tie_weights ? wte->weight : torch::Tensor()));
  num_params_ = init_gpt2_weights(*this, cfg);
}

torch::Tensor PlainGPTImpl::forward(const torch::Tensor& idx) {
  const auto T = idx.size(1);
  TORCH_CHECK(T <= cfg.block_size, "GPT: sequence of ", T, " tokens exceeds the context of ", cfg.block_size);
  auto pos = torch::arange(T, idx.options());
  auto x = drop(wte(idx) + wpe(pos));  // [B, T, C]
  if (sequence_parallel_mesh) x = fsdp::tp::distribute_sequence(x, sequence_parallel_mesh);  // [B, T / tp, C]
  for (const auto& block : *h) x = block->as<PlainBlock>()->forward(x);
  if (sequence_parallel_mesh) x = fsdp::tp::gather_sequence(x, sequence_parallel_mesh);
  return lm_head(ln_f(x));  // [B, T, vocab]
}

PlainGPTStageImpl::PlainGPTStageImpl(const PlainGPTImpl& model, int64_t first_layer, int64_t end_layer, bool is_first,
                                     bool is_last)
    : block_size(model.cfg.block_size) {
  TORCH_CHECK(0 <= first_layer && first_layer < end_layer && end_layer <= model.cfg.n_layer, "PlainGPTStage: blocks [",
              first_layer, ", ", end_layer, ") out of the model's ", model.cfg.n_layer);
  if (is_first) {
    wte = register_module("wte", model.wte);
    wpe = register_module("wpe", model.wpe);
    drop = register_module("drop", model.drop);
  }
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> named;
  for (int64_t i = first_layer; i < end_layer; ++i) named.emplace_back(std::to_string(i), model.h->ptr(i));
  h = register_module("h", torch::nn::ModuleDict(named));
  if (is_last) {
    ln_f = register_module("ln_f", model.ln_f);
    lm_head = register_module("lm_head", stage_head(model.cfg, model.lm_head, is_first));  // tied: a copy
  }
}

torch::Tensor PlainGPTStageImpl::forward(const torch::Tensor& input) {
  torch::Tensor x = input;
  if (wte) {  // as PlainGPTImpl::forward
    const auto T = x.size(1);
    TORCH_CHECK(T <= block_size, "PlainGPTStage: sequence of ", T, " tokens exceeds the context of ", block_size);
    auto pos = torch::arange(T, x.options());
    x = drop(wte(x) + wpe(pos));
    if (sequence_parallel_mesh) x = fsdp::tp::distribute_sequence(x, sequence_parallel_mesh);
  }
  for (const auto& block : h->values()) x = block->as<PlainBlock>()->forward(x);  // in index order (insertion)
  if (lm_head) {
    if (sequence_parallel_mesh) x = fsdp::tp::gather_sequence(x, sequence_parallel_mesh);
    x = lm_head(ln_f(x));
  }
  return x;
}

}  // namespace train_gpt
