// Python pickles without Python (see pickle.h). The opcodes follow CPython's Lib/pickle.py and
// pickletools.py; only the subset that pickle.dump (protocols 2-5) and torch.save emit for PyTorch's
// DCP metadata and payloads is read: anything else is refused by name, never guessed at.
#include "checkpoint/pickle.h"

#include <atomic>
#include <cstring>
#include <unordered_map>

#include <c10/util/Exception.h>

namespace fsdp::dcp::detail {

namespace {
std::atomic<int64_t> g_live{0};
}  // namespace
int64_t live_pyobjs() { return g_live.load(); }

PyObj::PyObj() { ++g_live; }

PyObj::~PyObj() {
  --g_live;
  static thread_local bool draining = false;
  static thread_local std::vector<PyRef> pending;
  for (auto& c : items) pending.push_back(std::move(c));
  for (auto& [k, v] : dict) {
    pending.push_back(std::move(k));
    pending.push_back(std::move(v));
  }
  for (auto* c : {&cls, &args, &state, &pid}) pending.push_back(std::move(*c));
  if (draining) return;
  draining = true;
  while (!pending.empty()) {
    PyRef p = std::move(pending.back());
    pending.pop_back();
    p.reset();  // may append its own children to `pending`
  }
  draining = false;
}

bool PyObj::is_global(const char* module, const char* attr) const {
  if (kind == Kind::Object) return cls && cls->is_global(module, attr);
  return kind == Kind::Global && s == module && name == attr;
}

PyRef PyObj::get(const std::string& key) const {
  if (kind != Kind::Dict) return nullptr;
  for (const auto& [k, v] : dict)
    if (k->kind == Kind::Str && k->s == key) return v;
  return nullptr;
}

PyRef PyObj::attr(const std::string& key) const {
  if (kind != Kind::Object || !state) return nullptr;
  return state->get(key);
}

std::string PyObj::type_name() const {
  switch (kind) {
    case Kind::None: return "None";
    case Kind::Bool: return "bool";
    case Kind::Int: return "int";
    case Kind::Float: return "float";
    case Kind::Str: return "str";
    case Kind::Bytes: return "bytes";
    case Kind::Tuple: return "tuple";
    case Kind::List: return "list";
    case Kind::Dict: return "dict";
    case Kind::Global: return s + "." + name;
    case Kind::Object: return (cls ? cls->type_name() : std::string("?")) + "(...)";
    case Kind::PersId: return "a persistent id";
  }
  return "?";
}

namespace {

PyRef make(PyObj::Kind k) {
  auto o = std::make_shared<PyObj>();
  o->kind = k;
  return o;
}

class Unpickler {
 public:
  Unpickler(const std::string& data, const std::string& what) : d_(data), what_(what) {}
  /// Cuts every edge of the values it made that are not part of the tree run() returned (all of them
  /// when it failed): a hostile pickle can make a list that holds itself (memo + APPEND), which
  /// reference counting never frees, in the tree (refused) or beside it (garbage).
  ~Unpickler() {
    std::vector<PyRef> drop;
    for (auto& w : made_) {
      auto p = w.lock();
      if (!p || (ok_ && in_tree_.count(p.get()))) continue;
      for (auto& c : p->items) drop.push_back(std::move(c));
      for (auto& [k, v] : p->dict) {
        drop.push_back(std::move(k));
        drop.push_back(std::move(v));
      }
      p->items.clear();
      p->dict.clear();
      for (auto* c : {&p->cls, &p->args, &p->state, &p->pid}) drop.push_back(std::move(*c));
    }
  }

  PyRef run() {
    while (true) {
      const size_t at = pos_;
      const uint8_t op = u8();
      switch (op) {
        case 0x80: u8(); break;              // PROTO
        case 0x95: take(8); break;           // FRAME: its length (frames are read as one stream)
        case '.':                            // STOP
          if (stack_.size() != 1 || !marks_.empty()) fail(at, "STOP with " + std::to_string(stack_.size()) + " values on the stack");
          if (has_cycle(stack_.back())) {
            fail(at, "the pickle holds a reference cycle (a value inside itself), which no checkpoint metadata has");
          }
          ok_ = true;
          return stack_.back();
        case '(': marks_.push_back(stack_.size()); break;  // MARK
        case 'N': push(make(PyObj::Kind::None)); break;
        case 0x88: case 0x89: {  // NEWTRUE, NEWFALSE
          auto o = make(PyObj::Kind::Bool);
          o->b = op == 0x88;
          push(o);
          break;
        }
        case 'J': push_int(static_cast<int32_t>(le(4))); break;  // BININT
        case 'K': push_int(u8()); break;                          // BININT1
        case 'M': push_int(static_cast<int64_t>(le(2))); break;  // BININT2
        case 0x8a: {                                              // LONG1
          const size_t n = u8();
          if (n > 8) fail(at, "an integer of " + std::to_string(n) + " bytes (wider than 64 bits)");
          const std::string b = take(n);
          uint64_t v = 0;
          for (size_t k = 0; k < n; ++k) v |= static_cast<uint64_t>(static_cast<uint8_t>(b[k])) << (8 * k);
          if (n > 0 && n < 8 && (static_cast<uint8_t>(b[n - 1]) & 0x80)) v |= ~uint64_t(0) << (8 * n);  // sign
          push_int(static_cast<int64_t>(v));
          break;
        }
        case 'G': {  // BINFLOAT: big-endian double
          const std::string b = take(8);
          uint64_t v = 0;
          for (int k = 0; k < 8; ++k) v = (v << 8) | static_cast<uint8_t>(b[k]);
          auto o = make(PyObj::Kind::Float);
          std::memcpy(&o->f, &v, 8);
          push(o);
          break;
        }
        case 0x8c: push_str(take(u8()), PyObj::Kind::Str); break;          // SHORT_BINUNICODE
        case 'X': push_str(take(le(4)), PyObj::Kind::Str); break;          // BINUNICODE
        case 0x8d: push_str(take(le(8)), PyObj::Kind::Str); break;         // BINUNICODE8
        case 'C': push_str(take(u8()), PyObj::Kind::Bytes); break;         // SHORT_BINBYTES
        case 'B': push_str(take(le(4)), PyObj::Kind::Bytes); break;        // BINBYTES
        case 0x8e: push_str(take(le(8)), PyObj::Kind::Bytes); break;       // BINBYTES8
        case 'U': push_str(take(u8()), PyObj::Kind::Str); break;           // SHORT_BINSTRING (py2 str)
        case 'T': push_str(take(le(4)), PyObj::Kind::Str); break;          // BINSTRING
        case ')': push(make(PyObj::Kind::Tuple)); break;                    // EMPTY_TUPLE
        case 0x85: case 0x86: case 0x87: {                                  // TUPLE1..3
          auto t = make(PyObj::Kind::Tuple);
          const size_t n = op - 0x84;
          if (stack_.size() < n + floor()) fail(at, "TUPLE" + std::to_string(n) + " on a stack of " + std::to_string(stack_.size()));
          t->items.assign(stack_.end() - n, stack_.end());
          stack_.resize(stack_.size() - n);
          push(t);
          break;
        }
        case 't': {  // TUPLE
          auto t = make(PyObj::Kind::Tuple);
          t->items = pop_mark(at);
          push(t);
          break;
        }
        case ']': push(make(PyObj::Kind::List)); break;  // EMPTY_LIST
        case 'l': {                                       // LIST
          auto l = make(PyObj::Kind::List);
          l->items = pop_mark(at);
          push(l);
          break;
        }
        case '}': push(make(PyObj::Kind::Dict)); break;  // EMPTY_DICT
        case 'a': {                                       // APPEND
          auto v = pop(at);
          list_at_top(at)->items.push_back(v);
          break;
        }
        case 'e': {  // APPENDS
          auto vs = pop_mark(at);
          auto l = list_at_top(at);
          l->items.insert(l->items.end(), vs.begin(), vs.end());
          break;
        }
        case 's': {  // SETITEM
          auto v = pop(at);
          auto k = pop(at);
          dict_at_top(at)->dict.emplace_back(k, v);
          break;
        }
        case 'u': {  // SETITEMS
          auto kv = pop_mark(at);
          if (kv.size() % 2) fail(at, "SETITEMS with an odd number of items");
          auto dct = dict_at_top(at);
          for (size_t k = 0; k < kv.size(); k += 2) dct->dict.emplace_back(kv[k], kv[k + 1]);
          break;
        }
        case 'c': {  // GLOBAL "module\nname\n"
          auto g = make(PyObj::Kind::Global);
          g->s = line(at);
          g->name = line(at);
          push(g);
          break;
        }
        case 0x93: {  // STACK_GLOBAL
          auto n = pop(at), m = pop(at);
          if (!m->is(PyObj::Kind::Str) || !n->is(PyObj::Kind::Str)) fail(at, "STACK_GLOBAL of non-strings");
          auto g = make(PyObj::Kind::Global);
          g->s = m->s;
          g->name = n->s;
          push(g);
          break;
        }
        case 'R': case 0x81: {  // REDUCE, NEWOBJ: callable(*args), cls.__new__(cls, *args)
          auto args = pop(at), cls = pop(at);
          if (!args->is(PyObj::Kind::Tuple)) fail(at, std::string(op == 'R' ? "REDUCE" : "NEWOBJ") + " with arguments that are not a tuple");
          if (!cls->is(PyObj::Kind::Global)) fail(at, "a call of " + cls->type_name() + ", which is not a global");
          if (cls->is_global("collections", "OrderedDict") && args->items.empty()) {
            push(make(PyObj::Kind::Dict));  // an empty OrderedDict is a dict to us
            break;
          }
          auto o = make(PyObj::Kind::Object);
          o->cls = cls;
          o->args = args;
          push(o);
          break;
        }
        case 'b': {  // BUILD
          auto st = pop(at);
          auto o = top(at);
          if (!o->is(PyObj::Kind::Object)) fail(at, "BUILD on " + o->type_name());
          o->state = st;
          break;
        }
        case 'Q': {  // BINPERSID
          auto p = make(PyObj::Kind::PersId);
          p->pid = pop(at);
          push(p);
          break;
        }
        case 0x94: memo_[memo_.size()] = top(at); break;      // MEMOIZE
        case 'q': memo_[u8()] = top(at); break;               // BINPUT
        case 'r': memo_[le(4)] = top(at); break;              // LONG_BINPUT
        case 'h': push(memo(u8(), at)); break;                // BINGET
        case 'j': push(memo(le(4), at)); break;               // LONG_BINGET
        case '0': pop(at); break;                             // POP
        case '2': push(top(at)); break;                       // DUP
        default: {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "0x%02x", op);
          fail(at, std::string("opcode ") + buf + " ('" + (op >= 32 && op < 127 ? std::string(1, char(op)) : "?") +
                       "'), which this reader does not handle (it reads the opcodes pickle.dump and torch.save emit for "
                       "dataclasses, containers, numbers, strings and tensors)");
        }
      }
      if (++objects_ > d_.size() + 16) fail(at, "more operations than bytes");
    }
  }

 private:
  [[noreturn]] void fail(size_t at, const std::string& msg) const {
    TORCH_CHECK(false, what_, ": not a valid pickle (truncated or damaged?): at byte ", at, ": ", msg);
  }
  uint8_t u8() {
    if (pos_ >= d_.size()) fail(pos_, "the data ends before STOP");
    return static_cast<uint8_t>(d_[pos_++]);
  }
  uint64_t le(size_t n) {
    if (d_.size() - pos_ < n) fail(pos_, "the data ends before STOP");
    uint64_t v = 0;
    for (size_t k = 0; k < n; ++k) v |= static_cast<uint64_t>(static_cast<uint8_t>(d_[pos_ + k])) << (8 * k);
    pos_ += n;
    return v;
  }
  std::string take(uint64_t n) {
    if (n > d_.size() - pos_) fail(pos_, "a string of " + std::to_string(n) + " bytes runs past the end of the data");
    std::string s = d_.substr(pos_, n);
    pos_ += n;
    return s;
  }
  std::string line(size_t at) {
    auto e = d_.find('\n', pos_);
    if (e == std::string::npos) fail(at, "GLOBAL without its newline");
    std::string s = d_.substr(pos_, e - pos_);
    pos_ = e + 1;
    return s;
  }
  size_t floor() const { return marks_.empty() ? 0 : marks_.back(); }
  void push(PyRef o) {
    made_.push_back(o);
    stack_.push_back(std::move(o));
  }
  /// Whether a value reachable from `root` contains itself (iterative depth-first search); the values
  /// reachable go into in_tree_.
  bool has_cycle(const PyRef& root) {
    enum Color : char { kOpen = 1, kDone = 2 };
    auto& color = in_tree_;
    std::vector<std::pair<const PyObj*, size_t>> path;  // node, next child
    auto children = [](const PyObj* o) {
      std::vector<const PyObj*> c;
      for (const auto& x : o->items) c.push_back(x.get());
      for (const auto& [k, v] : o->dict) {
        c.push_back(k.get());
        c.push_back(v.get());
      }
      for (const auto* x : {&o->cls, &o->args, &o->state, &o->pid}) c.push_back(x->get());
      return c;
    };
    std::vector<std::vector<const PyObj*>> kids;
    color[root.get()] = kOpen;
    path.emplace_back(root.get(), 0);
    kids.push_back(children(root.get()));
    while (!path.empty()) {
      auto& [node, next] = path.back();
      if (next == kids.back().size()) {
        color[node] = kDone;
        path.pop_back();
        kids.pop_back();
        continue;
      }
      const PyObj* c = kids.back()[next++];
      if (!c) continue;
      auto it = color.find(c);
      if (it != color.end()) {
        if (it->second == kOpen) return true;
        continue;
      }
      color[c] = kOpen;
      path.emplace_back(c, 0);
      kids.push_back(children(c));
    }
    return false;
  }
  void push_int(int64_t v) {
    auto o = make(PyObj::Kind::Int);
    o->i = v;
    push(o);
  }
  void push_str(std::string s, PyObj::Kind k) {
    auto o = make(k);
    o->s = std::move(s);
    push(o);
  }
  PyRef top(size_t at) {
    if (stack_.size() <= floor()) fail(at, "stack underflow");
    return stack_.back();
  }
  PyRef pop(size_t at) {
    auto o = top(at);
    stack_.pop_back();
    return o;
  }
  std::vector<PyRef> pop_mark(size_t at) {
    if (marks_.empty()) fail(at, "no MARK");
    const size_t m = marks_.back();
    marks_.pop_back();
    std::vector<PyRef> v(stack_.begin() + static_cast<std::ptrdiff_t>(m), stack_.end());
    stack_.resize(m);
    return v;
  }
  PyRef list_at_top(size_t at) {
    auto l = top(at);
    if (!l->is(PyObj::Kind::List)) fail(at, "APPEND to " + l->type_name());
    return l;
  }
  PyRef dict_at_top(size_t at) {
    auto d = top(at);
    if (!d->is(PyObj::Kind::Dict)) fail(at, "SETITEM on " + d->type_name());
    return d;
  }
  PyRef memo(uint64_t k, size_t at) {
    auto it = memo_.find(k);
    if (it == memo_.end()) fail(at, "memo entry " + std::to_string(k) + " was never stored");
    return it->second;
  }

  const std::string& d_;
  const std::string& what_;
  size_t pos_ = 0;
  size_t objects_ = 0;
  std::vector<PyRef> stack_;
  std::vector<std::weak_ptr<PyObj>> made_;  // every value made, for ~Unpickler
  bool ok_ = false;
  std::unordered_map<const PyObj*, char> in_tree_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, PyRef> memo_;
};

/// Values a to_json may produce: a shared reference (memo) can make a tiny pickle expand exponentially.
constexpr int64_t kJsonBudget = int64_t(1) << 22;

nlohmann::json to_json_at(const PyObj& o, std::string* why, int depth, int64_t& budget) {
  if (depth > 64) {
    *why = "nested more than 64 levels deep (or a cycle)";
    return nullptr;
  }
  if (--budget < 0) {
    *why = "more than " + std::to_string(kJsonBudget) + " values once shared references are expanded";
    return nullptr;
  }
  using K = PyObj::Kind;
  switch (o.kind) {
    case K::None: return nullptr;
    case K::Bool: return o.b;
    case K::Int: return o.i;
    case K::Float: return o.f;
    case K::Str: return o.s;
    case K::Tuple: case K::List: {
      auto a = nlohmann::json::array();
      for (const auto& it : o.items) {
        a.push_back(to_json_at(*it, why, depth + 1, budget));
        if (!why->empty()) return nullptr;
      }
      return a;
    }
    case K::Dict: {
      auto obj = nlohmann::json::object();
      for (const auto& [k, v] : o.dict) {
        if (!k->is(K::Str)) {
          *why = "a dict with a key of type " + k->type_name();
          return nullptr;
        }
        obj[k->s] = to_json_at(*v, why, depth + 1, budget);
        if (!why->empty()) return nullptr;
      }
      return obj;
    }
    default: *why = "a value of type " + o.type_name(); return nullptr;
  }
}

}  // namespace

PyRef unpickle(const std::string& data, const std::string& what) { return Unpickler(data, what).run(); }

nlohmann::json to_json(const PyObj& o, std::string* why) {
  why->clear();
  int64_t budget = kJsonBudget;
  return to_json_at(o, why, 0, budget);
}

// ---------------------------------------------------------------------------------------------
// Writer

PickleWriter::PickleWriter() {
  op(0x80);
  op(2);
}
PickleWriter& PickleWriter::none() { op('N'); return *this; }
PickleWriter& PickleWriter::boolean(bool v) { op(v ? 0x88 : 0x89); return *this; }
PickleWriter& PickleWriter::integer(int64_t v) {
  if (v >= 0 && v < 256) {
    op('K');
    op(static_cast<uint8_t>(v));
  } else if (v >= INT32_MIN && v <= INT32_MAX) {
    op('J');
    const uint32_t u = static_cast<uint32_t>(static_cast<int32_t>(v));
    for (int k = 0; k < 4; ++k) op(static_cast<uint8_t>(u >> (8 * k)));
  } else {
    op(0x8a);  // LONG1: 8 bytes, two's complement, little-endian
    op(8);
    const uint64_t u = static_cast<uint64_t>(v);
    for (int k = 0; k < 8; ++k) op(static_cast<uint8_t>(u >> (8 * k)));
  }
  return *this;
}
PickleWriter& PickleWriter::floating(double v) {
  op('G');
  uint64_t u;
  std::memcpy(&u, &v, 8);
  for (int k = 7; k >= 0; --k) op(static_cast<uint8_t>(u >> (8 * k)));
  return *this;
}
PickleWriter& PickleWriter::str(const std::string& v) {
  op('X');
  const uint32_t n = static_cast<uint32_t>(v.size());
  for (int k = 0; k < 4; ++k) op(static_cast<uint8_t>(n >> (8 * k)));
  out_ += v;
  return *this;
}
PickleWriter& PickleWriter::global(const std::string& module, const std::string& name) {
  op('c');
  out_ += module + "\n" + name + "\n";
  return *this;
}
PickleWriter& PickleWriter::mark() { op('('); return *this; }
PickleWriter& PickleWriter::tuple() { op('t'); return *this; }
PickleWriter& PickleWriter::empty_tuple() { op(')'); return *this; }
PickleWriter& PickleWriter::empty_list() { op(']'); return *this; }
PickleWriter& PickleWriter::appends() { op('e'); return *this; }
PickleWriter& PickleWriter::empty_dict() { op('}'); return *this; }
PickleWriter& PickleWriter::setitems() { op('u'); return *this; }
PickleWriter& PickleWriter::reduce() { op('R'); return *this; }
PickleWriter& PickleWriter::newobj() { op(0x81); return *this; }
PickleWriter& PickleWriter::build() { op('b'); return *this; }
PickleWriter& PickleWriter::binpersid() { op('Q'); return *this; }

PickleWriter& PickleWriter::json(const nlohmann::json& v) {
  switch (v.type()) {
    case nlohmann::json::value_t::null: return none();
    case nlohmann::json::value_t::boolean: return boolean(v.get<bool>());
    case nlohmann::json::value_t::number_integer: return integer(v.get<int64_t>());
    case nlohmann::json::value_t::number_unsigned: {
      TORCH_CHECK(v.get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX), "pickle: integer ", v.get<uint64_t>(),
                  " is wider than 64 bits");
      return integer(static_cast<int64_t>(v.get<uint64_t>()));
    }
    case nlohmann::json::value_t::number_float: return floating(v.get<double>());
    case nlohmann::json::value_t::string: return str(v.get<std::string>());
    case nlohmann::json::value_t::array:
      empty_list();
      if (v.empty()) return *this;
      mark();
      for (const auto& e : v) json(e);
      return appends();
    case nlohmann::json::value_t::object:
      empty_dict();
      if (v.empty()) return *this;
      mark();
      for (const auto& [k, e] : v.items()) {
        str(k);
        json(e);
      }
      return setitems();
    default: TORCH_CHECK(false, "pickle: cannot write JSON value ", v.dump());
  }
}

PickleWriter& PickleWriter::int_tuple(const std::vector<int64_t>& v) {
  if (v.empty()) return empty_tuple();
  mark();
  for (auto x : v) integer(x);
  return tuple();
}

std::string PickleWriter::finish() {
  op('.');
  return std::move(out_);
}

}  // namespace fsdp::dcp::detail
