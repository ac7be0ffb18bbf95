// dist/comm/collective_rates.cpp: the latency-bandwidth model of collectives (dist/comm/collective_rates.h).
#include "dist/comm/collective_rates.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <vector>

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

// Calls of `work` until `window` seconds have passed (at least one): how long they took, how many.
struct Calls {
  double seconds = 0;
  int count = 0;
  double per_call() const { return seconds / count; }
};
Calls call_for(const std::function<void()>& work, double window) {
  const auto start = std::chrono::steady_clock::now();
  const auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  int count = 0;
  do {
    work();
    ++count;
  } while (elapsed() < window);
  return {.seconds = elapsed(), .count = count};
}

// The slowdowns of compute and collectives beside each other (CollectiveRates), agreed over `comm`.
void measure_slowdowns(Communicator& comm, CollectiveRates& rates) {
  constexpr double kWindow = 0.1;
  const Tensor a = ones({256, 256}), b = ones({256, 256});
  const std::int64_t share = (std::int64_t{1} << 20) / 4 / comm.size();
  const Tensor buffer = zeros({share * comm.size()}), part = zeros({share});
  const auto matmul_call = [&] { (void)matmul(a, b); };
  const auto gather = [&] {
    return comm.all_gather_into(buffer, buffer.narrow(0, comm.rank() * share, share), "measure");
  };
  comm.barrier("measure").wait();
  const double matmul_alone = call_for(matmul_call, kWindow / 2).per_call();
  comm.barrier("measure").wait();
  // Every rank calls as many gathers (a collective): a fixed count alone, and beside the matmuls as many
  // as the slowest rank's time alone fits in the window.
  constexpr int kAlone = 8;
  const auto began = std::chrono::steady_clock::now();
  for (int i = 0; i < kAlone; ++i) gather().wait();
  const Tensor alone = from_vector(
      std::vector<double>{std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count() /
                          kAlone},
      {1});
  comm.all_reduce(alone, ReduceOp::max, "measure").wait();
  const double gather_alone = alone.to_vector<double>().front();
  // Beside each other: as many gathers queued as would take the window alone, matmuls for the window;
  // the gathers done by then against those; the rest then waited for alone.
  const auto gathers = static_cast<int>(std::clamp(kWindow / gather_alone, 4.0, 4000.0));
  comm.barrier("measure").wait();
  std::vector<Work> queued;
  for (int i = 0; i < gathers; ++i) queued.push_back(gather());
  const Calls beside = call_for(matmul_call, kWindow);
  const auto done = static_cast<double>(
      std::find_if(queued.begin(), queued.end(), [](const Work& work) { return !work.completed(); }) -
      queued.begin());
  for (const Work& work : queued) work.wait();
  // None done: at most half of one in the window.
  const Tensor slowdowns = from_vector(
      std::vector<double>{beside.per_call() / matmul_alone, beside.seconds / (std::max(done, 0.5) * gather_alone)},
      {2});
  comm.all_reduce(slowdowns, ReduceOp::max, "measure").wait();
  const std::vector<double> agreed = slowdowns.to_vector<double>();
  rates.compute_slowdown = std::max(1.0, agreed[0]);
  rates.communication_slowdown = std::max(1.0, agreed[1]);
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

CollectiveRates assumed_link(int ranks, double bytes_per_second, double latency_seconds) {
  SHARDLAB_CHECK(ranks >= 1, "assumed_link: {} ranks", ranks);
  SHARDLAB_CHECK(bytes_per_second > 0, "assumed_link: the bandwidth must be positive, got {} B/s",
                 bytes_per_second);
  SHARDLAB_CHECK(latency_seconds >= 0, "assumed_link: the latency must not be negative, got {} s",
                 latency_seconds);
  CollectiveRates rates{.ranks = ranks};
  for (const Collective op : kModelled)
    rates.fits[op] = {.latency_seconds = latency_seconds, .seconds_per_byte = 1 / bytes_per_second};
  return rates;
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
  measure_slowdowns(comm, rates);
  return rates;
}

}  // namespace shardlab::dist
