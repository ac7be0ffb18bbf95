// apps/support/metrics_file.cpp: MetricsFile over O_APPEND writes, one write() per line.
#include "apps/support/metrics_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "apps/support/ranks.h"
#include "core/error.h"

namespace shardlab::apps {

MetricsFile::MetricsFile(const std::string& path, dist::Communicator& comm, bool continues) {
  // Rank 0 makes (or truncates) it before anyone appends: the sum over ranks is also the barrier.
  if (comm.rank() == 0)
    fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | (continues ? 0 : O_TRUNC) | O_APPEND, 0644);
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

}  // namespace shardlab::apps
