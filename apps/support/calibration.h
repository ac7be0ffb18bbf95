// apps/support/calibration.h: the measured rates --explain's step time is predicted from: the device's
// (core/roofline.h), kept in a cache file per machine and build and measured again with --recalibrate,
// and the link's (dist/comm/collective_rates.h), measured at every start on the run's own ranks.
#pragma once

#include <string>

#include "core/device.h"
#include "core/roofline.h"
#include "dist/comm/collective_rates.h"
#include "dist/comm/communicator.h"

namespace shardlab::apps {

struct Calibration {
  DeviceRates device;
  dist::CollectiveRates link;
  std::string source;  // where the device's rates came from: "measured now, kept in ...", "from ..."
};

// The cache file: $SHARDLAB_CACHE_DIR/device-rates.json, else under $XDG_CACHE_HOME/shardlab or
// ~/.cache/shardlab. Its entries are keyed by calibration_key.
std::string calibration_cache_path();

// What the device's rates depend on: the host and its processor, the device and its threads, how
// many of the run's ranks share the host (they share its cores and memory), and the program's build.
std::string calibration_key(dist::Communicator& comm, Device device);

// A collective over `comm`: the device's rates from the cache or, with `recalibrate` or none cached,
// measured by every rank at once (the ranks of a host share it as training will) and rank 0's kept;
// then the link's. Every rank returns rank 0's device rates. A cache that cannot be read or written
// is said in `source`, not fatal: the rates are measured.
Calibration calibrate(dist::Communicator& comm, Device device, bool recalibrate);

}  // namespace shardlab::apps
