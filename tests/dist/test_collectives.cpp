// tests/dist/test_collectives.cpp (mpirun): every collective, dtype and reduction on exact rank
// patterns, counts that do not divide by the world size, empty and multi-megabyte buffers,
// byte counters, sub-communicators and the argument errors.
#include <algorithm>
#include <climits>
#include <cstdlib>
#include <memory>
#include <string>

#include "dist/comm/communicator.h"
#include "dist/comm/monitor.h"
#include "dist/comm/mpi_backend.h"
#include "dist/comm/mpi_support.h"
#include "tests/dist/world.h"
#include "tests/thread_bindings.h"

using namespace shardlab;
using dist::Collective;
using Reduce = dist::ReduceOp;
using test::pattern;
using test::world;
using test::wrong_on_any_rank;

namespace {

const std::vector<DType> kDTypes = {DType::f32, DType::f64, DType::bf16, DType::f16,
                                    DType::i64, DType::i32, DType::u8};
// Elements per rank: empty, one, prime (never a multiple of the world size), ~1 MiB of f32.
const std::vector<std::int64_t> kCounts = {0, 1, 7, 262147};
// What the staging tests use: every case of the copies (empty, one element, a prime count) without
// the multi-megabyte buffers, which add time and nothing a buffer of 1000 does not show.
const std::vector<std::int64_t> kSmallCounts = {0, 1, 7, 1000};

// Rank r contributes W * (i % 5) + 2r to element i, so over W ranks the sum is
// W^2 (i % 5) + W (W - 1), the average W (i % 5) + (W - 1) and the maximum W (i % 5) + 2 (W - 1):
// integers below 256, exact in every dtype, and the average divides exactly.
double contribution(int rank, int world_size, std::int64_t i) { return world_size * (i % 5) + 2.0 * rank; }

double reduced(Reduce op, int world_size, std::int64_t i) {
  const double w = world_size, base = i % 5;
  switch (op) {
    case Reduce::sum:
      return w * w * base + w * (w - 1);
    case Reduce::avg:
      return w * base + (w - 1);
    case Reduce::max:
      return w * base + 2 * (w - 1);
  }
  return 0;
}

void check_all_gather(dist::Communicator& comm, Device device,
                      const std::vector<std::int64_t>& counts = kCounts) {
  const int r = comm.rank(), w = comm.size();
  for (const DType type : kDTypes) {
    for (const std::int64_t n : counts) {
      INFO(comm.name() << " " << device.str() << " " << dtype_name(type) << " x " << n << " per rank");
      const auto value = [](int rank, std::int64_t i) { return static_cast<double>((rank * 7 + i) % 97); };
      const Tensor input = pattern(type, n, [&](std::int64_t i) { return value(r, i); }).to(device);
      const Tensor output = full({w * n}, 255, dtype(type).with_device(device));
      comm.all_gather_into(output, input).wait();
      CHECK(wrong_on_any_rank(output,
                              [&](std::int64_t j) { return value(static_cast<int>(j / n), j % n); }) == 0);
    }
  }
}

void check_all_gather_in_place(dist::Communicator& comm, Device device) {
  const int r = comm.rank(), w = comm.size();
  // 1000 elements: a buffer of one slot where the whole output belongs overflows by far more than
  // the CPU allocator's 64-byte rounding, at any world size above 1.
  for (const std::int64_t n : {std::int64_t{5}, std::int64_t{1000}}) {
    INFO(comm.name() << " " << device.str() << " " << n << " per rank");
    const Tensor output = full({w * n}, -1, dtype(DType::f32).with_device(device));
    const Tensor slot = output.narrow(0, r * n, n);
    slot.copy_(pattern(DType::f32, n, [&](std::int64_t i) { return 10.0 * r + i; }).to(device));
    comm.all_gather_into(output, slot).wait();
    CHECK(wrong_on_any_rank(output, [&](std::int64_t j) { return 10.0 * (j / n) + j % n; }) == 0);
  }
}

void check_reduce_scatter(dist::Communicator& comm, Device device,
                          const std::vector<std::int64_t>& counts = kCounts) {
  const int r = comm.rank(), w = comm.size();
  for (const Reduce op : {Reduce::sum, Reduce::avg, Reduce::max}) {
    for (const DType type : kDTypes) {
      for (const std::int64_t n : counts) {
        INFO(comm.name() << " " << device.str() << " " << dist::reduce_op_name(op) << " " << dtype_name(type)
                         << " x " << n << " per rank");
        const Tensor input =
            pattern(type, w * n, [&](std::int64_t i) { return contribution(r, w, i); }).to(device);
        const Tensor output = full({n}, 255, dtype(type).with_device(device));
        comm.reduce_scatter(output, input, op).wait();
        CHECK(wrong_on_any_rank(output, [&](std::int64_t i) { return reduced(op, w, r * n + i); }) == 0);
      }
    }
  }
}

void check_all_reduce(dist::Communicator& comm, Device device,
                      const std::vector<std::int64_t>& counts = {0, 1, 7, std::int64_t{1} << 20}) {
  const int r = comm.rank(), w = comm.size();
  for (const Reduce op : {Reduce::sum, Reduce::avg, Reduce::max}) {
    for (const DType type : kDTypes) {
      for (const std::int64_t n : counts) {
        INFO(comm.name() << " " << device.str() << " " << dist::reduce_op_name(op) << " " << dtype_name(type)
                         << " x " << n);
        const Tensor tensor =
            pattern(type, n, [&](std::int64_t i) { return contribution(r, w, i); }).to(device);
        comm.all_reduce(tensor, op).wait();
        CHECK(wrong_on_any_rank(tensor, [&](std::int64_t i) { return reduced(op, w, i); }) == 0);
      }
    }
  }
}

void check_broadcast(dist::Communicator& comm, Device device,
                     const std::vector<std::int64_t>& counts = {0, 7, std::int64_t{1} << 20}) {
  for (int root = 0; root < comm.size(); ++root) {
    for (const DType type : kDTypes) {
      for (const std::int64_t n : counts) {
        INFO(comm.name() << " " << device.str() << " root " << root << " " << dtype_name(type) << " x " << n);
        const auto value = [&](std::int64_t i) { return static_cast<double>((root * 11 + i) % 101); };
        const Tensor tensor = comm.rank() == root ? pattern(type, n, value).to(device)
                                                  : full({n}, 255, dtype(type).with_device(device));
        comm.broadcast(tensor, root).wait();
        CHECK(wrong_on_any_rank(tensor, value) == 0);
      }
    }
  }
}

void check_every_collective(dist::Communicator& comm, Device device) {
  check_all_gather(comm, device);
  check_all_gather_in_place(comm, device);
  check_reduce_scatter(comm, device);
  check_all_reduce(comm, device);
  check_broadcast(comm, device);
}

}  // namespace

TEST_CASE("all_gather_into concatenates the ranks' inputs in rank order", "[dist][collectives]") {
  check_all_gather(world(), Device::cpu());
}

TEST_CASE("all_gather_into in place: the input is this rank's slot of the output", "[dist][collectives]") {
  check_all_gather_in_place(world(), Device::cpu());
}

TEST_CASE("reduce_scatter sums, averages and maximises, each rank keeping its slot", "[dist][collectives]") {
  check_reduce_scatter(world(), Device::cpu());
}

TEST_CASE("all_reduce sums, averages and maximises in place", "[dist][collectives]") {
  check_all_reduce(world(), Device::cpu());
}

TEST_CASE("broadcast copies the root's tensor to every rank, from every root", "[dist][collectives]") {
  check_broadcast(world(), Device::cpu());
}

TEST_CASE("the MPI backend's host staging (what CUDA tensors take), run with CPU tensors",
          "[dist][collectives]") {
  // Copies of CPU tensors through the very staging CUDA tensors take, so that the sanitizer build
  // checks its buffers (an in-place all-gather's above all) where there is no GPU.
  const auto monitor = std::make_shared<dist::Monitor>(dist::MonitorOptions{.rank = world().rank()});
  const dist::MpiComm comm = dist::MpiComm::duplicate(MPI_COMM_WORLD);
  dist::Communicator staged("staged", dist::MpiComm::duplicate(MPI_COMM_WORLD),
                            dist::make_mpi_backend(comm, monitor, dist::MpiStaging::every_tensor), monitor,
                            /*debug=*/false);
  check_all_gather(staged, Device::cpu(), kSmallCounts);
  check_all_gather_in_place(staged, Device::cpu());
  check_reduce_scatter(staged, Device::cpu(), kSmallCounts);
  check_all_reduce(staged, Device::cpu(), kSmallCounts);
  check_broadcast(staged, Device::cpu(), kSmallCounts);
}

TEST_CASE("the MPI backend's communication thread makes the rank's device current first",
          "[dist][collectives]") {
  const test::ThreadBindings bindings;
  {
    const auto monitor = std::make_shared<dist::Monitor>(
        dist::MonitorOptions{.rank = world().rank(), .device = Device::cuda(6)});
    const auto backend = dist::make_mpi_backend(dist::MpiComm::duplicate(MPI_COMM_WORLD), monitor);
  }
  // The monitor's two threads and the backend's worker, all on the rank's device.
  CHECK(bindings.by_other_threads() == std::vector<Device>(3, Device::cuda(6)));
}

TEST_CASE(
    "CUDA tensors: the session's world (NCCL when each rank has a GPU) and MPI staging through the host",
    "[dist][collectives][cuda]") {
  dist::Session& session = dist::session();
  const Device gpu = session.device().is_cuda() ? session.device() : Device::cuda(0);
  check_every_collective(session.world(), gpu);
  if (&session.cpu_world() != &session.world()) check_every_collective(session.cpu_world(), gpu);
}

TEST_CASE("integer reductions run in pieces give every element its own exact sum and maximum",
          "[dist][collectives]") {
  // Integers reduce in pieces of a few KiB per rank: 300001 i64 per rank (many pieces, the last one
  // short) whose every element is distinct, larger than a double holds exactly, so that a slice taken
  // from the wrong place or rank shows.
  auto& comm = world();
  const int r = comm.rank(), w = comm.size();
  const std::int64_t n = 300001;
  const auto value = [](int rank, std::int64_t i) {
    return (std::int64_t{1} << 54) + i * 1000003 + rank * 7919;
  };
  std::vector<std::int64_t> mine(static_cast<std::size_t>(w * n));
  for (std::int64_t i = 0; i < w * n; ++i) mine[static_cast<std::size_t>(i)] = value(r, i);
  const auto expected = [&](std::int64_t i, Reduce op) {
    std::int64_t total = 0;
    for (int rank = 0; rank < w; ++rank)
      total = op == Reduce::max ? std::max(total, value(rank, i)) : total + value(rank, i);
    return total;
  };
  for (const Reduce op : {Reduce::sum, Reduce::max}) {
    INFO(dist::reduce_op_name(op));
    const Tensor output = empty({n}, dtype(DType::i64));
    comm.reduce_scatter(output, from_vector(mine, {w * n}), op).wait();
    const Tensor reduced = from_vector(mine, {w * n});
    comm.all_reduce(reduced, op).wait();
    const std::vector<std::int64_t> scattered = output.to_vector<std::int64_t>(),
                                    all = reduced.to_vector<std::int64_t>();
    std::int64_t wrong = 0;
    for (std::int64_t i = 0; i < n; ++i)
      wrong += scattered[static_cast<std::size_t>(i)] != expected(r * n + i, op);
    for (std::int64_t i = 0; i < w * n; ++i) wrong += all[static_cast<std::size_t>(i)] != expected(i, op);
    CHECK(test::sum_over_ranks(wrong) == 0);
  }
}

TEST_CASE("all_reduce avg truncates integer averages as NCCL does", "[dist][collectives]") {
  auto& comm = world();
  const int w = comm.size();
  // Every rank contributes 1: the sum is w; with one more on rank 0 it is w + 1, and
  // (w + 1) / w truncates to 1 for w > 1 (2 for w = 1).
  const Tensor tensor = full({3}, comm.rank() == 0 ? 2 : 1, dtype(DType::i32));
  comm.all_reduce(tensor, Reduce::avg).wait();
  CHECK(wrong_on_any_rank(tensor, [&](std::int64_t) { return static_cast<double>((w + 1) / w); }) == 0);
}

TEST_CASE("all_reduce max propagates a NaN from any rank", "[dist][collectives]") {
  auto& comm = world();
  const int last = comm.size() - 1;
  for (const DType type : {DType::f32, DType::bf16, DType::f16}) {
    INFO(dtype_name(type));
    const Tensor tensor = full({2}, comm.rank(), dtype(type));
    if (comm.rank() == last) tensor.narrow(0, 1, 1).fill_(std::nan(""));
    comm.all_reduce(tensor, Reduce::max).wait();
    const std::vector<double> got = tensor.to_vector<double>();
    CHECK(test::sum_over_ranks(got[0] == last && std::isnan(got[1]) ? 0 : 1) == 0);
  }
}

TEST_CASE("collectives ignore shapes: a [2, 3] tensor is six elements", "[dist][collectives]") {
  auto& comm = world();
  const Tensor tensor = pattern(DType::f32, 6, [&](std::int64_t i) {
                          return contribution(comm.rank(), comm.size(), i);
                        }).view({2, 3});
  comm.all_reduce(tensor).wait();
  CHECK(tensor.shape() == Shape{2, 3});
  CHECK(wrong_on_any_rank(tensor.view({6}),
                          [&](std::int64_t i) { return reduced(Reduce::sum, comm.size(), i); }) == 0);
}

TEST_CASE("counters hold the calls and bytes each collective must move", "[dist][counters]") {
  auto& comm = world();
  const int r = comm.rank(), w = comm.size();
  const std::int64_t n = 12, f32 = 4, f16 = 2;  // elements per rank's shard, bytes per element
  comm.reset_counters();
  CHECK(comm.counters().total() == dist::Traffic{});

  comm.all_gather_into(empty({w * n}), empty({n})).wait();
  comm.all_gather_into(empty({w * n}, dtype(DType::f16)), empty({n}, dtype(DType::f16))).wait();
  comm.reduce_scatter(empty({n}), zeros({w * n})).wait();
  comm.all_reduce(zeros({w * n})).wait();
  comm.broadcast(zeros({n}), w - 1).wait();
  comm.barrier().wait();

  const dist::CollectiveCounters counters = comm.counters();
  // A ring all-gather: each rank receives the w - 1 shards it lacks and sends its own w - 1 times.
  const std::int64_t gather = (w - 1) * n * (f32 + f16);
  CHECK(counters[Collective::all_gather] == dist::Traffic{2, gather, gather});
  CHECK(counters[Collective::reduce_scatter] == dist::Traffic{1, (w - 1) * n * f32, (w - 1) * n * f32});
  // All-reduce = reduce-scatter + all-gather of the same buffer.
  CHECK(counters[Collective::all_reduce] == dist::Traffic{1, 2 * (w - 1) * n * f32, 2 * (w - 1) * n * f32});
  const std::int64_t root_sends = (r == w - 1 && w > 1) ? n * f32 : 0;
  const std::int64_t others_receive = (r != w - 1) ? n * f32 : 0;
  CHECK(counters[Collective::broadcast] == dist::Traffic{1, root_sends, others_receive});
  CHECK(counters[Collective::barrier] == dist::Traffic{1, 0, 0});
  CHECK(counters.total().calls == 6);
  comm.reset_counters();
  CHECK(comm.counters().total() == dist::Traffic{});
}

TEST_CASE("split makes sub-communicators by color, ranked by key", "[dist][split]") {
  auto& comm = world();
  const int r = comm.rank(), w = comm.size();
  // Hybrid sharding's groups: shard groups of 2 consecutive ranks, replica groups across them.
  auto shard_group = comm.split(r / 2, r, "shard");
  auto replica_group = comm.split(r % 2, -r);  // key -r: reversed order
  CHECK(shard_group->name() == "shard");
  CHECK(replica_group->name() == fmt::format("{}/{}", comm.name(), r % 2));
  const int shard_size = std::min(2, w - (r / 2) * 2);
  const int replica_size = (w - r % 2 + 1) / 2;
  CHECK(test::sum_over_ranks(shard_group->size() == shard_size && shard_group->rank() == r % 2 ? 0 : 1) == 0);
  CHECK(test::sum_over_ranks(replica_group->size() == replica_size &&
                                     replica_group->rank() == replica_size - 1 - r / 2
                                 ? 0
                                 : 1) == 0);
  // Sums stay inside each group: the shard group of rank r holds ranks 2(r/2) and 2(r/2)+1.
  const Tensor mine = full({3}, r + 1, dtype(DType::i64));
  shard_group->all_reduce(mine).wait();
  double expected = 0;
  for (int other = (r / 2) * 2; other < (r / 2) * 2 + shard_size; ++other) expected += other + 1;
  CHECK(wrong_on_any_rank(mine, [&](std::int64_t) { return expected; }) == 0);
  // Counters and sequence numbers are per communicator.
  CHECK(shard_group->counters().total().calls == 1);
  CHECK(shard_group->monitor().tail(1).at(0).communicator == "shard");
  CHECK(shard_group->monitor().tail(1).at(0).sequence == 1);
}

TEST_CASE("collectives refuse bad arguments with the op, the sizes and what was expected",
          "[dist][collectives][errors]") {
  auto& comm = world();
  const int w = comm.size(), r = comm.rank();
  CHECK_THROWS_ERROR(
      comm.all_gather_into(empty({3 * w + 1}), empty({3})),
      fmt::format("all_gather_into: output has {} elements but {} ranks x 3 input elements = {}", 3 * w + 1,
                  w, 3 * w));
  CHECK_THROWS_ERROR(comm.all_gather_into(empty({3 * w}, dtype(DType::f64)), empty({3})),
                     "all_gather_into: output dtype f64 differs from input dtype f32");
  CHECK_THROWS_ERROR(comm.all_gather_into(empty({3 * w}), Tensor()),
                     "all_gather_into: the input is undefined");
  CHECK_THROWS_ERROR(
      comm.all_gather_into(empty({2 * w, 3}).transpose(0, 1), empty({2 * w})),
      fmt::format("all_gather_into: the output must be contiguous (shape [3, {}], strides [1, 3])", 2 * w));
  CHECK_THROWS_ERROR(
      comm.all_reduce(empty({4}, dtype(DType::boolean))),
      "all_reduce: dtype bool is not supported by collectives (f32, f64, bf16, f16, i64, i32, u8 are)");
  const Tensor buffer = zeros({4 * w});
  const int other_slot = (r + 1) % w;
  if (w > 1) {
    CHECK_THROWS_ERROR(
        comm.all_gather_into(buffer, buffer.narrow(0, other_slot * 4, 4)),
        fmt::format("all_gather_into: the input overlaps the output other than as this rank's slot {} "
                    "(elements [{}, {}))",
                    r, 4 * r, 4 * r + 4));
  }
  CHECK_THROWS_ERROR(
      comm.reduce_scatter(empty({3}), empty({3 * w + 2})),
      fmt::format("reduce_scatter: input has {} elements but {} ranks x 3 output elements = {} (pad "
                  "the buffer to a multiple of the world size)",
                  3 * w + 2, w, 3 * w));
  CHECK_THROWS_ERROR(comm.reduce_scatter(buffer.narrow(0, 0, 4), buffer),
                     "reduce_scatter: output and input overlap");
  CHECK_THROWS_ERROR(
      comm.broadcast(empty({2}), w),
      fmt::format("broadcast: root {} is not a rank of communicator '{}' (size {})", w, comm.name(), w));
  CHECK_THROWS_ERROR(
      comm.broadcast(empty({2}), -1),
      fmt::format("broadcast: root -1 is not a rank of communicator '{}' (size {})", comm.name(), w));
  CHECK_THROWS_ERROR(comm.split(-1, 0), "Communicator::split: color must be >= 0, got -1");
  // More elements than MPI's int count: refused before anything is sent (the bytes are never touched).
  const Tensor huge = empty({std::int64_t{INT_MAX} + 1}, dtype(DType::u8));
  CHECK_THROWS_ERROR(comm.all_reduce(huge),
                     "all_reduce: 2147483648 elements exceed MPI's count limit of 2147483647");
  // The communicator is still in step on every rank afterwards.
  const Tensor ones_tensor = ones({1});
  comm.all_reduce(ones_tensor).wait();
  CHECK(ones_tensor.item<float>() == static_cast<float>(w));
}

TEST_CASE("dist::init asks Open MPI to yield while a collective waits, keeping a value already set",
          "[dist][collectives]") {
  const char* name = "OMPI_MCA_mpi_yield_when_idle";
  const char* before = std::getenv(name);
  const std::string saved = before == nullptr ? "" : before;
  unsetenv(name);
  dist::prefer_yielding_waits();
  REQUIRE(std::getenv(name) != nullptr);
  CHECK(std::string(std::getenv(name)) == "1");
  setenv(name, "0", 1);
  dist::prefer_yielding_waits();
  CHECK(std::string(std::getenv(name)) == "0");
  if (before == nullptr) {
    unsetenv(name);
  } else {
    setenv(name, saved.c_str(), 1);
  }
}
