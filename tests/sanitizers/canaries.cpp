// tests/sanitizers/canaries.cpp: deliberate memory and arithmetic bugs, one per argument, that a
// -Db_sanitize=address,undefined build must catch; tests/sanitizers/canary_tests.py runs each and
// expects the sanitizer's report. Built only with -Dsanitizer_canaries=true.
#include <climits>
#include <cstdio>
#include <cstring>
#include <memory>

namespace {

// The sizes, indices and operands are volatile so the optimizer can neither prove the bug and
// delete the access (undefined behaviour licenses that) nor fold it into a constant.
volatile int ints = 8;
volatile int one = 1;
volatile int largest = INT_MAX;

int heap_buffer_overflow() {
  const auto block = std::make_unique<int[]>(static_cast<std::size_t>(ints));
  const int past_the_end = ints;
  block[past_the_end] = 1;  // one int past the allocation
  return block[0];
}

int use_after_free() {
  int* block = new int[static_cast<std::size_t>(ints)]();
  delete[] block;
  return block[one];
}

int signed_integer_overflow() {
  const int sum = largest + one;  // INT_MAX + 1
  return sum == 0 ? 1 : 0;
}

// The same kinds of operations, in bounds: the program itself works when nothing is wrong.
int clean() {
  const auto block = std::make_unique<int[]>(static_cast<std::size_t>(ints));
  block[ints - 1] = largest - one;
  return block[ints - 1] == INT_MAX - 1 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  const struct {
    const char* name;
    int (*run)();
  } canaries[] = {{"heap-buffer-overflow", heap_buffer_overflow},
                  {"use-after-free", use_after_free},
                  {"signed-integer-overflow", signed_integer_overflow},
                  {"clean", clean}};
  if (argc == 2) {
    for (const auto& canary : canaries) {
      if (std::strcmp(argv[1], canary.name) == 0) return canary.run();
    }
  }
  std::fprintf(stderr, "usage: %s heap-buffer-overflow|use-after-free|signed-integer-overflow|clean\n",
               argv[0]);
  return 2;
}
