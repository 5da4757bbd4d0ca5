#include "hf.h"

#include <algorithm>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <map>
#include <set>
#include <sstream>
#include <vector>

#include "data.h"  // UsageError
#include "options.h"  // one_line, fmt

namespace train_gpt {
namespace {

namespace fs = std::filesystem;

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

/// A field of config.json, read with its Hugging Face default when absent or null.
template <typename T>
T field(const nlohmann::json& j, const char* name, T fallback) {
  const auto it = j.find(name);
  if (it == j.end() || it->is_null()) return fallback;
  try {
    return it->get<T>();
  } catch (const nlohmann::json::exception&) {
    throw UsageError("--init-from: config.json: " + std::string(name) + "=" + it->dump() + " has the wrong type");
  }
}

/// The refusal of a field whose value this trainer does not compute the same way.
[[noreturn]] void unsupported(const std::string& dir, const std::string& name, const nlohmann::json& value,
                              const std::string& why) {
  throw UsageError("--init-from " + dir + ": config.json: " + name + "=" + value.dump() + " is not supported: " + why);
}

/// GPT-2's Conv1D weights (stored [in, out] by Hugging Face): our Linear weights of those modules.
bool is_conv1d_weight(const std::string& name) {
  return ends_with(name, ".attn.c_attn.weight") || ends_with(name, ".attn.c_proj.weight") ||
         ends_with(name, ".mlp.c_fc.weight") || ends_with(name, ".mlp.c_proj.weight");
}

/// Keys older transformers saved that are no parameters (causal masks, RoPE frequencies): skipped on load.
bool ignorable_hf_key(const std::string& key) {
  return ends_with(key, ".attn.bias") || ends_with(key, ".attn.masked_bias") || ends_with(key, "rotary_emb.inv_freq");
}

/// The transpose of a state dict entry: a view of the same memory (a DTensor sharded on the other dim), so that
/// a load into it writes the parameter in place.
fsdp::StateDictValue transposed(const fsdp::StateDictValue& v) {
  if (const auto* d = std::get_if<fsdp::DTensor>(&v)) {
    std::vector<fsdp::Placement> placements = d->placements();
    for (auto& p : placements) {
      if (p.is_shard()) p = fsdp::Shard(1 - p.dim);
    }
    return fsdp::DTensor(d->to_local().t(), d->device_mesh(), placements, {d->sizes()[1], d->sizes()[0]});
  }
  return std::get<torch::Tensor>(v).t();
}

GPTConfig llama_config(const nlohmann::json& j, const std::string& dir) {
  GPTConfig c;
  c.arch = "llama";
  c.vocab_size = field<int64_t>(j, "vocab_size", 32000);
  c.n_embd = field<int64_t>(j, "hidden_size", 4096);
  c.n_layer = field<int64_t>(j, "num_hidden_layers", 32);
  c.n_head = field<int64_t>(j, "num_attention_heads", 32);
  c.n_kv_head = field<int64_t>(j, "num_key_value_heads", c.n_head);
  c.intermediate_size = field<int64_t>(j, "intermediate_size", 11008);
  c.max_positions = field<int64_t>(j, "max_position_embeddings", 2048);
  c.block_size = c.max_positions;
  c.norm_eps = field<double>(j, "rms_norm_eps", 1e-6);
  c.tie_weights = field<bool>(j, "tie_word_embeddings", false);
  c.dropout = field<double>(j, "attention_dropout", 0.0);
  if (const auto act = field<std::string>(j, "hidden_act", "silu"); act != "silu") {
    unsupported(dir, "hidden_act", act, "the Llama MLP computes silu(gate_proj(x)) * up_proj(x)");
  }
  for (const char* bias : {"attention_bias", "mlp_bias"}) {
    if (field<bool>(j, bias, false)) unsupported(dir, bias, true, "the Llama model has no biases");
  }
  if (const auto tp = field<int64_t>(j, "pretraining_tp", 1); tp != 1) {
    unsupported(dir, "pretraining_tp", tp, "only 1 (the sliced-matmul emulation of Llama 2's training is not done)");
  }
  if (c.n_head > 0 && j.contains("head_dim") && !j["head_dim"].is_null() &&
      field<int64_t>(j, "head_dim", 0) != c.n_embd / c.n_head) {
    unsupported(dir, "head_dim", j["head_dim"],
                "only hidden_size / num_attention_heads = " + std::to_string(c.n_embd / c.n_head));
  }
  // RoPE: transformers < 5 writes rope_theta and rope_scaling ({"rope_type" (or "type"): ..., factor, ...} or
  // null); transformers >= 5 writes rope_parameters ({"rope_type", "rope_theta", ...}). Both are read.
  nlohmann::json rope = nullptr;
  std::string rope_field = "rope_scaling";
  if (j.contains("rope_parameters") && !j["rope_parameters"].is_null()) {
    rope = j["rope_parameters"];
    rope_field = "rope_parameters";
  } else if (j.contains("rope_scaling") && !j["rope_scaling"].is_null()) {
    rope = j["rope_scaling"];
  }
  c.rope_theta = field<double>(j, "rope_theta", 10000.0);
  if (!rope.is_null()) {
    if (!rope.is_object()) unsupported(dir, rope_field, rope, "expected an object or null");
    c.rope_theta = field<double>(rope, "rope_theta", c.rope_theta);
    const std::string type = field<std::string>(rope, "rope_type", field<std::string>(rope, "type", "default"));
    if (type != "default" && type != "llama3") {
      unsupported(dir, rope_field + ".rope_type", type, "expected default or llama3 (Llama 3.1's frequency scaling)");
    }
    if (const auto f = field<double>(rope, "partial_rotary_factor", 1.0); f != 1.0) {
      unsupported(dir, rope_field + ".partial_rotary_factor", f, "RoPE rotates every dim of a head (1.0)");
    }
    c.rope_type = type;
    if (type == "llama3") {
      for (const char* k : {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}) {
        if (!rope.contains(k)) unsupported(dir, rope_field, rope, std::string("llama3 scaling needs ") + k);
      }
      c.rope_factor = field<double>(rope, "factor", 8.0);
      c.rope_low_freq_factor = field<double>(rope, "low_freq_factor", 1.0);
      c.rope_high_freq_factor = field<double>(rope, "high_freq_factor", 4.0);
      c.rope_original_max_positions = field<int64_t>(rope, "original_max_position_embeddings", 8192);
      if (!(c.rope_high_freq_factor > c.rope_low_freq_factor)) {
        unsupported(dir, rope_field + ".high_freq_factor", c.rope_high_freq_factor, "must exceed low_freq_factor");
      }
    }
  }
  if (const auto f = field<double>(j, "partial_rotary_factor", 1.0); f != 1.0) {
    unsupported(dir, "partial_rotary_factor", f, "RoPE rotates every dim of a head (1.0)");
  }
  return c;
}

GPTConfig gpt2_config(const nlohmann::json& j, const std::string& dir) {
  GPTConfig c;
  c.arch = "gpt2";
  c.vocab_size = field<int64_t>(j, "vocab_size", 50257);
  c.block_size = field<int64_t>(j, "n_positions", 1024);
  c.n_embd = field<int64_t>(j, "n_embd", 768);
  c.n_layer = field<int64_t>(j, "n_layer", 12);
  c.n_head = field<int64_t>(j, "n_head", 12);
  c.tie_weights = field<bool>(j, "tie_word_embeddings", true);
  const auto act = field<std::string>(j, "activation_function", "gelu_new");
  if (act != "gelu_new" && act != "gelu_pytorch_tanh") {
    unsupported(dir, "activation_function", act, "the GPT-2 MLP uses the tanh GELU (gelu_new)");
  }
  if (const auto eps = field<double>(j, "layer_norm_epsilon", 1e-5); eps != 1e-5) {
    unsupported(dir, "layer_norm_epsilon", eps, "the GPT-2 LayerNorms use 1e-5");
  }
  if (const auto inner = field<int64_t>(j, "n_inner", 4 * c.n_embd); inner != 4 * c.n_embd) {
    unsupported(dir, "n_inner", inner, "the GPT-2 MLP is 4 * n_embd = " + std::to_string(4 * c.n_embd) + " wide");
  }
  if (!field<bool>(j, "scale_attn_weights", true)) {
    unsupported(dir, "scale_attn_weights", false, "attention scores are scaled by 1 / sqrt(head_dim)");
  }
  for (const char* flag : {"scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"}) {
    if (field<bool>(j, flag, false)) unsupported(dir, flag, true, "not implemented by the GPT-2 model");
  }
  const double resid = field<double>(j, "resid_pdrop", 0.1);
  for (const char* p : {"embd_pdrop", "attn_pdrop"}) {
    if (field<double>(j, p, 0.1) != resid) {
      unsupported(dir, p, field<double>(j, p, 0.1),
                  "the GPT-2 model has one dropout probability: resid_pdrop, embd_pdrop and attn_pdrop must be equal "
                  "(resid_pdrop=" + fmt("%g", resid) + "); override them all with --dropout");
    }
  }
  c.dropout = resid;
  return c;
}

/// Our parameters' state dict (DTensors and tensors aliasing the model) under Hugging Face's names, a tied head
/// once (as the embedding), Conv1D weights as transposed views.
fsdp::StateDict hf_state_dict(const torch::nn::Module& model, const GPTConfig& cfg) {
  fsdp::StateDict out;
  for (const auto& [key, value] : fsdp::get_model_state_dict(model)) {
    if (cfg.tie_weights && key == "lm_head.weight") continue;
    const auto [name, t] = hf_name(cfg, key);
    out.insert_or_assign(name, t ? transposed(value) : value);
  }
  return out;
}

std::vector<int64_t> sizes_of(const fsdp::StateDictValue& v) {
  if (const auto* d = std::get_if<fsdp::DTensor>(&v)) return d->sizes();
  return std::get<torch::Tensor>(v).sizes().vec();
}

}  // namespace

GPTConfig read_hf_config(const std::string& dir) {
  const std::string path = (fs::path(dir) / "config.json").string();
  std::ifstream in(path);
  if (!in) throw UsageError("--init-from " + dir + ": " + path + " cannot be read. Fix: a Hugging Face model folder "
                            "(config.json and model.safetensors, as save_pretrained writes it)");
  nlohmann::json j;
  try {
    in >> j;
  } catch (const nlohmann::json::exception& e) {
    throw UsageError("--init-from " + dir + ": config.json is not JSON: " + one_line(e.what()));
  }
  const auto type = field<std::string>(j, "model_type", "");
  GPTConfig c;
  if (type == "llama") {
    c = llama_config(j, dir);
  } else if (type == "gpt2") {
    c = gpt2_config(j, dir);
  } else {
    unsupported(dir, "model_type", type, "expected llama (LlamaForCausalLM) or gpt2 (GPT2LMHeadModel)");
  }
  try {
    validate(c);
  } catch (const std::invalid_argument& e) {
    throw UsageError("--init-from " + dir + ": config.json: " + e.what());
  }
  return c;
}

nlohmann::json hf_config_json(const GPTConfig& c, const nlohmann::json& base) {
  nlohmann::json j = base.is_object() ? base : nlohmann::json::object();
  j["torch_dtype"] = "float32";
  j["dtype"] = "float32";
  j["vocab_size"] = c.vocab_size;
  j["tie_word_embeddings"] = c.tie_weights;
  // Byte-level tokens have no special ids: none rather than transformers' defaults (GPT-2's 50256 lies outside a
  // 256-token vocabulary). A source folder's ids are kept.
  for (const char* id : {"bos_token_id", "eos_token_id", "pad_token_id"}) {
    if (!j.contains(id)) j[id] = nullptr;
  }
  if (c.is_llama()) {
    j["architectures"] = {"LlamaForCausalLM"};
    j["model_type"] = "llama";
    j["hidden_size"] = c.n_embd;
    j["intermediate_size"] = c.mlp_width();
    j["num_hidden_layers"] = c.n_layer;
    j["num_attention_heads"] = c.n_head;
    j["num_key_value_heads"] = c.kv_heads();
    j["head_dim"] = c.head_dim();
    j["hidden_act"] = "silu";
    j["max_position_embeddings"] = c.max_positions > 0 ? c.max_positions : c.block_size;
    j["rms_norm_eps"] = c.norm_eps;
    j["attention_bias"] = false;
    j["mlp_bias"] = false;
    j["attention_dropout"] = c.dropout;
    j["pretraining_tp"] = 1;
    if (!j.contains("initializer_range")) j["initializer_range"] = 0.02;
    // Both RoPE layouts: transformers >= 5 reads rope_parameters, older versions rope_theta and rope_scaling.
    nlohmann::json rope = {{"rope_type", c.rope_type}, {"rope_theta", c.rope_theta}};
    if (c.rope_type == "llama3") {
      rope["factor"] = c.rope_factor;
      rope["low_freq_factor"] = c.rope_low_freq_factor;
      rope["high_freq_factor"] = c.rope_high_freq_factor;
      rope["original_max_position_embeddings"] = c.rope_original_max_positions;
    }
    j["rope_parameters"] = rope;
    j["rope_theta"] = c.rope_theta;
    if (c.rope_type == "default") {
      j["rope_scaling"] = nullptr;
    } else {
      nlohmann::json scaling = rope;
      scaling.erase("rope_theta");
      j["rope_scaling"] = scaling;
    }
  } else {
    j["architectures"] = {"GPT2LMHeadModel"};
    j["model_type"] = "gpt2";
    j["n_positions"] = c.block_size;
    j["n_ctx"] = c.block_size;
    j["n_embd"] = c.n_embd;
    j["n_layer"] = c.n_layer;
    j["n_head"] = c.n_head;
    j["n_inner"] = nullptr;
    j["activation_function"] = "gelu_new";
    j["layer_norm_epsilon"] = 1e-5;
    j["resid_pdrop"] = j["embd_pdrop"] = j["attn_pdrop"] = c.dropout;
    j["scale_attn_weights"] = true;
    j["scale_attn_by_inverse_layer_idx"] = false;
    j["reorder_and_upcast_attn"] = false;
    if (!j.contains("initializer_range")) j["initializer_range"] = 0.02;
  }
  return j;
}

std::pair<std::string, bool> hf_name(const GPTConfig& cfg, const std::string& name) {
  if (cfg.is_llama()) return {name, false};
  if (name.rfind("lm_head.", 0) == 0) return {name, false};
  return {"transformer." + name, is_conv1d_weight(name)};
}

int64_t load_hf_weights(torch::nn::Module& model, const GPTConfig& cfg, const std::string& dir) {
  fsdp::StateDict sd = hf_state_dict(model, cfg);
  fsdp::dcp::CheckpointInfo info;
  try {
    info = fsdp::dcp::inspect(dir);
  } catch (const c10::Error& e) {
    throw UsageError("--init-from " + dir + ": the weights cannot be read: " + one_line(e.what_without_backtrace()));
  }
  // Every key checked before anything is read (the same on every rank: the same files).
  for (const auto& [key, value] : sd) {
    const auto it = info.tensors.find(key);
    if (it == info.tensors.end()) {
      throw UsageError("--init-from " + dir + ": the weights have no tensor '" + key + "' (shape " +
                       c10::str(c10::IntArrayRef(sizes_of(value))) + " in this model)" +
                       (key == "lm_head.weight" ? ". Fix: tie_word_embeddings true in config.json if the head is the "
                                                  "embedding"
                                                : ""));
    }
  }
  std::set<std::string> skipped;
  for (const auto& [key, t] : info.tensors) {
    if (sd.contains(key)) continue;
    if (ignorable_hf_key(key) || (cfg.tie_weights && key == "lm_head.weight")) {
      skipped.insert(key);
      continue;
    }
    throw UsageError("--init-from " + dir + ": the weights hold '" + key + "' of shape " +
                     c10::str(c10::IntArrayRef(t.sizes)) + ", which this " + describe(cfg) + " model lacks");
  }
  try {
    // strict(false): the skipped keys above; every key of `sd` is in the files (checked).
    return fsdp::dcp::load(sd, dir, fsdp::dcp::LoadOptions().strict(false)).bytes_read;
  } catch (const c10::Error& e) {
    throw UsageError("--init-from " + dir + ": " + one_line(e.what_without_backtrace()));
  }
}

std::vector<std::string> copy_tokenizer_files(const std::string& init_from, const std::string& tokenizer,
                                              const std::string& out_dir) {
  std::vector<std::pair<fs::path, std::string>> copies;  // from, name in out_dir
  std::error_code ec;
  if (!init_from.empty()) {
    for (const char* name : {"tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                             "generation_config.json"}) {
      if (fs::is_regular_file(fs::path(init_from) / name, ec)) copies.emplace_back(fs::path(init_from) / name, name);
    }
  }
  // An explicit --tokenizer is what the run encoded with: it replaces the folder's.
  if (!tokenizer.empty() && tokenizer != "bytes") {
    copies.erase(std::remove_if(copies.begin(), copies.end(), [](const auto& c) { return c.second == "tokenizer.model"; }),
                 copies.end());
    copies.emplace_back(tokenizer, "tokenizer.model");
  }
  std::vector<std::string> names;
  for (const auto& [from, name] : copies) {
    const fs::path to = fs::path(out_dir) / name;
    if (fs::equivalent(from, to, ec)) continue;  // exporting into the --init-from folder itself
    fs::copy_file(from, to, fs::copy_options::overwrite_existing, ec);
    if (ec) throw UsageError("--export-hf " + out_dir + ": cannot copy " + from.string() + ": " + ec.message());
    names.push_back(name);
  }
  return names;
}

void export_hf(const torch::nn::Module& model, const GPTConfig& cfg, const std::string& out_dir,
               const nlohmann::json& base, int64_t max_file_bytes, fsdp::ProcessGroup& pg) {
  const bool writer = pg.rank() == 0;
  if (writer) {
    std::error_code ec;
    fs::create_directories(out_dir, ec);
    if (!fs::is_directory(out_dir)) throw UsageError("--export-hf " + out_dir + " cannot be created: " + ec.message());
    // A former export's weights would be read beside these (transformers takes model.safetensors before an index):
    // removed first. Only the names an export writes.
    for (const auto& entry : fs::directory_iterator(out_dir)) {
      const std::string name = entry.path().filename().string();
      if (name == "model.safetensors" || name == "model.safetensors.index.json" ||
          (name.rfind("model-", 0) == 0 && ends_with(name, ".safetensors"))) {
        fs::remove(entry.path(), ec);
      }
    }
  }
  fsdp::StateDict sd;
  for (const auto& [key, value] : fsdp::get_model_state_dict(model)) {
    if (!(cfg.tie_weights && key == "lm_head.weight")) sd.insert_or_assign(key, value);
  }
  // Plan the files from the global shapes (fp32 bytes), in parameter order, then gather one file at a time.
  std::vector<std::vector<std::string>> files(1);
  int64_t in_file = 0;
  for (const auto& [key, value] : sd) {
    int64_t bytes = 4;
    for (auto s : sizes_of(value)) bytes *= s;
    if (max_file_bytes > 0 && in_file > 0 && in_file + bytes > max_file_bytes) {
      files.emplace_back();
      in_file = 0;
    }
    files.back().push_back(key);
    in_file += bytes;
  }
  const size_t n = files.size();
  auto file_name = [&](size_t i) {
    if (n == 1) return std::string("model.safetensors");
    std::ostringstream os;
    os << "model-" << std::setw(5) << std::setfill('0') << i + 1 << "-of-" << std::setw(5) << std::setfill('0') << n
       << ".safetensors";
    return os.str();
  };
  nlohmann::json weight_map = nlohmann::json::object();
  int64_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    std::map<std::string, torch::Tensor> tensors;
    for (const auto& key : files[i]) {
      const auto& value = sd.at(key);
      // full_tensor(): a collective over the parameter's mesh, in the same order on every rank.
      const torch::Tensor full = std::holds_alternative<fsdp::DTensor>(value) ? std::get<fsdp::DTensor>(value).full_tensor()
                                                                              : std::get<torch::Tensor>(value);
      if (!writer) continue;
      const auto [name, t] = hf_name(cfg, key);
      auto cpu = full.detach().to(torch::kCPU, torch::kFloat32);
      tensors.emplace(name, t ? cpu.t().contiguous() : cpu);
      weight_map[name] = file_name(i);
      total += cpu.numel() * 4;
    }
    if (!writer) continue;
    try {
      fsdp::dcp::save_file(tensors, (fs::path(out_dir) / file_name(i)).string(), {{"format", "pt"}});
    } catch (const c10::Error& e) {
      throw UsageError("--export-hf " + out_dir + ": " + one_line(e.what_without_backtrace()));
    }
  }
  if (writer) {
    auto write_json = [&](const std::string& name, const nlohmann::json& j) {
      std::ofstream out(fs::path(out_dir) / name, std::ios::trunc);
      out << j.dump(2) << '\n';
      if (!out) throw UsageError("--export-hf " + out_dir + ": " + name + " cannot be written");
    };
    if (n > 1) write_json("model.safetensors.index.json", {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}});
    write_json("config.json", hf_config_json(cfg, base));
  }
  // Every rank returns once the folder is complete (a caller may read it next).
  fsdp::barrier(pg);
}

torch::Tensor read_logits_tokens(const std::string& path, const GPTConfig& cfg) {
  std::map<std::string, torch::Tensor> file;
  try {
    file = fsdp::dcp::load_file(path);
  } catch (const c10::Error& e) {
    throw UsageError("--logits-tokens " + path + ": " + one_line(e.what_without_backtrace()));
  }
  const auto it = file.find("tokens");
  if (it == file.end() || it->second.scalar_type() != torch::kInt64 || it->second.dim() != 2) {
    throw UsageError("--logits-tokens " + path + ": expected an int64 tensor \"tokens\" of shape [B, T]");
  }
  const auto& t = it->second;
  if (t.size(1) > cfg.block_size || t.numel() == 0 || t.min().item<int64_t>() < 0 ||
      t.max().item<int64_t>() >= cfg.vocab_size) {
    throw UsageError("--logits-tokens " + path + ": tokens of shape " + c10::str(t.sizes()) +
                     " must be ids in [0, " + std::to_string(cfg.vocab_size) + ") and at most " +
                     std::to_string(cfg.block_size) + " per row");
  }
  return t;
}

}  // namespace train_gpt
