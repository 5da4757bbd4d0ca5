// PyTorch's default DCP format, written (see torch_dcp.h and [Note: PyTorch's DCP format] in
// torch_dcp.cpp): torch.save archives through LibTorch's zip writer, and the `.metadata` pickle.
#include <memory>

#include <caffe2/serialize/inline_container.h>

#include "checkpoint/pickle.h"
#include "checkpoint/torch_dcp.h"
#include "util.h"

namespace fsdp::dcp::detail {

namespace {

/// A torch.save archive appended to `f`, written by LibTorch's zip writer as torch.save writes it.
int64_t append_archive(File& f, const std::string& data_pkl, const void* data, size_t nbytes, bool has_data,
                       const std::string& what) {
  int64_t written = 0;
  std::string error;  // the write's own error: nothing may be thrown through the zip writer's C code
  std::unique_ptr<caffe2::serialize::PyTorchStreamWriter> zip;
  try {
    zip = std::make_unique<caffe2::serialize::PyTorchStreamWriter>([&](const void* buf, size_t n) -> size_t {
      if (!error.empty()) return 0;
      try {
        f.write_all(buf, n, what);
      } catch (const std::exception& e) {
        error = fsdp::detail::message_of(e);
        return 0;
      }
      written += static_cast<int64_t>(n);
      return n;
    });
    zip->writeRecord("data.pkl", data_pkl.data(), data_pkl.size());
    zip->writeRecord(".format_version", "1", 1);
    zip->writeRecord(".storage_alignment", "64", 2);
    zip->writeRecord("byteorder", "little", 6);
    if (has_data) zip->writeRecord("data/0", data, nbytes);
    zip->writeEndOfFile();
  } catch (const c10::Error& e) {
    // The writer's destructor finishes an unfinished archive and would throw again out of a destructor
    // (std::terminate): finish it here, where a second error is caught.
    if (zip && !zip->finalized()) {
      try {
        zip->writeEndOfFile();
      } catch (const std::exception&) {
      }
    }
    TORCH_CHECK(false, error.empty() ? what + ": " + e.what_without_backtrace() : error);
  }
  TORCH_CHECK(error.empty(), error);
  return written;
}

}  // namespace

int64_t append_torch_save(File& f, const torch::Tensor& t, const std::string& what) {
  TORCH_INTERNAL_ASSERT(t.is_cpu() && t.is_contiguous());
  const auto* d = torch_dtype_of(t.scalar_type());
  TORCH_CHECK(d, what, ": dtype ", t.scalar_type(), " has no torch.save form this writer knows");
  const bool v3 = !*d->storage;
  PickleWriter p;
  p.global("torch._utils", v3 ? "_rebuild_tensor_v3" : "_rebuild_tensor_v2");
  p.mark();
  p.mark().str("storage");
  if (v3) p.global("torch.storage", "UntypedStorage");
  else p.global("torch", d->storage);
  p.str("0").str("cpu").integer(v3 ? static_cast<int64_t>(t.nbytes()) : t.numel()).tuple().binpersid();
  p.integer(0).int_tuple(t.sizes().vec()).int_tuple(t.strides().vec()).boolean(false);
  p.global("collections", "OrderedDict").empty_tuple().reduce();
  if (v3) p.global("torch", d->name);
  p.tuple().reduce();
  return append_archive(f, p.finish(), t.data_ptr(), t.nbytes(), true, what);
}

int64_t append_torch_save_raw(File& f, const std::string& data_pkl, const torch::Tensor& data, const std::string& what) {
  return append_archive(f, data_pkl, data.defined() ? data.data_ptr() : nullptr, data.defined() ? data.nbytes() : 0,
                        data.defined(), what);
}

int64_t append_torch_save(File& f, const nlohmann::json& v, const std::string& what) {
  PickleWriter p;
  p.json(v);
  return append_archive(f, p.finish(), nullptr, 0, false, what);
}

std::string torch_metadata_pickle(const std::vector<TorchEntry>& entries, const std::string& save_id) {
  PickleWriter p;
  auto size = [&](const std::vector<int64_t>& v) {
    p.global("torch", "Size").mark().int_tuple(v).tuple().reduce();
  };
  p.global(kMetaModule, "Metadata").empty_tuple().newobj();
  p.empty_dict().mark();
  // state_dict_metadata
  p.str("state_dict_metadata").empty_dict();
  if (!entries.empty()) {
    p.mark();
    for (const auto& e : entries) {
      p.str(e.key);
      if (!e.tensor) {
        p.global(kMetaModule, "BytesStorageMetadata").empty_tuple().newobj();
        continue;
      }
      const auto* d = torch_dtype_of(e.dtype);
      TORCH_CHECK(d, "dcp::save: '", e.key, "' has dtype ", e.dtype, ", which PyTorch's DCP format cannot name");
      p.global(kMetaModule, "TensorStorageMetadata").empty_tuple().newobj().empty_dict().mark();
      p.str("properties").global(kMetaModule, "TensorProperties").empty_tuple().newobj();
      p.mark().global("torch", d->name);
      p.global("torch.serialization", "_get_layout").mark().str("torch.strided").tuple().reduce();
      p.boolean(false);
      p.global(kMetaModule, "_MEM_FORMAT_ENCODING").mark().integer(0).tuple().reduce();
      p.boolean(false).tuple().build();
      p.str("size");
      size(e.sizes);
      p.str("chunks").empty_list();
      if (!e.chunks.empty()) {
        p.mark();
        for (const auto& c : e.chunks) {
          p.global(kMetaModule, "ChunkStorageMetadata").empty_tuple().newobj().empty_dict().mark();
          p.str("offsets");
          size(c.offsets);
          p.str("sizes");
          size(c.sizes);
          p.setitems().build();
        }
        p.appends();
      }
      p.setitems().build();
    }
    p.setitems();
  }
  // planner_data: each key is its own path (a flat state dict).
  p.str("planner_data").empty_dict();
  if (!entries.empty()) {
    p.mark();
    for (const auto& e : entries) p.str(e.key).mark().str(e.key).tuple();
    p.setitems();
  }
  // storage_data
  p.str("storage_data").empty_dict();
  if (!entries.empty()) {
    p.mark();
    for (const auto& e : entries) {
      for (const auto& c : e.chunks) {
        p.global(kMetaModule, "MetadataIndex").empty_tuple().newobj().empty_dict().mark();
        p.str("fqn").str(e.key);
        if (e.tensor) {
          p.str("offset");
          size(c.offsets);
        }
        p.str("index").none().setitems().build();
        p.global(kFsModule, "_StorageInfo").empty_tuple().newobj().empty_dict().mark();
        p.str("relative_path").str(c.file).str("offset").integer(c.offset).str("length").integer(c.length);
        p.setitems().build();
      }
    }
    p.setitems();
  }
  p.str("storage_meta").global(kMetaModule, "StorageMeta").empty_tuple().newobj().empty_dict().mark();
  p.str("checkpoint_id").none().str("save_id").str(save_id).str("load_id").none().str("modules").empty_list();
  p.setitems().build();
  p.str("version").str("1.0.0");
  p.setitems().build();
  return p.finish();
}

std::string libfsdp_save_id(int64_t unix_ns) { return "libfsdp-" + std::to_string(unix_ns) + "-" + random_nonce(8); }
}  // namespace fsdp::dcp::detail
