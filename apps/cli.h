// apps/cli.h: the command-line conventions of every app: option checks whose errors name the option,
// the value and the rule, and one parse that prints "program: --option: ..." once.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace shardlab::apps {

// A whole integer >= `minimum`: "got '1.5', expected an integer >= 1".
CLI::Validator integer_at_least(std::int64_t minimum);
// A finite number >= `minimum`, or > it where `exclusive`: "got '-1', expected a number >= 0".
CLI::Validator number_at_least(double minimum, bool exclusive = false);

// One of `choices`: "got 'gpu', expected one of auto, cpu, cuda".
CLI::Validator one_of(std::vector<std::string> choices);

// "512M", "2G", "1048576": bytes, with an optional K, M, G or T suffix (powers of 1024); nullopt
// for anything else or a count past int64.
std::optional<std::int64_t> parse_bytes(std::string_view text);
// What parse_bytes reads: "got '2X', expected a number of bytes (digits with an optional K, M, G or T: 512M,
// 2G)".
CLI::Validator byte_count();

// Checks, before the work that ends in writing it, that a program can write `path`, given by
// `option`: a directory (`is_directory`: created now, as the program would create it) or a file
// whose directory exists; either writable. Throws an Error naming the option, the path and why.
void check_writable_path(std::string_view option, const std::string& path, bool is_directory);

// Parses the command line. On --help or an error, returns the exit status (0 or 1) after printing (when
// `print`: on one rank of a job) the help or "program: --global-batch: got '0', expected an integer
// >= 1" with the hint to run --help; nullopt when the program should go on.
std::optional<int> parse_command_line(CLI::App& app, int argc, char** argv, const char* program, bool print);

}  // namespace shardlab::apps
