// Small helpers every part of the library shares: shapes and key lists in messages, exception text.
// One copy each (issue 11); header-only because each is a line or two.
#pragma once

#include <c10/util/Exception.h>
#include <c10/util/StringUtil.h>
#include <c10/util/accumulate.h>

#include <exception>
#include <string>
#include <vector>

namespace fsdp::detail {

/// "[2, 3]": a shape as PyTorch prints it in its own messages.
inline std::string shape_str(c10::IntArrayRef sizes) { return c10::str(sizes); }

/// Number of elements of a tensor of shape `sizes` (1 for a scalar).
inline int64_t numel_of(c10::IntArrayRef sizes) { return c10::multiply_integers(sizes); }

/// "'a', 'b', 'c', 'd', 'e', ... (12 in all)": keys for an error message, at most five named.
inline std::string list_keys(const std::vector<std::string>& keys) {
  std::string s;
  for (size_t i = 0; i < keys.size() && i < 5; ++i) s += (i ? ", '" : "'") + keys[i] + "'";
  if (keys.size() > 5) s += ", ... (" + std::to_string(keys.size()) + " in all)";
  return s;
}

/// An exception's message without LibTorch's C++ backtrace (which says nothing to a user).
inline std::string message_of(const std::exception& e) {
  if (const auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

}  // namespace fsdp::detail
