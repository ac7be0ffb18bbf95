// tests/dist/test_collective_rates.cpp (mpirun): the collectives' latency-bandwidth model: the bytes a
// rank sends in each ring collective and the fitted lines by hand (exact points, a negative slope or
// latency kept physical, too few sizes refused), predictions from fixed fits, and a measurement on the
// world that fits every collective with the same lines on every rank.
#include <mpi.h>

#include <cmath>

#include "dist/comm/collective_rates.h"
#include "tests/dist/world.h"

using namespace shardlab;
using dist::Collective;

TEST_CASE("collective rates: ring bytes, fitted lines and predictions by hand", "[dist][collective_rates]") {
  // 4 ranks and a buffer of 1000 bytes: each sends 3/4 of it, an all-reduce twice that; one rank, none.
  CHECK(dist::ring_bytes(Collective::all_gather, 1000, 4) == 750);
  CHECK(dist::ring_bytes(Collective::reduce_scatter, 1000, 4) == 750);
  CHECK(dist::ring_bytes(Collective::all_reduce, 1000, 4) == 1500);
  CHECK(dist::ring_bytes(Collective::all_gather, 1000, 1) == 0);
  // Points on 1 + 2x.
  dist::LinkFit fit = dist::fit_line({{0, 1}, {2, 5}, {4, 9}});
  CHECK(fit.latency_seconds == 1);
  CHECK(fit.seconds_per_byte == 2);
  // Falling with size (noise): flat at the mean.
  fit = dist::fit_line({{1, 5}, {2, 4}});
  CHECK(fit.latency_seconds == 4.5);
  CHECK(fit.seconds_per_byte == 0);
  // A line crossing below zero (y = 3x - 2 through (1, 1) and (2, 4)): through the origin instead,
  // slope sum(xy) / sum(x^2) = 9 / 5.
  fit = dist::fit_line({{1, 1}, {2, 4}});
  CHECK(fit.latency_seconds == 0);
  CHECK(std::abs(fit.seconds_per_byte - 9.0 / 5) < 1e-15);
  CHECK_THROWS_ERROR(dist::fit_line({{1, 1}}), "fit_line: a line needs points of at least two sizes, got 1");
  CHECK_THROWS_ERROR(dist::fit_line({{1, 1}, {1, 2}}),
                     "fit_line: a line needs points of at least two sizes, got 2 of one size");
  // 10 us + 1 ns a byte: an all-gather of 4000 bytes over 4 ranks sends 3000.
  const dist::CollectiveRates rates{.ranks = 4, .fits = {{Collective::all_gather, {1e-5, 1e-9}}}};
  CHECK(std::abs(dist::collective_seconds(rates, Collective::all_gather, 4000) - (1e-5 + 3e-6)) < 1e-18);
  CHECK_THROWS_ERROR(dist::collective_seconds(rates, Collective::all_reduce, 4000),
                     "collective_seconds: no fit for all_reduce over 4 ranks");
  CHECK(dist::collective_seconds(dist::CollectiveRates{}, Collective::all_reduce, 4000) == 0);  // one rank
}

TEST_CASE("collective rates: measured on the world, every rank fits the same lines",
          "[dist][collective_rates]") {
  const dist::CollectiveRates rates = dist::measure_collectives(test::world());
  CHECK(rates.ranks == test::world().size());
  if (test::world().size() == 1) {
    CHECK(rates.fits.empty());  // nothing to send
    CHECK(rates.compute_slowdown == 1);
    CHECK(rates.communication_slowdown == 1);
    return;
  }
  // Measured, at least 1 (each run alone is the fastest it can), and the same on every rank.
  CHECK(std::isfinite(rates.compute_slowdown));
  CHECK(std::isfinite(rates.communication_slowdown));
  CHECK(rates.compute_slowdown >= 1);
  CHECK(rates.communication_slowdown >= 1);
  std::vector<double> mine;
  for (const Collective op : {Collective::all_gather, Collective::reduce_scatter, Collective::all_reduce}) {
    INFO(dist::collective_name(op));
    REQUIRE(rates.fits.count(op) == 1);
    const dist::LinkFit& fit = rates.fits.at(op);
    CHECK(std::isfinite(fit.latency_seconds));
    CHECK(std::isfinite(fit.seconds_per_byte));
    CHECK(fit.latency_seconds >= 0);
    CHECK(fit.seconds_per_byte >= 0);
    CHECK(fit.latency_seconds + fit.seconds_per_byte > 0);
    mine.push_back(fit.latency_seconds);
    mine.push_back(fit.seconds_per_byte);
  }
  mine.push_back(rates.compute_slowdown);
  mine.push_back(rates.communication_slowdown);
  std::vector<double> first = mine;
  MPI_Bcast(first.data(), static_cast<int>(first.size()), MPI_DOUBLE, 0, MPI_COMM_WORLD);
  CHECK(test::sum_over_ranks(first != mine) == 0);
}
