// autograd/batch_chunks.cpp: the BatchChunking scope and the row ranges of its chunks.
#include "autograd/batch_chunks.h"

#include "core/error.h"

namespace shardlab::autograd {
namespace {
thread_local std::optional<BatchChunks> current_chunks;
}  // namespace

BatchChunking::BatchChunking(BatchChunks chunks) : previous_(current_chunks) {
  SHARDLAB_CHECK(chunks.samples > 0 && chunks.chunk > 0 && chunks.samples % chunks.chunk == 0,
                 "BatchChunking: a batch of {} samples does not cut into chunks of {}", chunks.samples,
                 chunks.chunk);
  current_chunks = chunks;
}

BatchChunking::~BatchChunking() { current_chunks = previous_; }

std::optional<BatchChunks> batch_chunks() { return current_chunks; }

std::vector<RowRange> chunk_rows(const BatchChunks& chunks, std::int64_t rows, const char* op) {
  SHARDLAB_CHECK(
      rows % chunks.samples == 0,
      "{}: its {} rows are not a whole number per sample of the batch of {} that BatchChunking cuts "
      "into chunks of {}",
      op, rows, chunks.samples, chunks.chunk);
  const std::int64_t per_chunk = rows / chunks.samples * chunks.chunk;
  std::vector<RowRange> ranges;
  for (std::int64_t start = 0; start < rows; start += per_chunk) ranges.push_back({start, per_chunk});
  return ranges;
}

}  // namespace shardlab::autograd
