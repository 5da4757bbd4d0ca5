// fsdp::elastic::record (include/fsdp/elastic/errors.h): the error file fsdprun's and torchrun's failure
// summaries read (tools/fsdprun/workers.cpp read_error_file; torch's ErrorHandler writes the same JSON).
#include "fsdp/elastic/errors.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <typeinfo>

#include <c10/util/Exception.h>
#include <c10/util/Type.h>
#include <nlohmann/json.hpp>

namespace fsdp::elastic {
namespace {

/// "<type>: <message>" and the stack, as torch's record splits them (message; py_callstack).
std::pair<std::string, std::string> describe(const std::exception& e) {
  if (const auto* c = dynamic_cast<const c10::Error*>(&e)) {
    const std::string all = c->what(), msg = c->what_without_backtrace();
    // what() is the message followed by the stack when TORCH_SHOW_CPP_STACKTRACES=1.
    std::string stack = all.size() > msg.size() && all.compare(0, msg.size(), msg) == 0 ? all.substr(msg.size()) : "";
    while (!stack.empty() && (stack.front() == '\n' || stack.front() == ' ')) stack.erase(stack.begin());
    return {"c10::Error: " + msg, stack};
  }
  // Other exceptions carry no stack, and the catch site's would only show main.
  return {c10::demangle(typeid(e).name()) + ": " + e.what(), ""};
}

}  // namespace

void record_exception(const std::exception& e) {
  const char* path = std::getenv("TORCHELASTIC_ERROR_FILE");
  if (!path || !*path) return;
  try {
    const auto [message, stack] = describe(e);
    const auto now = std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch());
    nlohmann::json j = {{"message",
                         {{"message", message},
                          {"extraInfo", {{"py_callstack", stack}, {"timestamp", std::to_string(now.count())}}}}}};
    std::ofstream f(path, std::ios::trunc);
    f << j.dump();
    if (!f) std::cerr << "fsdp::elastic::record: cannot write the error file " << path << "\n";
  } catch (const std::exception& w) {
    std::cerr << "fsdp::elastic::record: cannot write the error file " << path << ": " << w.what() << "\n";
  }
}

int record(const std::function<int()>& main) {
  try {
    return main();
  } catch (const std::exception& e) {
    record_exception(e);
    const auto* c = dynamic_cast<const c10::Error*>(&e);
    std::cerr << "error: " << (c ? c->what_without_backtrace() : e.what()) << std::endl;
    return 1;
  } catch (...) {
    const std::runtime_error unknown("an exception that is not a std::exception");
    record_exception(unknown);
    std::cerr << "error: " << unknown.what() << std::endl;
    return 1;
  }
}

}  // namespace fsdp::elastic
