// dist/comm/collective.h: the vocabulary of collectives: their kinds, reductions, the fingerprint
// every rank must agree on, and the bytes each one moves.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "core/dtype.h"

namespace shardlab::dist {

enum class Collective : std::uint8_t { all_gather, reduce_scatter, all_reduce, broadcast, barrier };
inline constexpr int kNumCollectives = 5;

enum class ReduceOp : std::uint8_t { sum, avg, max };

std::string_view collective_name(Collective op);  // "all_gather", ...
std::string_view reduce_op_name(ReduceOp op);     // "sum", "avg", "max"

// What one collective call is. All ranks of a communicator must issue the same fingerprints
// in the same order; the ledger records them and debug mode compares them across ranks.
struct Fingerprint {
  Collective op = Collective::barrier;
  DType dtype = DType::u8;
  // Elements of the full buffer: all_gather's output, reduce_scatter's input, otherwise the
  // tensor itself (0 for barrier). The same number on every rank.
  std::int64_t count = 0;
  ReduceOp reduce = ReduceOp::sum;  // reduce_scatter and all_reduce only
  int root = 0;                     // broadcast only
  std::string tag;                  // the caller's label, e.g. an FSDP unit name

  bool operator==(const Fingerprint&) const = default;
};

// "all_gather(f32, 2048)", with " 'tag'" appended when there is one.
std::string describe(const Fingerprint& fingerprint);
// describe() plus the reduction or root: "all_reduce(f32, 8, avg)", "broadcast(i64, 3, root 1)".
std::string describe_in_detail(const Fingerprint& fingerprint);

// Calls and bytes one rank sent and received.
struct Traffic {
  std::int64_t calls = 0;
  std::int64_t bytes_sent = 0;
  std::int64_t bytes_received = 0;

  Traffic& operator+=(const Traffic& other);
  bool operator==(const Traffic&) const = default;
};

// The bytes rank `rank` of `world_size` must move for one call, with bandwidth-optimal
// algorithms (what NCCL's rings reach and FSDP's communication budget counts):
// - all_gather / reduce_scatter of a full buffer of B bytes: each rank sends and receives the
//   W-1 shards it does not own, (W-1) * B / W;
// - all_reduce: a reduce-scatter then an all-gather, 2 * (W-1) * B / W (rounded down when B
//   does not divide by W);
// - broadcast: the root sends B, every other rank receives B;
// - barrier: nothing.
Traffic traffic_of(const Fingerprint& fingerprint, int rank, int world_size);

// Per-kind totals since the last reset, readable by tests and by FSDP's plan and trace.
struct CollectiveCounters {
  std::array<Traffic, kNumCollectives> by_kind{};

  const Traffic& operator[](Collective op) const { return by_kind[static_cast<int>(op)]; }
  Traffic& operator[](Collective op) { return by_kind[static_cast<int>(op)]; }
  Traffic total() const;
};

}  // namespace shardlab::dist
