// dist/comm/mesh.h: a device mesh, the ranks of a communicator laid out as an N-dimensional grid
// with named dimensions ({"dp", "tp"}), and one communicator per dimension: the ranks that differ
// in that coordinate only. What 2-D parallelism runs on: tensor parallelism inside a "tp" group,
// FSDP across the "dp" one, as PyTorch's DeviceMesh.
//
//   dist::DeviceMesh mesh(session->world(), {2, 2}, {"dp", "tp"});  // 4 ranks: rank = 2 * dp + tp
//   dist::Communicator& tp = mesh["tp"];                              // {0, 1} or {2, 3}
//   dist::fully_shard(block, {.communicator = &mesh["dp"]});         // {0, 2} or {1, 3}
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "dist/comm/communicator.h"

namespace shardlab::dist {

class DeviceMesh {
 public:
  // Rank r of `world` sits at the row-major coordinates of r in `shape` (the last dimension
  // varies fastest, so its groups are consecutive ranks: on one machine each, as tensor
  // parallelism wants). Makes each dimension's communicator, named after the dimension, with one
  // split of `world` per dimension: a collective, which every rank calls with the same arguments.
  // The shape's product must be world.size(), every extent at least 1, names unique and one each.
  DeviceMesh(Communicator& world, std::vector<int> shape, std::vector<std::string> names);
  ~DeviceMesh();
  DeviceMesh(const DeviceMesh&) = delete;
  DeviceMesh& operator=(const DeviceMesh&) = delete;

  int ndim() const { return static_cast<int>(shape_.size()); }
  const std::vector<int>& shape() const { return shape_; }
  const std::vector<std::string>& names() const { return names_; }
  // The dimension named `name`, or an Error listing the mesh's names.
  int dim(std::string_view name) const;
  int size(std::string_view name) const { return shape_[dim(name)]; }
  // This rank's coordinate along `name`, its rank in that dimension's communicator.
  int coordinate(std::string_view name) const { return coordinates_[dim(name)]; }
  // The communicator of this rank's group along `name`.
  Communicator& operator[](std::string_view name) const { return *groups_[dim(name)]; }
  Communicator& world() const { return *world_; }
  // "dp=2 x tp=2".
  std::string str() const;

 private:
  Communicator* world_;
  std::vector<int> shape_;
  std::vector<std::string> names_;
  std::vector<int> coordinates_;
  std::vector<std::unique_ptr<Communicator>> groups_;
};

}  // namespace shardlab::dist
