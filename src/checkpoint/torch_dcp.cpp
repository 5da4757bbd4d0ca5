// PyTorch's default DCP format, read and written without Python (see torch_dcp.h).
//
// [Note: PyTorch's DCP format]
// What torch.distributed.checkpoint.save(sd, checkpoint_id=DIR) writes with its default FileSystemWriter
// (torch 2.13: checkpoint/filesystem.py, metadata.py, default_planner.py):
//   DIR/__{rank}_{n}.distcp   each rank's items, one after another, each a complete torch.save archive
//                             (a zip: archive/data.pkl, archive/data/0 with the tensor's bytes 64-byte
//                             aligned and uncompressed, archive/byteorder, version, ...): a tensor chunk as
//                             torch.save(tensor), a non-tensor entry as torch.save(obj)
//   DIR/.metadata             pickle.dump(Metadata): state_dict_metadata {key: TensorStorageMetadata(
//                             properties=TensorProperties(dtype, ...), size=torch.Size, chunks=[
//                             ChunkStorageMetadata(offsets, sizes)]) | BytesStorageMetadata()},
//                             storage_data {MetadataIndex(fqn, offset): _StorageInfo(relative_path,
//                             offset, length)}, planner_data {key: path tuple}, storage_meta, version
// Nested state dicts are flattened by the planner into dotted keys ("optim.state.w.exp_avg",
// "optim.param_groups.0.lr"), which is how our flat StateDict names them too.
//
// Reading: the pickle is parsed by our own reader (pickle.h: names, never imports), then for each
// chunk the archive's data.pkl (_rebuild_tensor_v2/v3: storage dtype, offset, size, stride) and the
// zip's directory (LibTorch's PyTorchStreamReader over that byte range of the file) give where the
// tensor's raw bytes lie in the `.distcp` file: a ChunkInfo like any other, so resharded loads read
// only the bytes they need, straight into the destination, as for safetensors. A non-tensor entry is
// unpickled into a Value when it is made of None/bool/int/float/str/list/tuple/dict (step counters,
// hyper-parameters, scheduler state); anything else (a Python object) is kept by name in
// `unreadable` and refused when the state dict asks for it (as is an entry whose data cannot be read).
//
// Writing (SaveOptions::storage_format(StorageFormat::Distcp); torch_dcp_write.cpp): each rank appends its
// chunks to __{rank}_{i}.distcp as torch.save archives (PyTorchStreamWriter, the writer torch.save uses); rank 0
// writes the Values to __0_{n}.distcp (after its n files of chunks) and the `.metadata` pickle (protocol 2, the same classes), so
// that `dcp.load(sd, checkpoint_id=DIR)` reads it. Per-rank Values, which PyTorch has no notion of,
// are stored as {"libfsdp_per_rank": [value of rank 0, value of rank 1, ...]}.
#include "checkpoint/torch_dcp.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <deque>
#include <map>
#include <set>
#include <regex>

#include <caffe2/serialize/inline_container.h>
#include <caffe2/serialize/read_adapter_interface.h>

#include "checkpoint/pickle.h"
#include "util.h"

namespace fsdp::dcp::detail {

namespace fs = std::filesystem;
using fsdp::detail::numel_of;
using fsdp::detail::shape_str;

namespace {

constexpr TorchDtype kTorchDtypes[] = {
    {torch::kFloat64, "float64", "DoubleStorage"},   {torch::kFloat32, "float32", "FloatStorage"},
    {torch::kBFloat16, "bfloat16", "BFloat16Storage"}, {torch::kFloat16, "float16", "HalfStorage"},
    {torch::kInt64, "int64", "LongStorage"},         {torch::kInt32, "int32", "IntStorage"},
    {torch::kInt16, "int16", "ShortStorage"},        {torch::kInt8, "int8", "CharStorage"},
    {torch::kUInt8, "uint8", "ByteStorage"},         {torch::kBool, "bool", "BoolStorage"},
    {torch::kComplexFloat, "complex64", "ComplexFloatStorage"},
    {torch::kComplexDouble, "complex128", "ComplexDoubleStorage"},
    {torch::kFloat8_e4m3fn, "float8_e4m3fn", ""},    {torch::kFloat8_e5m2, "float8_e5m2", ""},
    {torch::kUInt16, "uint16", ""},                  {torch::kUInt32, "uint32", ""},
    {torch::kUInt64, "uint64", ""},
};

/// The dtype of `torch.<name>` (a Global).
std::optional<torch::ScalarType> dtype_of(const PyObj& g) {
  if (!g.is(PyObj::Kind::Global) || g.s != "torch") return std::nullopt;
  for (const auto& d : kTorchDtypes)
    if (g.name == d.name) return d.dtype;
  return std::nullopt;
}

/// A byte range of an open file, as LibTorch's zip reader sees it.
class FileSlice final : public caffe2::serialize::ReadAdapterInterface {
 public:
  FileSlice(int fd, int64_t base, int64_t len) : fd_(fd), base_(base), len_(len) {}
  size_t size() const override { return static_cast<size_t>(len_); }
  size_t read(uint64_t pos, void* buf, size_t n, const char* /*what*/) const override {
    if (pos >= static_cast<uint64_t>(len_)) return 0;
    n = std::min<uint64_t>(n, static_cast<uint64_t>(len_) - pos);
    size_t done = 0;
    while (done < n) {
      const ssize_t r = ::pread(fd_, static_cast<char*>(buf) + done, n - done, base_ + static_cast<int64_t>(pos + done));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) break;
      done += static_cast<size_t>(r);
    }
    return done;
  }

 private:
  int fd_;
  int64_t base_, len_;
};

/// Ints of a torch.Size (an Object torch.Size((...))) or a plain tuple/list of ints.
std::optional<std::vector<int64_t>> ints_of(const PyRef& o) {
  if (!o) return std::nullopt;
  const PyObj* t = o.get();
  if (o->is_global("torch", "Size")) {
    if (!o->args || o->args->items.size() != 1) return std::nullopt;
    t = o->args->items[0].get();
  }
  if (!t->is(PyObj::Kind::Tuple) && !t->is(PyObj::Kind::List)) return std::nullopt;
  std::vector<int64_t> v;
  for (const auto& e : t->items) {
    if (!e->is(PyObj::Kind::Int)) return std::nullopt;
    v.push_back(e->i);
  }
  return v;
}

/// One torch.save archive inside a `.distcp` file.
struct Archive {
  std::shared_ptr<FileSlice> slice;
  std::unique_ptr<caffe2::serialize::PyTorchStreamReader> zip;
  std::string what;
};

Archive open_archive(const File& f, int64_t offset, int64_t length, const std::string& what) {
  Archive a;
  a.what = what;
  try {
    a.slice = std::make_shared<FileSlice>(f.fd(), offset, length);
    a.zip = std::make_unique<caffe2::serialize::PyTorchStreamReader>(a.slice);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, what, " is not a readable torch.save archive (damaged, or written with a transform such as ",
                "compression that this reader does not undo): ", e.what_without_backtrace());
  }
  return a;
}

/// Runs `f` on archive `a`, turning the zip reader's errors into ours (naming the file and the key).
template <typename F>
auto in_archive(const Archive& a, F&& f) {
  try {
    return f();
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, a.what, " is not a readable torch.save archive (damaged?): ", e.what_without_backtrace());
  }
}

std::string record(Archive& a, const std::string& name) {
  return in_archive(a, [&] {
    TORCH_CHECK(a.zip->hasRecord(name), "it has no record '", name, "'");
    // Stored records are no larger than the archive: a larger size is a deflated (or lying) record,
    // which must not make us allocate what it claims.
    TORCH_CHECK(a.zip->getRecordSize(name) <= a.slice->size(), "record '", name, "' claims ",
                a.zip->getRecordSize(name), " bytes in an archive of ", a.slice->size());
    auto [ptr, n] = a.zip->getRecord(name);
    return std::string(static_cast<const char*>(ptr.get()), n);
  });
}

/// Where the raw bytes of the tensor that archive `a` holds lie, relative to the archive's start.
struct TensorBytes {
  int64_t offset = 0, nbytes = 0;
};

TensorBytes locate_tensor(Archive& a, torch::ScalarType dtype, const std::vector<int64_t>& sizes) {
  const std::string& what = a.what;
  if (in_archive(a, [&] { return a.zip->hasRecord("byteorder"); })) {
    const auto order = record(a, "byteorder");
    TORCH_CHECK(order == "little", what, " stores its tensor ", order, "-endian; this reader reads little-endian data");
  }
  auto root = unpickle(record(a, "data.pkl"), what + " (data.pkl)");
  const bool v2 = root->is_global("torch._utils", "_rebuild_tensor_v2");
  const bool v3 = root->is_global("torch._utils", "_rebuild_tensor_v3");
  TORCH_CHECK(root->is(PyObj::Kind::Object) && (v2 || v3) && root->args->items.size() >= (v3 ? 7u : 4u), what,
              " does not hold a plain tensor (it holds ", root->type_name(),
              "): expected torch.save of a tensor (torch._utils._rebuild_tensor_v2 or _v3)");
  const auto& args = root->args->items;
  const auto& pid = args[0];
  TORCH_CHECK(pid->is(PyObj::Kind::PersId) && pid->pid && pid->pid->is(PyObj::Kind::Tuple) &&
                  pid->pid->items.size() == 5 && pid->pid->items[2]->is(PyObj::Kind::Str) &&
                  pid->pid->items[4]->is(PyObj::Kind::Int),
              what, ": its tensor's storage is not a ('storage', type, key, location, size) record");
  const auto& storage_type = *pid->pid->items[1];
  const std::string key = pid->pid->items[2]->s;
  std::optional<torch::ScalarType> stored;
  if (v3) {
    stored = dtype_of(*args[6]);
  } else {
    for (const auto& d : kTorchDtypes)
      if (*d.storage && storage_type.is_global("torch", d.storage)) stored = d.dtype;
  }
  TORCH_CHECK(stored, what, ": its tensor's storage type ", storage_type.type_name(), " is not one this reader knows");
  TORCH_CHECK(*stored == dtype, what, ": the archive holds a ", *stored, " tensor but .metadata says ", dtype);
  auto size = ints_of(args[2]);
  auto stride = ints_of(args[3]);
  TORCH_CHECK(args[1]->is(PyObj::Kind::Int) && size && stride && size->size() == stride->size(), what,
              ": malformed tensor record (storage offset, size and stride)");
  TORCH_CHECK(*size == sizes, what, ": the archive holds a tensor of shape ", shape_str(*size), " but .metadata says ",
              shape_str(sizes));
  // Row-major and dense: the chunk is one run of bytes (DCP saves contiguous clones; refuse anything else).
  // (A tensor without elements has no layout to check.)
  int64_t expect = 1;
  const bool empty = std::any_of(size->begin(), size->end(), [](int64_t d) { return d == 0; });
  for (size_t d = size->size(); d-- > 0 && !empty;) {
    TORCH_CHECK((*size)[d] <= 1 || (*stride)[d] == expect, what, ": its tensor has strides ", shape_str(*stride),
                " for shape ", shape_str(*size), ", not row-major contiguous (e.g. a transposed view or channels_last ",
                "tensor saved as is); this reader reads row-major chunks only");
    expect *= std::max<int64_t>((*size)[d], 1);
  }
  const int64_t es = static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t storage_offset = args[1]->i;
  const int64_t storage_elems = pid->pid->items[4]->i;  // v3 (untyped storage): bytes
  // Hostile numbers must not wrap around: every product and sum below is checked.
  int64_t storage_bytes = 0, offset_bytes = 0, numel = 1;
  bool overflow = storage_elems < 0 || storage_offset < 0 ||
                  __builtin_mul_overflow(storage_elems, v3 ? int64_t(1) : es, &storage_bytes) ||
                  __builtin_mul_overflow(storage_offset, es, &offset_bytes);
  for (auto d : sizes) overflow = overflow || d < 0 || __builtin_mul_overflow(numel, d, &numel);
  TensorBytes tb;
  overflow = overflow || __builtin_mul_overflow(numel, es, &tb.nbytes);
  TORCH_CHECK(!overflow, what, ": its tensor record's sizes overflow (damaged or hostile archive)");
  const std::string data = "data/" + key;
  TORCH_CHECK(in_archive(a, [&] { return a.zip->hasRecord(data); }), what, " has no record '", data,
              "' for its tensor's storage");
  const int64_t rec_size = in_archive(a, [&] { return static_cast<int64_t>(a.zip->getRecordSize(data)); });
  TORCH_CHECK(storage_bytes <= rec_size && offset_bytes <= storage_bytes - tb.nbytes, what,
              ": its tensor (offset ", storage_offset, ", ", tb.nbytes, " bytes) does not fit its storage record (",
              rec_size, " bytes)");
  // Stored, not deflated: the bytes in the file are the tensor's (torch.save never compresses).
  in_archive(a, [&] {
    const auto header = static_cast<int64_t>(a.zip->getRecordHeaderOffset(data));
    uint8_t h[30];
    TORCH_CHECK(a.slice->read(static_cast<uint64_t>(header), h, sizeof h, "") == sizeof h && h[0] == 'P' && h[1] == 'K' &&
                    h[8] == 0 && h[9] == 0,
                "record '", data, "' is compressed (or its header is damaged); this reader reads stored records");
    return 0;
  });
  tb.offset = in_archive(a, [&] { return static_cast<int64_t>(a.zip->getRecordOffset(data)); }) + offset_bytes;
  return tb;
}

int rank_of_distcp(const std::string& name) {
  static const std::regex re("^__(\\d+)_\\d+\\.distcp$");
  std::smatch m;
  return std::regex_match(name, m, re) ? std::stoi(m[1].str()) : -1;
}

/// The key of storage_data: (fqn, chunk offsets or none).
using StorageKey = std::pair<std::string, std::optional<std::vector<int64_t>>>;
struct StorageInfo {
  std::string file;
  int64_t offset = 0, length = 0;
};

}  // namespace

const TorchDtype* torch_dtype_of(torch::ScalarType t) {
  for (const auto& d : kTorchDtypes)
    if (d.dtype == t) return &d;
  return nullptr;
}

std::string torch_dtype_name(torch::ScalarType dtype, const char* api, const std::string& key) {
  const auto* d = torch_dtype_of(dtype);
  TORCH_CHECK(d, api, ": '", key, "' has dtype ", dtype, ", which PyTorch's DCP format cannot name here. Fix: convert it, ",
              "or leave it out of the state dict");
  return d->name;
}

std::string distcp_file_name(int rank, int index) {
  return "__" + std::to_string(rank) + "_" + std::to_string(index) + ".distcp";
}

void read_torch_dcp(CheckpointInfo& info, const std::function<void(const std::string&)>& report, const char* api) {
  const fs::path dir = info.dir;
  const std::string meta_path = (dir / kTorchMetadataFileName).string();
  info.format = kTorchFormatName;
  PyRef root;
  {
    // .metadata is small (a few hundred bytes per chunk) but not tiny: read it whole.
    auto f = File::open_read(meta_path, api);
    std::string text(static_cast<size_t>(f.size()), '\0');
    f.pread_exact(text.data(), text.size(), 0, meta_path);
    root = unpickle(text, std::string(api) + ": " + meta_path);
  }
  const std::string bad = std::string(api) + ": " + meta_path + " is not PyTorch DCP metadata: ";
  TORCH_CHECK(root->is_global(kMetaModule, "Metadata") && root->state && root->state->is(PyObj::Kind::Dict), bad,
              "expected a pickled ", kMetaModule, ".Metadata, found ", root->type_name());
  auto sdm = root->attr("state_dict_metadata");
  auto storage = root->attr("storage_data");
  TORCH_CHECK(sdm && sdm->is(PyObj::Kind::Dict), bad, "no state_dict_metadata dict");
  TORCH_CHECK(storage && storage->is(PyObj::Kind::Dict), bad,
              "no storage_data dict (written by a storage writer other than FileSystemWriter?)");
  // (Our metadata stays null: the loader streams this format's data, as it has no checksums.)

  // storage_data: where each item's archive lies.
  std::map<StorageKey, StorageInfo> where;
  for (const auto& [k, v] : storage->dict) {
    TORCH_CHECK(k->is_global(kMetaModule, "MetadataIndex") && v->is_global(kFsModule, "_StorageInfo"), bad,
                "storage_data maps ", k->type_name(), " to ", v->type_name(), " (expected MetadataIndex to _StorageInfo)");
    auto fqn = k->attr("fqn");
    TORCH_CHECK(fqn && fqn->is(PyObj::Kind::Str), bad, "a MetadataIndex without its fqn");
    std::optional<std::vector<int64_t>> off;
    if (auto o = k->attr("offset"); o && !o->is(PyObj::Kind::None)) {
      off = ints_of(o);
      TORCH_CHECK(off, bad, "the MetadataIndex of '", fqn->s, "' has offset ", o->type_name());
    }
    auto path = v->attr("relative_path"), offset = v->attr("offset"), length = v->attr("length");
    TORCH_CHECK(path && path->is(PyObj::Kind::Str) && offset && offset->is(PyObj::Kind::Int) && length &&
                    length->is(PyObj::Kind::Int) && offset->i >= 0 && length->i >= 0,
                bad, "the _StorageInfo of '", fqn->s, "' lacks relative_path, offset or length");
    TORCH_CHECK(length->i <= INT64_MAX - offset->i, bad, "the _StorageInfo of '", fqn->s, "' ends past 2^63 bytes");
    TORCH_CHECK(!path->s.empty() && path->s.find('/') == std::string::npos && path->s != "." && path->s != "..", bad,
                "'", fqn->s, "' is stored in '", path->s, "', which is not a file name in the folder");
    if (auto t = v->attr("transform_descriptors"); t && !t->is(PyObj::Kind::None)) {
      TORCH_CHECK(t->items.empty(), api, ": '", fqn->s, "' in ", info.dir, " was written through storage transforms (",
                  "e.g. compression, extensions of FileSystemWriter(_extensions=...)), which this reader does not undo. ",
                  "Fix: save without extensions");
    }
    where[{fqn->s, off}] = {path->s, offset->i, length->i};
  }

  // The files: present, and long enough for what .metadata puts in them.
  std::map<std::string, int64_t> need;
  for (const auto& [_, s] : where) need[s.file] = std::max(need[s.file], s.offset + s.length);
  std::set<std::string> present;
  for (const auto& [name, bytes] : need) {
    const std::string path = (dir / name).string();
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) {
      report(std::string(api) + ": " + path + " is missing: " + meta_path + " places checkpoint data in it. The " +
             "checkpoint is incomplete; restore the file or use another checkpoint");
      continue;
    }
    if (st.st_size < bytes) {
      report(std::string(api) + ": " + path + " is truncated: " + std::to_string(st.st_size) + " bytes, but " + meta_path +
             " places data up to byte " + std::to_string(bytes) + " in it. The file was damaged; restore it or use " +
             "another checkpoint");
      continue;
    }
    FileInfo fi;
    fi.name = name;
    fi.rank = rank_of_distcp(name);
    fi.bytes = static_cast<int64_t>(st.st_size);
    info.files.push_back(fi);
    present.insert(name);
  }
  // Open lazily, at most kOpenFiles at once (oldest closed first): a checkpoint of thousands of files
  // (ranks x thread_count) must not exhaust the process's file descriptors. An Archive lives only
  // while one entry's chunk is read, so closing a file never pulls one from under it.
  constexpr size_t kOpenFiles = 64;
  std::map<std::string, File> open;
  std::deque<std::string> opened;  // oldest first
  auto archive_of = [&](const std::string& key, const StorageInfo& s) -> std::optional<Archive> {
    if (!present.count(s.file)) return std::nullopt;  // reported above
    auto f = open.find(s.file);
    if (f == open.end()) {
      if (open.size() >= kOpenFiles) {
        open.erase(opened.front());
        opened.pop_front();
      }
      f = open.emplace(s.file, File::open_read((dir / s.file).string(), api)).first;
      opened.push_back(s.file);
    }
    return open_archive(f->second, s.offset, s.length,
                        std::string(api) + ": '" + key + "' (bytes " + std::to_string(s.offset) + "-" +
                            std::to_string(s.offset + s.length) + " of " + (dir / s.file).string() + ")");
  };

  // One entry; an entry this reader cannot read (a Python object, an unknown dtype, a transposed chunk,
  // a damaged archive) is set aside in `unreadable` with the reason, and refused only if asked for.
  auto read_entry = [&](const std::string& key, const PyRef& md) {
    if (md->is_global(kMetaModule, "BytesStorageMetadata")) {
      auto s = where.find({key, std::nullopt});
      TORCH_CHECK(s != where.end(), bad, "no storage_data for the non-tensor entry '", key, "'");
      auto a = archive_of(key, s->second);
      if (!a) return;
      auto obj = unpickle(record(*a, "data.pkl"), a->what + " (data.pkl)");
      std::string why;
      auto j = to_json(*obj, &why);
      if (!why.empty()) {
        info.unreadable[key] = why + ", which has no C++ form (a Value holds None, bool, int, float, str and lists, " +
                               "tuples and str-keyed dicts of them)";
      } else if (j.is_object() && j.size() == 1 && j.contains(kPerRankKey) && j[kPerRankKey].is_array()) {
        info.per_rank_values[key] = j[kPerRankKey].get<std::vector<nlohmann::json>>();
        info.world_size = static_cast<int>(info.per_rank_values[key].size());
      } else {
        info.values[key] = std::move(j);
      }
      return;
    }
    TORCH_CHECK(md->is_global(kMetaModule, "TensorStorageMetadata"), bad, "'", key, "' is described by ",
                md->type_name(), " (expected TensorStorageMetadata or BytesStorageMetadata)");
    auto props = md->attr("properties");
    auto size = ints_of(md->attr("size"));
    auto chunks = md->attr("chunks");
    TORCH_CHECK(props && props->is(PyObj::Kind::Object) && props->state && size && chunks &&
                    chunks->is(PyObj::Kind::List),
                bad, "the TensorStorageMetadata of '", key, "' lacks properties, size or chunks");
    // TensorProperties pickles its state as a tuple (dtype, layout, requires_grad, memory format, pin).
    PyRef dt = props->state->is(PyObj::Kind::Tuple) && !props->state->items.empty() ? props->state->items[0]
                                                                                     : props->state->get("dtype");
    auto dtype = dt ? dtype_of(*dt) : std::nullopt;
    TORCH_CHECK(dtype, api, ": '", key, "' in ", meta_path, " has dtype ", dt ? dt->type_name() : "(none)",
                ", which this reader does not know");
    TensorInfo t;
    t.dtype = *dtype;
    t.sizes = *size;
    for (const auto& c : chunks->items) {
      auto off = ints_of(c->attr("offsets")), sz = ints_of(c->attr("sizes"));
      TORCH_CHECK(c->is_global(kMetaModule, "ChunkStorageMetadata") && off && sz && off->size() == t.sizes.size() &&
                      sz->size() == t.sizes.size(),
                  bad, "a chunk of '", key, "' is not a ChunkStorageMetadata(offsets, sizes) of ", t.sizes.size(), " dims");
      for (size_t d = 0; d < t.sizes.size(); ++d) {
        TORCH_CHECK(t.sizes[d] >= 0 && (*off)[d] >= 0 && (*sz)[d] >= 0 && (*off)[d] <= t.sizes[d] - (*sz)[d], bad,
                    "a chunk of '", key,
                    "' at ", shape_str(*off), " of shape ", shape_str(*sz), " lies outside its shape ",
                    shape_str(t.sizes));
      }
      auto s = where.find({key, *off});
      TORCH_CHECK(s != where.end(), bad, "no storage_data for the chunk of '", key, "' at ", shape_str(*off));
      auto a = archive_of(key, s->second);
      if (!a) continue;
      const auto tb = locate_tensor(*a, t.dtype, *sz);
      TORCH_CHECK(tb.offset + tb.nbytes <= s->second.length, a->what, ": its tensor data runs past the archive");
      ChunkInfo ci;
      ci.file = s->second.file;
      ci.offsets = *off;
      ci.sizes = *sz;
      ci.file_offset = s->second.offset + tb.offset;
      ci.nbytes = tb.nbytes;
      t.chunks.push_back(std::move(ci));
    }
    TORCH_CHECK(!chunks->items.empty(), bad, "'", key, "' has no chunks");
    info.tensors[key] = std::move(t);
  };
  for (const auto& [k, md] : sdm->dict) {
    TORCH_CHECK(k->is(PyObj::Kind::Str), bad, "a state_dict_metadata key of type ", k->type_name());
    try {
      read_entry(k->s, md);
    } catch (const c10::Error& e) {
      info.tensors.erase(k->s);
      info.values.erase(k->s);
      info.per_rank_values.erase(k->s);
      info.unreadable[k->s] = e.what_without_backtrace();
    }
  }
}

std::optional<int64_t> libfsdp_torch_dcp_time(const std::string& dir) {
  try {
    const std::string path = (fs::path(dir) / kTorchMetadataFileName).string();
    auto f = File::open_read(path, "dcp::save");
    std::string text(static_cast<size_t>(f.size()), '\0');
    f.pread_exact(text.data(), text.size(), 0, path);
    auto root = unpickle(text, path);
    auto meta = root->attr("storage_meta");
    auto id = meta ? meta->attr("save_id") : nullptr;
    static const std::regex re("^libfsdp-(\\d+)-[0-9a-zA-Z]+$");
    std::smatch m;
    if (id && id->is(PyObj::Kind::Str) && std::regex_match(id->s, m, re)) return std::stoll(m[1].str());
  } catch (const std::exception&) {
  }
  return std::nullopt;
}

}  // namespace fsdp::dcp::detail
