// bench/gemm_libraries.cpp: the Llama benchmark's GEMMs (bench_ops's shapes and layouts) on
// shardlab's GEMM, BLIS and oneDNN from Debian, at one thread count, side by side: the measurement
// behind the choice of shardlab's own GEMM. Built and run by bench/gemm_libraries.sh; its table goes
// through bench/torch_gemm.py for torch.mm's column. With --bits it prints instead a hash of each
// library's result bits per shape, which the script compares across thread counts and instruction sets.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include <blis.h>
#include <oneapi/dnnl/dnnl.h>

#include "core/cpu/gemm.h"
#include "core/parallel.h"

namespace {

// Median seconds per call over 7 samples of about 20 ms each, after a warm-up call.
double seconds_per_call(const std::function<void()>& fn) {
  const auto time = [](const std::function<void()>& f) {
    const auto start = std::chrono::steady_clock::now();
    f();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  const int calls = static_cast<int>(std::clamp(0.02 / std::max(time(fn), 1e-7), 1.0, 10000.0));
  std::vector<double> samples;
  for (int s = 0; s < 7; ++s) samples.push_back(time([&] {
                                                   for (int i = 0; i < calls; ++i) fn();
                                                 }) /
                                                calls);
  std::nth_element(samples.begin(), samples.begin() + 3, samples.end());
  return samples[3];
}

// C [m, n] = A [m, k] B [k, n], row-major; A stored [k, m] when transpose_a, B [n, k] when transpose_b.
struct Shape {
  long m, n, k;
  bool transpose_a, transpose_b;
  std::string label;
};

struct Operands {
  std::vector<float> a, b, c;
  explicit Operands(const Shape& s) : a(s.m * s.k), b(s.k * s.n), c(s.m * s.n) {
    unsigned state = 7;
    for (auto* v : {&a, &b}) {
      for (float& x : *v) x = static_cast<float>((state = state * 1103515245u + 12345u) >> 8) / 16777216.0f - 0.5f;
    }
  }
};

std::function<void()> ours(const Shape& s, Operands& o) {
  using shardlab::cpu::MatrixView;
  const MatrixView<float> a = s.transpose_a ? shardlab::cpu::transposed(o.a.data(), s.m)
                                            : shardlab::cpu::row_major(o.a.data(), s.k);
  const MatrixView<float> b = s.transpose_b ? shardlab::cpu::transposed(o.b.data(), s.k)
                                            : shardlab::cpu::row_major(o.b.data(), s.n);
  return [=, &o] { shardlab::cpu::gemm<float>(s.m, s.n, s.k, a, b, o.c.data(), s.n, false); };
}

std::function<void()> blis(const Shape& s, Operands& o) {
  return [=, &o] {
    cblas_sgemm(CblasRowMajor, s.transpose_a ? CblasTrans : CblasNoTrans, s.transpose_b ? CblasTrans : CblasNoTrans,
                s.m, s.n, s.k, 1.0f, o.a.data(), s.transpose_a ? s.m : s.k, o.b.data(), s.transpose_b ? s.k : s.n,
                0.0f, o.c.data(), s.n);
  };
}

std::function<void()> onednn(const Shape& s, Operands& o) {
  return [=, &o] {
    if (dnnl_sgemm(s.transpose_a ? 'T' : 'N', s.transpose_b ? 'T' : 'N', s.m, s.n, s.k, 1.0f, o.a.data(),
                   s.transpose_a ? s.m : s.k, o.b.data(), s.transpose_b ? s.k : s.n, 0.0f, o.c.data(),
                   s.n) != dnnl_success) {
      std::fprintf(stderr, "gemm_libraries: dnnl_sgemm failed on %s\n", s.label.c_str());
      std::exit(1);
    }
  };
}

// The three GEMMs of a Linear(in, out) on `tokens` rows, as bench_ops names them.
void add_linear(std::vector<Shape>& shapes, const std::string& label, long tokens, long in, long out) {
  shapes.push_back({tokens, out, in, false, true, label});
  shapes.push_back({tokens, in, out, false, false, label + " grad input"});
  shapes.push_back({out, in, tokens, true, false, label + " grad weight"});
}

}  // namespace

// FNV-1a over the bits of C.
unsigned long bits_hash(const std::vector<float>& c) {
  unsigned long hash = 1469598103934665603ul;
  for (const float x : c) {
    unsigned bits;
    std::memcpy(&bits, &x, sizeof bits);
    hash = (hash ^ bits) * 1099511628211ul;
  }
  return hash;
}

int main(int argc, char** argv) {
  const bool bits = argc > 1 && std::string(argv[1]) == "--bits";
  const int threads = argc > 1 + bits ? std::atoi(argv[1 + bits]) : 2;
  shardlab::set_num_threads(threads);
  bli_thread_set_num_threads(threads);  // oneDNN takes OMP_NUM_THREADS, set by the script
  std::vector<Shape> shapes;
  add_linear(shapes, "llama q/o", 4096, 256, 256);
  add_linear(shapes, "llama k/v", 4096, 256, 64);
  add_linear(shapes, "llama gate/up", 4096, 256, 1024);
  add_linear(shapes, "llama down", 4096, 1024, 256);
  add_linear(shapes, "llama head", 4096, 256, 259);
  const char* names[3] = {"ours", "BLIS", "oneDNN"};
  if (bits) {
    for (int library = 0; library < 3; ++library) {
      for (const Shape& s : shapes) {
        Operands o(s);
        (library == 0 ? ours(s, o) : library == 1 ? blis(s, o) : onednn(s, o))();
        std::printf("%s\t%s\t%016lx\n", names[library], s.label.c_str(), bits_hash(o.c));
      }
    }
    return 0;
  }
  std::vector<double> gflops[3];
  // One library at a time over every shape: a library's idle threads then spin on no one's cores.
  for (int library = 0; library < 3; ++library) {
    for (const Shape& s : shapes) {
      Operands o(s);
      const std::function<void()> fn = library == 0 ? ours(s, o) : library == 1 ? blis(s, o) : onednn(s, o);
      gflops[library].push_back(2.0 * s.m * s.n * s.k / seconds_per_call(fn) / 1e9);
    }
  }
  std::printf("gemm_libraries: %d CPU threads; BLIS %s, oneDNN %d.%d\n", threads, bli_info_get_version_str(),
              dnnl_version()->major, dnnl_version()->minor);
  std::printf("%-64s %12s %14s %8s %8s\n", "op (f32)", "ours GFLOP/s", "BLIS GF/s", "oneDNN", "-");
  for (std::size_t i = 0; i < shapes.size(); ++i) {
    const Shape& s = shapes[i];
    // bench_ops's names: each operand's [rows, cols] as the product reads it, ^T where stored transposed.
    const std::string name = "matmul [" + std::to_string(s.m) + ", " + std::to_string(s.k) + "]" +
                             (s.transpose_a ? "^T" : "") + " x [" + std::to_string(s.k) + ", " + std::to_string(s.n) +
                             "]" + (s.transpose_b ? "^T" : "") + " " + s.label;
    std::printf("%-64s %12.1f %14.1f %8.1f %8s\n", name.c_str(), gflops[0][i], gflops[1][i], gflops[2][i], "-");
  }
}
