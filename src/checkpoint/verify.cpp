// dcp::read_tensor, dcp::verify and dcp::consolidate: whole tensors of a checkpoint, read and verified
// through the chunk reader (chunk_reader.h).
#include <cstdio>

#include <filesystem>
#include <set>

#include "checkpoint/chunk_reader.h"
#include "checkpoint/metadata.h"
#include "checkpoint/safetensors.h"
#include "fsdp/checkpoint/checkpoint.h"
#include "util.h"

namespace fsdp::dcp {

namespace fs = std::filesystem;
using fsdp::detail::numel_of;
using detail::chunk_view;
using detail::coverage_problem;
using detail::FileCache;
using detail::narrow_to;
using detail::Overlap;
using detail::overlap_of;
using detail::read_info;

torch::Tensor read_tensor(const CheckpointInfo& info, const std::string& fqn) {
  const char* api = "dcp::read_tensor";
  auto it = info.tensors.find(fqn);
  TORCH_CHECK(it != info.tensors.end(), api, ": ", info.dir, " holds no tensor '", fqn, "'");
  const auto& t = it->second;
  std::vector<int64_t> zeros(t.sizes.size(), 0);
  auto problem = coverage_problem(t, zeros, t.sizes);
  TORCH_CHECK(problem.empty(), api, ": '", fqn, "' in ", info.dir, ": ", problem);
  auto out = torch::empty(t.sizes, torch::TensorOptions().dtype(t.dtype));
  FileCache files(info.dir, api);
  for (const auto& c : t.chunks) {
    if (auto ov = overlap_of(c, zeros, t.sizes)) {
      narrow_to(out, zeros, *ov).copy_(chunk_view(info, c, fqn, t.dtype, *ov, /*verify=*/true, files, api));
    }
  }
  return out;
}

std::vector<std::string> verify(const std::string& dir) {
  const char* api = "dcp::verify";
  std::vector<std::string> problems;
  CheckpointInfo info;
  try {
    info = read_info(dir, api, &problems);
  } catch (const c10::Error& e) {
    problems.push_back(e.what_without_backtrace());
    return problems;
  }
  for (const auto& [k, why] : info.unreadable) {
    problems.push_back(std::string(api) + ": '" + k + "' in " + info.dir + " cannot be loaded: " + why);
  }
  if (info.metadata.is_object()) {
    // Files nobody listed: PyTorch's reader would read them too.
    std::set<std::string> listed;
    for (const auto& [name, _] : info.metadata["files"].items()) listed.insert(name);
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(info.dir, ec)) {
      auto n = e.path().filename().string();
      if (n.size() > 12 && n.compare(n.size() - 12, 12, ".safetensors") == 0 && !listed.count(n))
        problems.push_back(std::string(api) + ": " + info.dir + "/" + n + " is not listed in the metadata (a stray file: "
                           "PyTorch's HuggingFaceStorageReader would read it too)");
    }
  }
  for (const auto& [fqn, t] : info.tensors) {
    // Exactly-once coverage: pairwise disjoint chunks whose volumes sum to the tensor's.
    std::vector<int64_t> zeros(t.sizes.size(), 0);
    auto problem = coverage_problem(t, zeros, t.sizes);
    for (size_t i = 0; problem.empty() && i < t.chunks.size(); ++i) {
      for (size_t j = 0; j < i; ++j) {
        const auto &a = t.chunks[i], &b = t.chunks[j];
        bool overlap = numel_of(a.sizes) > 0 && numel_of(b.sizes) > 0;
        for (size_t d = 0; overlap && d < a.sizes.size(); ++d)
          overlap = a.offsets[d] < b.offsets[d] + b.sizes[d] && b.offsets[d] < a.offsets[d] + a.sizes[d];
        if (overlap) {
          problem = "its chunks in " + a.file + " and " + b.file + " overlap";
          break;
        }
      }
    }
    if (!problem.empty()) problems.push_back(std::string(api) + ": '" + fqn + "': " + problem);
    // Checksums: read every chunk whole.
    FileCache files(info.dir, api);
    for (const auto& c : t.chunks) {
      if (c.nbytes == 0) continue;
      try {
        chunk_view(info, c, fqn, t.dtype, Overlap{c.offsets, c.sizes}, /*verify=*/true, files, api);
      } catch (const c10::Error& e) {
        problems.push_back(e.what_without_backtrace());
      }
    }
  }
  return problems;
}

std::vector<std::string> consolidate(const std::string& dir, const std::string& out_dir, const ConsolidateOptions& o) {
  const char* api = "dcp::consolidate";
  CheckpointInfo info = inspect(dir);
  struct Out {
    std::string fqn, name;
    const TensorInfo* t;
  };
  std::vector<Out> tensors;
  std::set<std::string> names;
  for (const auto& [fqn, t] : info.tensors) {
    if (fqn.compare(0, o.prefix().size(), o.prefix()) != 0) continue;
    std::string name = o.strip_prefix() ? fqn.substr(o.prefix().size()) : fqn;
    TORCH_CHECK(!name.empty() && names.insert(name).second, api, ": stripping '", o.prefix(), "' from '", fqn,
                "' gives an empty or duplicate name");
    tensors.push_back({fqn, name, &t});
  }
  TORCH_CHECK(!tensors.empty(), api, ": ", info.dir, " holds no tensor whose key starts with '", o.prefix(), "'");
  // Split into files of at most max_file_bytes (a larger tensor gets a file of its own).
  std::vector<std::vector<size_t>> groups(1);
  int64_t cur = 0, total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    int64_t n = numel_of(tensors[i].t->sizes) * static_cast<int64_t>(c10::elementSize(tensors[i].t->dtype));
    total += n;
    if (o.max_file_bytes() > 0 && !groups.back().empty() && cur + n > o.max_file_bytes()) {
      groups.emplace_back();
      cur = 0;
    }
    groups.back().push_back(i);
    cur += n;
  }
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  TORCH_CHECK(!ec, api, ": cannot create ", out_dir, ": ", ec.message());
  std::vector<std::string> written;
  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  for (size_t g = 0; g < groups.size(); ++g) {
    char name[64];
    if (groups.size() == 1) std::snprintf(name, sizeof(name), "model.safetensors");
    else std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", g + 1, groups.size());
    std::vector<detail::WriteEntry> entries;
    for (auto i : groups[g]) {
      entries.push_back({tensors[i].name, tensors[i].t->dtype, tensors[i].t->sizes, std::nullopt});
      weight_map[tensors[i].name] = name;
    }
    const std::string path = (fs::path(out_dir) / name).string();
    detail::write_safetensors(
        path, entries, [&](size_t k) { return read_tensor(info, tensors[groups[g][k]].fqn); }, /*sharding_info=*/false,
        int64_t(1) << 20, /*do_fsync=*/true, api);
    written.push_back(path);
  }
  if (groups.size() > 1) {
    nlohmann::ordered_json index;
    index["metadata"] = {{"total_size", total}};
    index["weight_map"] = weight_map;
    const std::string path = (fs::path(out_dir) / "model.safetensors.index.json").string();
    detail::write_file_atomic(path, index.dump(2) + "\n", true, api);
    written.push_back(path);
  }
  return written;
}

}  // namespace fsdp::dcp
