// fsdp-ckpt: a command-line tool for distributed checkpoints (libfsdp's, and sharded or plain safetensors
// folders written by PyTorch's HuggingFaceStorageWriter).
//
//   fsdp-ckpt ls DIR                       tensors, dtypes, shapes, chunks per rank; Values
//   fsdp-ckpt verify DIR                   files, sizes, checksums, exact coverage; exit 1 on a problem
//   fsdp-ckpt consolidate DIR OUT          full tensors as model.safetensors (or model-0000i-of-0000n +
//                                          model.safetensors.index.json with --max-file-size); OUT may
//                                          also be given as --out OUT
//   fsdp-ckpt diff A B                     keys, dtypes, shapes, values; exit 1 when they differ
//
// DIR (and A, B) may also be a `latest` pointer file, or a run's --ckpt-dir (the folder holding
// step-N folders and `latest`): then the checkpoint `latest` names. Uses only the public API
// (fsdp/checkpoint.h).
#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <set>
#include <stdexcept>

#include "fsdp/checkpoint/checkpoint.h"

namespace {

using fsdp::dcp::CheckpointInfo;

std::string human_bytes(int64_t b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(b);
  int u = 0;
  while (v >= 1024 && u < 4) v /= 1024, ++u;
  char buf[32];
  std::snprintf(buf, sizeof(buf), u == 0 ? "%.0f %s" : "%.1f %s", v, units[u]);
  return buf;
}

const char* dtype_str(torch::ScalarType t) {
  switch (t) {
    case torch::kFloat64: return "F64";
    case torch::kFloat32: return "F32";
    case torch::kBFloat16: return "BF16";
    case torch::kFloat16: return "F16";
    case torch::kInt64: return "I64";
    case torch::kInt32: return "I32";
    case torch::kInt16: return "I16";
    case torch::kInt8: return "I8";
    case torch::kUInt8: return "U8";
    case torch::kBool: return "BOOL";
    default: return "?";
  }
}

/// A usage error: printed as one line, exit status 2.
struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// "5GB", "100MiB", "4096" -> bytes. Throws UsageError naming the flag, the value and the expected form.
int64_t parse_size(const std::string& s) {
  const std::string expected = "--max-file-size " + s +
                               ": expected a positive size, a number with an optional unit (B, KB, MB, GB, KiB, "
                               "MiB, GiB), e.g. 5GB, 100MiB or 4096";
  size_t pos = 0;
  double v = 0;
  try {
    v = std::stod(s, &pos);  // throws for "abc" (std::invalid_argument: "stod") or "1e999"
  } catch (const std::exception&) {
    throw UsageError(expected);
  }
  if (!std::isfinite(v) || v <= 0 || std::isspace(static_cast<unsigned char>(s[0]))) throw UsageError(expected);
  std::string unit = s.substr(pos);
  for (auto& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  double mult = 1;
  if (unit == "" || unit == "B") mult = 1;
  else if (unit == "K" || unit == "KB") mult = 1e3;
  else if (unit == "KIB") mult = 1024.0;
  else if (unit == "M" || unit == "MB") mult = 1e6;
  else if (unit == "MIB") mult = 1024.0 * 1024;
  else if (unit == "G" || unit == "GB") mult = 1e9;
  else if (unit == "GIB") mult = 1024.0 * 1024 * 1024;
  else throw UsageError(expected + " (unknown unit '" + unit + "')");
  const double bytes = v * mult;
  if (bytes < 1 || bytes > 9.2e18) throw UsageError(expected + " (out of range)");
  return static_cast<int64_t>(bytes);
}

/// A checkpoint argument: a checkpoint folder, a `latest` file, or a run's --ckpt-dir, which holds
/// step-N folders and the `latest` file naming the newest (then that one; the commands' output names
/// it). A checkpoint folder holds no `latest` of its own, so the two cannot be confused.
std::string resolve_checkpoint(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(dir, ec) || fs::exists(fs::path(dir) / fsdp::dcp::kMetadataFileName, ec)) return dir;
  auto newest = fsdp::dcp::latest(dir);  // throws for a malformed `latest`
  if (!newest) return dir;
  return *newest;
}

/// "r0[0:3, 0:6]": the rank that wrote the chunk and its box.
std::string chunk_str(const CheckpointInfo& info, const fsdp::dcp::ChunkInfo& c) {
  int rank = -1;
  for (const auto& f : info.files)
    if (f.name == c.file) rank = f.rank;
  std::string s = rank >= 0 ? "r" + std::to_string(rank) : c.file;
  s += "[";
  for (size_t d = 0; d < c.sizes.size(); ++d)
    s += (d ? ", " : "") + std::to_string(c.offsets[d]) + ":" + std::to_string(c.offsets[d] + c.sizes[d]);
  return s + "]";
}

int cmd_ls(const std::string& dir, bool all_values) {
  auto info = fsdp::dcp::inspect(dir);
  int64_t total = 0;
  for (const auto& f : info.files) total += f.bytes;
  std::cout << "checkpoint " << info.dir << "\n  format " << info.format;
  if (info.version) std::cout << " v" << info.version;
  if (info.world_size) std::cout << ", saved by " << info.world_size << " rank(s)";
  if (!info.mesh_shape.empty()) {
    std::cout << ", mesh " << c10::str(c10::IntArrayRef(info.mesh_shape));
    if (!info.mesh_dim_names.empty()) {
      std::cout << " (";
      for (size_t i = 0; i < info.mesh_dim_names.size(); ++i) std::cout << (i ? ", " : "") << info.mesh_dim_names[i];
      std::cout << ")";
    }
  }
  std::cout << "\n  " << info.files.size() << " file(s), " << human_bytes(total) << ", " << info.tensors.size()
            << " tensor(s), " << info.values.size() + info.per_rank_values.size() << " value(s)\n";
  std::cout << "files:\n";
  for (const auto& f : info.files) {
    std::cout << "  " << f.name << "  rank " << (f.rank >= 0 ? std::to_string(f.rank) : "?") << "  " << human_bytes(f.bytes)
              << (f.checksummed ? "  crc32c" : "  (no checksums)") << "\n";
  }
  std::cout << "tensors:\n";
  size_t width = 0;
  for (const auto& [k, t] : info.tensors) width = std::max(width, k.size());
  for (const auto& [k, t] : info.tensors) {
    std::string chunks;
    for (const auto& c : t.chunks) chunks += " " + chunk_str(info, c);
    std::printf("  %-*s %-4s %-12s %zu chunk(s):%s\n", static_cast<int>(width), k.c_str(), dtype_str(t.dtype),
                c10::str(c10::IntArrayRef(t.sizes)).c_str(), t.chunks.size(), chunks.c_str());
  }
  if (!info.values.empty() || !info.per_rank_values.empty()) std::cout << "values:\n";
  size_t shown = 0;
  for (const auto& [k, v] : info.values) {
    if (!all_values && shown++ == 20) {
      std::cout << "  ... (" << info.values.size() << " in all; --values shows every one)\n";
      break;
    }
    std::cout << "  " << k << " = " << v.dump() << "\n";
  }
  for (const auto& [k, v] : info.per_rank_values) {
    std::cout << "  " << k << " (per rank) =";
    for (size_t r = 0; r < v.size(); ++r) std::cout << " r" << r << ":" << v[r].dump();
    std::cout << "\n";
  }
  return 0;
}

int cmd_verify(const std::string& dir) {
  auto problems = fsdp::dcp::verify(dir);
  if (problems.empty()) {
    auto info = fsdp::dcp::inspect(dir);
    bool sums = !info.files.empty();
    for (const auto& f : info.files) sums = sums && f.checksummed;
    size_t chunks = 0;
    for (const auto& [k, t] : info.tensors) chunks += t.chunks.size();
    std::cout << "OK " << info.dir << ": " << info.tensors.size() << " tensor(s) in " << chunks << " chunk(s) across "
              << info.files.size() << " file(s); every tensor covered exactly once; "
              << (sums ? "every checksum matches" : "no checksums to verify (not written by libfsdp)") << "\n";
    return 0;
  }
  for (const auto& p : problems) std::cout << "PROBLEM " << p << "\n";
  std::cout << problems.size() << " problem(s) in " << dir << "\n";
  return 1;
}

int cmd_diff(const std::string& a, const std::string& b, double atol) {
  auto ia = fsdp::dcp::inspect(a);
  auto ib = fsdp::dcp::inspect(b);
  int differences = 0;
  auto report = [&](const std::string& s) {
    std::cout << s << "\n";
    ++differences;
  };
  std::set<std::string> keys;
  for (const auto& [k, _] : ia.tensors) keys.insert(k);
  for (const auto& [k, _] : ib.tensors) keys.insert(k);
  size_t same = 0;
  for (const auto& k : keys) {
    auto ta = ia.tensors.find(k), tb = ib.tensors.find(k);
    if (ta == ia.tensors.end()) { report("only in B: " + k); continue; }
    if (tb == ib.tensors.end()) { report("only in A: " + k); continue; }
    if (ta->second.dtype != tb->second.dtype || ta->second.sizes != tb->second.sizes) {
      report(std::string("differs: ") + k + ": " + dtype_str(ta->second.dtype) + " " +
             c10::str(c10::IntArrayRef(ta->second.sizes)) + " vs " + dtype_str(tb->second.dtype) + " " +
             c10::str(c10::IntArrayRef(tb->second.sizes)));
      continue;
    }
    auto x = fsdp::dcp::read_tensor(ia, k);
    auto y = fsdp::dcp::read_tensor(ib, k);
    if (torch::equal(x, y)) { ++same; continue; }
    if (x.is_floating_point()) {
      auto d = (x.to(torch::kFloat64) - y.to(torch::kFloat64)).abs();
      double maxd = d.numel() ? d.max().item<double>() : 0.0;
      int64_t n = (d > atol).sum().item<int64_t>();
      if (maxd <= atol) { ++same; continue; }
      char buf[160];
      std::snprintf(buf, sizeof(buf), ": %lld of %lld elements differ, max |a - b| = %.6g", static_cast<long long>(n),
                    static_cast<long long>(x.numel()), maxd);
      report("differs: " + k + buf);
    } else {
      report("differs: " + k + ": " + std::to_string(x.ne(y).sum().item<int64_t>()) + " element(s)");
    }
  }
  std::set<std::string> vkeys;
  for (const auto& [k, _] : ia.values) vkeys.insert(k);
  for (const auto& [k, _] : ib.values) vkeys.insert(k);
  for (const auto& k : vkeys) {
    auto va = ia.values.find(k), vb = ib.values.find(k);
    if (va == ia.values.end()) report("only in B: " + k + " = " + vb->second.dump());
    else if (vb == ib.values.end()) report("only in A: " + k + " = " + va->second.dump());
    else if (va->second != vb->second) report("differs: " + k + ": " + va->second.dump() + " vs " + vb->second.dump());
  }
  if (ia.per_rank_values != ib.per_rank_values) report("per-rank values differ");
  std::cout << (differences ? std::to_string(differences) + " difference(s)" : std::string("identical")) << " (" << same
            << " identical tensor(s), " << vkeys.size() << " value(s) compared)\n";
  return differences ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"fsdp-ckpt: inspect, verify, consolidate and compare distributed checkpoints (libfsdp's, or\n"
               "safetensors folders written by PyTorch's HuggingFaceStorageWriter). DIR may be a `latest`\n"
               "file, or a run's --ckpt-dir (the folder of step-N folders and `latest`): then the checkpoint\n"
               "`latest` names."};
  app.require_subcommand(1);
  std::string dir, out, out_flag, a, b, max_size, prefix;
  bool strip = false, all_values = false;
  double atol = 0;
  auto* ls = app.add_subcommand("ls", "List tensors (dtype, shape, chunks per rank), files and values");
  ls->add_option("DIR", dir)->required();
  ls->add_flag("--values", all_values, "Show every value (default: the first 20)");
  auto* verify = app.add_subcommand("verify", "Check files, sizes, checksums and exact coverage (exit 1 on a problem)");
  verify->add_option("DIR", dir)->required();
  auto* cons = app.add_subcommand("consolidate", "Write full tensors as safetensors loadable by the safetensors package");
  cons->add_option("DIR", dir)->required();
  cons->add_option("OUT", out, "Output folder (or --out OUT)");
  cons->add_option("--out", out_flag, "Output folder (or OUT after DIR)");
  cons->add_option("--max-file-size", max_size, "Split into files of at most this size, e.g. 5GB (default: one file)");
  cons->add_option("--prefix", prefix, "Only keys starting with this prefix, e.g. model.");
  cons->add_flag("--strip-prefix", strip, "Remove --prefix from the names written (e.g. Hugging Face names)");
  auto* diff = app.add_subcommand("diff", "Compare two checkpoints (exit 1 when they differ)");
  diff->add_option("A", a)->required();
  diff->add_option("B", b)->required();
  diff->add_option("--atol", atol, "Treat floating differences up to this as equal (default: 0, bitwise)");
  CLI11_PARSE(app, argc, argv);
  try {
    if (*ls) return cmd_ls(resolve_checkpoint(dir), all_values);
    if (*verify) return cmd_verify(resolve_checkpoint(dir));
    if (*diff) return cmd_diff(resolve_checkpoint(a), resolve_checkpoint(b), atol);
    if (!out.empty() && !out_flag.empty() && out != out_flag) {
      throw UsageError("consolidate: two output folders, " + out + " (after DIR) and --out " + out_flag +
                       ". Fix: give one");
    }
    if (out.empty()) out = out_flag;
    if (out.empty()) throw UsageError("consolidate: no output folder. Fix: fsdp-ckpt consolidate DIR OUT");
    auto opts = fsdp::dcp::ConsolidateOptions().prefix(prefix).strip_prefix(strip);
    if (!max_size.empty()) opts.max_file_bytes(parse_size(max_size));
    for (const auto& f : fsdp::dcp::consolidate(resolve_checkpoint(dir), out, opts)) {
      std::cout << "wrote " << f << "\n";
    }
    return 0;
  } catch (const UsageError& e) {
    std::cerr << "fsdp-ckpt: " << e.what() << "\n";
    return 2;
  } catch (const c10::Error& e) {
    std::cerr << "fsdp-ckpt: " << e.what_without_backtrace() << "\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "fsdp-ckpt: " << e.what() << "\n";
    return 2;
  }
}
