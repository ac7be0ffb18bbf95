// apps/support/ranks.h: what the ranks of a training run do together besides training: sums,
// work on rank 0 whose failure every rank sees, text sent from rank 0, output paths checked before
// step 1, and how a global batch splits over the ranks.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "dist/comm/communicator.h"

namespace shardlab::apps {

// The element-wise sums of `values` over all ranks of `comm` (f64: counts stay exact); `tag` names
// the all-reduce in the ledger, the trace and a watchdog's report.
std::vector<double> sum_over_ranks(dist::Communicator& comm, const std::vector<double>& values,
                                   const std::string& tag = "training");

// Runs `work` on rank 0 only. Its failure is thrown on every rank (rank 0's with its message, the
// others' naming `what`), so that no rank waits in a collective that rank 0 never reaches.
void on_rank_zero(dist::Communicator& comm, std::string_view what, const std::function<void()>& work);

// Checks before step 1 (on rank 0, failing on every rank) that the run can write `path`, given by
// `option`: a directory (`is_directory`: created now, as the run would create it) or a file whose
// directory exists; either writable. An output the run could not write would otherwise cost it
// at the end.
void check_output_path(dist::Communicator& comm, std::string_view option, const std::string& path,
                       bool is_directory);

// Rank 0's `text` on every rank (the others' `text` is ignored); a collective.
std::string broadcast_text(dist::Communicator& comm, const std::string& text);

// How a global batch splits over the ranks, for the start-up line: "32 per rank", or where W does
// not divide G, "22 on rank 0, 21 on ranks 1-2" (data::rank_batch_size). With a chunk (bitwise
// training, data::chunk_share): "in chunks of 16, 32 on rank 0, 16 on ranks 1-2".
std::string rank_shares(std::int64_t global_batch, int world_size, std::int64_t chunk = 0);

}  // namespace shardlab::apps
