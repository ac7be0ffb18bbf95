// apps/support/ranks.cpp: sums over ranks, rank 0's work and text, output path checks.
#include "apps/support/ranks.h"

#include <cstring>

#include "apps/cli.h"
#include "core/error.h"
#include "core/tensor.h"

namespace shardlab::apps {

std::vector<double> sum_over_ranks(dist::Communicator& comm, const std::vector<double>& values,
                                   const std::string& tag) {
  const Tensor total = from_vector(values);
  comm.all_reduce(total, dist::ReduceOp::sum, tag).wait();
  return total.to_vector<double>();
}

void on_rank_zero(dist::Communicator& comm, std::string_view what, const std::function<void()>& work) {
  std::string error;
  if (comm.rank() == 0) {
    try {
      work();
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  const bool failed = sum_over_ranks(comm, {error.empty() ? 0.0 : 1.0})[0] > 0;
  if (!failed) return;
  if (comm.rank() == 0) throw Error(error);
  fail("{} failed on rank 0", what);
}

void check_output_path(dist::Communicator& comm, std::string_view option, const std::string& path,
                       bool is_directory) {
  on_rank_zero(comm, fmt::format("checking {}", option),
               [&] { check_writable_path(option, path, is_directory); });
}

std::string broadcast_text(dist::Communicator& comm, const std::string& text) {
  const Tensor size = from_vector(std::vector<std::int64_t>{static_cast<std::int64_t>(text.size())});
  comm.broadcast(size, 0, "training").wait();
  const Tensor bytes = empty({size.to_vector<std::int64_t>()[0]}, TensorOptions{.dtype = DType::u8});
  if (comm.rank() == 0) std::memcpy(bytes.data<std::uint8_t>(), text.data(), text.size());
  comm.broadcast(bytes, 0, "training").wait();
  return {reinterpret_cast<const char*>(bytes.data<std::uint8_t>()), static_cast<std::size_t>(bytes.numel())};
}

std::string rank_shares(std::int64_t global_batch, int world_size, std::int64_t chunk) {
  // Ranks 0..larger-1 hold one row (or chunk) more.
  const std::int64_t unit = chunk > 0 ? chunk : 1, units = global_batch / unit;
  const std::int64_t larger = units % world_size, base = units / world_size * unit;
  const std::string chunks = chunk > 0 ? fmt::format("in chunks of {}, ", chunk) : "";
  if (larger == 0) return fmt::format("{}{} per rank", chunks, base);
  const auto ranks = [](std::int64_t first, std::int64_t last) {
    return first == last ? fmt::format("rank {}", first) : fmt::format("ranks {}-{}", first, last);
  };
  return fmt::format("{}{} on {}, {} on {}", chunks, base + unit, ranks(0, larger - 1), base,
                     ranks(larger, world_size - 1));
}

}  // namespace shardlab::apps
