// dist/comm/mesh.cpp: DeviceMesh's layout and its per-dimension communicators (dist/comm/mesh.h).
#include "dist/comm/mesh.h"

#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <numeric>
#include <set>

#include "core/error.h"

namespace shardlab::dist {

namespace {

std::string shape_text(const std::vector<int>& shape, const std::vector<std::string>& names) {
  std::vector<std::string> parts;
  for (std::size_t d = 0; d < shape.size(); ++d)
    parts.push_back(fmt::format("{}={}", d < names.size() ? names[d] : "?", shape[d]));
  return fmt::format("{}", fmt::join(parts, " x "));
}

void check_layout(const Communicator& world, const std::vector<int>& shape,
                  const std::vector<std::string>& names) {
  SHARDLAB_CHECK(!shape.empty(), "DeviceMesh: the shape has no dimension");
  SHARDLAB_CHECK(names.size() == shape.size(), "DeviceMesh: {} names for a shape of {} dimensions",
                 names.size(), shape.size());
  std::set<std::string> seen;
  for (std::size_t d = 0; d < shape.size(); ++d) {
    SHARDLAB_CHECK(!names[d].empty(), "DeviceMesh: dimension {} has an empty name", d);
    SHARDLAB_CHECK(seen.insert(names[d]).second, "DeviceMesh: the name '{}' is given twice", names[d]);
    SHARDLAB_CHECK(shape[d] >= 1, "DeviceMesh: dimension '{}' has extent {} (must be at least 1)", names[d],
                   shape[d]);
  }
  const long long ranks = std::accumulate(shape.begin(), shape.end(), 1LL, std::multiplies<>());
  SHARDLAB_CHECK(ranks == world.size(), "DeviceMesh: {} holds {} ranks, but '{}' has {}",
                 shape_text(shape, names), ranks, world.name(), world.size());
}

}  // namespace

DeviceMesh::DeviceMesh(Communicator& world, std::vector<int> shape, std::vector<std::string> names)
    : world_(&world), shape_(std::move(shape)), names_(std::move(names)) {
  check_layout(world, shape_, names_);
  // Row-major coordinates of this rank: the last dimension varies fastest.
  coordinates_.assign(shape_.size(), 0);
  for (int d = ndim() - 1, rest = world.rank(); d >= 0; --d) {
    coordinates_[d] = rest % shape_[d];
    rest /= shape_[d];
  }
  for (int d = 0; d < ndim(); ++d) {
    // The group: the ranks whose other coordinates are this rank's, ranked by their coordinate here.
    int color = 0;
    for (int other = 0; other < ndim(); ++other) {
      if (other != d) color = color * shape_[other] + coordinates_[other];
    }
    groups_.push_back(world.split(color, coordinates_[d], names_[d]));
  }
}

DeviceMesh::~DeviceMesh() = default;

int DeviceMesh::dim(std::string_view name) const {
  const auto it = std::find(names_.begin(), names_.end(), name);
  SHARDLAB_CHECK(it != names_.end(), "DeviceMesh {}: no dimension '{}' (it has {})", str(), name,
                 fmt::join(names_, ", "));
  return static_cast<int>(it - names_.begin());
}

std::string DeviceMesh::str() const { return shape_text(shape_, names_); }

}  // namespace shardlab::dist
