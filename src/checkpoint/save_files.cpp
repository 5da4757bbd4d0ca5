// The files one rank of dcp::save writes (save_plan.h): its chunks in either format, by `thread_count`
// writers, and rank 0's metadata file of either format.
#include <algorithm>
#include <chrono>
#include <map>
#include <thread>

#include "checkpoint/copy_ahead.h"
#include "checkpoint/safetensors.h"
#include "checkpoint/save_plan.h"
#include "checkpoint/torch_dcp.h"
#include "util.h"

namespace fsdp::dcp::detail {

namespace fs = std::filesystem;
using fsdp::detail::message_of;

namespace {

/// PyTorch's format: this rank's chunks as torch.save archives in __{rank}_0.distcp; the record lists
/// where each archive lies ([key, offsets, sizes, offset, length]).
nlohmann::json write_distcp(const std::vector<const Item*>& items, CopyAhead& data, const std::string& tmp, int rank,
                            int index, bool do_fsync, const char* api) {
  const std::string name = distcp_file_name(rank, index);
  const std::string path = tmp + "/" + name;
  auto f = File::create(path, api);
  nlohmann::json archives = nlohmann::json::array();
  int64_t at = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    const auto* it = items[i];
    const int64_t n = append_torch_save(f, data.get(i), std::string(api) + ": writing '" + it->key + "' to " + path);
    archives.push_back({it->key, it->offsets, it->sizes, at, n});
    at += n;
    fault_point({"write", path, at});
  }
  if (do_fsync) f.fsync();
  f.close();
  return {{"name", name}, {"rank", rank}, {"bytes", at}, {"archives", archives}};
}

/// This rank's items split into at most `n` groups of about equal bytes: largest first, each into the
/// lightest group (as FileSystemWriter's _split_by_size_and_type), each group in the plan's order.
std::vector<std::vector<const Item*>> split_by_size(const std::vector<const Item*>& items, int n) {
  n = std::max(1, std::min<int>(n, static_cast<int>(items.size())));
  std::vector<size_t> order(items.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  auto bytes = [&](size_t i) { return items[i]->data.nbytes(); };
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return bytes(a) > bytes(b); });
  std::vector<std::vector<size_t>> groups(n);
  std::vector<size_t> load(n, 0);
  for (size_t i : order) {
    const size_t g = std::min_element(load.begin(), load.end()) - load.begin();
    groups[g].push_back(i);
    load[g] += bytes(i);
  }
  std::vector<std::vector<const Item*>> out;
  for (auto& g : groups) {
    std::sort(g.begin(), g.end());
    std::vector<const Item*> v;
    for (size_t i : g) v.push_back(items[i]);
    out.push_back(std::move(v));
  }
  return out;
}

/// Writes file `index` of `count` of this rank into `tmp`; returns its record.
nlohmann::json write_file(const Plan& plan, const std::vector<const Item*>& items, const std::string& tmp, int rank,
                          int index, int count, int64_t copy_ahead, bool do_fsync, const char* api) {
  std::vector<torch::Tensor> sources;
  for (const auto* it : items) sources.push_back(it->data);
  CopyAhead data(std::move(sources), copy_ahead);
  struct Peak {  // recorded however the write ends
    CopyAhead& data;
    ~Peak() { record_copy_ahead_peak_bytes(data.peak_bytes(), /*reset=*/false); }
  } peak{data};
  if (plan.format == StorageFormat::Distcp) return write_distcp(items, data, tmp, rank, index, do_fsync, api);
  std::vector<WriteEntry> entries;
  for (const auto* it : items) entries.push_back({it->key, it->dtype, it->sizes, it->offsets});
  const std::string path = tmp + "/" + shard_file_name(rank, index, count);
  auto rec = write_safetensors(
      path, entries, [&](size_t i) { return data.get(i); }, /*sharding_info=*/true, kChecksumBlockBytes, do_fsync,
      api);
  nlohmann::json crcs = nlohmann::json::object();
  for (size_t i = 0; i < items.size(); ++i) crcs[items[i]->key] = rec.tensor_crcs[i];
  return {{"name", rec.name}, {"rank", rank}, {"bytes", rec.bytes}, {"header_crc32c", rec.header_crc},
          {"tensor_crc32c", crcs}};
}

}  // namespace

nlohmann::json write_shard(const Plan& plan, const std::string& tmp, int rank, int threads, int64_t copy_ahead,
                           bool do_fsync, const char* api) {
  record_copy_ahead_peak_bytes(0, /*reset=*/true);
  std::vector<const Item*> items;
  for (const auto& it : plan.items)
    if (it.write) items.push_back(&it);
  nlohmann::json files = nlohmann::json::array();
  if (items.empty()) return files;
  const auto groups = split_by_size(items, threads);
  const int n = static_cast<int>(groups.size());
  std::vector<nlohmann::json> recs(n);
  std::vector<std::string> errors(n);
  auto work = [&](int i) {
    try {
      recs[i] = write_file(plan, groups[i], tmp, rank, i, n, copy_ahead, do_fsync, api);
    } catch (const std::exception& e) {
      errors[i] = message_of(e);
    }
  };
  std::vector<std::thread> pool;
  for (int i = 1; i < n; ++i) pool.emplace_back(work, i);
  work(0);
  for (auto& t : pool) t.join();
  for (const auto& e : errors) TORCH_CHECK(e.empty(), e);
  for (auto& r : recs) files.push_back(std::move(r));
  return files;
}

nlohmann::ordered_json metadata_of(const Plan& plan, const std::vector<nlohmann::json>& reports, int world) {
  nlohmann::ordered_json meta;
  meta["format"] = kFormatName;
  meta["version"] = kFormatVersion;
  meta["created_unix_ns"] =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  meta["world_size"] = world;
  auto mesh_shape = plan.mesh_shape.empty() ? std::vector<int64_t>{world} : plan.mesh_shape;
  meta["mesh"] = {{"shape", mesh_shape}, {"dim_names", plan.mesh_dim_names}};
  meta["checksum"] = {{"algorithm", "crc32c"}, {"block_bytes", kChecksumBlockBytes}};
  nlohmann::ordered_json files = nlohmann::ordered_json::object();
  for (const auto& rep : reports) {
    for (const auto& f : rep["files"]) {
      files[f["name"].get<std::string>()] = {{"rank", f["rank"]}, {"bytes", f["bytes"]},
                                             {"header_crc32c", f["header_crc32c"]},
                                             {"tensor_crc32c", f["tensor_crc32c"]}};
    }
  }
  meta["files"] = files;
  nlohmann::ordered_json tensors = nlohmann::ordered_json::object();
  for (const auto& k : reports[0]["keys"]) {
    if (k[1] == "Value") continue;
    tensors[k[0].get<std::string>()] = {{"dtype", k[2]}, {"shape", k[3]}, {"sharded", k[1] == "DTensor"}};
  }
  meta["tensors"] = tensors;
  meta["values"] = plan.values;
  nlohmann::ordered_json per_rank = nlohmann::ordered_json::object();
  for (const auto& [key, v] : reports[0]["per_rank"].items()) {
    nlohmann::json all = nlohmann::json::array();
    for (const auto& rep : reports) all.push_back(rep["per_rank"].value(key, nlohmann::json()));
    per_rank[key] = all;
  }
  meta["per_rank_values"] = per_rank;
  return meta;
}

void write_torch_metadata(const Plan& plan, const std::vector<nlohmann::json>& reports, const fs::path& tmp,
                          bool do_fsync, const char* api) {
  std::map<std::string, const Item*> items;
  for (const auto& it : plan.items) items[it.key] = &it;
  std::map<std::string, TorchEntry> entries;
  for (const auto& rep : reports) {
    for (const auto& f : rep["files"]) {
      const std::string file = f["name"];
      for (const auto& a : f["archives"]) {
        entries[a[0].get<std::string>()].chunks.push_back(
            {a[1].get<std::vector<int64_t>>(), a[2].get<std::vector<int64_t>>(), file, a[3].get<int64_t>(),
             a[4].get<int64_t>()});
      }
    }
  }
  // The Values, in one file of rank 0.
  std::map<std::string, TorchEntry::Chunk> values;
  {
    std::vector<std::pair<std::string, nlohmann::json>> objs;
    for (const auto& [k, v] : plan.values.items()) objs.emplace_back(k, v);
    for (const auto& [key, v] : reports[0]["per_rank"].items()) {
      nlohmann::json all = nlohmann::json::array();
      for (const auto& rep : reports) all.push_back(rep["per_rank"].value(key, nlohmann::json()));
      objs.emplace_back(key, nlohmann::json{{kPerRankKey, all}});
    }
    if (!objs.empty()) {
      // After rank 0's own files (__0_0 ... __0_{n-1}).
      const std::string name = distcp_file_name(0, static_cast<int>(reports[0]["files"].size()));
      auto f = File::create((tmp / name).string(), api);
      int64_t at = 0;
      for (const auto& [k, v] : objs) {
        const int64_t n = append_torch_save(f, v, std::string(api) + ": writing '" + k + "' to " + name);
        values[k] = {{}, {}, name, at, n};
        at += n;
      }
      if (do_fsync) f.fsync();
    }
  }
  std::vector<TorchEntry> list;
  for (const auto& k : reports[0]["keys"]) {
    const std::string key = k[0];
    TorchEntry e;
    e.key = key;
    if (k[1] == "Value") {
      auto v = values.find(key);
      TORCH_INTERNAL_ASSERT(v != values.end(), "no archive for Value ", key);
      e.tensor = false;
      e.chunks.push_back(v->second);
    } else {
      e.dtype = items.at(key)->dtype;
      e.sizes = k[3].get<std::vector<int64_t>>();
      e.chunks = std::move(entries[key].chunks);
    }
    list.push_back(std::move(e));
  }
  const int64_t now =
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  const std::string text = torch_metadata_pickle(list, libfsdp_save_id(now));
  auto f = File::create((tmp / kTorchMetadataFileName).string(), api);
  f.write_all(text.data(), text.size(), "the checkpoint metadata");
  if (do_fsync) f.fsync();
}

}  // namespace fsdp::dcp::detail
