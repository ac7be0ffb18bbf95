// autograd/anomaly.h: anomaly detection (PyTorch's detect_anomaly): while a DetectAnomaly guard
// lives, every op's forward result is checked for NaN and every gradient a backward node returns
// for NaN and infinity; the first that has one throws, naming the op, the input, and the leaf the
// gradient flows to. Forward infinities pass: attention masks fill with -inf on purpose, and a NaN
// is what a bad infinity turns into one op later. Costs one pass over every tensor: for debugging.
//
//   { autograd::DetectAnomaly detect; loss = model(x); loss.backward(); }  // throws at the first NaN
#pragma once

#include <cstddef>

#include "core/tensor.h"

namespace shardlab::autograd {

class Node;

// Process-wide, as PyTorch's: the switch is read by whatever thread runs an op.
bool anomaly_detection_on();

class DetectAnomaly {
 public:
  explicit DetectAnomaly(bool on = true);
  ~DetectAnomaly();
  DetectAnomaly(const DetectAnomaly&) = delete;
  DetectAnomaly& operator=(const DetectAnomaly&) = delete;

 private:
  bool previous_;
};

// Throws if `output` of the op `op` holds a NaN (record() calls it while detection is on).
void check_forward(const char* op, const Tensor& output);
// Throws if `grad`, the gradient `node` returned for its input `input`, holds a NaN or an
// infinity (the engine calls it while detection is on).
void check_gradient(const Node& node, std::size_t input, const Tensor& grad);

}  // namespace shardlab::autograd
