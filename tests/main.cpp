// tests/main.cpp: Catch2 runner for every shardlab test binary. Tests tagged [cuda] need a
// GPU, tests tagged [fortunes-corpus] Debian's fortunes (/usr/share/games/fortunes, which
// scripts/setup installs): without what they need they are not run and are reported as skipped,
// never as passed. CUDA-vs-CPU comparisons, tagged [cuda-vs-cpu], run their CPU half without a GPU
// (tests/cuda_compare.h), as the log's first lines say. The last line is "<binary>: N passed, N failed, N
// skipped" (test cases), which scripts/test adds up; under mpirun (tests/runner.h) rank 0 prints it for all
// ranks.
#define CATCH_CONFIG_RUNNER
#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "core/cpu/isa.h"
#include "core/cuda/runtime.h"
#include "tests/runner.h"

namespace {

int skipped_cases = 0;
std::unique_ptr<shardlab::test::TestProcess> test_process;

class SummaryListener : public Catch::TestEventListenerBase {
 public:
  using TestEventListenerBase::TestEventListenerBase;
  void testCaseEnded(const Catch::TestCaseStats& stats) override {
    failed_.push_back(stats.totals.testCases.failed + stats.totals.testCases.failedButOk > 0 ? 1 : 0);
  }
  void testRunEnded(const Catch::TestRunStats& stats) override {
    const std::vector<char> failed = test_process->combine(failed_);
    const auto failures = static_cast<std::size_t>(std::count(failed.begin(), failed.end(), 1));
    if (!test_process->prints_summary()) return;
    std::printf("%s: %zu passed, %zu failed, %d skipped\n",
                test_process->summary_name(stats.runInfo.name).c_str(), failed.size() - failures, failures,
                skipped_cases);
  }

 private:
  std::vector<char> failed_;
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

// A tag whose test cases need something this machine may lack.
struct Requirement {
  const char* tag;
  bool available;
  std::string reason;  // why not, when not
};

}  // namespace

CATCH_REGISTER_LISTENER(SummaryListener)

int main(int argc, char* argv[]) {
  test_process = shardlab::test::start_test_process(argc, argv);
  Catch::Session session;
  if (const int rc = session.applyCommandLine(argc, argv); rc != 0) return rc;
  const bool fortunes = std::filesystem::is_directory("/usr/share/games/fortunes");
  const Requirement requirements[] = {
      {"[cuda]", shardlab::cuda::available(),
       shardlab::cuda::available() ? "" : shardlab::cuda::unavailable_reason()},
      {"[fortunes-corpus]", fortunes, "/usr/share/games/fortunes is missing (scripts/setup installs it)"},
  };
  for (const Requirement& requirement : requirements) {
    if (requirement.available) continue;
    auto& config = session.configData();
    Catch::ConfigData probe = config;
    probe.testsOrTags = {with_term_in_every_alternative(config.testsOrTags, requirement.tag)};
    const Catch::Config probe_config(probe);
    const auto skipped = static_cast<int>(
        Catch::filterTests(Catch::getAllTestCasesSorted(probe_config), probe_config.testSpec(), probe_config)
            .size());
    if (skipped > 0)
      std::printf("skipping %d %s test case(s): %s\n", skipped, requirement.tag, requirement.reason.c_str());
    skipped_cases += skipped;
    config.testsOrTags = {
        with_term_in_every_alternative(config.testsOrTags, std::string("~") + requirement.tag)};
  }
  // CUDA-vs-CPU comparisons (tests/cuda_compare.h) run their CPU half everywhere.
  if (!shardlab::cuda::available()) {
    auto probe = session.configData();
    probe.testsOrTags = {with_term_in_every_alternative(probe.testsOrTags, "[cuda-vs-cpu]")};
    const Catch::Config probe_config(probe);
    const auto halves =
        Catch::filterTests(Catch::getAllTestCasesSorted(probe_config), probe_config.testSpec(), probe_config)
            .size();
    if (halves > 0) {
      std::printf("running the CPU half only of %zu [cuda-vs-cpu] test case(s): %s\n", halves,
                  shardlab::cuda::unavailable_reason().c_str());
    }
  }
  // Results may differ in the last bits between processors: the log says which kernels ran.
  if (test_process->prints_summary()) std::printf("CPU: %s\n", shardlab::cpu::describe_cpu_kernels().c_str());
  const int failed_assertions = session.run();
  test_process.reset();
  return failed_assertions;
}
