// tests/apps/installed_table/main.cpp: every entry of the CPU kernel table is set in a program linked
// against the installed static archives, where the linker keeps only the objects something refers to.
#include <cstdio>

#include "core/kernels.h"

int main() {
  const shardlab::EntryCount count = shardlab::count_entries(shardlab::cpu_kernels());
  std::printf("the CPU kernel table: %zu of %zu entries set\n", count.set, count.entries);
  return count.set == count.entries ? 0 : 1;
}
