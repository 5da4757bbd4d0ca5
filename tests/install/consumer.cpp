// Shards a Linear on one rank with the installed libfsdp and takes one optimizer step.
#include <fsdp/fsdp.h>

#include <iostream>

int main() {
  auto pg = fsdp::init_process_group();
  fsdp::FSDPModule<torch::nn::Linear> model(torch::nn::LinearOptions(4, 3));
  fsdp::fully_shard(model);
  torch::optim::SGD opt(model->parameters(), 0.1);
  model(torch::ones({2, 4})).sum().backward();
  opt.step();
  std::cout << "consumer ok: " << fsdp::fsdp_api(model).sharded_parameters().size() << " sharded parameters on "
            << pg->size() << " rank(s)" << std::endl;
  return 0;
}
