// fsdp_hello: the smallest multi-rank program. Initialises the process group from the launcher's
// environment, all-reduces the ranks and prints the result on every rank.
//   build/bin/fsdprun --standalone --nproc-per-node 3 build/bin/fsdp_hello
#include <iostream>

#include <fsdp/c10d/collectives.h>
#include <fsdp/c10d/distributed.h>

int main(int argc, char** argv) {
  try {
    auto pg = fsdp::init_process_group();
    auto t = torch::full({1}, static_cast<float>(pg->rank()));
    fsdp::all_reduce(t, *pg);
    int n = pg->size();
    std::cout << "hello from rank " << pg->rank() << "/" << n << ": sum of ranks = " << t.item<float>()
              << " (expected " << n * (n - 1) / 2 << ")" << std::endl;
    return t.item<float>() == n * (n - 1) / 2 ? 0 : 1;
  } catch (const std::exception& e) {
    std::cerr << "fsdp_hello: " << e.what() << std::endl;
    return 1;
  }
}
