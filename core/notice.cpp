// core/notice.cpp: one-time notices (core/notice.h).
#include "core/notice.h"

#include <cstdio>
#include <mutex>
#include <set>

namespace shardlab {

namespace {
std::mutex mutex;
std::set<std::string> given_keys;
std::vector<std::string> given;
}  // namespace

void notice_once(const std::string& key, const std::string& message) {
  const std::lock_guard lock(mutex);
  if (!given_keys.insert(key).second) return;
  given.push_back(message);
  std::fprintf(stderr, "shardlab: %s\n", message.c_str());
}

std::vector<std::string> notices() {
  const std::lock_guard lock(mutex);
  return given;
}

}  // namespace shardlab
