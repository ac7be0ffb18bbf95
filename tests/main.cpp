// tests/main.cpp: Catch2 runner for every shardlab test binary. Tests tagged [cuda] need a
// GPU: without one they are not run and are reported as skipped, never as passed. The last
// line is "<binary>: N passed, N failed, N skipped" (test cases), which scripts/test adds up.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#include <cstdio>

#include "core/cuda/runtime.h"

namespace {

int skipped_cases = 0;

class SummaryListener : public Catch::TestEventListenerBase {
 public:
  using TestEventListenerBase::TestEventListenerBase;
  void testRunEnded(const Catch::TestRunStats& stats) override {
    const auto& cases = stats.totals.testCases;
    std::printf("%s: %zu passed, %zu failed, %d skipped\n", stats.runInfo.name.c_str(),
                static_cast<std::size_t>(cases.passed),
                static_cast<std::size_t>(cases.failed + cases.failedButOk), skipped_cases);
  }
};

}  // namespace

CATCH_REGISTER_LISTENER(SummaryListener)

int main(int argc, char* argv[]) {
  Catch::Session session;
  if (const int rc = session.applyCommandLine(argc, argv); rc != 0) return rc;
  if (!shardlab::cuda::available()) {
    // Count the [cuda] cases the filters would run, then exclude them.
    // Separate test-spec arguments are AND-ed by Catch2.
    auto& config = session.configData();
    Catch::ConfigData probe = config;
    probe.testsOrTags.push_back("[cuda]");
    Catch::Config probe_config(probe);
    skipped_cases = static_cast<int>(
        Catch::filterTests(Catch::getAllTestCasesSorted(probe_config), probe_config.testSpec(), probe_config)
            .size());
    if (skipped_cases > 0) {
      std::printf("skipping %d [cuda] test case(s): %s\n", skipped_cases,
                  shardlab::cuda::unavailable_reason().c_str());
    }
    config.testsOrTags.push_back("~[cuda]");
  }
  return session.run();
}
