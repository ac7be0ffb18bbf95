// dist/comm/communicator.h: Communicator, the collectives over a group of ranks on Tensors.
//
//   dist::Communicator& world = session->world();
//   Tensor full = empty({world.size() * shard.numel()}, dtype(DType::f32));
//   dist::Work gathered = world.all_gather_into(full, shard, "layers.0");  // returns at once
//   ... compute ...
//   gathered.wait();
//   world.reduce_scatter(grad_shard, full_grad, dist::ReduceOp::avg).wait();
//
// Every rank of the communicator must issue the same collectives in the same order. Each
// call is recorded in the ledger (dist/comm/monitor.h) with its sequence number; in debug mode
// the ranks compare fingerprints before every collective and a mismatch raises an Error on
// all of them instead of hanging.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>

#include "core/tensor.h"
#include "dist/comm/collective.h"
#include "dist/comm/monitor.h"
#include "dist/comm/work.h"

namespace shardlab::dist {

class Backend;
class MpiComm;
struct CollectiveCall;

class Communicator {
 public:
  // Made by dist::init (the world) and by split(); `control` carries debug-mode fingerprint
  // exchanges, `backend` the collectives themselves.
  Communicator(std::string name, MpiComm control, std::unique_ptr<Backend> backend,
               std::shared_ptr<Monitor> monitor, bool debug);
  ~Communicator();  // waits for the collectives still queued
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& name() const { return name_; }
  std::string_view backend_name() const;  // "mpi" or "nccl"

  // Flat collectives on contiguous tensors of one dtype (f32, f64, bf16, f16, i64, i32, u8).
  // Shapes do not matter, element counts do. `tag` labels the call in the ledger.
  //
  // output (numel size*n) = the ranks' inputs (numel n), rank 0's first. The input may be
  // this rank's own slot of the output (in-place); no other overlap.
  Work all_gather_into(const Tensor& output, const Tensor& input, std::string_view tag = {});
  // output (numel n) = slot `rank` of the elementwise reduction of the ranks' inputs (numel size*n).
  Work reduce_scatter(const Tensor& output, const Tensor& input, ReduceOp op = ReduceOp::sum,
                      std::string_view tag = {});
  // In place: every rank ends with the elementwise reduction. avg divides the sum by size()
  // (truncating for integers, as NCCL).
  Work all_reduce(const Tensor& tensor, ReduceOp op = ReduceOp::sum, std::string_view tag = {});
  // In place: every rank ends with rank `root`'s values.
  Work broadcast(const Tensor& tensor, int root, std::string_view tag = {});
  Work barrier(std::string_view tag = {});

  // The ranks that pass the same color (>= 0) form a new communicator, ranked by (key, rank
  // here). Collective: every rank calls it. For hybrid sharding: split(rank / G, rank) makes
  // the shard groups, split(rank % G, rank) the replica groups.
  std::unique_ptr<Communicator> split(int color, int key, std::string name = {});

  // Calls and bytes per collective kind since construction or the last reset (traffic_of).
  CollectiveCounters counters() const;
  void reset_counters();

  void set_debug(bool debug) { debug_ = debug; }
  bool debug() const { return debug_; }
  Monitor& monitor() const { return *monitor_; }

 private:
  Work issue(Fingerprint fingerprint, const Tensor& input, const Tensor& output);
  void compare_fingerprints(const CollectiveCall& call, std::uint64_t sequence);
  void check_tensor(const Tensor& tensor, std::string_view op, std::string_view role) const;

  std::string name_;
  std::unique_ptr<MpiComm> control_;
  std::unique_ptr<Backend> backend_;
  std::shared_ptr<Monitor> monitor_;
  int rank_ = 0, size_ = 1;
  bool debug_ = false;
  mutable std::mutex mutex_;  // issue order = sequence order, from any thread
  std::uint64_t sequence_ = 0;
  CollectiveCounters counters_;
};

}  // namespace shardlab::dist
