// dist/comm/log.h: rank-aware printing. log() prints on rank 0 only (what a user of a multi-rank
// job wants to read once); log_all() prints on every rank with a "[rank k] " prefix.
#pragma once

#include <fmt/format.h>

#include <cstdio>
#include <string_view>
#include <utility>

namespace shardlab::dist {

// This process's rank in the world (0 before dist::init and after its session ended).
int process_rank();
void set_process_rank(int rank);  // called by dist::init

// Writes `line` and a newline to stdout in one call and flushes, so lines of different ranks
// interleave whole.
void write_line(std::string_view line);

template <typename... Args>
void log(fmt::format_string<Args...> format, Args&&... args) {
  if (process_rank() == 0) write_line(fmt::format(format, std::forward<Args>(args)...));
}

template <typename... Args>
void log_all(fmt::format_string<Args...> format, Args&&... args) {
  write_line(fmt::format("[rank {}] {}", process_rank(), fmt::format(format, std::forward<Args>(args)...)));
}

}  // namespace shardlab::dist
