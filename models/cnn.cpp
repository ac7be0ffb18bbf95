// models/cnn.cpp: the tutorial CNN's layers and forward.
#include "models/cnn.h"

namespace shardlab::models {

CnnImpl::CnnImpl(std::uint64_t seed)
    : nn::Module("Cnn"),
      conv1(nn::Conv2dOptions(1, 32, 3)),
      conv2(nn::Conv2dOptions(32, 64, 3)),
      dropout1(0.25),
      dropout2(0.5),
      fc1(nn::LinearOptions(9216, 128)),
      fc2(nn::LinearOptions(128, 10)) {
  register_module("conv1", conv1.ptr());
  register_module("conv2", conv2.ptr());
  register_module("dropout1", dropout1.ptr());
  register_module("dropout2", dropout2.ptr());
  register_module("fc1", fc1.ptr());
  register_module("fc2", fc2.ptr());
  nn::initialize(*this, seed);
}

Variable CnnImpl::operator()(const Variable& input) {
  return with_hooks(
      [&](const Variable& images) {
        SHARDLAB_CHECK(
            images.dim() == 4 && images.size(1) == 1 && images.size(2) == 28 && images.size(3) == 28,
            "Cnn: expected images [N, 1, 28, 28], got {}", shape_str(images.shape()));
        Variable x = relu(conv1(images));
        x = relu(conv2(x));
        x = max_pool2d(x, {.kernel_size = 2});
        x = flatten(dropout1(x), 1);
        x = dropout2(relu(fc1(x)));
        return log_softmax(fc2(x), 1);
      },
      input);
}

}  // namespace shardlab::models
