// tests/main.cpp: Catch2 runner for every shardlab test binary. Tests tagged [cuda] need a
// GPU: without one they are not run and are reported as skipped, never as passed. The last
// line is "<binary>: N passed, N failed, N skipped" (test cases), which scripts/test adds up.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>
#include <cstdio>
#include <string>
#include <vector>

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

// Catch2 reads its test-spec arguments as one expression in which commas separate
// alternatives and spaces join terms. Returns that expression with `term` added to every
// alternative (commas inside quoted names are not separators).
std::string with_term_in_every_alternative(const std::vector<std::string>& args, const std::string& term) {
  std::string spec;
  for (const auto& arg : args) spec += (spec.empty() ? "" : " ") + arg;
  if (spec.empty()) return term;
  std::string out;
  bool quoted = false;
  for (const char c : spec) {
    if (c == '"') quoted = !quoted;
    if (c == ',' && !quoted) out += " " + term;
    out += c;
  }
  return out + " " + term;
}

}  // namespace

CATCH_REGISTER_LISTENER(SummaryListener)

int main(int argc, char* argv[]) {
  Catch::Session session;
  if (const int rc = session.applyCommandLine(argc, argv); rc != 0) return rc;
  if (!shardlab::cuda::available()) {
    auto& config = session.configData();
    Catch::ConfigData probe = config;
    probe.testsOrTags = {with_term_in_every_alternative(config.testsOrTags, "[cuda]")};
    const Catch::Config probe_config(probe);
    skipped_cases = static_cast<int>(
        Catch::filterTests(Catch::getAllTestCasesSorted(probe_config), probe_config.testSpec(), probe_config)
            .size());
    if (skipped_cases > 0) {
      std::printf("skipping %d [cuda] test case(s): %s\n", skipped_cases,
                  shardlab::cuda::unavailable_reason().c_str());
    }
    config.testsOrTags = {with_term_in_every_alternative(config.testsOrTags, "~[cuda]")};
  }
  return session.run();
}
