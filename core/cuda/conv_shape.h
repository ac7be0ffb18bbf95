// core/cuda/conv_shape.h: internal to core/cuda: conv2d's sizes, and whether cuDNN's descriptors
// can hold them (plain C++, so the check is tested on any machine).
#pragma once

#include <cstdint>
#include <limits>
#include <string>

namespace shardlab::cuda {

// conv2d's sizes: input [batch, channels, height, width], weight [O, channels, kernel_h, kernel_w],
// output [batch, O, out_h, out_w].
struct ConvShape {
  std::int64_t batch = 0, channels = 0, height = 0, width = 0, outs = 0;
  std::int64_t kernel_h = 0, kernel_w = 0, out_h = 0, out_w = 0;
  std::int64_t stride = 1, padding = 0;
};

// Why cuDNN cannot take this convolution ("" when it can): its 4-d descriptors hold every size and
// stride as an int, and a tensor of more than 2^31 - 1 elements is refused. (No fmt here: nvcc
// compiles this header too, and fmt's compile-time format checks fail under it.)
inline std::string cudnn_size_problem(const ConvShape& g) {
  constexpr std::int64_t kLimit = std::numeric_limits<int>::max();
  const struct {
    const char* what;
    std::int64_t value;
  } sizes[] = {{"input elements", g.batch * g.channels * g.height * g.width},
               {"output elements", g.batch * g.outs * g.out_h * g.out_w},
               {"filter elements", g.outs * g.channels * g.kernel_h * g.kernel_w},
               {"stride", g.stride},
               {"padding", g.padding}};
  for (const auto& size : sizes) {
    if (size.value > kLimit)
      return std::string("its ") + size.what + " (" + std::to_string(size.value) +
             ") exceed cuDNN's int sizes (" + std::to_string(kLimit) + ")";
  }
  return "";
}

}  // namespace shardlab::cuda
