// tests/runner.h: what differs between a test binary that runs as one process and one that
// mpirun starts on several ranks (tests/single_process.cpp, tests/dist/mpi_process.cpp).
#pragma once

#include <memory>
#include <string>
#include <vector>

namespace shardlab::test {

class TestProcess {
 public:
  virtual ~TestProcess() = default;
  // The name on the summary line, e.g. "test_core" or "test_dist@np3".
  virtual std::string summary_name(const std::string& binary) const = 0;
  // Per test case (in run order) whether it failed, combined over every process of the run:
  // a case fails when it failed anywhere.
  virtual std::vector<char> combine(const std::vector<char>& failed) const = 0;
  // Whether this process prints the summary line (one process per run does).
  virtual bool prints_summary() const = 0;
};

// Set up before the tests run (MPI for the dist tests); kept alive until they have ended.
std::unique_ptr<TestProcess> start_test_process(int& argc, char**& argv);

}  // namespace shardlab::test
