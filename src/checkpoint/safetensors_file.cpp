// fsdp::dcp::save_file and load_file: one safetensors file, on the checkpoints' writer and reader
// (checkpoint/safetensors.h), so that there is one implementation of the format.
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>

#include "checkpoint/safetensors.h"
#include "fsdp/checkpoint/checkpoint.h"

namespace fsdp::dcp {

void save_file(const std::map<std::string, torch::Tensor>& tensors, const std::string& path,
               const std::map<std::string, std::string>& metadata) {
  const char* api = "dcp::save_file";
  std::vector<detail::WriteEntry> entries;
  std::vector<torch::Tensor> sources;
  for (const auto& [name, t] : tensors) {
    TORCH_CHECK(name != "__metadata__", api, ": the key '__metadata__' is reserved for the header's metadata. "
                "Fix: rename the tensor");
    TORCH_CHECK(t.defined(), api, ": '", name, "' is an undefined tensor. Fix: leave it out or give it a value");
    TORCH_CHECK(t.layout() == torch::kStrided, api, ": '", name, "' is a ", t.layout(),
                " tensor; safetensors stores dense tensors only. Fix: convert it with .to_dense()");
    detail::WriteEntry e;
    e.name = name;
    e.dtype = t.scalar_type();
    e.shape = t.sizes().vec();
    detail::dtype_name(e.dtype, api, name);  // throws for a dtype safetensors cannot store, now
    entries.push_back(std::move(e));
    sources.push_back(t);
  }
  const auto slash = path.find_last_of('/');
  const std::string folder = slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  struct stat st {};
  TORCH_CHECK(::stat(folder.c_str(), &st) == 0 && S_ISDIR(st.st_mode), api, ": cannot write ", path, ": the folder ",
              folder, " does not exist. Fix: create it first, or another path");
  // A temporary file renamed into place: a failed save never leaves a partial `path`.
  const std::string tmp = path + ".tmp-" + detail::random_nonce(8);
  try {
    detail::write_safetensors(
        tmp, entries,
        [&](size_t i) { return sources[i].detach().to(torch::kCPU).contiguous(); },
        /*sharding_info=*/false, /*block_bytes=*/int64_t(1) << 30, /*do_fsync=*/false, api, &metadata);
    TORCH_CHECK(::rename(tmp.c_str(), path.c_str()) == 0, api, ": renaming ", tmp, " to ", path,
                " failed: ", detail::errno_text(errno));
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
}

std::map<std::string, torch::Tensor> load_file(const std::string& path, torch::Device device) {
  const char* api = "dcp::load_file";
  const detail::File file = detail::File::open_read(path, api);
  const detail::Header header = detail::read_header(file, file.size(), api);
  std::map<std::string, torch::Tensor> out;
  for (const auto& e : header.entries) {
    TORCH_CHECK(!out.count(e.name), api, ": ", path, ": tensor '", e.name, "' appears twice in the header");
    auto t = torch::empty(e.shape, torch::TensorOptions(e.dtype));
    if (e.end > e.begin) {
      file.pread_exact(t.data_ptr(), static_cast<size_t>(e.end - e.begin), header.data_start + e.begin,
                       "'" + e.name + "'");
    }
    out.emplace(e.name, device.is_cpu() ? t : t.to(device));
  }
  return out;
}

}  // namespace fsdp::dcp
