// Reading a checkpoint's description (see metadata.h): the metadata file, each safetensors header
// (size and checksum checked against the metadata), and the chunks of every tensor they describe.
#include "checkpoint/metadata.h"

#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <optional>
#include <regex>
#include <set>

#include "checkpoint/safetensors.h"
#include "checkpoint/torch_dcp.h"
#include "util.h"

namespace fsdp::dcp {

namespace fs = std::filesystem;

namespace detail {

namespace {

using fsdp::detail::shape_str;

/// `dir`, or the folder a `latest` pointer file names when `dir` is that file.
std::string resolve_dir(const std::string& dir, const char* api) {
  std::string d = dir;
  while (d.size() > 1 && d.back() == '/') d.pop_back();
  TORCH_CHECK(fs::exists(d), api, ": checkpoint folder ", d, " does not exist");
  if (fs::is_regular_file(d)) {
    auto parent = fs::path(d).parent_path();
    auto target = latest(parent.empty() ? "." : parent.string());
    TORCH_CHECK(target && fs::path(d).filename() == kLatestFileName, api, ": ", d,
                " is a file, not a checkpoint folder (nor a `latest` pointer)");
    TORCH_CHECK(fs::is_directory(*target), api, ": ", d, " names ", *target, ", which does not exist");
    return *target;
  }
  TORCH_CHECK(fs::is_directory(d), api, ": ", d, " is not a checkpoint folder");
  return d;
}

int rank_from_name(const std::string& name) {
  static const std::regex re("^shard-(\\d+)-model-\\d+-of-\\d+\\.safetensors$");
  std::smatch m;
  if (std::regex_match(name, m, re)) return std::stoi(m[1].str()) - 1;
  return -1;
}

/// Problems either throw (problems == null) or are collected.
struct Problems {
  std::vector<std::string>* out = nullptr;
  const char* api;
  void report(const std::string& msg) {
    if (!out) TORCH_CHECK(false, msg);
    out->push_back(msg);
  }
};

/// ", holding 'a', 'b', 'c', ... (12 tensors)": what a file holds, for messages about it.
std::string tensors_in(const nlohmann::json& file_meta) {
  std::string s;
  size_t n = 0;
  if (file_meta.contains("tensor_crc32c")) {
    for (const auto& [k, v] : file_meta["tensor_crc32c"].items()) {
      if (n++ < 3) s += (s.empty() ? "'" : ", '") + k + "'";
    }
  }
  if (n > 3) s += ", ... (" + std::to_string(n) + " tensors)";
  return s.empty() ? "" : ", holding " + s;
}

/// Reads our metadata file into `info`; returns the names of the files it lists.
std::vector<std::string> read_metadata(CheckpointInfo& info, const fs::path& meta_path, const char* api) {
  std::string text = read_small_file(meta_path.string(), api);
  try {
    info.metadata = nlohmann::json::parse(text);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, api, ": ", meta_path.string(), " is not valid JSON (truncated or damaged?): ", e.what());
  }
  const auto& m = info.metadata;
  TORCH_CHECK(m.is_object() && m.value("format", "") == "libfsdp-dcp", api, ": ", meta_path.string(),
              " is not libfsdp checkpoint metadata (format '", m.is_object() ? m.value("format", "") : "", "')");
  info.format = "libfsdp-dcp";
  info.version = m.value("version", 0);
  TORCH_CHECK(info.version >= 1 && info.version <= 1, api, ": ", meta_path.string(), " has format version ",
              info.version, "; this libfsdp reads version 1. Fix: use a newer libfsdp");
  std::vector<std::string> names;
  try {
    info.world_size = m.at("world_size").get<int>();
    info.mesh_shape = m.at("mesh").at("shape").get<std::vector<int64_t>>();
    info.mesh_dim_names = m.at("mesh").at("dim_names").get<std::vector<std::string>>();
    for (const auto& [k, v] : m.at("values").items()) info.values[k] = v;
    for (const auto& [k, v] : m.at("per_rank_values").items()) info.per_rank_values[k] = v.get<std::vector<nlohmann::json>>();
    for (const auto& [name, f] : m.at("files").items()) names.push_back(name);
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, api, ": ", meta_path.string(), " is malformed: ", e.what());
  }
  return names;
}

/// The index file of a split Hugging Face checkpoint (consolidate() writes it too).
constexpr const char* kIndexFileName = "model.safetensors.index.json";

/// The weight_map of `dir`/model.safetensors.index.json: tensor name -> file name.
std::map<std::string, std::string> read_index(const fs::path& path, const char* api) {
  const std::string text = read_small_file(path.string(), api);
  std::map<std::string, std::string> map;
  try {
    const auto j = nlohmann::json::parse(text);
    for (const auto& [k, v] : j.at("weight_map").items()) map[k] = v.get<std::string>();
  } catch (const std::exception& e) {
    TORCH_CHECK(false, api, ": ", path.string(), " is not a valid safetensors index (expected a JSON object with a ",
                "\"weight_map\" of tensor name to file name): ", e.what());
  }
  for (const auto& [k, f] : map) {
    TORCH_CHECK(!f.empty() && f.find('/') == std::string::npos && f != "." && f != "..", api, ": ", path.string(),
                " maps '", k, "' to '", f, "', which is not a file name in the folder");
  }
  return map;
}

/// The safetensors files of a folder without our metadata (sorted). With a
/// model.safetensors.index.json (a split Hugging Face checkpoint), exactly the files it names (into
/// `index`); otherwise every *.safetensors file (model.safetensors, or the shards PyTorch's
/// HuggingFaceStorageWriter writes), as PyTorch's HuggingFaceStorageReader reads them.
std::vector<std::string> list_safetensors(const fs::path& dir, const char* api,
                                          std::map<std::string, std::string>& index) {
  std::vector<std::string> names;
  const fs::path index_path = dir / kIndexFileName;
  if (fs::exists(index_path)) {
    index = read_index(index_path, api);
    std::set<std::string> files;
    for (const auto& [_, f] : index) files.insert(f);
    TORCH_CHECK(!files.empty(), api, ": ", index_path.string(), " maps no tensor to a file: an empty checkpoint");
    for (const auto& f : files) {
      TORCH_CHECK(fs::is_regular_file(dir / f), api, ": ", (dir / f).string(), " is missing: ", index_path.string(),
                  " names it (e.g. for '",
                  std::find_if(index.begin(), index.end(), [&](const auto& e) { return e.second == f; })->first,
                  "'). The checkpoint is incomplete; restore the file or use another checkpoint");
    }
    return {files.begin(), files.end()};
  }
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    auto n = e.path().filename().string();
    if (e.is_regular_file() && n.size() > 12 && n.compare(n.size() - 12, 12, ".safetensors") == 0) names.push_back(n);
  }
  std::sort(names.begin(), names.end());
  TORCH_CHECK(!names.empty(), api, ": ", dir.string(), " holds no checkpoint: looked for ", kMetadataFileName,
              " (a libfsdp checkpoint), ", kTorchMetadataFileName, " (PyTorch's dcp.save), ", kIndexFileName, " with the files it names (a split Hugging Face ",
              "checkpoint, as consolidate() writes), model.safetensors, or any other *.safetensors file (e.g. PyTorch's ",
              "HuggingFaceStorageWriter shards), and found none. Fix: pass the folder that holds the checkpoint's files");
  return names;
}

/// The header of file `fi` at `path`, checked against its metadata `fmeta` (size, checksum); nullopt
/// (and a problem reported) when the file is missing, the wrong size or damaged.
std::optional<Header> checked_header(FileInfo& fi, const std::string& path, const nlohmann::json& fmeta,
                                     Problems& problems, const char* api) {
  const std::string by = " (written by rank " + std::to_string(fi.rank) + tensors_in(fmeta);
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) {
    problems.report(std::string(api) + ": " + path + " is missing: the checkpoint's metadata lists it" + by + ")" +
                    ". The checkpoint is incomplete; restore the file or use another checkpoint");
    return std::nullopt;
  }
  fi.bytes = static_cast<int64_t>(st.st_size);
  const int64_t expect = fmeta.is_object() ? fmeta.value("bytes", int64_t(-1)) : fi.bytes;
  if (fi.bytes != expect) {
    problems.report(std::string(api) + ": " + path + (fi.bytes < expect ? " is truncated" : " has the wrong size") +
                    ": " + std::to_string(fi.bytes) + " bytes, but the checkpoint's metadata records " +
                    std::to_string(expect) + by + "). The file was damaged; restore it or use another checkpoint");
    return std::nullopt;
  }
  Header h;
  try {
    auto f = File::open_read(path, api);
    h = read_header(f, fi.bytes, api);
  } catch (const c10::Error& e) {
    problems.report(e.what_without_backtrace());
    return std::nullopt;
  }
  if (fi.checksummed && crc32c(0, h.raw.data(), h.raw.size()) != fmeta["header_crc32c"].get<uint32_t>()) {
    problems.report(std::string(api) + ": checksum mismatch in the header of " + path + by +
                    "): the file was modified or damaged after it was written; restore it or use another checkpoint");
    return std::nullopt;
  }
  return h;
}

/// Adds the chunks that header `h` of file `name` (at `path`) describes to `info.tensors`.
void add_chunks(CheckpointInfo& info, const std::string& name, const std::string& path, const Header& h,
                Problems& problems, const char* api) {
  for (const auto& e : h.entries) {
    ChunkInfo c;
    c.file = name;
    c.sizes = e.shape;
    c.offsets = e.saved_offsets ? *e.saved_offsets : std::vector<int64_t>(e.shape.size(), 0);
    c.file_offset = h.data_start + e.begin;
    c.nbytes = e.end - e.begin;
    auto [it, fresh] = info.tensors.try_emplace(e.name);
    auto& t = it->second;
    if (fresh) {
      t.dtype = e.dtype;
      t.sizes.assign(e.shape.size(), 0);
    } else if (t.dtype != e.dtype || t.sizes.size() != e.shape.size()) {
      problems.report(std::string(api) + ": '" + e.name + "' is " + c10::toString(e.dtype) + " " + shape_str(e.shape) +
                      " in " + path + " but " + c10::toString(t.dtype) + " with " + std::to_string(t.sizes.size()) +
                      " dims in " + t.chunks[0].file);
      continue;
    }
    for (size_t d = 0; d < e.shape.size(); ++d) t.sizes[d] = std::max(t.sizes[d], c.offsets[d] + c.sizes[d]);
    t.chunks.push_back(std::move(c));
  }
}

/// The metadata's summary of each tensor must agree with the headers.
void check_summary(const CheckpointInfo& info, const fs::path& meta_path, Problems& problems, const char* api) {
  if (!info.metadata.is_object() || !info.metadata.contains("tensors")) return;
  for (const auto& [k, v] : info.metadata["tensors"].items()) {
    auto it = info.tensors.find(k);
    if (it == info.tensors.end()) {
      problems.report(std::string(api) + ": '" + k + "' is listed in " + meta_path.string() +
                      " but no safetensors file holds it (a file is missing?)");
      continue;
    }
    auto shape = v.value("shape", std::vector<int64_t>());
    if (dtype_name(it->second.dtype, api, k) != v.value("dtype", "") || shape != it->second.sizes) {
      problems.report(std::string(api) + ": '" + k + "' is " + v.value("dtype", "") + " " + shape_str(shape) + " in " +
                      meta_path.string() + " but " + dtype_name(it->second.dtype, api, k) + " " +
                      shape_str(it->second.sizes) + " in the safetensors headers (a chunk is missing?)");
    }
  }
}

}  // namespace

CheckpointInfo read_info(const std::string& dir_arg, const char* api, std::vector<std::string>* problems_out) {
  Problems problems{problems_out, api};
  CheckpointInfo info;
  info.dir = resolve_dir(dir_arg, api);
  const fs::path dir = info.dir;
  const fs::path meta_path = dir / kMetadataFileName;
  if (!fs::exists(meta_path) && fs::exists(dir / kTorchMetadataFileName)) {
    read_torch_dcp(info, [&](const std::string& msg) { problems.report(msg); }, api);
    return info;
  }
  std::map<std::string, std::string> index;  // weight_map of a split Hugging Face checkpoint
  const auto names = fs::exists(meta_path) ? read_metadata(info, meta_path, api) : list_safetensors(dir, api, index);
  if (!info.metadata.is_object()) info.format = "safetensors";
  for (const auto& name : names) {
    const std::string path = (dir / name).string();
    const nlohmann::json fmeta = info.metadata.is_object() ? info.metadata["files"][name] : nlohmann::json();
    FileInfo fi;
    fi.name = name;
    fi.rank = fmeta.is_object() ? fmeta.value("rank", -1) : rank_from_name(name);
    fi.checksummed = fmeta.is_object() && fmeta.contains("header_crc32c");
    auto h = checked_header(fi, path, fmeta, problems, api);
    if (!h) continue;
    fi.header_bytes = static_cast<int64_t>(h->raw.size());
    info.files.push_back(fi);
    add_chunks(info, name, path, *h, problems, api);
  }
  // The index and the headers must agree: a tensor the index places in a file that does not hold it
  // means the files come from different checkpoints.
  for (const auto& [k, f] : index) {
    auto it = info.tensors.find(k);
    const bool found = it != info.tensors.end() &&
                       std::any_of(it->second.chunks.begin(), it->second.chunks.end(),
                                   [&](const ChunkInfo& c) { return c.file == f; });
    if (!found && std::any_of(info.files.begin(), info.files.end(), [&](const FileInfo& fi) { return fi.name == f; })) {
      problems.report(std::string(api) + ": " + (dir / kIndexFileName).string() + " places '" + k + "' in " +
                      (dir / f).string() + ", whose header does not hold it: the index and the files do not belong " +
                      "together. Fix: restore the files the index was written with");
    }
  }
  check_summary(info, meta_path, problems, api);
  return info;
}

}  // namespace detail

CheckpointInfo inspect(const std::string& dir) { return detail::read_info(dir, "dcp::inspect", nullptr); }

}  // namespace fsdp::dcp
