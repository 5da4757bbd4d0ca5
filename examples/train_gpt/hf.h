// Hugging Face checkpoints in and out (issue 33, item 2), for both architectures:
//   --init-from DIR    the model's shape from DIR/config.json (LlamaForCausalLM or GPT2LMHeadModel; anything this
//                      trainer would compute differently is refused, naming the field), its weights from
//                      DIR/model.safetensors or DIR/model.safetensors.index.json and its shards, read straight
//                      into the sharded model by fsdp::dcp::load (each rank reads only its own rows);
//   --export-hf DIR    after training: DIR/config.json and DIR/model.safetensors (or model-0000i-of-0000n plus
//                      model.safetensors.index.json above --export-max-file-mb), which transformers'
//                      from_pretrained loads;
//   --logits-tokens F --dump-logits OUT   the logits of fixed tokens after initialisation and after training, for
//                      the parity tests against transformers (tests/python/test_llama.py).
// Names: Llama's are Hugging Face's already (model_llama.h). GPT's are GPT-2's without the "transformer." prefix
// (wte.weight, h.N.attn.c_attn.weight, ...: kept for the existing checkpoints and twins), so the prefix is added
// here; and Hugging Face's GPT-2 stores c_attn, c_proj and c_fc as Conv1D, weight [in, out], the transpose of our
// Linear's [out, in]: transposed on the way in (a transposed view of the shard, so each rank still reads only its
// own slice) and on the way out.
#pragma once

#include <string>
#include <vector>
#include <utility>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "fsdp/fsdp.h"
#include "model.h"

namespace train_gpt {

/// The model shape of the Hugging Face folder `dir` (its config.json): model_type "llama" or "gpt2". Throws
/// UsageError naming the field and its value for what this trainer does not compute the same way: another
/// model_type; Llama: hidden_act other than silu, attention_bias or mlp_bias true, a rope type other than
/// default/llama3, head_dim other than hidden_size / num_attention_heads, pretraining_tp other than 1,
/// partial_rotary_factor other than 1; GPT-2: activation_function other than gelu_new (or gelu_pytorch_tanh, the
/// same function), layer_norm_epsilon other than 1e-5, n_inner other than 4 * n_embd, scale_attn_weights false,
/// scale_attn_by_inverse_layer_idx, reorder_and_upcast_attn or add_cross_attention true, resid_pdrop,
/// embd_pdrop and attn_pdrop not all equal. Example: `auto cfg = read_hf_config("hf/llama-tiny");`
GPTConfig read_hf_config(const std::string& dir);

/// config.json for `cfg`: `base` (the --init-from folder's config.json, so token ids and other fields the
/// trainer does not use survive; null: none) with the architecture and shape fields set from `cfg`, torch_dtype
/// float32. Example: `hf_config_json(cfg, nullptr).dump(2)`.
nlohmann::json hf_config_json(const GPTConfig& cfg, const nlohmann::json& base);

/// The Hugging Face name of our parameter `name` and whether its Hugging Face tensor is the transpose of ours
/// (GPT-2's Conv1D weights). Example: `hf_name(gpt2_cfg, "h.0.attn.c_attn.weight")` is
/// {"transformer.h.0.attn.c_attn.weight", true}.
std::pair<std::string, bool> hf_name(const GPTConfig& cfg, const std::string& name);

/// Loads the weights of the Hugging Face folder `dir` into `model` (sharded or not), in place. Collective over the
/// model's group: call on every rank. The keys are checked first (on every rank, from the files' headers): a
/// parameter without a tensor in the folder, or a tensor in the folder without a parameter (other than
/// non-persistent buffers older transformers saved: attn.bias, attn.masked_bias, rotary_emb.inv_freq), throws
/// UsageError naming it, before anything is read. Returns the bytes this rank read. A tied head is loaded once,
/// as the embedding (Hugging Face's files leave lm_head.weight out when tied). Floating-point files of another dtype
/// (bf16) convert to the parameters' dtype. Throws UsageError for an unreadable folder, a shape that differs (naming
/// the tensor and both shapes) or an I/O error. Example: `load_hf_weights(*model, s.cfg, "hf/llama")` after
/// parallelize() and materialize_module().
int64_t load_hf_weights(torch::nn::Module& model, const GPTConfig& cfg, const std::string& dir);

/// Writes `model` (sharded or not) as a Hugging Face folder `out_dir` (created): config.json (hf_config_json of
/// `base`) and model.safetensors in fp32, or, when the tensors exceed `max_file_bytes` (> 0), several files
/// model-0000i-of-0000n.safetensors of at most that size (a tensor larger than it alone in its file) plus
/// model.safetensors.index.json. Collective: every rank gathers one file's tensors at a time (full_tensor()),
/// rank 0 writes them, so rank 0 holds at most one file's tensors. Throws UsageError when `out_dir` cannot be
/// written. Example: `export_hf(*model, cfg, "out/hf", nullptr, 0, *pg)`.
void export_hf(const torch::nn::Module& model, const GPTConfig& cfg, const std::string& out_dir,
               const nlohmann::json& base, int64_t max_file_bytes, fsdp::ProcessGroup& pg);

/// Copies the run's tokenizer next to an export, so that the folder generates text as it is: the Hugging Face
/// tokenizer files of `init_from` (tokenizer.model, tokenizer.json, tokenizer_config.json, special_tokens_map.json,
/// generation_config.json; those present), and `tokenizer` (--tokenizer FILE.model, "" or "bytes": none) as
/// tokenizer.model. Rank 0 only. Returns the names copied. Throws UsageError naming a file that cannot be copied.
/// Example: `copy_tokenizer_files(o.init_from, o.tokenizer, o.export_hf)`.
std::vector<std::string> copy_tokenizer_files(const std::string& init_from, const std::string& tokenizer,
                                              const std::string& out_dir);

/// --logits-tokens FILE: the int64 tensor "tokens" [B, T] of the safetensors file FILE (written by e.g.
/// safetensors.torch.save_file). Throws UsageError when it is missing, of another dtype or rank, or longer than
/// `block_size`, or holds an id outside [0, vocab_size). Example: `auto tokens = read_logits_tokens("t.safetensors", cfg);`
torch::Tensor read_logits_tokens(const std::string& path, const GPTConfig& cfg);

/// The fp32 CPU logits [B, T, vocab] of `tokens` under `model` in eval mode, without gradients (collective under
/// FSDP: every rank runs the forward). Example: `logits_of(model, tokens, pg.device())`.
template <typename Model>
torch::Tensor logits_of(Model& model, const torch::Tensor& tokens, const torch::Device& device) {
  model->eval();
  torch::NoGradGuard no_grad;
  auto logits = model(tokens.to(device)).to(torch::kCPU, torch::kFloat32);
  model->train();
  return logits;
}

}  // namespace train_gpt
