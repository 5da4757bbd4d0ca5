// The message of the c10::Error a call throws, for tests of refusals.
#pragma once

#include <functional>
#include <string>

#include <c10/util/Exception.h>

namespace fsdp::testing {

/// What `fn` throws as a c10::Error (without the backtrace), or "(no error)".
inline std::string error_message(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "(no error)";
}

}  // namespace fsdp::testing
