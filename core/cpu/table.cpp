// core/cpu/table.cpp: the CPU kernel table, complete: every entry has a CPU reference.
#include "core/cpu/kernels.h"

namespace shardlab {
namespace {

// Accumulating kernels sum 16-bit floats in f32 and round once at the end.
void scatter_add_f32(const Tensor& out, std::int64_t dim, const Tensor& index, const Tensor& src) {
  cpu::in_f32_precision(
      out, [&](const Tensor& o, const Tensor& s) { cpu::scatter_add(o, dim, index, s); }, src);
}
void index_add_f32(const Tensor& out, std::int64_t dim, const Tensor& index, const Tensor& src) {
  cpu::in_f32_precision(
      out, [&](const Tensor& o, const Tensor& s) { cpu::index_add(o, dim, index, s); }, src);
}
void max_pool2d_backward_f32(const Tensor& grad_out, const Tensor& indices, const Tensor& grad_in) {
  cpu::in_f32_precision(
      grad_in, [&](const Tensor& gi, const Tensor& go) { cpu::max_pool2d_backward(go, indices, gi); },
      grad_out);
}

}  // namespace

const Kernels& cpu_kernels() {
  static const Kernels table{
      .fill = cpu::fill,
      .copy = cpu::copy,
      .unary = cpu::unary,
      .binary = cpu::binary,
      .where = cpu::where,
      .reduce = cpu::reduce,
      .foreach_sum_squares = cpu::foreach_sum_squares,
      .matmul = cpu::matmul,
      .softmax = cpu::softmax,
      .cross_entropy_forward = cpu::cross_entropy_forward,
      .cross_entropy_backward = cpu::cross_entropy_backward,
      .rms_norm_forward = cpu::rms_norm_forward,
      .rms_norm_backward = cpu::rms_norm_backward,
      .swiglu_forward = cpu::swiglu_forward,
      .swiglu_backward = cpu::swiglu_backward,
      .rotary = cpu::rotary,
      .conv2d = cpu::conv2d,
      .conv2d_backward_input = cpu::conv2d_backward_input,
      .conv2d_backward_weight = cpu::conv2d_backward_weight,
      .max_pool2d = cpu::max_pool2d,
      .max_pool2d_backward = max_pool2d_backward_f32,
      .attention_forward = cpu::attention_forward,
      .attention_backward = cpu::attention_backward,
      .check_index = cpu::check_index,
      .index_select = cpu::index_select,
      .gather = cpu::gather,
      .scatter_add = scatter_add_f32,
      .index_add = index_add_f32,
      .random = cpu::random,
      .adadelta_step = cpu::adadelta_step,
      .adam_step = cpu::adam_step,
      .strided_heads = [](const Tensor& t) { return t.stride(-1) == 1; },
  };
  return table;
}

const Kernels& kernels_for(Device device) { return device.is_cuda() ? cuda_kernels() : cpu_kernels(); }

}  // namespace shardlab
