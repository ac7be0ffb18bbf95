// dist/comm/collective_rates.h: how long a collective takes on a communicator, as a latency plus the
// bytes each rank sends over a bandwidth (alpha + beta n), fitted per collective to a short measurement
// on that communicator at a few sizes; n as the ring algorithms move it: (N - 1) / N of the buffer for
// an all-gather or a reduce-scatter, twice that for an all-reduce.
//
//   const CollectiveRates rates = measure_collectives(comm);  // a collective, about 1 s
//   double seconds = collective_seconds(rates, Collective::all_gather, bytes_of_the_gathered_buffer);
#pragma once

#include <map>
#include <utility>
#include <vector>

#include "dist/comm/collective.h"

namespace shardlab::dist {

class Communicator;

// seconds = latency_seconds + seconds_per_byte * bytes sent.
struct LinkFit {
  double latency_seconds = 0;
  double seconds_per_byte = 0;
};

struct CollectiveRates {
  int ranks = 1;
  std::map<Collective, LinkFit> fits;  // all_gather, reduce_scatter and all_reduce
  // How much slower compute and collectives run beside each other than alone: on a CPU the
  // communication thread takes the cores the ranks compute on (1: they do not interfere).
  double compute_slowdown = 1, communication_slowdown = 1;
};

// The bytes one rank sends in a ring collective over `ranks` of a buffer of `bytes` (the gathered
// output, the reduce-scatter's input, the all-reduced tensor); 0 for one rank.
double ring_bytes(Collective op, double bytes, int ranks);

// The least-squares line through (bytes sent, seconds) points of at least two sizes, kept physical: a
// negative slope (noise over sizes that barely differ) becomes 0 with the mean as latency, a negative
// latency 0 with the line through the origin.
LinkFit fit_line(const std::vector<std::pair<double, double>>& points);

// The predicted time of `op` over a buffer of `bytes` among `ranks` (0: the rates' own; a subgroup,
// such as hybrid sharding's, at the latency and byte rate measured): 0 for one rank; an Error for an op
// not fitted.
double collective_seconds(const CollectiveRates& rates, Collective op, double bytes, int ranks = 0);

// A link a person gives (--link-bandwidth, --link-latency) for `ranks`: every collective at that latency
// and that many bytes a second sent per rank (a ring's bus bandwidth), beside compute without slowing
// it or being slowed (a GPU's collectives run on their own stream). An Error names a value out of range.
CollectiveRates assumed_link(int ranks, double bytes_per_second, double latency_seconds);

// Times all-gather, reduce-scatter and all-reduce of f32 buffers of 4 KiB to 4 MiB on `comm` (after a
// barrier, the median of 5 calls per size, each rank's median agreed with max, so every rank fits the
// same lines), then 256-row f32 matmuls on the calling thread for 0.1 s while 1 MiB all-gathers run back
// to back, against each alone (the gathers done in the window against those that take it alone), for the
// slowdowns (the ranks' largest): about a second and a quarter on one host. A collective: every rank of
// `comm` calls it.
CollectiveRates measure_collectives(Communicator& comm);

}  // namespace shardlab::dist
