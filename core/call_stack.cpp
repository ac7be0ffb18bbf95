// core/call_stack.cpp: the call stack through glibc's backtrace, names demangled.
#include "core/call_stack.h"

#include <cxxabi.h>
#include <execinfo.h>
#include <fmt/format.h>

#include <cstdlib>
#include <memory>
#include <string_view>

namespace shardlab {
namespace {

// "object(mangled+0x1f) [0x...]" -> "demangled (object+0x1f)"; a line in another form as it is.
std::string readable(std::string_view symbol) {
  const std::size_t open = symbol.find('('), plus = symbol.find('+', open), close = symbol.find(')', open);
  if (open == std::string_view::npos || close == std::string_view::npos || plus == std::string_view::npos ||
      plus > close)
    return std::string(symbol);
  const std::string object(symbol.substr(0, open));
  const std::string mangled(symbol.substr(open + 1, plus - open - 1));
  const std::string_view offset = symbol.substr(plus, close - plus);
  if (mangled.empty()) return fmt::format("{}({})", object, offset);
  int status = 0;
  const std::unique_ptr<char, void (*)(void*)> demangled(
      abi::__cxa_demangle(mangled.c_str(), nullptr, nullptr, &status), std::free);
  return fmt::format("{} ({}{})", status == 0 ? demangled.get() : mangled.c_str(), object, offset);
}

}  // namespace

std::string call_stack(int skip) {
  constexpr int kMaxFrames = 64;
  void* frames[kMaxFrames];
  const int count = backtrace(frames, kMaxFrames);
  const std::unique_ptr<char*, void (*)(void*)> symbols(backtrace_symbols(frames, count), std::free);
  std::string out;
  if (!symbols) return out;
  for (int i = 1 + skip; i < count; ++i)
    out += fmt::format("  #{} {}\n", i - 1 - skip, readable(symbols.get()[i]));
  return out;
}

}  // namespace shardlab
