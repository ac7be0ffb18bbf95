// core/roofline.h: a device's measured rates, and the time a kernel call takes by the roofline they make:
// a dense call (GEMM, convolution, attention) at the rate dense calls of its size and dtype ran, or its
// bytes at the memory rate if that takes longer; any other call its bytes at the memory rate; each call
// also the time a tiny kernel takes (dispatch, launch). The rates come from a short measurement on the
// device with the process's threads (measure_rates), never from the work being predicted. On the CPU the
// thread that issues a call runs it, so a call's issue and its work add; a GPU's host queues each kernel
// while earlier ones run, so a call there takes the longer of the two (calls_overlap).
//
//   const DeviceRates rates = measure_rates(Device::cpu());
//   double seconds = 0;
//   for (const KernelCost& cost : kernel_costs(step)) seconds += roofline_seconds(cost, rates);
#pragma once

#include <map>
#include <optional>
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

using DenseRates = std::map<DType, std::vector<DenseRate>>;

// An attention kernel's time: seconds per scored query-key pair plus its flops at a rate.
struct AttentionRate {
  double seconds_per_pair = 0;
  double flops_per_second = 0;
};  // per dtype, by work size, ascending

struct DeviceRates {
  std::string device;  // what was measured, e.g. "cpu (avx512), 1 thread"
  DenseRates dense;    // GEMMs
  // Other dense kernels measured apart, by op: the convolutions ("conv2d", "conv2d_backward_input",
  // "conv2d_backward_weight") reach a fraction of a GEMM's rate, least where the channels are few.
  std::map<std::string, DenseRates> kernels;
  // Attention's kernels ("attention_forward", "attention_backward") per dtype: a softmax term per
  // scored pair besides the multiply-adds, so their time is not flops over one rate.
  std::map<std::string, std::map<DType, AttentionRate>> attention;
  double bytes_per_second = 0;                    // a large elementwise add's bytes over its time
  double seconds_per_call = 0;                    // a tiny add's time
  // Copies between pinned host memory and a GPU (CPU offload's shards in, gradient shards out); 0 for
  // the CPU, which copies nothing.
  double host_to_device_bytes_per_second = 0, device_to_host_bytes_per_second = 0;
  // The host queues kernels ahead of the device (a GPU): a call's issue hides behind the work before it.
  bool calls_overlap = false;
};

// The rate of a dense call of `flops` operations in `dtype`: linear in log(flops) between the measured
// sizes around it, the nearest size's beyond them; `op`'s own where its kernel was measured apart, else
// the GEMMs'. An Error where `dtype` was not measured.
double dense_rate(const DeviceRates& rates, DType dtype, double flops, const std::string& op = "matmul");

// An attention call's compute time: its pairs and flops at its kernel's measured rates, or its flops at
// the GEMMs' rate where those were not measured.
double attention_seconds(const KernelCost& cost, const DeviceRates& rates);

// One call's work: its dense math or its bytes, whichever takes longer; throws where the rates lack what
// it needs.
double work_seconds(const KernelCost& cost, const DeviceRates& rates);

// The roofline time of one call: its work plus the call's own time, or the longer of the two where calls
// overlap.
double roofline_seconds(const KernelCost& cost, const DeviceRates& rates);

// `calls` calls doing `work` seconds of work in all, by the same rule.
double with_calls(double work, double calls, const DeviceRates& rates);

// How measure_rates names `device`: "cpu (avx2), 2 threads" (the threads the CPU pool has now), "cuda:0".
std::string describe_device(Device device);

// Rates a person gives for a device not at hand (--peak-tflops, --memory-bandwidth, --launch-overhead):
// each replaces the measured one.
struct AssumedRates {
  std::optional<double>
      dense_flops_per_second;  // every dense call (GEMM, convolution, attention), every dtype
  std::optional<double> bytes_per_second;
  std::optional<double> seconds_per_call;
  bool any() const { return dense_flops_per_second || bytes_per_second || seconds_per_call; }
};

// `measured` with the assumed rates in place of its own, its description saying which: a dense rate
// replaces the GEMMs' of f32, bf16 and f16 at every size, and the convolutions' and attention's own
// (they run at it). An Error names a rate that is not positive, or a negative time a call.
DeviceRates with_assumed_rates(DeviceRates measured, const AssumedRates& assumed);

// Measures `device`'s rates in about `budget_seconds`: square matmuls of 64 to 512 rows in f32 and bf16
// (256 to 4096 on a GPU, whose smaller ones only show the launch), each size as a Linear's three in
// training (a b^T, a b, a^T b; each repeated until it has run a slice of the budget), causal attention
// forward and backward over 256 tokens (4 sequences of 1024 on a GPU; 8 query heads, 2 key-value
// heads) with heads of 64 and of 128, whose difference separates the per-pair time from the flops'
// rate, in both; an add of 4 Mi f32 elements (64 Mi on a GPU) and adds of 16; convolutions of 3x3
// kernels over 8 images of 28x28 (1 to 32 channels, 32 to 64) and 14x14 (64 to 128), forward and both
// gradients, in both; on a GPU, copies of 16 MiB from pinned host memory and back; with the threads the
// CPU pool has now.
DeviceRates measure_rates(Device device, double budget_seconds = 2.0);

}  // namespace shardlab
