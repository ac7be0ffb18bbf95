// dist/tp/parallelize.cpp: parallelize_module, the plan's styles applied to modules (dist/tp/parallelize.h).
#include "dist/tp/parallelize.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>

#include "autograd/ops.h"
#include "core/ops.h"
#include "dist/tp/regions.h"
#include "nn/layers.h"

namespace shardlab::dist {

std::pair<std::int64_t, std::int64_t> split_range(std::int64_t size, int parts, int index,
                                                  const std::string& what) {
  SHARDLAB_CHECK(size >= parts,
                 "tensor parallel: {} has {} elements to split over {} ranks: some would hold none", what,
                 size, parts);
  const std::int64_t base = size / parts, longer = size % parts;
  return {index * base + std::min<std::int64_t>(index, longer), base + (index < longer ? 1 : 0)};
}

namespace {

// "model.layers.*.mlp" matches "model.layers.3.mlp": "*" is one dotted component.
bool matches(const std::string& pattern, const std::string& name) {
  std::size_t p = 0, n = 0;
  while (p <= pattern.size() && n <= name.size()) {
    const std::size_t p_end = std::min(pattern.find('.', p), pattern.size());
    const std::size_t n_end = std::min(name.find('.', n), name.size());
    const std::string_view part(pattern.data() + p, p_end - p), component(name.data() + n, n_end - n);
    if (part != "*" && part != component) return false;
    if (p_end == pattern.size() || n_end == name.size())
      return p_end == pattern.size() && n_end == name.size();
    p = p_end + 1;
    n = n_end + 1;
  }
  return false;
}

// The modules already parallelised, so that a second plan over one of them is refused rather than
// splitting its pieces again.
class Parallelised {
 public:
  bool contains(const nn::Module& module) {
    std::lock_guard lock(mutex_);
    std::erase_if(modules_, [](const std::weak_ptr<const nn::Module>& m) { return m.expired(); });
    return std::ranges::any_of(modules_, [&](const auto& m) { return m.lock().get() == &module; });
  }
  void add(const nn::Module& module) {
    std::lock_guard lock(mutex_);
    modules_.push_back(module.weak_from_this());
  }

 private:
  std::mutex mutex_;
  std::vector<std::weak_ptr<const nn::Module>> modules_;
};

Parallelised& parallelised() {
  static Parallelised modules;
  return modules;
}

struct Context {
  nn::Module& root;
  Communicator& group;
};

// Makes `parameter` (named `name` from the root) this rank's piece along `dim`, drawing it when it
// is still deferred, and says where the piece sits.
TensorParallelSplit keep_piece(const Context& context, nn::Module& module, const std::string& path,
                               const std::string& own_name, const Variable& parameter, int dim) {
  const std::string name = path.empty() ? own_name : path + "." + own_name;
  const Shape full = parameter.data().shape();
  const auto [offset, extent] = split_range(full[static_cast<std::size_t>(dim)], context.group.size(),
                                            context.group.rank(), fmt::format("'{}' (dim {})", name, dim));
  Shape local = full;
  local[static_cast<std::size_t>(dim)] = extent;
  const NoGradGuard no_grad;
  if (!nn::deferred(parameter.data())) {
    parameter.set_data(parameter.data().narrow(dim, offset, extent).contiguous().clone());
  } else {
    const auto seed = context.root.initialized_seed();  // checked before any change
    nn::Init init;
    for (const auto& [init_name, found] : module.named_inits()) {
      if (init_name == own_name) init = found;
    }
    const Tensor piece =
        empty(local, {.dtype = parameter.data().dtype(), .device = parameter.data().device()});
    // Row r of the piece is elements [r * row + offset * inner, ...) of the whole, drawn as the
    // whole parameter's draw gives them: one fill per row of dims before `dim`.
    std::int64_t outer = 1, inner = 1;
    for (int d = 0; d < dim; ++d) outer *= full[static_cast<std::size_t>(d)];
    for (std::size_t d = static_cast<std::size_t>(dim) + 1; d < full.size(); ++d) inner *= full[d];
    const Tensor rows = piece.reshape({outer, extent * inner});
    for (std::int64_t r = 0; r < outer; ++r) {
      init.fill(rows.narrow(0, r, 1), *seed, name,
                (r * full[static_cast<std::size_t>(dim)] + offset) * inner);
    }
    parameter.set_data(piece);
  }
  return {.name = name, .full_shape = full, .dim = dim, .offset = offset, .extent = extent};
}

void check_not_sharded(const nn::Module& module, const std::string& path) {
  for (const auto& [name, parameter] : module.named_parameters()) {
    SHARDLAB_CHECK(
        parameter.shard_info() == nullptr,
        "tensor parallel: '{}' is already sharded by FSDP ('{}'); apply tensor parallelism first, then "
        "fully_shard",
        path, name);
  }
  SHARDLAB_CHECK(!parallelised().contains(module), "tensor parallel: '{}' is already parallelised", path);
}

// Whether a module on the way from the root to `path` is a region_input of the plan.
bool inside_region(const std::string& path, const std::vector<std::string>& region_inputs) {
  return std::ranges::any_of(region_inputs, [&](const std::string& region) {
    return region.empty() ||
           (path.size() > region.size() && path.starts_with(region) && path[region.size()] == '.');
  });
}

void enter_region_before(nn::Module& module, Communicator& group, const std::string& path) {
  module.register_forward_pre_hook([&group, tag = path + " input"](nn::Module&, nn::ForwardInputs& inputs) {
    SHARDLAB_CHECK(!inputs.empty() && inputs.front().defined(),
                   "tensor parallel: '{}' has no first input to enter the parallel region with", tag);
    inputs.front() = copy_to_parallel_region(inputs.front(), group, tag);
  });
}

// Refuses, before any module changes, a style on a module it does not fit or a split that would
// leave a rank nothing.
void check_fits(const nn::Module& module, const std::string& path, ParallelStyle style, int ranks) {
  const auto* linear = dynamic_cast<const nn::LinearImpl*>(&module);
  const auto* embedding = dynamic_cast<const nn::EmbeddingImpl*>(&module);
  if (style == ParallelStyle::colwise) {
    SHARDLAB_CHECK(linear != nullptr, "tensor parallel: colwise fits a Linear, but '{}' is a {}", path,
                   module.type_name());
    split_range(linear->weight.size(0), ranks, 0, fmt::format("'{}' (out features)", path));
  } else if (style == ParallelStyle::rowwise) {
    SHARDLAB_CHECK(linear != nullptr || embedding != nullptr,
                   "tensor parallel: rowwise fits a Linear or an Embedding, but '{}' is a {}", path,
                   module.type_name());
    split_range(linear != nullptr ? linear->weight.size(1) : embedding->weight.size(0), ranks, 0,
                fmt::format("'{}' ({})", path, linear != nullptr ? "in features" : "vocabulary"));
  }
}

void apply_colwise(const Context& context, nn::Module& module, const std::string& path, bool in_region,
                   std::vector<TensorParallelSplit>& splits) {
  auto* linear = dynamic_cast<nn::LinearImpl*>(&module);
  splits.push_back(keep_piece(context, module, path, "weight", linear->weight, 0));
  if (linear->bias.defined()) splits.push_back(keep_piece(context, module, path, "bias", linear->bias, 0));
  if (!in_region) enter_region_before(module, context.group, path);
}

void apply_rowwise_linear(const Context& context, nn::LinearImpl& linear, const std::string& path,
                          std::vector<TensorParallelSplit>& splits) {
  splits.push_back(keep_piece(context, linear, path, "weight", linear.weight, 1));
  // Every rank adding the bias to its partial sum would add it group.size() times: the forward
  // computes without it (it stays registered, whole, in named_parameters) and the hook adds it once.
  const Variable bias = linear.bias;
  linear.bias = Variable();
  linear.register_forward_hook(
      [&group = context.group, bias, tag = path + " output"](nn::Module&, Variable& output) {
        output = reduce_from_parallel_region(output, group, tag);
        if (bias.defined()) output = add(output, bias);
      });
}

void apply_rowwise_embedding(const Context& context, nn::EmbeddingImpl& embedding, const std::string& path,
                             std::vector<TensorParallelSplit>& splits) {
  splits.push_back(keep_piece(context, embedding, path, "weight", embedding.weight, 0));
  const std::int64_t offset = splits.back().offset, extent = splits.back().extent;
  // The tokens this rank holds, found before the lookup, mask its output after it.
  auto held = std::make_shared<Tensor>();
  embedding.register_forward_pre_hook([offset, extent, held](nn::Module&, nn::ForwardInputs& inputs) {
    const Tensor tokens = sub(inputs.front().data(), offset);
    const Tensor clamped = clamp(tokens, Scalar(0), Scalar(extent - 1));
    *held = eq(clamped, tokens);
    inputs.front() = constant(clamped);
  });
  embedding.register_forward_hook(
      [&group = context.group, held, tag = path + " output"](nn::Module&, Variable& output) {
        Shape mask_shape = held->shape();
        mask_shape.push_back(1);
        const Tensor mask = cast(*held, output.dtype()).reshape(mask_shape);
        *held = Tensor();  // nothing of the batch stays between steps
        output = reduce_from_parallel_region(mul(output, constant(mask)), group, tag);
      });
}

void apply_rowwise(const Context& context, nn::Module& module, const std::string& path,
                   std::vector<TensorParallelSplit>& splits) {
  if (auto* linear = dynamic_cast<nn::LinearImpl*>(&module))
    return apply_rowwise_linear(context, *linear, path, splits);
  apply_rowwise_embedding(context, dynamic_cast<nn::EmbeddingImpl&>(module), path, splits);
}

// The parameters no style split, when the model is still deferred: drawn whole, so that FSDP then
// finds every parameter of a unit materialised alike.
void draw_the_rest(nn::Module& root) {
  const auto inits = root.named_inits();
  const NoGradGuard no_grad;
  for (const auto& [name, parameter] : root.named_parameters()) {
    if (!nn::deferred(parameter.data())) continue;
    const Tensor whole = empty(parameter.data().shape(),
                               {.dtype = parameter.data().dtype(), .device = parameter.data().device()});
    const std::string& wanted = name;  // a structured binding is not captured before C++20's clang 16
    const auto init = std::ranges::find_if(inits, [&](const auto& entry) { return entry.first == wanted; });
    init->second.fill(whole, *root.initialized_seed(), name);
    parameter.set_data(whole);
  }
}

std::string style_name(ParallelStyle style) {
  switch (style) {
    case ParallelStyle::colwise:
      return "colwise";
    case ParallelStyle::rowwise:
      return "rowwise";
    case ParallelStyle::region_input:
      return "region_input";
  }
  return "?";
}

}  // namespace

std::vector<TensorParallelSplit> parallelize_module(
    nn::Module& root, Communicator& group, const std::vector<std::pair<std::string, ParallelStyle>>& plan) {
  const auto modules = root.named_modules();
  // Each module's style, every pattern matching something and no module matched twice.
  std::map<std::string, std::pair<ParallelStyle, std::string>> chosen;
  std::vector<std::string> region_inputs;
  for (const auto& [pattern, style] : plan) {
    bool found = false;
    for (const auto& [path, module] : modules) {
      if (!matches(pattern, path)) continue;
      found = true;
      const auto [it, fresh] = chosen.emplace(path, std::pair{style, pattern});
      SHARDLAB_CHECK(fresh, "tensor parallel: module '{}' is matched by '{}' ({}) and by '{}' ({})", path,
                     it->second.second, style_name(it->second.first), pattern, style_name(style));
      check_not_sharded(*module, path);
      SHARDLAB_CHECK(module->has_forward(), "tensor parallel: '{}' ({}) has no forward of its own to hook",
                     path, module->type_name());
      check_fits(*module, path, style, group.size());
      if (style == ParallelStyle::region_input) region_inputs.push_back(path);
    }
    SHARDLAB_CHECK(found, "tensor parallel: the plan's '{}' ({}) matches no module of {}", pattern,
                   style_name(style), root.type_name());
  }
  for (const auto& [name, parameter] : root.named_parameters()) {
    SHARDLAB_CHECK(
        !nn::deferred(parameter.data()) || root.initialized_seed().has_value(),
        "tensor parallel: '{}' was made under nn::DeferredInitGuard, but nn::initialize(root, seed) "
        "was not called on the root {}",
        name, root.type_name());
  }
  const Context context{root, group};
  std::vector<TensorParallelSplit> splits;
  for (const auto& [path, module] : modules) {
    const auto it = chosen.find(path);
    if (it == chosen.end()) continue;
    switch (it->second.first) {
      case ParallelStyle::colwise:
        apply_colwise(context, *module, path, inside_region(path, region_inputs), splits);
        break;
      case ParallelStyle::rowwise:
        apply_rowwise(context, *module, path, splits);
        break;
      case ParallelStyle::region_input:
        enter_region_before(*module, group, path);
        break;
    }
    parallelised().add(*module);
  }
  if (root.initialized_seed().has_value()) draw_the_rest(root);
  return splits;
}

}  // namespace shardlab::dist
