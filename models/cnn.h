// models/cnn.h: the MNIST net of the PyTorch FSDP tutorial, layer for layer:
// conv1 1->32 3x3, ReLU, conv2 32->64 3x3, ReLU, max_pool 2, dropout 0.25, flatten,
// fc1 9216->128, ReLU, dropout 0.5, fc2 128->10, log_softmax. 1,199,882 parameters.
#pragma once

#include <cstdint>

#include "nn/layers.h"

namespace shardlab::models {

class CnnImpl : public nn::Module {
 public:
  // Parameters are drawn by nn::initialize(*this, seed), named from this module.
  explicit CnnImpl(std::uint64_t seed = 1);
  // images [N, 1, 28, 28] -> log-probabilities [N, 10]
  Variable operator()(const Variable& images);

  nn::Conv2d conv1, conv2;
  nn::Dropout dropout1, dropout2;
  nn::Linear fc1, fc2;
};
using Cnn = nn::Holder<CnnImpl>;

}  // namespace shardlab::models
