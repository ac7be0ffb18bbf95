// tests/autograd/test_anomaly.cpp: anomaly detection names the op whose forward made the first NaN
// and the backward node (and the leaf) whose gradient first held a NaN or an infinity; off, nothing
// is checked.
#include <cmath>
#include <limits>

#include "autograd/anomaly.h"
#include "autograd/ops.h"
#include "tests/check.h"

using namespace shardlab;

namespace {

Variable leaf(std::vector<float> values, std::string name) {
  return Variable(from_vector<float>(values), true, std::move(name));
}

}  // namespace

TEST_CASE("detect_anomaly is off by default and a guard turns it on for its scope only",
          "[autograd][anomaly]") {
  CHECK_FALSE(autograd::anomaly_detection_on());
  const Variable x = leaf({4, 1, -1, 9}, "x");
  const Variable y = sqrt(x);  // a NaN, unchecked
  CHECK(std::isnan(y.data().to(DType::f64).narrow(0, 2, 1).item<double>()));
  {
    autograd::DetectAnomaly detect;
    CHECK(autograd::anomaly_detection_on());
    {
      autograd::DetectAnomaly off(false);
      CHECK_FALSE(autograd::anomaly_detection_on());
      CHECK_NOTHROW(sqrt(x));
    }
    CHECK(autograd::anomaly_detection_on());
  }
  CHECK_FALSE(autograd::anomaly_detection_on());
}

TEST_CASE("detect_anomaly: a forward NaN names the op, the count and the first index",
          "[autograd][anomaly]") {
  const Variable x = leaf({4, 1, -1, 9, -4, 16}, "x");
  autograd::DetectAnomaly detect;
  CHECK_NOTHROW(sqrt(narrow(x, 0, 0, 2)));
  CHECK_THROWS_ERROR(
      sqrt(x),
      "detect_anomaly: the forward of 'sqrt' produced 2 NaN of 6 elements in its output [6] f32 (the "
      "first at flat index 2)");
  // An infinity in forward is no anomaly: masks fill with -inf.
  const float inf = std::numeric_limits<float>::infinity();
  CHECK_NOTHROW(add(x, Variable(from_vector<float>({0, -inf, 0, 0, 0, 0}))));
}

TEST_CASE("detect_anomaly: a non-finite gradient names the backward node and the leaf it flows to",
          "[autograd][anomaly]") {
  // d/dw sum(log(w)) = 1/w: infinite where w = 0, though the forward's -inf is allowed.
  const Variable w = leaf({1, 2, 0, 4}, "layer.weight");
  {
    const Variable loss = sum(log(w));  // unchecked: the gradient is inf, nobody complains
    loss.backward();
    CHECK(std::isinf(w.grad().to(DType::f64).narrow(0, 2, 1).item<double>()));
  }
  autograd::DetectAnomaly detect;
  const Variable loss = sum(log(w));
  CHECK_THROWS_ERROR(
      loss.backward(),
      "detect_anomaly: 'log_backward' returned 1 non-finite values of 4 in the gradient of its input 0 "
      "[4] f32 (the first at flat index 2: inf), which flows to leaf 'layer.weight'");
  // A NaN that enters inside the graph is named where it appears, with the next node as its destination.
  const Variable v = leaf({1, 2, 3}, "v");
  const Variable scaled = mul(v, Variable(from_vector<float>({1, 1, 1})));
  const float nan = std::numeric_limits<float>::quiet_NaN();
  CHECK_THROWS_ERROR(sum(scaled).backward(from_vector<float>({nan}).reshape({})),
                     "detect_anomaly: 'sum_backward' returned 3 non-finite values of 3 in the gradient of "
                     "its input 0 [3] f32 (the "
                     "first at flat index 0: nan), which flows to 'mul_backward'");
}
