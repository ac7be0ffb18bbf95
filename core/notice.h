// core/notice.h: one-time notices: something worked, but not the way it usually does (a library
// declined a case and a fallback took it), said once per process and cause on stderr and kept for
// the reports, so a slower path is never taken silently.
#pragma once

#include <string>
#include <vector>

namespace shardlab {

// Prints "shardlab: <message>" to stderr and keeps it, the first time `key` is given; later calls
// with the same key do nothing. Thread-safe.
void notice_once(const std::string& key, const std::string& message);

// Every notice given so far, oldest first.
std::vector<std::string> notices();

}  // namespace shardlab
