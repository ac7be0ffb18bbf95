// apps/training_support.cpp: sums over ranks, the metrics file, the progress bar, medians.
#include "apps/training_support.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "core/error.h"
#include "core/tensor.h"

namespace shardlab::apps {

std::vector<double> sum_over_ranks(dist::Communicator& comm, const std::vector<double>& values) {
  const Tensor total = from_vector(values);
  comm.all_reduce(total, dist::ReduceOp::sum, "training").wait();
  return total.to_vector<double>();
}

MetricsFile::MetricsFile(const std::string& path, dist::Communicator& comm) {
  // Rank 0 truncates before anyone appends: the sum over ranks is also the barrier.
  if (comm.rank() == 0) fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_APPEND, 0644);
  const int error = errno;
  SHARDLAB_CHECK(sum_over_ranks(comm, {comm.rank() == 0 && fd_ < 0 ? 1.0 : 0.0})[0] == 0,
                 "cannot write metrics to '{}'{}", path,
                 comm.rank() == 0 ? fmt::format(": {}", std::strerror(error)) : "");
  if (comm.rank() != 0) fd_ = ::open(path.c_str(), O_WRONLY | O_APPEND);
  const double failed = sum_over_ranks(comm, {fd_ < 0 ? 1.0 : 0.0})[0];
  SHARDLAB_CHECK(failed == 0, "cannot append metrics to '{}' on {} of {} ranks", path, failed, comm.size());
}

MetricsFile::~MetricsFile() { ::close(fd_); }

void MetricsFile::write(const nlohmann::json& record) const {
  const std::string line = record.dump() + "\n";
  const ssize_t written = ::write(fd_, line.data(), line.size());
  SHARDLAB_CHECK(written == static_cast<ssize_t>(line.size()), "metrics: wrote {} of {} bytes: {}", written,
                 line.size(), std::strerror(errno));
}

std::unique_ptr<dist::Session> start_cpu_session(int& argc, char**& argv, const char* program) {
  try {
    return dist::init(argc, argv, {.device = dist::DeviceChoice::cpu});
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", program, e.what());
    return nullptr;
  }
}

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

double median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const std::size_t middle = values.size() / 2;
  return values.size() % 2 == 1 ? values[middle] : (values[middle - 1] + values[middle]) / 2;
}

}  // namespace shardlab::apps
