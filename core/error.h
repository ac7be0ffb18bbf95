// core/error.h: shardlab::Error and the one check macro that throws it with context.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>
#include <utility>

namespace shardlab {

// Every failure a user can cause is reported as an Error whose message names the op and
// the offending values. Library code never exits; only apps/ turns an Error into an exit code.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> format, Args&&... args) {
  throw Error(fmt::format(format, std::forward<Args>(args)...));
}

}  // namespace shardlab

// SHARDLAB_CHECK(cond, "fmt {}", args...): throws shardlab::Error with the formatted message.
#define SHARDLAB_CHECK(cond, ...)               \
  do {                                          \
    if (!(cond)) ::shardlab::fail(__VA_ARGS__); \
  } while (0)
