// dist/comm/fault_injection.h: faults on purpose, for the fault tests: SHARDLAB_INJECT_FAULT makes one
// rank of a real run die, hang or send NaN at a chosen collective.
//
//   SHARDLAB_INJECT_FAULT=kill:rank=1:call=3:tag=pre-backward fc1
//     rank 1 issues its 3rd collective tagged "pre-backward fc1", then dies by SIGKILL while the
//     others are in it;
//   SHARDLAB_INJECT_FAULT=hang:rank=1:call=40      rank 1 never issues its 40th collective;
//   SHARDLAB_INJECT_FAULT=nan:rank=0:call=2:tag=fc1
//     rank 0's input to its 2nd "fc1" collective (a reduce-scatter or all-reduce) is all NaN: the
//     reduction spreads it to every rank, as a numerical blow-up on one rank would.
// Calls are counted per process over every communicator, from 1; without tag= every collective
// counts. Unset (or empty), nothing is armed and each collective pays one branch.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "core/tensor.h"
#include "dist/comm/collective.h"

namespace shardlab::dist {

struct FaultInjection {
  enum class Action { kill, hang, nan };
  Action action = Action::kill;
  int rank = 0;            // the world rank that misbehaves
  std::uint64_t call = 1;  // its call-th matching collective
  std::string tag;         // matching collectives carry this tag; empty: all match
};

// Parses the SHARDLAB_INJECT_FAULT text; throws naming the field that is wrong. Empty: none.
std::optional<FaultInjection> parse_fault_injection(std::string_view text);

// Arms `fault` in this process (world rank `rank`), or disarms it (nullopt); dist::init arms
// what SHARDLAB_INJECT_FAULT says and the session's end disarms it.
void arm_fault_injection(std::optional<FaultInjection> fault, int rank);

// Called by Communicator::issue with each collective before it is launched: a matching hang
// never returns, a matching nan fills `input` with NaN (refused for collectives that do not
// reduce). Returns whether the process is to kill itself once the collective is launched.
bool before_collective(const Fingerprint& fingerprint, const Tensor& input);
// Dies by SIGKILL, saying which collective it left its peers in.
[[noreturn]] void kill_after_collective(const Fingerprint& fingerprint);

}  // namespace shardlab::dist
