// autograd/random_context.cpp: the thread-local random context and its guard.
#include "autograd/random_context.h"

#include <utility>

namespace shardlab {
namespace {
thread_local RandomContext current;
}  // namespace

const RandomContext& random_context() { return current; }

RandomContextGuard::RandomContextGuard(RandomContext context)
    : previous_(std::exchange(current, std::move(context))) {}

RandomContextGuard::~RandomContextGuard() { current = std::move(previous_); }

}  // namespace shardlab
