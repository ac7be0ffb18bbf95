// nn/layers.cpp: the standard layers' parameters, default initialisation and forward.
#include "nn/layers.h"

namespace shardlab::nn {

LinearImpl::LinearImpl(const LinearOptions& opts) : Module("Linear"), options(opts) {
  SHARDLAB_CHECK(opts.in() > 0 && opts.out() > 0, "Linear: in and out must be positive, got {} and {}",
                 opts.in(), opts.out());
  weight = register_parameter("weight", {opts.out(), opts.in()}, Init::fan_in_uniform(opts.in()));
  if (opts.bias()) bias = register_parameter("bias", {opts.out()}, Init::fan_in_uniform(opts.in()));
}

Variable LinearImpl::operator()(const Variable& input) {
  return with_hooks(
      [&](const Variable& x) {
        // The weight's in features: a tensor-parallel row split holds some of options.in().
        SHARDLAB_CHECK(x.dim() >= 1 && x.size(-1) == weight.size(1),
                       "Linear: input of shape {} does not end in {}", shape_str(x.shape()), weight.size(1));
        return linear(x, weight, bias);
      },
      input);
}

std::string LinearImpl::describe() const {
  return fmt::format("Linear(in={}, out={}, bias={})", options.in(), options.out(), options.bias());
}

Conv2dImpl::Conv2dImpl(const Conv2dOptions& opts) : Module("Conv2d"), options(opts) {
  SHARDLAB_CHECK(opts.in_channels() > 0 && opts.out_channels() > 0 && opts.kernel_size() > 0,
                 "Conv2d: channels and kernel size must be positive, got {}, {} and {}", opts.in_channels(),
                 opts.out_channels(), opts.kernel_size());
  const std::int64_t fan_in = opts.in_channels() * opts.kernel_size() * opts.kernel_size();
  weight = register_parameter(
      "weight", {opts.out_channels(), opts.in_channels(), opts.kernel_size(), opts.kernel_size()},
      Init::fan_in_uniform(fan_in));
  if (opts.bias()) bias = register_parameter("bias", {opts.out_channels()}, Init::fan_in_uniform(fan_in));
}

Variable Conv2dImpl::operator()(const Variable& input) {
  return with_hooks(
      [&](const Variable& x) {
        return conv2d(x, weight, bias, {options.stride(), options.padding()});
      },
      input);
}

std::string Conv2dImpl::describe() const {
  return fmt::format("Conv2d({}, {}, kernel_size={}, stride={}, padding={}, bias={})", options.in_channels(),
                     options.out_channels(), options.kernel_size(), options.stride(), options.padding(),
                     options.bias());
}

MaxPool2dImpl::MaxPool2dImpl(MaxPool2dParams p) : Module("MaxPool2d"), params(p) {}

Variable MaxPool2dImpl::operator()(const Variable& input) {
  return with_hooks([&](const Variable& x) { return max_pool2d(x, params); }, input);
}

std::string MaxPool2dImpl::describe() const {
  return fmt::format("MaxPool2d(kernel_size={}, stride={}, padding={})", params.kernel_size,
                     params.stride == 0 ? params.kernel_size : params.stride, params.padding);
}

DropoutImpl::DropoutImpl(double probability) : Module("Dropout"), p(probability) {
  SHARDLAB_CHECK(p >= 0 && p <= 1, "Dropout: p must be in [0, 1], got {}", p);
}

Variable DropoutImpl::operator()(const Variable& input) {
  return with_hooks([&](const Variable& x) { return dropout(x, p, is_training(), stream()); }, input);
}

std::string DropoutImpl::describe() const { return fmt::format("Dropout(p={})", p); }

Variable ReLUImpl::operator()(const Variable& input) {
  return with_hooks([&](const Variable& x) { return relu(x); }, input);
}

Variable SiLUImpl::operator()(const Variable& input) {
  return with_hooks([&](const Variable& x) { return silu(x); }, input);
}

GELUImpl::GELUImpl(GeluApproximation approx) : Module("GELU"), approximate(approx) {}

Variable GELUImpl::operator()(const Variable& input) {
  return with_hooks([&](const Variable& x) { return gelu(x, approximate); }, input);
}

EmbeddingImpl::EmbeddingImpl(std::int64_t num_embeddings, std::int64_t dim) : Module("Embedding") {
  SHARDLAB_CHECK(num_embeddings > 0 && dim > 0, "Embedding: sizes must be positive, got {} and {}",
                 num_embeddings, dim);
  weight = register_parameter("weight", {num_embeddings, dim}, Init::normal(0.0, 1.0));
}

Variable EmbeddingImpl::operator()(const Tensor& input) {
  return with_hooks([&](const Tensor& indices) { return embedding(weight, indices); }, input);
}

std::string EmbeddingImpl::describe() const {
  return fmt::format("Embedding({}, {})", weight.size(0), weight.size(1));
}

RMSNormImpl::RMSNormImpl(std::int64_t dim, double epsilon) : Module("RMSNorm"), eps(epsilon) {
  SHARDLAB_CHECK(dim > 0, "RMSNorm: dim must be positive, got {}", dim);
  weight = register_parameter("weight", {dim}, Init::constant(1.0));
}

Variable RMSNormImpl::operator()(const Variable& input) {
  return with_hooks([&](const Variable& x) { return rms_norm(x, weight, eps); }, input);
}

AddRmsNorm RMSNormImpl::add_then_norm(const Variable& x, const Variable& y) {
  if (forward_is_plain()) return add_rms_norm(x, y, weight, eps);
  const Variable sum = add(x, y);
  return {sum, (*this)(sum)};
}

std::string RMSNormImpl::describe() const { return fmt::format("RMSNorm({}, eps={})", weight.size(0), eps); }

LayerNormImpl::LayerNormImpl(std::int64_t dim, double epsilon, bool affine)
    : Module("LayerNorm"), eps(epsilon) {
  SHARDLAB_CHECK(dim > 0, "LayerNorm: dim must be positive, got {}", dim);
  if (affine) {
    weight = register_parameter("weight", {dim}, Init::constant(1.0));
    bias = register_parameter("bias", {dim}, Init::constant(0.0));
  }
}

Variable LayerNormImpl::operator()(const Variable& input) {
  return with_hooks([&](const Variable& x) { return layer_norm(x, weight, bias, eps); }, input);
}

std::string LayerNormImpl::describe() const {
  return fmt::format("LayerNorm(eps={}, affine={})", eps, weight.defined());
}

FlattenImpl::FlattenImpl(std::int64_t start, std::int64_t end)
    : Module("Flatten"), start_dim(start), end_dim(end) {}

Variable FlattenImpl::operator()(const Variable& input) {
  return with_hooks([&](const Variable& x) { return flatten(x, start_dim, end_dim); }, input);
}

void SequentialImpl::push_back_module(std::shared_ptr<Module> module,
                                      std::function<Variable(const Variable&)> step) {
  register_module(std::to_string(steps_.size()), std::move(module));
  steps_.push_back(std::move(step));
}

Variable SequentialImpl::operator()(const Variable& input) {
  return with_hooks(
      [&](const Variable& x) {
        Variable y = x;
        for (const auto& step : steps_) y = step(y);
        return y;
      },
      input);
}

}  // namespace shardlab::nn
