// --estimate-memory (issue 14): fsdp::estimate_memory for train_gpt's model and options.
#include "memory_estimate.h"

#include <algorithm>
#include <cstdlib>
#include <iostream>

#include "fsdp/fsdp.h"
#include "model.h"
#include "model_llama.h"

namespace train_gpt {
namespace {

/// The activations of one microbatch's forward + backward on one rank, from the model shape: what autograd
/// saves (B x T x C elements unless said otherwise, in the compute dtype e), counted from model.cpp's forward:
///   per block 16: its input (saved by ln_1), ln_1's output (by c_attn), qkv 3 (by SDPA, as q/k/v views),
///     SDPA's output 1 (also c_proj's input: LibTorch's CPU flash attention allocates it [B, T, H, D], so
///     transpose(1, 2).contiguous() is free), the residual sum 1 (by ln_2), ln_2's
///     output 1 (by c_fc), c_fc's output 4 (by GELU), GELU's output 4 (by mlp.c_proj); plus fp32 stats:
///     LayerNorm mean + rstd (2 x 2 x B x T) and SDPA's logsumexp (B x H x T);
///   selective-op (train_gpt's selective_op_policy: c_attn's and c_fc's outputs and SDPA's saved, c_proj's and
///     mlp.c_proj's recomputed): the input 1, qkv 3, SDPA's output 1 and logsumexp, c_fc's output 4;
///   the rest: the last block's output (by ln_f) 1, ln_f's output 1 (by lm_head), the logits B x T x V in e
///     (train_step keeps them), log_softmax's fp32 output B x T x V (by nll_loss);
///   backward temporaries: the loss's two fp32 B x T x V gradients, then a block's MLP gradients (4 + 4 + 2
///     residual).
fsdp::ActivationProfile gpt_activation_profile(const GPTConfig& c, int64_t batch, int64_t e) {
  const int64_t B = batch, T = c.block_size, C = c.n_embd, H = c.n_head, V = c.vocab_size;
  const int64_t btc = B * T * C * e;
  const int64_t ln_stats = 2 * 2 * B * T * 4, sdpa_stats = B * H * T * 4;
  fsdp::ActivationProfile p;
  p.blocks = c.n_layer;
  p.block_saved = 16 * btc + ln_stats + sdpa_stats;
  p.block_input = btc;
  p.block_selective = 9 * btc + sdpa_stats;
  p.other_saved = 2 * btc + B * T * V * e + B * T * V * 4;
  p.head_backward_temporary = 2 * B * T * V * 4;
  p.block_backward_temporary = 10 * btc;
  return p;
}

/// The same for Llama (model_llama.cpp's forward), B x T x C elements in the compute dtype e unless said otherwise:
///   per layer: its input 1 (the residual) and the fp32 upcast of each RMSNorm's input (2 x 4/e) with the normed
///     value and the norm's output (2 x 2), q 1 and k, v 2 x KV/H (before and after RoPE: x 2), SDPA's output 1,
///     the residual sum 1, the MLP's gate, silu(gate), up and their product 4 x I/C; fp32 stats: the norms' rsqrt
///     (2 x B x T) and SDPA's logsumexp (B x H x T);
///   selective-op: the input 1, q, k, v after RoPE, SDPA's output and logsumexp, the gate and up outputs 2 x I/C;
///   the rest: the last layer's output and the final norm's (as per layer: 1 + 4/e + 2), the logits B x T x V in e
///     and log_softmax's fp32 output; backward temporaries as GPT's, with the MLP's 3 x I/C + 2.
fsdp::ActivationProfile llama_activation_profile(const GPTConfig& c, int64_t batch, int64_t e) {
  const int64_t B = batch, T = c.block_size, C = c.n_embd, H = c.n_head, V = c.vocab_size;
  const int64_t I = c.mlp_width(), KV = c.kv_heads() * c.head_dim();
  const int64_t bt = B * T;
  const int64_t norm = bt * C * 4 + 2 * bt * C * e + bt * 4;  // fp32 input, normed and scaled output, rsqrt
  const int64_t qkv = bt * (C + 2 * KV) * e;
  fsdp::ActivationProfile p;
  p.blocks = c.n_layer;
  p.block_saved = bt * C * e + 2 * norm + 2 * qkv + bt * C * e + bt * C * e + 4 * bt * I * e + B * H * T * 4;
  p.block_input = bt * C * e;
  p.block_selective = bt * C * e + qkv + bt * C * e + B * H * T * 4 + 2 * bt * I * e;
  p.other_saved = bt * C * e + norm + B * T * V * e + B * T * V * 4;
  p.head_backward_temporary = 2 * B * T * V * 4;
  p.block_backward_temporary = (3 * bt * I + 2 * bt * C) * e;
  return p;
}

/// --activation-checkpointing as the estimator's mode.
fsdp::ActivationCheckpointing activation_checkpointing(const std::string& mode) {
  using Mode = fsdp::ActivationCheckpointing::Mode;
  if (mode == "full") return {Mode::full, 1};
  if (mode == "selective-op") return {Mode::selective, 1};
  if (mode.rfind("layer:", 0) == 0) return {Mode::full, std::stoll(mode.substr(6))};
  return {};
}

// LibTorch's own first-use memory on the CPU over the process baseline, independent of the model: the
// OpenMP and autograd threads, oneDNN/MKL scratch and JIT code, glibc's per-thread arenas. Measured with
// the tiny preset (model states and activations < 1 MiB, so its RSS growth is this overhead): 15 MiB in
// fp32, 28 MiB with bf16/fp16 compute (oneDNN's reduced-precision kernels); see docs/BENCHMARKS.md,
// "Memory estimator (issue 14, part 2)".
int64_t cpu_runtime_overhead_bytes(torch::ScalarType compute) {
  return (compute == torch::kFloat32 ? 15 : 28) * (int64_t(1) << 20);
}

}  // namespace

/// Prints fsdp::estimate_memory's breakdown for this run (rank 0) without building anything but meta
/// tensors: the same groups parallelize() makes (every block, then the root, which keeps its parameters
/// unsharded from forward to backward).
void print_memory_estimate(const RunSetup& s, int world, int rank, bool cuda) {
  const Options& o = s.opts;
  // Meta tensors: sizes and dtypes only (an 8B or 70B Llama allocates nothing).
  std::shared_ptr<torch::nn::Module> model;
  if (s.cfg.is_llama()) {
    model = fsdp::deferred_init([&] { return Llama(s.cfg); }).ptr();
  } else {
    model = fsdp::deferred_init([&] { return GPT(s.cfg); }).ptr();
  }
  std::vector<std::string> sharded = {""};  // forward order: the root (embeddings) first, then the blocks
  // Llama untied: the embedding and the head are groups of their own (parallelize.cpp), the head kept gathered.
  const bool llama_own_groups = s.cfg.is_llama() && !s.cfg.tie_weights;
  if (llama_own_groups) sharded.push_back("model.embed_tokens");
  for (int64_t i = 0; i < s.cfg.n_layer; ++i) {
    sharded.push_back((s.cfg.is_llama() ? "model.layers." : "h.") + std::to_string(i));
  }
  if (llama_own_groups) sharded.push_back("lm_head");
  auto groups = fsdp::shard_groups(*model, sharded);
  groups[0].reshard_after_forward = false;  // the root's default
  if (llama_own_groups) groups.back().reshard_after_forward = false;
  fsdp::MemoryEstimateOptions eo;
  eo.world_size = world;
  eo.reshard_after_forward = o.reshard_after_forward != "false";  // N (a slice kept) counts as true
  if (s.parallel.param_dtype != torch::kFloat32) {
    eo.param_dtype = s.parallel.param_dtype;
    eo.reduce_dtype = torch::kFloat32;
  }
  eo.cpu_offload = o.cpu_offload;
  eo.device_is_cpu = !cuda;
  // CPU ranks of one host share memory (make_gloo_group's transport) unless it is turned off; across hosts
  // (LOCAL_WORLD_SIZE below the world) Gloo's sockets hold an output and receive buffers beside FSDP's.
  const char* local = std::getenv("LOCAL_WORLD_SIZE");
  const char* shm = std::getenv("FSDP_SHM_TRANSPORT");
  eo.cpu_shared_memory =
      !(local && std::atoi(local) > 0 && std::atoi(local) < world) && !(shm && std::string(shm) == "0");
  eo.optimizer_bytes_per_element = 8.0;  // AdamW: exp_avg + exp_avg_sq in fp32
  const int64_t e = static_cast<int64_t>(c10::elementSize(s.parallel.param_dtype));
  eo.activation_bytes = fsdp::activation_peak_bytes(s.cfg.is_llama() ? llama_activation_profile(s.cfg, o.batch_size, e)
                                                                     : gpt_activation_profile(s.cfg, o.batch_size, e),
                                                   activation_checkpointing(o.activation_checkpointing));
  eo.runtime_overhead_bytes = cuda ? 0 : cpu_runtime_overhead_bytes(s.parallel.param_dtype);
  const auto est = fsdp::estimate_memory(fsdp::param_infos(*model), groups, eo);
  if (rank != 0) return;
  std::cout << "memory estimate per rank: " << describe(s.cfg) << ", " << est.num_params << " parameters, "
            << world << (world == 1 ? " rank" : " ranks") << ", batch " << o.batch_size << ", " << o.mixed_precision
            << ", reshard_after_forward " << o.reshard_after_forward
            << (o.activation_checkpointing != "none" ? ", activation checkpointing " + o.activation_checkpointing : "")
            << (o.cpu_offload ? ", cpu offload" : "")
            << (cuda ? " (CUDA: the caching allocator's peak)" : " (CPU: RSS growth over the process baseline)") << "\n"
            << fsdp::format_memory_estimate(est);
}

}  // namespace train_gpt
