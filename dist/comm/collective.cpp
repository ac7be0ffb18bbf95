// dist/comm/collective.cpp: names, descriptions and byte counts of collectives.
#include "dist/comm/collective.h"

#include <fmt/format.h>

namespace shardlab::dist {

std::string_view collective_name(Collective op) {
  switch (op) {
    case Collective::all_gather:
      return "all_gather";
    case Collective::reduce_scatter:
      return "reduce_scatter";
    case Collective::all_reduce:
      return "all_reduce";
    case Collective::broadcast:
      return "broadcast";
    case Collective::barrier:
      return "barrier";
  }
  return "unknown collective";
}

std::string_view reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return "sum";
    case ReduceOp::avg:
      return "avg";
    case ReduceOp::max:
      return "max";
  }
  return "unknown reduction";
}

namespace {

std::string with_tag(std::string text, const std::string& tag) {
  return tag.empty() ? text : fmt::format("{} '{}'", text, tag);
}

}  // namespace

std::string describe(const Fingerprint& fingerprint) {
  if (fingerprint.op == Collective::barrier) return with_tag("barrier()", fingerprint.tag);
  return with_tag(fmt::format("{}({}, {})", collective_name(fingerprint.op), dtype_name(fingerprint.dtype),
                              fingerprint.count),
                  fingerprint.tag);
}

std::string describe_in_detail(const Fingerprint& fingerprint) {
  std::string detail;
  switch (fingerprint.op) {
    case Collective::reduce_scatter:
    case Collective::all_reduce:
      detail = fmt::format(", {}", reduce_op_name(fingerprint.reduce));
      break;
    case Collective::broadcast:
      detail = fmt::format(", root {}", fingerprint.root);
      break;
    case Collective::all_gather:
    case Collective::barrier:
      return describe(fingerprint);
  }
  return with_tag(fmt::format("{}({}, {}{})", collective_name(fingerprint.op), dtype_name(fingerprint.dtype),
                              fingerprint.count, detail),
                  fingerprint.tag);
}

Traffic& Traffic::operator+=(const Traffic& other) {
  calls += other.calls;
  bytes_sent += other.bytes_sent;
  bytes_received += other.bytes_received;
  return *this;
}

Traffic traffic_of(const Fingerprint& fingerprint, int rank, int world_size) {
  const std::int64_t bytes = fingerprint.count * static_cast<std::int64_t>(dtype_size(fingerprint.dtype));
  const std::int64_t others = world_size - 1;
  Traffic traffic{.calls = 1};
  switch (fingerprint.op) {
    case Collective::all_gather:
    case Collective::reduce_scatter:
      traffic.bytes_sent = traffic.bytes_received = others * bytes / world_size;
      break;
    case Collective::all_reduce:
      traffic.bytes_sent = traffic.bytes_received = 2 * others * bytes / world_size;
      break;
    case Collective::broadcast:
      if (world_size == 1) break;
      (rank == fingerprint.root ? traffic.bytes_sent : traffic.bytes_received) = bytes;
      break;
    case Collective::barrier:
      break;
  }
  return traffic;
}

Traffic CollectiveCounters::total() const {
  Traffic sum;
  for (const Traffic& traffic : by_kind) sum += traffic;
  return sum;
}

}  // namespace shardlab::dist
