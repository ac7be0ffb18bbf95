// core/roofline.h: a device's measured rates, and the time a kernel call takes by the roofline they make:
// a dense call (GEMM, convolution, attention) at the rate dense calls of its size and dtype ran, or its
// bytes at the memory rate if that takes longer; any other call its bytes at the memory rate; each call
// also the time a tiny kernel takes (dispatch, launch). The rates come from a short measurement on the
// device with the process's threads (measure_rates), never from the work being predicted.
//
//   const DeviceRates rates = measure_rates(Device::cpu());
//   double seconds = 0;
//   for (const KernelCost& cost : kernel_costs(step)) seconds += roofline_seconds(cost, rates);
#pragma once

#include <map>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/dtype.h"
#include "core/op_cost.h"

namespace shardlab {

// One measured size of dense work: calls of `flops` operations ran at `per_second`.
struct DenseRate {
  double flops = 0;
  double per_second = 0;
};

struct DeviceRates {
  std::string device;                             // what was measured, e.g. "cpu (avx512), 1 thread"
  std::map<DType, std::vector<DenseRate>> dense;  // per dtype, by work size, ascending
  double bytes_per_second = 0;                    // a large elementwise add's bytes over its time
  double seconds_per_call = 0;                    // a tiny add's time
};

// The rate of a dense call of `flops` operations in `dtype`: linear in log(flops) between the measured
// sizes around it, the nearest size's beyond them. An Error where `dtype` was not measured.
double dense_rate(const DeviceRates& rates, DType dtype, double flops);

// The roofline time of one call (above); throws where the rates lack what it needs.
double roofline_seconds(const KernelCost& cost, const DeviceRates& rates);

// Measures `device`'s rates in about `budget_seconds`: square matmuls of 64 to 512 rows in f32 and bf16
// (each size repeated until it has run a slice of the budget), an add of 4 Mi f32 elements and adds of
// 16; with the threads the CPU pool has now.
DeviceRates measure_rates(Device device, double budget_seconds = 2.0);

}  // namespace shardlab
