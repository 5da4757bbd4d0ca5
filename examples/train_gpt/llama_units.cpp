// llama_units: model_llama.h's formulas on given tensors, for tests/python/test_llama.py, which checks each against
// transformers' own (LlamaRMSNorm, the llama3 RoPE frequencies and LlamaRotaryEmbedding, apply_rotary_pos_emb,
// repeat_kv + eager attention).
//
//   llama_units IN.safetensors OUT.safetensors HEAD_DIM THETA ROPE_TYPE FACTOR LOW HIGH ORIGINAL EPS
//
// IN holds x [B, T, C], w [C] (RMSNorm), q [B, H, T, D], k and v [B, KV, T, D]; OUT gets rms = rms_norm(x, w, EPS),
// inv_freq = rope_inv_freq(...), cos and sin = rope_cos_sin(inv_freq, T), q_rot = apply_rotary(q, cos, sin),
// attn = gqa_attention(q, k, v, 0). Exit status 2 with a usage line for wrong arguments.
#include <cstdlib>
#include <iostream>
#include <string>

#include "fsdp/checkpoint/checkpoint.h"
#include "model_llama.h"

int main(int argc, char** argv) {
  if (argc != 11) {
    std::cerr << "usage: llama_units IN.safetensors OUT.safetensors HEAD_DIM THETA ROPE_TYPE FACTOR LOW HIGH ORIGINAL "
                 "EPS\n";
    return 2;
  }
  try {
    auto in = fsdp::dcp::load_file(argv[1]);
    train_gpt::GPTConfig cfg;
    cfg.arch = "llama";
    const int64_t head_dim = std::stoll(argv[3]);
    cfg.n_head = 1, cfg.n_embd = head_dim;  // head_dim() = n_embd / n_head
    cfg.rope_theta = std::stod(argv[4]);
    cfg.rope_type = argv[5];
    cfg.rope_factor = std::stod(argv[6]);
    cfg.rope_low_freq_factor = std::stod(argv[7]);
    cfg.rope_high_freq_factor = std::stod(argv[8]);
    cfg.rope_original_max_positions = std::stoll(argv[9]);
    const double eps = std::stod(argv[10]);
    const auto& q = in.at("q");
    auto inv_freq = train_gpt::rope_inv_freq(cfg);
    auto [cos, sin] = train_gpt::rope_cos_sin(inv_freq, q.size(2));
    fsdp::dcp::save_file({{"rms", train_gpt::rms_norm(in.at("x"), in.at("w"), eps)},
                          {"inv_freq", inv_freq},
                          {"cos", cos},
                          {"sin", sin},
                          {"q_rot", train_gpt::apply_rotary(q, cos, sin)},
                          {"attn", train_gpt::gqa_attention(q, in.at("k"), in.at("v"), 0.0)}},
                         argv[2]);
  } catch (const std::exception& e) {
    std::cerr << "llama_units: error: " << e.what() << std::endl;
    return 1;
  }
  return 0;
}
