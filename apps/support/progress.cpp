// apps/support/progress.cpp: the bar on a terminal, plain lines elsewhere.
#include "apps/support/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

namespace shardlab::apps {

Progress::Progress(std::string label, std::int64_t total, std::string rate_unit, bool shown)
    : label_(std::move(label)),
      rate_unit_(std::move(rate_unit)),
      total_(total),
      shown_(shown),
      tty_(isatty(fileno(stdout)) && std::getenv("OMPI_COMM_WORLD_SIZE") == nullptr) {}

Progress::~Progress() {
  if (shown_ && tty_ && last_ >= 0 && last_ != total_) std::printf("\n");
}

void Progress::update(std::int64_t done, double loss, double rate) {
  const std::int64_t tenth = std::max<std::int64_t>(1, total_ / 10);
  if (!shown_ || (!tty_ && done != total_ && done / tenth == last_ / tenth)) return;
  last_ = done;
  constexpr int kWidth = 30;
  const int filled = static_cast<int>(kWidth * done / std::max<std::int64_t>(total_, 1));
  const std::string bar = std::string(filled, '#') + std::string(kWidth - filled, '.');
  std::printf("%s%s [%s] %lld/%lld  loss %.4f  %.0f %s%s", tty_ ? "\r" : "", label_.c_str(), bar.c_str(),
              static_cast<long long>(done), static_cast<long long>(total_), loss, rate, rate_unit_.c_str(),
              tty_ ? "" : "\n");
  if (tty_ && done == total_) std::printf("\n");
  std::fflush(stdout);
}

}  // namespace shardlab::apps
