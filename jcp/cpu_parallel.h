// Work over XLA's intra-op thread pool, shared by jcp's CPU kernels (jcp/cpu_kernels.py
// builds them into one library: attention/cpu_flash.cc, lora_cpu.cc).
//
// parallel_for(pool, n, f): items 0 … n-1 taken from one atomic counter by the caller and
// by up to (threads - 1) scheduled tasks. The caller always drains the counter itself, so
// a task the pool starts late (or never) costs nothing; a late task sees the counter
// exhausted and touches only the shared state it holds.

#ifndef JCP_CPU_PARALLEL_H_
#define JCP_CPU_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jcp_cpu {

// Floats in one of the widest vector registers the build targets (-march=native): 16 with
// AVX-512, else 8 (AVX2; SSE splits such a vector in two). The kernels size their vectors
// and register blocks by it; JcpCpuVectorFloats (cpu_flash.cc) reports it to Python.
#if defined(__AVX512F__)
#define JCP_VECTOR_FLOATS 16
#else
#define JCP_VECTOR_FLOATS 8
#endif
constexpr int kVectorFloats = JCP_VECTOR_FLOATS;

struct Counter {
  std::atomic<int64_t> next{0}, done{0};
};

template <typename F>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t n, const F& f) {
  if (n <= 0) return;
  const int64_t workers = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), n);
  auto st = std::make_shared<Counter>();
  const F* fp = &f;
  auto work = [st, n, fp]() {
    for (;;) {
      const int64_t i = st->next.fetch_add(1);
      if (i >= n) return;
      (*fp)(i);
      st->done.fetch_add(1, std::memory_order_release);
    }
  };
  for (int64_t w = 1; w < workers; ++w) pool.Schedule(decltype(work)(work));
  work();
  while (st->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

}  // namespace jcp_cpu

#endif  // JCP_CPU_PARALLEL_H_
