// autograd/ops_elementwise.cpp: differentiable elementwise ops, each forward next to its
// backward. Gradients of broadcast operands are summed back to their shapes (sum_to).
#include <cmath>

#include "autograd/record.h"
#include "autograd/ops.h"

namespace shardlab {

using autograd::Grads;
using autograd::record;
using autograd::sum_to;

namespace {

// d/dx f(x) = g * factor: the common shape of most unary backwards.
Variable unary(const char* name, const Variable& x, Tensor y,
               std::function<Tensor(const Tensor& g)> backward) {
  return record(name, {x}, std::move(y),
                [backward = std::move(backward)](const Tensor& g) -> Grads { return {backward(g)}; });
}

Tensor zeros_as(const Tensor& like) {
  return zeros(like.shape(), TensorOptions{like.dtype(), like.device()});
}

Tensor one_minus(const Tensor& t) { return sub(scalar_tensor(1.0, TensorOptions{t.dtype(), t.device()}), t); }

}  // namespace

Variable neg(const Variable& x) {
  return unary("neg", x, neg(x.data()), [](const Tensor& g) { return neg(g); });
}

Variable abs(const Variable& x) {
  const Tensor input = x.data();
  return unary("abs", x, abs(input), [input](const Tensor& g) {
    // sign(x): +1, -1, and 0 at 0 (as PyTorch)
    return where(gt(input, 0), g, where(lt(input, 0), neg(g), 0));
  });
}

Variable exp(const Variable& x) {
  const Tensor y = exp(x.data());
  return unary("exp", x, y, [y](const Tensor& g) { return mul(g, y); });
}

Variable log(const Variable& x) {
  const Tensor input = x.data();
  return unary("log", x, log(input), [input](const Tensor& g) { return div(g, input); });
}

Variable sqrt(const Variable& x) {
  const Tensor y = sqrt(x.data());
  return unary("sqrt", x, y, [y](const Tensor& g) { return div(mul(g, 0.5), y); });
}

Variable rsqrt(const Variable& x) {
  const Tensor y = rsqrt(x.data());
  // d/dx x^(-1/2) = -1/2 x^(-3/2) = -1/2 y^3
  return unary("rsqrt", x, y, [y](const Tensor& g) { return mul(mul(g, -0.5), mul(y, mul(y, y))); });
}

Variable tanh(const Variable& x) {
  const Tensor y = tanh(x.data());
  return unary("tanh", x, y, [y](const Tensor& g) { return mul(g, one_minus(mul(y, y))); });
}

Variable sigmoid(const Variable& x) {
  const Tensor y = sigmoid(x.data());
  return unary("sigmoid", x, y, [y](const Tensor& g) { return mul(g, mul(y, one_minus(y))); });
}

Variable relu(const Variable& x) {
  const Tensor y = relu(x.data());
  return unary("relu", x, y, [y](const Tensor& g) { return relu_backward(g, y); });
}

Variable silu(const Variable& x) {
  const Tensor input = x.data();
  return unary("silu", x, silu(input), [input](const Tensor& g) {
    // d/dx x s(x) = s(x) (1 + x (1 - s(x)))
    const Tensor s = sigmoid(input);
    return mul(g, mul(s, add(mul(input, one_minus(s)), 1.0)));
  });
}

Variable gelu(const Variable& x, GeluApproximation approximate) {
  const Tensor input = x.data();
  return unary("gelu", x, gelu(input, approximate), [input, approximate](const Tensor& g) {
    if (approximate == GeluApproximation::none) {
      // d/dx x Phi(x) = Phi(x) + x phi(x)
      const Tensor cdf = mul(add(erf(mul(input, M_SQRT1_2)), 1.0), 0.5);
      const Tensor pdf = mul(exp(mul(mul(input, input), -0.5)), 0.5 * M_2_SQRTPI * M_SQRT1_2);
      return mul(g, add(cdf, mul(input, pdf)));
    }
    // u = c (x + a x^3), y = x (1 + tanh u) / 2: dy/dx = (1 + t)/2 + x (1 - t^2) c (1 + 3 a x^2) / 2
    const double c = std::sqrt(2.0 / M_PI), a = 0.044715;
    const Tensor x2 = mul(input, input);
    const Tensor t = tanh(mul(add(mul(mul(x2, input), a), input), c));
    const Tensor du = mul(add(mul(x2, 3 * a), 1.0), c);
    const Tensor left = mul(add(t, 1.0), 0.5);
    const Tensor right = mul(mul(mul(input, one_minus(mul(t, t))), du), 0.5);
    return mul(g, add(left, right));
  });
}

Variable clamp(const Variable& x, std::optional<Scalar> min, std::optional<Scalar> max) {
  const Tensor input = x.data();
  return unary("clamp", x, clamp(input, min, max), [input, min, max](const Tensor& g) {
    Tensor pass = g;
    if (min) pass = where(lt(input, *min), zeros_as(g), pass);
    if (max) pass = where(gt(input, *max), zeros_as(g), pass);
    return pass;
  });
}

Variable pow(const Variable& x, Scalar exponent) {
  const Tensor input = x.data();
  return unary("pow", x, pow(input, exponent), [input, exponent](const Tensor& g) {
    const double p = exponent.to_double();
    // x^0 = 1 everywhere (0^0 included): the gradient is 0, where p x^(p-1) gives 0 * inf = NaN at 0.
    if (p == 0.0) return zeros_as(g);
    return mul(g, mul(pow(input, p - 1), p));
  });
}

Variable pow(const Variable& base, const Variable& exponent) {
  const Tensor b = base.data(), e = exponent.data(), y = pow(b, e);
  const bool need_exponent = exponent.requires_grad();
  return record("pow", {base, exponent}, y, [b, e, y, need_exponent](const Tensor& g) -> Grads {
    // Where e = 0 the output is 1 for every base: gradient 0, not e b^(e-1) = 0 * inf = NaN at b = 0.
    const Tensor grad_base = sum_to(where(ne(e, 0.0), mul(g, mul(e, pow(b, sub(e, 1.0)))), 0.0), b.shape());
    if (!need_exponent) return {grad_base, {}};
    return {grad_base, sum_to(mul(g, mul(y, log(b))), e.shape())};
  });
}

Variable cast(const Variable& x, DType dtype) {
  const DType from = x.dtype();
  return unary("cast", x, x.data().to(dtype), [from](const Tensor& g) { return g.to(from); });
}

Variable add(const Variable& a, const Variable& b) {
  const Shape sa = a.shape(), sb = b.shape();
  const bool need_a = a.requires_grad(), need_b = b.requires_grad();
  return record("add", {a, b}, add(a.data(), b.data()), [sa, sb, need_a, need_b](const Tensor& g) -> Grads {
    return {need_a ? sum_to(g, sa) : Tensor(), need_b ? sum_to(g, sb) : Tensor()};
  });
}

Variable sub(const Variable& a, const Variable& b) {
  const Shape sa = a.shape(), sb = b.shape();
  const bool need_a = a.requires_grad(), need_b = b.requires_grad();
  return record("sub", {a, b}, sub(a.data(), b.data()), [sa, sb, need_a, need_b](const Tensor& g) -> Grads {
    return {need_a ? sum_to(g, sa) : Tensor(), need_b ? sum_to(neg(g), sb) : Tensor()};
  });
}

Variable mul(const Variable& a, const Variable& b) {
  const Tensor x = a.data(), y = b.data();
  const bool need_a = a.requires_grad(), need_b = b.requires_grad();
  return record("mul", {a, b}, mul(x, y), [x, y, need_a, need_b](const Tensor& g) -> Grads {
    return {need_a ? sum_to(mul(g, y), x.shape()) : Tensor(),
            need_b ? sum_to(mul(g, x), y.shape()) : Tensor()};
  });
}

Variable div(const Variable& a, const Variable& b) {
  const Tensor x = a.data(), y = b.data(), quotient = div(x, y);
  const bool need_a = a.requires_grad(), need_b = b.requires_grad();
  return record("div", {a, b}, quotient, [x, y, quotient, need_a, need_b](const Tensor& g) -> Grads {
    return {need_a ? sum_to(div(g, y), x.shape()) : Tensor(),
            need_b ? sum_to(neg(div(mul(g, quotient), y)), y.shape()) : Tensor()};  // d(x/y)/dy = -(x/y)/y
  });
}

namespace {
// maximum/minimum: `wins` marks where a is taken; ties (a == b) split the gradient.
Variable select_larger(const char* name, const Variable& a, const Variable& b, bool larger) {
  const Tensor x = a.data(), y = b.data();
  const Tensor output = larger ? maximum(x, y) : minimum(x, y);
  const bool need_a = a.requires_grad(), need_b = b.requires_grad();
  return record(name, {a, b}, output, [x, y, larger, need_a, need_b](const Tensor& g) -> Grads {
    const Tensor a_wins = larger ? gt(x, y) : lt(x, y);
    const Tensor tie = eq(x, y);
    const Tensor half = mul(g, 0.5), none = zeros_as(g);
    return {need_a ? sum_to(where(a_wins, g, where(tie, half, none)), x.shape()) : Tensor(),
            need_b ? sum_to(where(a_wins, none, where(tie, half, g)), y.shape()) : Tensor()};
  });
}
}  // namespace

Variable maximum(const Variable& a, const Variable& b) { return select_larger("maximum", a, b, true); }
Variable minimum(const Variable& a, const Variable& b) { return select_larger("minimum", a, b, false); }

// A Scalar operand is a constant of the variable's dtype and device.
Variable add(const Variable& a, Scalar b) {
  return add(a, constant(scalar_tensor(b, {a.dtype(), a.device()})));
}
Variable sub(const Variable& a, Scalar b) {
  return sub(a, constant(scalar_tensor(b, {a.dtype(), a.device()})));
}
Variable mul(const Variable& a, Scalar b) {
  return mul(a, constant(scalar_tensor(b, {a.dtype(), a.device()})));
}
Variable div(const Variable& a, Scalar b) {
  return div(a, constant(scalar_tensor(b, {a.dtype(), a.device()})));
}

Variable where(const Tensor& condition, const Variable& a, const Variable& b) {
  const Shape sa = a.shape(), sb = b.shape();
  const bool need_a = a.requires_grad(), need_b = b.requires_grad();
  return record("where", {a, b}, where(condition, a.data(), b.data()),
                [condition, sa, sb, need_a, need_b](const Tensor& g) -> Grads {
                  return {need_a ? sum_to(where(condition, g, 0), sa) : Tensor(),
                          need_b ? sum_to(where(condition, zeros_as(g), g), sb) : Tensor()};
                });
}

Variable operator-(const Variable& x) { return neg(x); }
Variable operator+(const Variable& a, const Variable& b) { return add(a, b); }
Variable operator-(const Variable& a, const Variable& b) { return sub(a, b); }
Variable operator*(const Variable& a, const Variable& b) { return mul(a, b); }
Variable operator/(const Variable& a, const Variable& b) { return div(a, b); }
Variable operator+(const Variable& a, Scalar b) { return add(a, b); }
Variable operator-(const Variable& a, Scalar b) { return sub(a, b); }
Variable operator*(const Variable& a, Scalar b) { return mul(a, b); }
Variable operator/(const Variable& a, Scalar b) { return div(a, b); }

}  // namespace shardlab
