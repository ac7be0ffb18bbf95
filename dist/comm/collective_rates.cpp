// dist/comm/collective_rates.cpp: the latency-bandwidth model of collectives (dist/comm/collective_rates.h).
#include "dist/comm/collective_rates.h"

#include <algorithm>
#include <chrono>

#include "core/error.h"
#include "core/ops.h"
#include "dist/comm/communicator.h"

namespace shardlab::dist {
namespace {

constexpr Collective kModelled[] = {Collective::all_gather, Collective::reduce_scatter,
                                    Collective::all_reduce};
constexpr std::int64_t kSizes[] = {std::int64_t{4} << 10, std::int64_t{64} << 10, std::int64_t{1} << 20,
                                   std::int64_t{4} << 20};
constexpr int kCalls = 5;

// One call of `op` over `buffer` (the gathered output, the reduce-scatter's input, the all-reduced
// tensor; `part` is this rank's share of it), waited for.
void run(Communicator& comm, Collective op, const Tensor& buffer, const Tensor& part) {
  switch (op) {
    case Collective::all_gather:
      comm.all_gather_into(buffer, buffer.narrow(0, comm.rank() * part.numel(), part.numel()), "measure")
          .wait();
      return;
    case Collective::reduce_scatter:
      comm.reduce_scatter(part, buffer, ReduceOp::sum, "measure").wait();
      return;
    default:
      comm.all_reduce(buffer, ReduceOp::sum, "measure").wait();
      return;
  }
}

// The median time of kCalls calls of `op` over `bytes` of f32, the buffers made before the clock starts.
double median_seconds(Communicator& comm, Collective op, std::int64_t bytes) {
  const std::int64_t share = bytes / 4 / comm.size();
  const Tensor buffer = zeros({share * comm.size()}), part = zeros({share});
  std::vector<double> seconds;
  comm.barrier("measure").wait();
  for (int call = 0; call < kCalls; ++call) {
    const auto start = std::chrono::steady_clock::now();
    run(comm, op, buffer, part);
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::nth_element(seconds.begin(), seconds.begin() + kCalls / 2, seconds.end());
  return seconds[kCalls / 2];
}

}  // namespace

double ring_bytes(Collective op, double bytes, int ranks) {
  const double share = static_cast<double>(ranks - 1) / ranks;
  return (op == Collective::all_reduce ? 2 : 1) * share * bytes;
}

LinkFit fit_line(const std::vector<std::pair<double, double>>& points) {
  SHARDLAB_CHECK(points.size() >= 2, "fit_line: a line needs points of at least two sizes, got {}",
                 points.size());
  double n = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (const auto& [x, y] : points) {
    n += 1, sx += x, sy += y, sxx += x * x, sxy += x * y;
  }
  const double spread = n * sxx - sx * sx;
  SHARDLAB_CHECK(spread > 0, "fit_line: a line needs points of at least two sizes, got {} of one size",
                 points.size());
  const double slope = (n * sxy - sx * sy) / spread, intercept = (sy - slope * sx) / n;
  if (slope < 0) return {sy / n, 0};
  if (intercept < 0) return {0, sxy / sxx};
  return {intercept, slope};
}

double collective_seconds(const CollectiveRates& rates, Collective op, double bytes, int ranks) {
  if (ranks == 0) ranks = rates.ranks;
  if (ranks <= 1) return 0;
  const auto fit = rates.fits.find(op);
  SHARDLAB_CHECK(fit != rates.fits.end(), "collective_seconds: no fit for {} over {} ranks",
                 collective_name(op), rates.ranks);
  return fit->second.latency_seconds + fit->second.seconds_per_byte * ring_bytes(op, bytes, ranks);
}

CollectiveRates measure_collectives(Communicator& comm) {
  CollectiveRates rates{.ranks = comm.size()};
  if (comm.size() == 1) return rates;
  std::vector<double> medians;
  for (const Collective op : kModelled) {
    for (const std::int64_t bytes : kSizes) medians.push_back(median_seconds(comm, op, bytes));
  }
  const Tensor agreed = from_vector(medians, {static_cast<std::int64_t>(medians.size())});
  comm.all_reduce(agreed, ReduceOp::max, "measure").wait();
  const std::vector<double> slowest = agreed.to_vector<double>();
  std::size_t next = 0;
  for (const Collective op : kModelled) {
    std::vector<std::pair<double, double>> points;
    for (const std::int64_t bytes : kSizes)
      points.emplace_back(ring_bytes(op, static_cast<double>(bytes), comm.size()), slowest[next++]);
    rates.fits[op] = fit_line(points);
  }
  return rates;
}

}  // namespace shardlab::dist
