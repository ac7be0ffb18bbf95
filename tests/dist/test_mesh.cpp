// tests/dist/test_mesh.cpp (mpirun): DeviceMesh at every world size of the test runs: every 1-, 2-
// and 3-dimensional shape of the world, each rank's coordinates row-major, each dimension's
// communicator holding exactly the ranks that differ in that coordinate (checked by a naive loop
// over the world's ranks, through an all-gather and an all-reduce on it); and every refusal.
#include <fmt/format.h>

#include <numeric>
#include <string>
#include <vector>

#include "core/error.h"
#include "dist/comm/mesh.h"
#include "tests/dist/world.h"

using namespace shardlab;
using shardlab::test::world;

namespace {

// Every shape of `size` ranks in `dims` dimensions (extents >= 1 whose product is size).
std::vector<std::vector<int>> shapes_of(int size, int dims) {
  if (dims == 1) return {{size}};
  std::vector<std::vector<int>> shapes;
  for (int first = 1; first <= size; ++first) {
    if (size % first != 0) continue;
    for (std::vector<int> rest : shapes_of(size / first, dims - 1)) {
      rest.insert(rest.begin(), first);
      shapes.push_back(rest);
    }
  }
  return shapes;
}

// The row-major coordinates of `rank` in `shape`, by a naive count from the first rank.
std::vector<int> coordinates_of(int rank, const std::vector<int>& shape) {
  std::vector<int> at(shape.size(), 0);
  for (int r = 0; r < rank; ++r) {
    for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
      if (++at[d] < shape[d]) break;
      at[d] = 0;
    }
  }
  return at;
}

}  // namespace

TEST_CASE("DeviceMesh: every shape of the world, each dimension's group the ranks that differ only there",
          "[dist][mesh]") {
  const int size = world().size(), me = world().rank();
  const std::vector<std::string> all_names = {"dp", "tp", "pp"};
  for (int dims = 1; dims <= 3; ++dims) {
    for (const std::vector<int>& shape : shapes_of(size, dims)) {
      const std::vector<std::string> names(all_names.begin(), all_names.begin() + dims);
      dist::DeviceMesh mesh(world(), shape, names);
      INFO("mesh " << mesh.str());
      CHECK(mesh.ndim() == dims);
      const std::vector<int> mine = coordinates_of(me, shape);
      for (int d = 0; d < dims; ++d) {
        const std::string& name = names[d];
        dist::Communicator& group = mesh[name];
        CHECK(group.name() == name);
        CHECK(group.size() == shape[d]);
        CHECK(mesh.size(name) == shape[d]);
        CHECK(group.rank() == mine[d]);
        CHECK(mesh.coordinate(name) == mine[d]);
        // The world ranks of the group, in its rank order: every rank whose other coordinates are mine.
        std::vector<double> expected;
        for (int r = 0; r < size; ++r) {
          std::vector<int> theirs = coordinates_of(r, shape);
          theirs[d] = mine[d];
          if (theirs == mine) expected.push_back(r);
        }
        const Tensor gathered = zeros({group.size()}, dtype(DType::f64));
        group.all_gather_into(gathered, full({1}, static_cast<double>(me), dtype(DType::f64)), "mesh ranks")
            .wait();
        CHECK(gathered.to_vector<double>() == expected);
        const Tensor total = full({1}, static_cast<double>(me), dtype(DType::f64));
        group.all_reduce(total, dist::ReduceOp::sum, "mesh sum").wait();
        CHECK(total.item<double>() == std::accumulate(expected.begin(), expected.end(), 0.0));
      }
    }
  }
}

TEST_CASE("DeviceMesh refuses a layout that does not fit the world, naming what is wrong", "[dist][mesh]") {
  const int size = world().size();
  CHECK_THROWS_ERROR(dist::DeviceMesh(world(), {size + 1}, {"dp"}),
                     fmt::format("DeviceMesh: dp={} holds {} ranks, but '{}' has {}", size + 1, size + 1,
                                 world().name(), size));
  CHECK_THROWS_ERROR(dist::DeviceMesh(world(), {size, 1}, {"dp"}),
                     "DeviceMesh: 1 names for a shape of 2 dimensions");
  CHECK_THROWS_ERROR(dist::DeviceMesh(world(), {size, 1}, {"dp", "dp"}),
                     "DeviceMesh: the name 'dp' is given twice");
  CHECK_THROWS_ERROR(dist::DeviceMesh(world(), {size, 0}, {"dp", "tp"}),
                     "DeviceMesh: dimension 'tp' has extent 0 (must be at least 1)");
  CHECK_THROWS_ERROR(dist::DeviceMesh(world(), {size, 1}, {"dp", ""}),
                     "DeviceMesh: dimension 1 has an empty name");
  CHECK_THROWS_ERROR(dist::DeviceMesh(world(), {}, {}), "DeviceMesh: the shape has no dimension");
  const dist::DeviceMesh mesh(world(), {1, size}, {"dp", "tp"});
  CHECK_THROWS_ERROR(mesh["pp"],
                     fmt::format("DeviceMesh dp=1 x tp={}: no dimension 'pp' (it has dp, tp)", size));
  CHECK(mesh.str() == fmt::format("dp=1 x tp={}", size));
}
