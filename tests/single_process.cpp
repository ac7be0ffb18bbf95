// tests/single_process.cpp: the TestProcess of the test binaries that run as one process.
#include "tests/runner.h"

namespace shardlab::test {

namespace {

class SingleProcess final : public TestProcess {
 public:
  std::string summary_name(const std::string& binary) const override { return binary; }
  std::vector<char> combine(const std::vector<char>& failed) const override { return failed; }
  bool prints_summary() const override { return true; }
};

}  // namespace

std::unique_ptr<TestProcess> start_test_process(int&, char**&) { return std::make_unique<SingleProcess>(); }

}  // namespace shardlab::test
