// autograd/gradcheck.h: compares an op's analytical Jacobian (from backward) with central
// differences, like torch.autograd.gradcheck, to prove a backward right.
//
//   GradcheckResult r = gradcheck([](const std::vector<Variable>& x) { return mul(x[0], x[1]); },
//                                 {Variable(a, true), Variable(b, true)});
//   if (!r.ok) fmt::print("{}\n", r.report);
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "autograd/variable.h"

namespace shardlab {

struct GradcheckOptions {
  double eps = 1e-6;   // perturbation of each input element
  double atol = 1e-5;  // an entry passes when |analytical - numerical| <= atol + rtol * |numerical|
  double rtol = 1e-3;
};

struct GradcheckResult {
  bool ok = false;
  std::string report;  // the first mismatching entries, or a summary when ok
};

using GradcheckFn = std::function<Variable(const std::vector<Variable>&)>;

// Every input that requires grad must be f64 (and may be a non-contiguous view); its
// elements are perturbed in place and restored. Entries that are NaN on either side fail.
GradcheckResult gradcheck(const GradcheckFn& fn, const std::vector<Variable>& inputs,
                          GradcheckOptions options = {});

}  // namespace shardlab
