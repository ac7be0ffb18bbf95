// apps/support/metrics_file.h: the --metrics file of JSON lines, written by every rank.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "dist/comm/communicator.h"

namespace shardlab::apps {

// The --metrics file: rank 0 truncates it (unless `continues`: a resumed run's records follow those
// of the runs before it), then every rank appends whole JSON lines, each with one write() on an
// O_APPEND descriptor, so the ranks' records never interleave within a line.
class MetricsFile {
 public:
  MetricsFile(const std::string& path, dist::Communicator& comm, bool continues);
  ~MetricsFile();
  MetricsFile(const MetricsFile&) = delete;
  MetricsFile& operator=(const MetricsFile&) = delete;

  void write(const nlohmann::json& record) const;

 private:
  int fd_ = -1;
};

}  // namespace shardlab::apps
