// Python pickles without Python: a reader that turns the opcodes PyTorch's DCP metadata and torch.save
// payloads use into a tree of plain values (it never calls or imports anything: a GLOBAL is a name, a
// REDUCE/NEWOBJ an object holding that name and its arguments), and a writer of protocol-2 pickles that
// Python's pickle.load reads. See [Note: PyTorch's DCP format] in torch_dcp.cpp for what is read and
// written with them.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace fsdp::dcp::detail {

struct PyObj;
using PyRef = std::shared_ptr<PyObj>;

/// One value of an unpickled tree.
struct PyObj {
  enum class Kind { None, Bool, Int, Float, Str, Bytes, Tuple, List, Dict, Global, Object, PersId };
  Kind kind = Kind::None;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;                              ///< Str, Bytes; Global: the module
  std::string name;                           ///< Global: the attribute ("torch", "float32")
  std::vector<PyRef> items;                   ///< Tuple, List
  std::vector<std::pair<PyRef, PyRef>> dict;  ///< Dict, in insertion order
  PyRef cls, args, state;                     ///< Object: the callable (a Global), its arguments (a Tuple), BUILD's state
  PyRef pid;                                  ///< PersId: the persistent id (torch.save: a Tuple)

  PyObj();
  PyObj(const PyObj&) = delete;
  PyObj& operator=(const PyObj&) = delete;
  /// Frees the children iteratively: a hostile pickle can nest millions of levels deep.
  ~PyObj();

  bool is(Kind k) const { return kind == k; }
  /// True for a Global `module.name`, or an Object whose callable is that Global.
  bool is_global(const char* module, const char* attr) const;
  /// Object: the entry `key` of its BUILD state when that is a dict with string keys (a dataclass's
  /// __dict__), else null.
  PyRef attr(const std::string& key) const;
  /// Dict: the value of the string key `key`, else null.
  PyRef get(const std::string& key) const;
  /// "int", "str", "torch.Size(...)", ... (for messages).
  std::string type_name() const;
};

/// Values alive in this process (for tests that a hostile pickle's values are all freed).
int64_t live_pyobjs();

/// Unpickles `data` (protocols 0-5 as far as these opcodes go: the ones pickle.dump and torch.save emit
/// for dicts, lists, tuples, strings, numbers, globals, dataclasses and tensors). Throws c10::Error
/// "<what>: ..." naming the byte offset and the fault for a truncated pickle, an unknown opcode, a bad
/// memo index or stack underflow. Bounded: at most `data.size()` objects; no recursion.
PyRef unpickle(const std::string& data, const std::string& what);

/// The JSON of a tree of None/bool/int/float/str/list/tuple/dict-with-str-keys values (tuples become
/// arrays); "" into `why` and null when something else is inside (then `why` names it). Depth at most 64.
nlohmann::json to_json(const PyObj& o, std::string* why);

/// A protocol-2 pickle, written opcode by opcode (no memo: nothing is shared).
class PickleWriter {
 public:
  PickleWriter();
  PickleWriter& none();
  PickleWriter& boolean(bool v);
  PickleWriter& integer(int64_t v);
  PickleWriter& floating(double v);
  PickleWriter& str(const std::string& v);
  /// GLOBAL: pushes `module.name` (pickle.load imports it).
  PickleWriter& global(const std::string& module, const std::string& name);
  PickleWriter& mark();
  PickleWriter& tuple();  ///< the items since the last mark
  PickleWriter& empty_tuple();
  PickleWriter& empty_list();
  PickleWriter& appends();  ///< appends the items since the mark to the list below it
  PickleWriter& empty_dict();
  PickleWriter& setitems();  ///< key/value pairs since the mark into the dict below it
  PickleWriter& reduce();    ///< callable(args tuple)
  PickleWriter& newobj();    ///< cls.__new__(cls, *args)
  PickleWriter& build();     ///< obj.__setstate__(state) or obj.__dict__.update(state)
  PickleWriter& binpersid();
  /// Any JSON value as Python builtins (objects: dicts with str keys; arrays: lists).
  PickleWriter& json(const nlohmann::json& v);
  /// Tuple of ints (shapes, offsets).
  PickleWriter& int_tuple(const std::vector<int64_t>& v);
  /// Ends the pickle; returns its bytes.
  std::string finish();

 private:
  void op(uint8_t c) { out_.push_back(static_cast<char>(c)); }
  std::string out_;
};

}  // namespace fsdp::dcp::detail
