// autograd/gradcheck.cpp: full Jacobians, numerical (central differences) and analytical
// (one backward per output element), compared entry by entry.
#include "autograd/gradcheck.h"

#include <cmath>

#include "core/ops.h"

namespace shardlab {
namespace {

// A 0-d view of element `flat` (row-major) of t, whatever t's strides.
Tensor element(const Tensor& t, std::int64_t flat) {
  Tensor view = t;
  std::vector<std::int64_t> coordinates(static_cast<std::size_t>(t.dim()));
  for (std::int64_t d = t.dim() - 1; d >= 0; --d) {
    coordinates[static_cast<std::size_t>(d)] = flat % t.size(d);
    flat /= t.size(d);
  }
  for (const std::int64_t c : coordinates) view = view.select(0, c);
  return view;
}

std::vector<double> evaluate(const GradcheckFn& fn, const std::vector<Variable>& inputs) {
  const NoGradGuard no_grad;
  return fn(inputs).data().to_vector<double>();
}

}  // namespace

GradcheckResult gradcheck(const GradcheckFn& fn, const std::vector<Variable>& inputs,
                          GradcheckOptions options) {
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    SHARDLAB_CHECK(!inputs[i].requires_grad() || inputs[i].dtype() == DType::f64,
                   "gradcheck: input {} is {}; finite differences need f64", i,
                   dtype_name(inputs[i].dtype()));
  }
  const Variable output = fn(inputs);
  SHARDLAB_CHECK(output.requires_grad(),
                 "gradcheck: the output does not require grad (no input requires grad)");
  const std::int64_t outputs = output.numel();

  GradcheckResult result{true, ""};
  std::int64_t checked = 0, wrong = 0;
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].requires_grad()) continue;
    const Tensor& data = inputs[i].data();
    const std::int64_t n = data.numel();
    // Analytical: row j of the Jacobian is the input's gradient for output gradient e_j.
    std::vector<double> analytical(static_cast<std::size_t>(outputs * n), 0.0);
    for (std::int64_t j = 0; j < outputs; ++j) {
      for (const Variable& input : inputs) {
        if (input.requires_grad()) input.zero_grad();
      }
      Tensor seed = zeros(output.shape(), TensorOptions{output.dtype(), output.device()});
      element(seed, j).fill_(1.0);
      output.backward(seed, /*retain_graph=*/true);
      if (!inputs[i].grad().defined()) continue;
      const std::vector<double> row = inputs[i].grad().to_vector<double>();
      std::copy(row.begin(), row.end(), analytical.begin() + j * n);
    }
    // Numerical: column k from perturbing element k by +-eps.
    for (std::int64_t k = 0; k < n; ++k) {
      const Tensor cell = element(data, k);
      const double original = cell.item<double>();
      cell.fill_(original + options.eps);
      const std::vector<double> plus = evaluate(fn, inputs);
      cell.fill_(original - options.eps);
      const std::vector<double> minus = evaluate(fn, inputs);
      cell.fill_(original);
      for (std::int64_t j = 0; j < outputs; ++j) {
        const double numerical = (plus[j] - minus[j]) / (2 * options.eps);
        const double exact = analytical[static_cast<std::size_t>(j * n + k)];
        ++checked;
        if (!(std::abs(exact - numerical) <= options.atol + options.rtol * std::abs(numerical))) {
          if (++wrong <= 5) {
            result.report += fmt::format(
                "input {} element {} -> output element {}: analytical {:.10g}, "
                "numerical {:.10g}\n",
                i, k, j, exact, numerical);
          }
        }
      }
    }
  }
  for (const Variable& input : inputs) {
    if (input.requires_grad()) input.zero_grad();
  }
  result.ok = wrong == 0;
  result.report = result.ok ? fmt::format("gradcheck: {} Jacobian entries agree", checked)
                            : fmt::format("gradcheck: {} of {} Jacobian entries differ:\n{}", wrong, checked,
                                          result.report);
  return result;
}

}  // namespace shardlab
