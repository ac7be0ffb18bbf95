// apps/cli.cpp: the apps' option checks and their one way of reporting a bad command line.
#include "apps/cli.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <system_error>
#include <utility>

#include "core/error.h"

namespace shardlab::apps {

CLI::Validator integer_at_least(std::int64_t minimum) {
  const std::string rule = fmt::format("an integer >= {}", minimum);
  return CLI::Validator(
      [minimum, rule](std::string& text) -> std::string {
        std::int64_t value = 0;
        const char* end = text.data() + text.size();
        const auto [stop, error] = std::from_chars(text.data(), end, value);
        if (text.empty() || error != std::errc() || stop != end || value < minimum)
          return fmt::format("got '{}', expected {}", text, rule);
        return {};
      },
      fmt::format(">= {}", minimum));  // after CLI11's type in --help: "INT:>= 1"
}

CLI::Validator number_at_least(double minimum, bool exclusive) {
  const std::string rule = fmt::format("a number {} {:g}", exclusive ? ">" : ">=", minimum);
  return CLI::Validator(
      [minimum, exclusive, rule](std::string& text) -> std::string {
        char* stop = nullptr;
        const double value = text.empty() ? NAN : std::strtod(text.c_str(), &stop);
        const bool parsed = !text.empty() && stop == text.c_str() + text.size() && std::isfinite(value);
        if (!parsed || value < minimum || (exclusive && value == minimum))
          return fmt::format("got '{}', expected {}", text, rule);
        return {};
      },
      fmt::format("{} {:g}", exclusive ? ">" : ">=", minimum));
}

CLI::Validator one_of(std::vector<std::string> choices) {
  const std::string listed = fmt::format("{}", fmt::join(choices, ", "));
  return CLI::Validator(
      [choices = std::move(choices), listed](std::string& text) -> std::string {
        if (std::find(choices.begin(), choices.end(), text) != choices.end()) return {};
        return fmt::format("got '{}', expected one of {}", text, listed);
      },
      fmt::format("{{{}}}", listed));
}

std::optional<std::int64_t> parse_bytes(std::string_view text) {
  std::size_t digits = 0;
  while (digits < text.size() && text[digits] >= '0' && text[digits] <= '9') ++digits;
  const std::string_view suffix = text.substr(digits);
  int shift = -1;
  if (suffix.empty()) shift = 0;
  if (suffix == "K") shift = 10;
  if (suffix == "M") shift = 20;
  if (suffix == "G") shift = 30;
  if (suffix == "T") shift = 40;
  std::int64_t value = 0;
  const auto [stop, error] = std::from_chars(text.data(), text.data() + digits, value);
  if (digits == 0 || shift < 0 || error != std::errc() || value > (INT64_MAX >> shift)) return std::nullopt;
  return value << shift;
}

CLI::Validator byte_count() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        if (parse_bytes(text)) return {};
        return fmt::format(
            "got '{}', expected a number of bytes (digits with an optional K, M, G or T: 512M, 2G)", text);
      },
      "BYTES");
}

std::optional<int> parse_command_line(CLI::App& app, int argc, char** argv, const char* program, bool print) {
  // CLI11 prints its own errors bare; every other error of the apps starts with the program.
  app.failure_message([program](const CLI::App*, const CLI::Error& error) {
    return fmt::format("{}: {}\nRun with --help for more information.\n", program, error.what());
  });
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& error) {
    // CLI11's codes (105 for a failed check, ...) say nothing to a shell: a usage error exits 1.
    const int status = print ? app.exit(error) : error.get_exit_code();
    return status == 0 ? 0 : 1;
  }
  return std::nullopt;
}

void check_writable_path(std::string_view option, const std::string& path, bool is_directory) {
  namespace fs = std::filesystem;
  std::error_code error;
  fs::path directory = is_directory ? fs::path(path) : fs::path(path).parent_path();
  if (directory.empty()) directory = ".";
  if (is_directory) {
    fs::create_directories(directory, error);
    SHARDLAB_CHECK(!error, "{} '{}': cannot create the directory: {}", option, path, error.message());
  } else {
    SHARDLAB_CHECK(!fs::is_directory(path, error), "{} '{}' is a directory, not a file", option, path);
    SHARDLAB_CHECK(fs::is_directory(directory, error), "{} '{}': '{}' is not an existing directory", option,
                   path, directory.string());
  }
  SHARDLAB_CHECK(::access(directory.c_str(), W_OK) == 0, "{} '{}': cannot write in '{}': {}", option, path,
                 directory.string(), std::strerror(errno));
}

}  // namespace shardlab::apps
