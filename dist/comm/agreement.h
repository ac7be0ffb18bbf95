// dist/comm/agreement.h: internal to dist/: how the ranks of a collective that writes or reads files
// agree on its outcome: every rank learns the lowest failing rank's error and throws it, so that
// none waits in a collective the others left.
#pragma once

#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"
#include "dist/comm/communicator.h"

namespace shardlab::dist::detail {

// Every rank's `mine`, in rank order, on every rank.
std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& mine);

// Every rank's error ("" when it did fine): the lowest failing rank's message, the same on every
// rank, or nothing when all did fine. One small all-reduce when all did fine.
std::optional<std::string> first_error(Communicator& comm, const std::string& error);

// What `work` threw, as the text first_error agrees on ("" when it returned); an exception from
// the standard library (a file system error) is prefixed with `where`.
template <typename Work>
std::string attempt(std::string_view where, Work&& work) {
  try {
    work();
  } catch (const Error& error) {
    return error.what();
  } catch (const std::exception& error) {
    return fmt::format("{}: {}", where, error.what());
  }
  return {};
}

// Rank 0's random_id(), on every rank: names the temporary file or directory of one save.
std::uint64_t agreed_id(Communicator& comm);

}  // namespace shardlab::dist::detail
