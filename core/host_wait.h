// core/host_wait.h: the one door through which the host waits for a device's queued work. Each
// wait is counted by its reason, drawn on the trace, and refused inside a HostWaitsForbidden scope,
// which a training step opens so that a wait that would stall the GPU pipeline is an error naming
// its reason rather than a silent slowdown (as torch.cuda.set_sync_debug_mode("error")).
//
//   {
//     HostWaitsForbidden step("training step");
//     forward, backward, optimizer step;  // a loss.item() in here throws, naming the reason
//   }
//   loss.item<double>();                  // counted under "copy to pageable host memory"
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace shardlab {

// Called by every piece of code just before the host blocks until work queued on a device has
// run (`where`: the device, "cuda:0"). Throws Error naming the reason, the device and the scope
// inside a HostWaitsForbidden scope of this thread (unless a HostWaitsUnavoidable scope is inside
// it); counts the wait otherwise.
void host_wait(std::string_view reason, std::string_view where);

// The waits counted since the start (or reset_host_wait_counts), per reason, in order of first use.
struct HostWaitCount {
  std::string reason;
  std::int64_t count = 0;
};
std::vector<HostWaitCount> host_wait_counts();
std::int64_t host_wait_total();
void reset_host_wait_counts();

// While one lives, a host_wait on this thread throws. Scopes nest; the message names the
// innermost.
class HostWaitsForbidden {
 public:
  explicit HostWaitsForbidden(std::string scope);
  ~HostWaitsForbidden();
  HostWaitsForbidden(const HostWaitsForbidden&) = delete;
  HostWaitsForbidden& operator=(const HostWaitsForbidden&) = delete;

 private:
  std::string scope_;
  const std::string* outer_;  // the enclosing scope's name, if any
};

// True when this thread is inside a HostWaitsForbidden scope.
bool host_waits_forbidden();

// For the few waits nothing can avoid once they are needed (an allocation that fits only after the
// cache went back to the device; which parameters some other rank gave a gradient): while one lives,
// the host waits of this thread are allowed even inside a HostWaitsForbidden scope, and each is
// counted and traced under the scope's reason instead of its own, so a step that had one shows it
// in its counts as a slowdown with its cause, never as an error.
//
//   {
//     HostWaitsUnavoidable retry("out of memory: cached blocks returned to the device");
//     release the cache;  // its wait counts under that reason, inside a training step too
//   }
class HostWaitsUnavoidable {
 public:
  explicit HostWaitsUnavoidable(std::string reason);
  ~HostWaitsUnavoidable();
  HostWaitsUnavoidable(const HostWaitsUnavoidable&) = delete;
  HostWaitsUnavoidable& operator=(const HostWaitsUnavoidable&) = delete;

 private:
  std::string reason_;
  const std::string* outer_;
};

}  // namespace shardlab
