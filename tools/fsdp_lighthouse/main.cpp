// fsdp_lighthouse: serves the store that the replica groups of a fault-tolerant job share (fsdp::ft::Manager,
// [Note: replica quorum] in src/ft/manager.cpp), as torchft_lighthouse serves TorchFT's quorum. It holds no
// logic: the ranks agree through the store's atomic operations; it must only outlive every replica group, so
// run it on a host (or beside a replica group) that is not expected to fail.
//   fsdp_lighthouse --port 29510            # then: train_gpt --ft-lighthouse HOST:29510 ... in each replica group
// Runs until SIGINT or SIGTERM (exit 0). Exit 1 when the port cannot be bound.
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <iostream>

#include <CLI/CLI.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

int main(int argc, char** argv) {
  CLI::App app{"fsdp_lighthouse: the store the replica groups of a fault-tolerant job share (fsdp::ft::Manager; "
               "train_gpt --ft-lighthouse HOST:PORT). Runs until SIGINT or SIGTERM."};
  int port = 29510;
  app.add_option("--port", port, "TCP port to listen on (all interfaces; 0: any free port, printed)")
      ->capture_default_str()
      ->check(CLI::Range(0, 65535));
  CLI11_PARSE(app, argc, argv);
  // The signals are waited for, not handled: blocked before the store's threads start, so they inherit the mask.
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGINT);
  sigaddset(&stop, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop, nullptr);
  c10::intrusive_ptr<c10d::TCPStore> store;
  try {
    c10d::TCPStoreOptions opts;
    opts.port = static_cast<uint16_t>(port);
    opts.isServer = true;
    opts.waitWorkers = false;
    opts.timeout = std::chrono::hours(24 * 365);
    store = c10::make_intrusive<c10d::TCPStore>("0.0.0.0", opts);
  } catch (const std::exception& e) {
    std::cerr << "fsdp_lighthouse: cannot listen on port " << port << ": " << e.what()
              << "\nFix: choose a free --port (0 picks one)" << std::endl;
    return 1;
  }
  std::cout << "fsdp_lighthouse: listening on port " << store->getPort() << std::endl;
  int sig = 0;
  sigwait(&stop, &sig);
  std::cout << "fsdp_lighthouse: stopped by signal " << sig << std::endl;
  return 0;
}
