// nn/layers.h: the standard layers, each an Impl module with an options struct and a Holder
// alias, as in the libtorch C++ frontend: `Conv2d conv(Conv2dOptions(1, 32, 3)); conv(x)`.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "autograd/functional.h"
#include "nn/module.h"

namespace shardlab::nn {

// Chainable setters for an options field: `LinearOptions(4, 2).bias(false)`.
#define SHARDLAB_OPTION(Type, field)             \
  auto& field(Type value) {                      \
    field##_ = std::move(value);                 \
    return *this;                                \
  }                                              \
  const Type& field() const { return field##_; } \
  Type field##_

struct LinearOptions {
  LinearOptions(std::int64_t in_features, std::int64_t out_features) : in_(in_features), out_(out_features) {}
  SHARDLAB_OPTION(std::int64_t, in);
  SHARDLAB_OPTION(std::int64_t, out);
  SHARDLAB_OPTION(bool, bias) = true;
};

// y = x W^T + b, W [out, in].
class LinearImpl : public Module {
 public:
  explicit LinearImpl(const LinearOptions& options);
  Variable operator()(const Variable& x);
  std::string describe() const override;

  const LinearOptions options;
  Variable weight, bias;
};
using Linear = Holder<LinearImpl>;

struct Conv2dOptions {
  Conv2dOptions(std::int64_t in_channels, std::int64_t out_channels, std::int64_t kernel_size)
      : in_channels_(in_channels), out_channels_(out_channels), kernel_size_(kernel_size) {}
  SHARDLAB_OPTION(std::int64_t, in_channels);
  SHARDLAB_OPTION(std::int64_t, out_channels);
  SHARDLAB_OPTION(std::int64_t, kernel_size);
  SHARDLAB_OPTION(std::int64_t, stride) = 1;
  SHARDLAB_OPTION(std::int64_t, padding) = 0;
  SHARDLAB_OPTION(bool, bias) = true;
};

// NCHW convolution, weight [out, in, k, k].
class Conv2dImpl : public Module {
 public:
  explicit Conv2dImpl(const Conv2dOptions& options);
  Variable operator()(const Variable& x);
  std::string describe() const override;

  const Conv2dOptions options;
  Variable weight, bias;
};
using Conv2d = Holder<Conv2dImpl>;

class MaxPool2dImpl : public Module {
 public:
  explicit MaxPool2dImpl(MaxPool2dParams params);
  Variable operator()(const Variable& x);
  std::string describe() const override;

  const MaxPool2dParams params;
};
using MaxPool2d = Holder<MaxPool2dImpl>;

// Zeroes elements with probability p while training (masks keyed by this module's stream:
// autograd/functional.h).
class DropoutImpl : public Module {
 public:
  explicit DropoutImpl(double p = 0.5);
  Variable operator()(const Variable& x);
  std::string describe() const override;

  const double p;
};
using Dropout = Holder<DropoutImpl>;

// Activation layers.
class ReLUImpl : public Module {
 public:
  ReLUImpl() : Module("ReLU") {}
  Variable operator()(const Variable& x);
};
using ReLU = Holder<ReLUImpl>;

class SiLUImpl : public Module {
 public:
  SiLUImpl() : Module("SiLU") {}
  Variable operator()(const Variable& x);
};
using SiLU = Holder<SiLUImpl>;

class GELUImpl : public Module {
 public:
  explicit GELUImpl(GeluApproximation approximate = GeluApproximation::none);
  Variable operator()(const Variable& x);
  const GeluApproximation approximate;
};
using GELU = Holder<GELUImpl>;

// Lookup table [num_embeddings, dim], initialised N(0, 1) as PyTorch.
class EmbeddingImpl : public Module {
 public:
  EmbeddingImpl(std::int64_t num_embeddings, std::int64_t dim);
  Variable operator()(const Tensor& indices);
  std::string describe() const override;

  Variable weight;
};
using Embedding = Holder<EmbeddingImpl>;

class RMSNormImpl : public Module {
 public:
  explicit RMSNormImpl(std::int64_t dim, double eps = 1e-6);
  Variable operator()(const Variable& x);
  // {x + y, this norm of it}: add_rms_norm's one kernel where this module's forward is plain; with
  // hooks or checkpointing, add(x, y) and then the forward through them.
  AddRmsNorm add_then_norm(const Variable& x, const Variable& y);
  std::string describe() const override;

  const double eps;
  Variable weight;
};
using RMSNorm = Holder<RMSNormImpl>;

class LayerNormImpl : public Module {
 public:
  explicit LayerNormImpl(std::int64_t dim, double eps = 1e-5, bool affine = true);
  Variable operator()(const Variable& x);
  std::string describe() const override;

  const double eps;
  Variable weight, bias;  // undefined unless affine
};
using LayerNorm = Holder<LayerNormImpl>;

class FlattenImpl : public Module {
 public:
  explicit FlattenImpl(std::int64_t start_dim = 1, std::int64_t end_dim = -1);
  Variable operator()(const Variable& x);
  const std::int64_t start_dim, end_dim;
};
using Flatten = Holder<FlattenImpl>;

// Modules that map one Variable to one Variable, applied in order; children are named "0", "1", ...
class SequentialImpl : public Module {
 public:
  SequentialImpl() : Module("Sequential") {}
  template <typename... Layers>
  explicit SequentialImpl(Layers... layers) : Module("Sequential") {
    (push_back(layers), ...);
  }
  template <typename Impl>
  void push_back(const Holder<Impl>& layer) {
    push_back_module(layer.ptr(), [impl = layer.ptr()](const Variable& x) { return (*impl)(x); });
  }
  Variable operator()(const Variable& x);
  std::size_t size() const { return steps_.size(); }

 private:
  void push_back_module(std::shared_ptr<Module> module, std::function<Variable(const Variable&)> step);
  std::vector<std::function<Variable(const Variable&)>> steps_;
};
using Sequential = Holder<SequentialImpl>;

// A list of modules (no forward of its own); children are named "0", "1", ...
template <typename Impl>
class ModuleListImpl : public Module {
 public:
  ModuleListImpl() : Module("ModuleList") {}
  bool has_forward() const override { return false; }
  void push_back(std::shared_ptr<Impl> module) {
    items_.push_back(register_module(std::to_string(items_.size()), std::move(module)));
  }
  std::size_t size() const { return items_.size(); }
  Impl& operator[](std::size_t i) const { return *items_.at(i); }
  auto begin() const { return items_.begin(); }
  auto end() const { return items_.end(); }

 private:
  std::vector<std::shared_ptr<Impl>> items_;
};
template <typename Impl>
using ModuleList = Holder<ModuleListImpl<Impl>>;

}  // namespace shardlab::nn
