// dist/fsdp/fsdp.h: fully sharded data parallelism (FSDP / ZeRO-3), bottom-up as PyTorch's FSDP2.
//
//   for (auto& block : model->blocks) dist::fully_shard(*block);  // inner units first
//   dist::fully_shard(*model);                                    // the root last
//   optim::AdamW opt(model->named_parameters(), {});              // now this rank's shards, as FSDP2
//   fmt::print("{}", dist::explain(*model).str());                 // the plan, before step 1
//   loss = ...model(x)...; loss.backward(); opt.step();           // as without FSDP
//
// Each fully_shard call makes an FSDP unit of the module's parameters that no inner unit took:
// one flat f32 shard per rank (rank r of the shard group holds elements [r*S, (r+1)*S) of the
// flattened parameters, padded with zeros to a multiple of the group size) and its gradient
// shard. What the layers compute with becomes views of one gathered buffer that holds bytes only
// between the unit's all-gather and its reshard. The model does not know: the hooks do it.
//
// Communication is per unit (one flat buffer), training is per parameter, as in one process:
// - the module's parameters (named_parameters(), parameters(), state_dict()) become each
//   parameter's slice of this rank's shard, a Variable of its own under the parameter's name,
//   with its gradient a slice of the unit's gradient shard; its shape(), dim() and numel() answer
//   for the whole parameter and shard_info() says which elements it holds, as a DTensor would;
// - a frozen parameter (set_requires_grad(false) on what named_parameters() gives, before or
//   between steps) never gets a gradient, so the optimizer skips it and keeps no state for it;
// - a parameter that got no gradient on any rank in a step has none after it; one that got a
//   gradient on some ranks has the average over all ranks (zeros from the others). The ranks
//   agree on these flags with one small all-reduce per root and step.
// Every unit whose forward runs in a step must run on every rank of its communicator (its
// collectives are issued by its hooks); parameters inside it may be used on some ranks only.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "dist/comm/communicator.h"
#include "nn/module.h"

namespace shardlab::optim {
class Optimizer;
}

namespace shardlab::dist {

enum class Sharding : std::uint8_t {
  full,     // FULL_SHARD (ZeRO-3): parameters gathered for forward and again for backward
  grad_op,  // SHARD_GRAD_OP (ZeRO-2): gathered from forward until the end of backward
  none,     // NO_SHARD (DDP): every rank holds everything; gradients all-reduced
  hybrid,   // HYBRID_SHARD: FULL_SHARD inside groups of `hybrid_group_size` ranks, replicated across groups
  // ZeRO-1: the parameters and the unsharded gradient stay whole on every rank between steps, and
  // only the optimizer state (with the f32 master shard and the gradient shard it steps on) is
  // sharded. The gradient is reduce-scattered, not all-reduced: each rank steps its slice only, so
  // it needs only that slice of the average, and a reduce-scatter moves half an all-reduce's bytes;
  // the updated slices are all-gathered into the whole parameters before the next forward, so a
  // step moves what DDP's all-reduce moves.
  optimizer,
};
std::string_view sharding_name(Sharding sharding);  // "full", "grad_op", "none", "hybrid", "optimizer"
// Parses "full", "grad_op", "optimizer", "none", "hybrid:G" (G > 0 dividing the world size is checked
// by fully_shard).
std::pair<Sharding, int> parse_sharding(std::string_view text);

// FSDP2's MixedPrecisionPolicy.
struct MixedPrecision {
  DType param_dtype = DType::f32;   // the gathered parameters and the forward/backward compute
  DType reduce_dtype = DType::f32;  // the gradient reduction; the master shard is always f32
  // With a param_dtype other than f32, the floating inputs of the unit's forward are cast to it
  // (their gradients flow back in the inputs' dtype), so an f32 batch feeds a bf16 model.
  bool cast_forward_inputs = true;
  // When set, the unit's floating output is cast to it (FSDP2's output_dtype). A bf16 Llama's root
  // needs none: cross_entropy takes bf16 logits' loss in f32 itself.
  std::optional<DType> output_dtype;
};

struct FsdpOptions {
  Sharding sharding = Sharding::full;
  int hybrid_group_size = 0;  // G, for Sharding::hybrid
  // Free the gathered parameters after forward (and gather again for backward). Default: true
  // for full and hybrid, false for grad_op, optimizer and none; the root always keeps them (its backward
  // comes right after its forward), as FSDP2.
  std::optional<bool> reshard_after_forward;
  // FSDP2's reshard_after_forward=G (ZeRO++'s hpZ): after forward, keep the parameters sharded over
  // groups of G consecutive ranks of the shard group (a machine's, say) instead of freeing them:
  // each rank holds 1/G of the gathered unit until backward, whose all-gather then runs inside its
  // group only. 0: off. G must divide the shard group, be neither 1 nor all of it, and the unit must
  // reshard after forward (full, hybrid).
  int reshard_after_forward_group = 0;
  // Units whose all-gather is issued ahead, in forward and in backward, in the order recorded in
  // the first step; set_modules_to_*_prefetch replaces it on a unit with a list of its own.
  int prefetch = 1;
  MixedPrecision mixed_precision;
  // Keep the f32 shards, their gradients and the optimizer state in host memory (GPU runs: the
  // optimizer steps on the CPU; each gather copies the shard up). On the CPU: nothing to do.
  bool cpu_offload = false;
  // Gradients with the same bits at any world size and sharding: each parameter's gradient parts
  // (one per chunk of the batch, autograd::BatchChunking) go into an order-free sum (BinnedSum),
  // reduced across ranks as integers (block tops with max, windows with sum) and rounded once, so
  // the reduction is a sum, not an average: the loss is scaled by the global batch. The reduction
  // waits for the unit's gradient (no overlap with the backward) and moves 8 bytes an element
  // instead of the reduce dtype's. CPU only.
  bool bitwise = false;
  // Default: dist::session().world().
  Communicator* communicator = nullptr;
};

// Makes `module` an FSDP unit. Call it on inner modules first and on the root last; an
// ancestor sharded before its descendant, a module sharded twice, or a parameter tied to one
// in another unit is refused with an Error naming them.
void fully_shard(nn::Module& module, const FsdpOptions& options = {});

// fully_shard on every descendant of type Block (innermost first), then on the root.
template <typename Block>
int shard_by_type(nn::Module& root, const FsdpOptions& options = {});
// fully_shard on every descendant holding at least `min_parameters` parameters not taken by an
// inner unit (innermost first), then on the root. Returns the number of units.
int shard_by_size(nn::Module& root, std::int64_t min_parameters, const FsdpOptions& options = {});

// root.named_parameters() with a tied parameter once, under its first name: after fully_shard,
// this rank's shard of every parameter (data() is a 1-D f32 view of its contiguous slice of the
// unit's flat shard, 0 elements on ranks that hold none of it; after a backward, grad() is the
// matching slice of the unit's gradient shard). Refuses a root that is no FSDP unit.
nn::Named<Variable> sharded_parameters(nn::Module& root);

// Micro-steps of gradient accumulation: with sync off, backward keeps each unit's unsharded
// gradient (P elements per unit, until the synced step) and accumulates into it; the next backward
// with sync on reduce-scatters the sum once. Where reduce_dtype differs from param_dtype the sum is
// kept in reduce_dtype, as FSDP2 upcasts it: each backward's param_dtype gradient (bf16) is added
// into an f32 sum, and its buffer freed until the next backward. The alternative,
// reduce-scattering every micro-step into the f32 gradient shard, would keep only P / N
// elements but pay a reduce-scatter per micro-step; this keeps one reduction per optimizer step.
void set_requires_gradient_sync(nn::Module& root, bool sync);

// FSDP2's set_requires_all_reduce, for the whole root: with false, a synced backward reduce-scatters
// each unit's gradient over its shard group but leaves out the all-reduce over the replicas (hybrid,
// none): each rank adds its reduce-scattered shard into a sum of its own (f32, one shard per unit),
// and the next synced backward with it on adds that sum in before its one all-reduce. Micro-steps of
// gradient accumulation then pay one all-reduce per optimizer step, and hold a shard, not the
// unsharded gradient (set_requires_gradient_sync(false) holds that and pays nothing until the end).
// While a unit's sum waits for its all-reduce, its parameters have no gradient, and optimizers and
// clipping refuse them, naming the call that completes it. A unit without replicas (full, grad_op,
// optimizer) has no all-reduce to leave out: it reduce-scatters into its gradient shard every
// synced micro-step either way. Refused with FsdpOptions::bitwise, whose one exact reduction spans
// both groups (accumulate without sync instead).
void set_requires_all_reduce(nn::Module& root, bool all_reduce);

// FSDP2's set_gradient_divide_factor, for the unit `module` is (only it, as in PyTorch; call it on
// each unit to set them all): the unit's gradient becomes the sum of the ranks' gradients over
// every data-parallel rank (shard group x replicas) divided by `factor`, instead of their mean
// (factor = those ranks). 1 gives the sum, for a loss its caller divides by a global count such as
// the tokens of the whole batch. The reductions then sum, and the reduced shard is divided once, in
// f32. With FsdpOptions::bitwise, whose reduction is a sum, it is that sum divided by `factor`
// (still the same bits at any world size). `factor` must be positive and finite; refused while the
// unit holds a sum that waits for its all-reduce (set_requires_all_reduce), made with the old one.
void set_gradient_divide_factor(nn::Module& module, double factor);

// FSDP2's set_force_sum_reduction_for_comms, for the unit `module` is: its collectives only sum (no
// average on the wire, for backends or links that move sums only), and the reduced shard is divided
// by the data-parallel ranks (or the divide factor) once, in f32; the same gradient up to rounding.
// With FsdpOptions::bitwise, whose reduction is a sum, nothing changes. Refused while a sum waits for
// its all-reduce (set_requires_all_reduce), made the other way.
void set_force_sum_reduction_for_comms(nn::Module& module, bool force_sum);

// FSDP2's set_all_reduce_hook, for the unit `module` is: after the unit's last collective of a synced
// backward (its reduce-scatter, or with replicas the all-reduce over them), `hook` gets the reduced
// shard, this rank's S elements in reduce_dtype, and may change it in place (an all-reduce of its own
// over another group, a clip): before the cast to f32, the divide factor and any copy to the host.
// It sees the mean over the ranks, or their sum where the unit sums (a divide factor, forced sums).
// Every rank runs the units' hooks in the same order. None while a sum waits for its all-reduce
// (set_requires_all_reduce); an empty function removes the hook.
using AllReduceHook = std::function<void(const Tensor& reduced)>;
void set_all_reduce_hook(nn::Module& module, AllReduceHook hook);

// FSDP2's set_reshard_after_backward: with false, every unit under `module` (itself included) keeps
// its gathered parameters from the end of one backward to the next forward, which then gathers
// nothing: micro-steps of gradient accumulation trade memory for all-gathers. Only while gradient
// sync is off: after a synced backward the optimizer changes the shards, so a forward of a unit
// kept gathered with sync on is refused (set it back to true for the last micro-step).
void set_reshard_after_backward(nn::Module& module, bool reshard);

// Clipping a sharded model is optim::clip_grad_norm_(root.parameters(), max_norm), as PyTorch's
// clip_grad_norm_ over FSDP2's DTensor parameters: the parameters are the shards, whose sums of
// squares it adds over the ranks (a replicated unit's counted once).

// This rank's share of the global sum of squared gradients that optim::clip_grad_norm_ adds: its
// shards' sums, a replicated unit's counted by one replica only, as a one-element f64 tensor on
// the units' device. Not a collective: for a caller that adds it to an all-reduce of its own (the
// CNN's loss sum) and takes the square root.
Tensor local_gradient_sum_of_squares(nn::Module& root);

// Every parameter's full value (f32, unpadded, by its dotted name under `root`), gathered from
// the shards on every rank: for checkpoints, evaluation and tests.
nn::Named<Tensor> gather_full_parameters(nn::Module& root);

// From the next step on, `optimizer`'s updates of the root's shards run on a host thread of their
// own, one unit after another in the order of the forward: step() and step_if() return at once,
// and each unit's next gather waits for its own part only. With cpu_offload on a GPU, the host's
// AdamW of a unit thus overlaps the GPU's forward of the units before it (ZeRO-Offload's overlap);
// on the CPU it overlaps the forward's own work. The optimizer's calls (step, settle_step,
// state_dict, ...), sharded_parameters, parameter_shards, checkpoints and gather_full_parameters
// wait for the updates; a shard read any other way needs optimizer.wait_for_updates() first. An
// update that fails is rethrown by the gather that waits for it and by the optimizer's next call.
// Every unit's shard and every parameter of the optimizer must be in host memory.
//
//   dist::fully_shard(*model, {.cpu_offload = true});
//   optim::AdamW opt(model->named_parameters(), {});
//   dist::overlap_host_step(opt, *model);
void overlap_host_step(optim::Optimizer& optimizer, nn::Module& root);

// --- explicit gathering and prefetching, FSDP2's FSDPModule calls --------------------------------

namespace detail {
class Unit;
}

// The all-gather dist::unshard issued. wait() returns once the unit's parameters are gathered
// (a second wait returns at once). Dropped without wait(), nothing leaks and nothing blocks: the
// gather completes on its own, and the unit's next forward, reshard or destruction waits for it.
class UnshardHandle {
 public:
  UnshardHandle() = default;
  void wait();

 private:
  friend UnshardHandle unshard(nn::Module& unit);
  explicit UnshardHandle(std::weak_ptr<detail::Unit> unit) : unit_(std::move(unit)) {}
  std::weak_ptr<detail::Unit> unit_;
};

// Issues the all-gather of the unit's parameters now, so that it overlaps what comes next; the
// unit's forward then uses them without gathering again. A collective: call it on every rank.
//   dist::UnshardHandle gathering = dist::unshard(*model);  // the root's all-gather ...
//   const Tensor tokens = batch.tokens.to(device);          // ... overlaps the copy
//   Variable logits = model(tokens);                        // waits for it, gathers nothing
// A unit already gathered (the root, or any unit kept gathered through backward, between its
// forward and the end of its backward) gathers nothing. An error if `unit` is no FSDP unit.
UnshardHandle unshard(nn::Module& unit);
// Frees the unit's gathered parameters (once an all-gather in flight has completed); its forward
// or backward gathers them again when it needs them. An error if `unit` is no FSDP unit, or while
// its backward runs (its gradients still read them).
void reshard(nn::Module& unit);

// Explicit prefetching: when set on `unit`, its pre-forward (pre-backward) issues the all-gathers of
// exactly these units, in this order, from the first step on, instead of the next
// FsdpOptions::prefetch units of the order recorded in the first step; an empty list prefetches
// nothing. Each must be a unit under the same root as `unit`.
//   for (std::size_t i = 0; i + 1 < blocks.size(); ++i) {
//     dist::set_modules_to_forward_prefetch(*blocks[i], {blocks[i + 1].get()});
//     dist::set_modules_to_backward_prefetch(*blocks[i + 1], {blocks[i].get()});
//   }
void set_modules_to_forward_prefetch(nn::Module& unit, std::vector<nn::Module*> next);
void set_modules_to_backward_prefetch(nn::Module& unit, std::vector<nn::Module*> previous);

// --- where each parameter lives ---------------------------------------------------------------------

// This rank's part of one parameter: what PyTorch's DTensor tells with placements and to_local().
struct ParameterShard {
  Shape full_shape;  // the parameter's own shape
  // This rank holds elements [first, first + count) of the flattened parameter (count 0: none).
  std::int64_t first = 0, count = 0;
  Variable local;  // those elements: the parameter's view in sharded_parameters(), 1-D f32
  // "Shard(flat) elements [12, 40) of 64, rank 1 of 2" (full, grad_op; hybrid adds ", replicated
  // over 2 groups"), or "Replicate" (none).
  std::string placement;
  // Whether this rank's copy is the one that counts once: always for full and grad_op, on the
  // first replica for none and hybrid (the others hold the same elements). What a checkpoint writes.
  bool first_replica = true;
  // With tensor parallelism (place_in_mesh): full_shape is this rank's piece of a larger parameter,
  // placed in the whole by `piece`.
  std::optional<ShardInfo::Piece> piece;
};
// The whole parameter's shape: piece->whole, else full_shape.
Shape whole_shape(const ParameterShard& shard);
// Where `local`'s elements lie in the whole parameter, flattened, in their order: one run
// [first, first + count) for a whole parameter, a run per row a piece crosses otherwise.
struct ElementRun {
  std::int64_t first = 0, count = 0;  // of the whole, flattened
  std::int64_t at = 0;                // in `local`
};
std::vector<ElementRun> whole_runs(const ParameterShard& shard);
// Every parameter under `root`, by dotted name in root.named_parameters() order (a tied parameter
// once, under its first name).
nn::Named<ParameterShard> parameter_shards(nn::Module& root);
// Tensor parallelism's layout around FSDP's: places the parameters FSDP shards under `root` in a
// mesh whose ranks are `all` (FSDP's communicator being one dimension of it). Those named in
// `pieces` are that piece of a larger parameter; the others every group of the other dimension
// holds alike, and they count once, on the group where `counts_copies` is true. Sums over shards
// (clip_grad_norm_), checkpoints and full safetensors then run over `all`. `all` must outlive the
// model; a name in `pieces` that is no parameter of `root` is an error, and nothing changes.
void place_in_mesh(nn::Module& root, Communicator& all, const nn::Named<ShardInfo::Piece>& pieces,
                   bool counts_copies);
// The ranks that train the units under `root` (FsdpOptions::communicator, or the world; place_in_mesh's
// `all` with tensor parallelism): the ranks of a collective over the whole model, such as a
// checkpoint's save and load.
Communicator& root_communicator(nn::Module& root);

// The collectives the units under `root` issued since the last reset, summed over the distinct
// communicators they use (the base, and for hybrid sharding the shard and replica groups the
// world's own counters do not see): what Plan::bytes_per_step() predicts for one step.
CollectiveCounters collective_counters(nn::Module& root);
void reset_collective_counters(nn::Module& root);

// Bytes of gathered (unsharded) parameters held by all units of this process: now, and the
// peak since the last reset. What prefetching and resharding bound.
struct UnshardedMemory {
  std::int64_t bytes = 0, peak_bytes = 0;
};
UnshardedMemory unsharded_memory();
void reset_unsharded_peak();

// --- the plan -----------------------------------------------------------------------------------

struct UnitPlan {
  std::string name;                 // dotted module path ("" = root)
  std::string sharding;             // "full", "hybrid:2", ...
  int shard_group_size = 1;         // ranks the unit's parameters are sharded over
  std::int64_t parameters = 0;      // P: elements of the unit's parameters
  std::int64_t frozen = 0;          // of which frozen: no gradient, no optimizer state
  std::int64_t padding = 0;         // zeros appended so the flat length divides by the group size
  std::int64_t shard_elements = 0;  // S per rank
  // Per rank: f32 shard + f32 gradient shard (none when every parameter is frozen) + optimizer
  // state for this rank's elements of trainable parameters (none for padding).
  std::int64_t persistent_bytes = 0;
  std::int64_t unsharded_bytes = 0;  // the gathered parameters while they exist
  std::int64_t optimizer_bytes = 0;  // of persistent_bytes, the optimizer state
  // The unsharded gradient in reduce_dtype, kept until the unit's reduce-scatter is waited for:
  // when kReductionsInFlight newer ones started, else at the end of the backward (0 where the
  // reduction's output is the gradient shard itself: a group of 1 rank).
  std::int64_t reduce_buffer_bytes = 0;
  // With reduce_dtype other than param_dtype: the param_dtype gradient while the unit's backward runs.
  std::int64_t cast_buffer_bytes = 0;
  // What backwards without sync keep until the reduction (set_requires_gradient_sync(false)): the sum
  // in reduce_dtype where it differs from param_dtype, else the unsharded gradient (none for ZeRO-1,
  // which keeps it anyway); bitwise, the exact sum. 0 when every parameter is frozen.
  std::int64_t accumulated_bytes = 0;
  // Gathered from forward to the end of backward: the root, grad_op and none units, and units
  // kept gathered by reshard_after_forward=false.
  bool gathered_through_backward = false;
  // Sharding::optimizer: the gathered parameters and the unsharded gradient stay between steps
  // (both in persistent_bytes).
  bool gathered_between_steps = false;
  // set_reshard_after_backward(false): gathered from one micro-step's backward to the next forward.
  bool kept_after_backward = false;
  std::int64_t forward_gather_bytes = 0;   // received per rank per step (traffic_of)
  std::int64_t backward_gather_bytes = 0;  // 0 when the unit stays gathered for backward
  std::int64_t reduce_bytes = 0;           // reduce-scatter (and hybrid's replica all-reduce)
  std::int64_t replica_reduce_bytes = 0;   // of reduce_bytes, the replica all-reduce's (not bitwise)
  int forward_gathers = 0, backward_gathers = 0, reduce_scatters = 0,
      all_reduces = 0;                        // collectives per step
  // The reductions' buffers, as dist/fsdp/step_time.h times them: the reduce-scatter's input over the
  // shard group, the replica all-reduce's tensor over replica_group_size ranks (hybrid, none).
  std::int64_t reduce_scatter_input_bytes = 0, replica_all_reduce_bytes = 0;
  int replica_group_size = 1;
  int post_forward_group = 0;                 // reshard_after_forward_group (0: off)
  std::int64_t held_after_forward_bytes = 0;  // this rank's slice kept from forward to backward
  // CPU offload from a GPU: the f32 shard copied to the device before each gather, the f32 gradient shard
  // to the host after the reduction, the update on the host.
  bool offloaded = false;

  bool operator==(const UnitPlan&) const = default;
};

// Gradient accumulation: how the micro-batches of one optimizer step reduce their gradients.
enum class MicroBatchSync : std::uint8_t {
  every,           // each micro-batch's backward reduces as a whole step's does
  reduce_scatter,  // each reduce-scatters; the all-reduce over the replicas waits for the last
                   // (set_requires_all_reduce(false) before it)
  last,            // only the last reduces; the others accumulate unsharded gradients
                   // (set_requires_gradient_sync(false) before it)
};
std::string_view micro_batch_sync_name(MicroBatchSync sync);  // "every", "reduce-scatter", "last"
// Parses those names; an Error names anything else.
MicroBatchSync parse_micro_batch_sync(std::string_view text);

struct Accumulation {
  int micro_batches = 1;  // forward and backward passes per optimizer step
  MicroBatchSync sync = MicroBatchSync::every;
  bool operator==(const Accumulation&) const = default;
};

struct Plan {
  std::string sharding;  // the units' strategy ("full", "hybrid:2", ...), or "mixed"
  int world_size = 1, shard_group_size = 1, prefetch = 1;  // the root's group; the units' largest prefetch
  std::int64_t optimizer_state_bytes_per_element = 8;      // Adam/AdamW: m and v in f32
  bool bitwise = false;                                    // FsdpOptions::bitwise
  std::vector<UnitPlan> units;
  // The all-reduce (max) per step that agrees on which parameters had a gradient on some rank.
  std::int64_t gradient_flags = 0, flag_bytes = 0;
  std::string note;  // e.g. what cpu offload does here
  // The micro-batches of a step, as the training loop runs them: what bytes_per_step(), the gradient
  // terms of the peak and str() count (one pass per step unless set).
  Accumulation accumulation;

  std::int64_t total_persistent_bytes() const;
  // Of which the gathered parameters kept between steps (Sharding::optimizer), which
  // peak_unsharded_bytes() counts too.
  std::int64_t persistent_unsharded_bytes() const;
  std::int64_t optimizer_state_bytes() const;  // of which the optimizer state (allocated by its first step)
  // Gathered parameters at once: every unit gathered through backward, the slices kept for a
  // post-forward group, and the largest (1 + prefetch) of the units gathered for forward and again
  // for backward.
  std::int64_t peak_unsharded_bytes() const;
  // What of the parameters stays gathered from the end of forward to backward: the units gathered
  // through backward and the slices kept for post-forward groups.
  std::int64_t held_after_forward_bytes() const;
  // Unsharded gradients at once during backward: the kReductionsInFlight + 1 largest reduce buffers
  // (the reductions in flight and the gradient being computed), plus the largest cast buffer.
  std::int64_t gradient_buffer_bytes() const;
  // All collectives of one optimizer step, received per rank: the gathers of every micro-batch, and
  // the reductions and gradient flags of every micro-batch that reduces (accumulation).
  std::int64_t bytes_per_step() const;
  // What gradient accumulation without sync holds between micro-steps: every unit's
  // accumulated_bytes.
  std::int64_t accumulation_bytes() const;
  // What micro-batches that reduce-scatter and leave the all-reduce to the last hold between them:
  // the f32 sum of each replicated unit's reduced shards.
  std::int64_t partial_sum_bytes() const;
  // The gradients' term of the training peak under `accumulation`: gradient_buffer_bytes(), plus
  // accumulation_bytes() or partial_sum_bytes() where earlier micro-batches keep them.
  std::int64_t accumulated_gradient_bytes() const;
  std::string str() const;  // the table --explain prints
  std::string accumulation_text() const;  // str()'s last line: what accumulation holds and moves
};

// The plan of the units under `root` (finalises them: call after the last fully_shard).
Plan explain(nn::Module& root, std::int64_t optimizer_state_bytes_per_element = 8);

// A world to plan the units for instead of their own: `world_size` ranks (the plan is rank 0's), and where
// `sharding` is given the strategy every unit would have there (a world of one process cannot shard
// hybrid:8, yet can predict it: shard it fully here).
struct PlanAt {
  int world_size = 1;
  std::optional<Sharding> sharding;
  int hybrid_group_size = 0;            // with Sharding::hybrid
  int reshard_after_forward_group = 0;  // with `sharding`: FsdpOptions::reshard_after_forward_group
};
// The plan the units under `root` would have at `at`: the same parameters, dtypes and options; errors
// name a strategy that does not fit that world.
Plan explain(nn::Module& root, std::int64_t optimizer_state_bytes_per_element, const PlanAt& at);

template <typename Block>
int shard_by_type(nn::Module& root, const FsdpOptions& options) {
  auto modules = root.named_modules();  // preorder: reversed, every module comes after its descendants
  int units = 0;
  for (auto it = modules.rbegin(); it != modules.rend(); ++it) {
    if (!it->first.empty() && dynamic_cast<Block*>(it->second.get()) != nullptr) {
      fully_shard(*it->second, options);
      ++units;
    }
  }
  fully_shard(root, options);
  return units + 1;
}

}  // namespace shardlab::dist
