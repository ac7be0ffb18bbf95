// core/call_stack.h: the calling functions of this point of a program, demangled, for diagnostics.
#pragma once

#include <string>

namespace shardlab {

// One line per frame, innermost first, without call_stack itself and the `skip` frames above it:
// "  #0 shardlab::Tensor::to(shardlab::Device) const (train_cnn+0x1a2b3c)". Names come from the
// dynamic symbol table: a program linked with -rdynamic (meson's export_dynamic, as the training
// programs are) names its own functions; elsewhere a frame shows its object and offset, which
// `addr2line -f -C -e OBJECT OFFSET` turns into a function and line.
std::string call_stack(int skip = 0);

}  // namespace shardlab
