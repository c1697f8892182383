// The grouped LoRA products of a multi-LoRA pass for XLA:CPU (jcp/lora_cpu.py): each row
// multiplied by its own adapter's factors, read in place from the slot table's pages.
//
// Built with jcp's other CPU kernels by jcp/cpu_kernels.py (-O3 -march=native), so the
// loops below are written for the compiler's vectorizer: GCC vector types of one page's
// rank (4 … 32 floats) for the factors' rank axis and of 16 floats along a wide axis,
// accumulators held in registers over a few rows. The register blocks are sized for
// AVX-512 (32 registers of 16 floats); on AVX2 (16 registers of 8: jcp/cpu_parallel.h) a
// vector wider than a register is an array of registers (Wide, below) and each block is
// cut to at most kAccRegs registers of accumulators.
//
// Shapes (one device's shards): rows Q, each row's adapter row_k [Q] (an index into pages;
// < 0 or ≥ A: no adapter, its outputs 0); pages [A, K] each adapter's K pages (an entry
// outside [0, P): a page of zeros); a factor's table of P pages [P, L, I, R] ("a" factors:
// input I, the page's rank R last) or [P, L, R, O] ("b" factors); layer [1]. An adapter's
// C = K·R columns are its pages' rank columns side by side (page k: [k·R, (k+1)·R)).
//
//   AForward   x [Q, I]            -> u [Q, C]       u = x · A(row)
//   BForward   u [Q, C]            -> y [Q, O]       y = u · B(row)
//   ABackward  x [Q, I], du [Q, C] -> dx [Q, I], dA [A, K, I, R]
//   BBackward  u [Q, C], dy [Q, O] -> du [Q, C], dB [A, K, R, O]
//
// Work: each row meets its own adapter's pages only; a factor page is read once per piece
// of at most kPiece rows of one adapter (forward, dx) and once per adapter (dA, dB), never
// copied per row. Threads: XLA's intra-op pool (ffi::ThreadPool), items from one atomic
// counter; the gradients of the factors are split by (adapter, column chunk), so no two
// items write the same output.

#include <algorithm>
#include <cmath>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "cpu_parallel.h"

namespace ffi = xla::ffi;

namespace {

typedef float f8 __attribute__((vector_size(32)));
typedef float f4 __attribute__((vector_size(16)));

// A vector of Nf floats wider than the machine's (jcp/cpu_parallel.h) as an array of
// native ones. GCC lowers a vector type wider than the target's registers through memory
// (each operation a store and partial reloads: store-forwarding stalls), which made these
// kernels up to 18× slower than XLA's dots on AVX2; an array of native vectors, loaded and
// stored part by part, stays in registers (rows_by_a's block 6× faster in isolation).
template <int Nf>
struct Wide {
  typedef float nv __attribute__((vector_size(4 * jcp_cpu::kVectorFloats)));
  static constexpr int kParts = Nf / jcp_cpu::kVectorFloats;
  nv p[kParts];

  Wide() : p{} {}
  float operator[](int l) const { return p[l / jcp_cpu::kVectorFloats][l % jcp_cpu::kVectorFloats]; }
  Wide& operator+=(const Wide& o) {
    for (int i = 0; i < kParts; ++i) p[i] += o.p[i];
    return *this;
  }
  friend Wide operator+(Wide a, const Wide& b) { return a += b; }
  friend Wide operator-(Wide a, const Wide& b) {
    for (int i = 0; i < kParts; ++i) a.p[i] -= b.p[i];
    return a;
  }
  friend Wide operator*(Wide a, const Wide& b) {
    for (int i = 0; i < kParts; ++i) a.p[i] *= b.p[i];
    return a;
  }
  friend Wide operator*(float s, Wide a) {
    for (int i = 0; i < kParts; ++i) a.p[i] *= s;
    return a;
  }
};

// Along a wide axis (O, or I for dx): 16 floats, one AVX-512 register (two AVX2 ones).
#if JCP_VECTOR_FLOATS >= 16
typedef float fw __attribute__((vector_size(64)));
#else
typedef Wide<16> fw;
#endif
typedef Wide<32> f32x32;  // a page of rank 32: two AVX-512 registers, four AVX2 ones
constexpr int kW = 16;
// Registers per fw (1 with AVX-512, 2 with AVX2), and the most registers a block's
// accumulators may take: none of AVX-512's blocks is cut (the largest holds 32 of its 32
// registers: rank 32, 8 rows, 2 pages); AVX2's hold at most 12 of 16, leaving room for
// the operands.
constexpr int kFwRegs = kW / jcp_cpu::kVectorFloats;
constexpr int kAccRegs = jcp_cpu::kVectorFloats >= 16 ? 32 : 12;

// Registers of a vector of n floats (an xmm-sized one counts one).
constexpr int regs_of(int n) {
  return n <= jcp_cpu::kVectorFloats ? 1 : n / jcp_cpu::kVectorFloats;
}

// The rows of a register block that keeps `most` rows of `per_row` registers each within
// kAccRegs: `most` halved until it fits (1 at least).
constexpr int block_rows(int most, int per_row) {
  return (most == 1 || most * per_row <= kAccRegs) ? most : block_rows(most / 2, per_row);
}

template <int R>
struct Lanes;
template <>
struct Lanes<8> {
  typedef f8 type;
};
template <>
struct Lanes<4> {
  typedef f4 type;
};
template <>
struct Lanes<16> {
  typedef fw type;
};
template <>
struct Lanes<32> {
  typedef f32x32 type;
};

template <typename V>
struct Io {
  static V load(const float* p) {
    V v;
    std::memcpy(&v, p, sizeof(V));
    return v;
  }
  static void store(float* p, const V& v) { std::memcpy(p, &v, sizeof(V)); }
};
template <int Nf>
struct Io<Wide<Nf>> {
  typedef typename Wide<Nf>::nv nv;
  static Wide<Nf> load(const float* p) {
    Wide<Nf> w;
    for (int i = 0; i < Wide<Nf>::kParts; ++i) w.p[i] = Io<nv>::load(p + i * jcp_cpu::kVectorFloats);
    return w;
  }
  static void store(float* p, const Wide<Nf>& w) {
    for (int i = 0; i < Wide<Nf>::kParts; ++i) Io<nv>::store(p + i * jcp_cpu::kVectorFloats, w.p[i]);
  }
};

template <typename V>
inline V load(const float* p) {
  return Io<V>::load(p);
}

template <typename V>
inline void store(float* p, const V& v) {
  Io<V>::store(p, v);
}

using jcp_cpu::parallel_for;  // cpu_parallel.h: work over XLA's intra-op pool

// Per-thread scratch that work items reuse, one buffer per Slot: no allocation per item
// (at many adapters the items are small, and under jcp's malloc settings,
// jcp/host_memory.py, all threads share one heap and its lock). Contents are not cleared.
template <typename T, int Slot>
T* scratch(size_t n) {
  thread_local std::vector<T> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

// ---------------------------------------------------------------------------------------
// Routing

constexpr int64_t kPiece = 32;  // rows of one adapter per forward / dx work item

struct Run {
  int64_t start, end;
  int32_t k;  // the adapter, -1 for none
};

struct Routing {
  int64_t Q, A, K, P, L, layer;
  const int32_t* row_k;
  const int32_t* pages;

  int32_t adapter(int64_t q) const {
    const int32_t k = row_k[q];
    return (k < 0 || k >= A) ? -1 : k;
  }
  // Page kk of adapter k's rows: its offset in a table of P pages of `page` floats each
  // per layer, or -1 for a page of zeros.
  int64_t page(int32_t k, int64_t kk, int64_t floats) const {
    const int64_t p = pages[k * K + kk];
    return (p < 0 || p >= P) ? -1 : (p * L + layer) * floats;
  }
  // The rows in runs of one adapter, cut into pieces of at most `most` rows.
  std::vector<Run> runs(int64_t most) const {
    std::vector<Run> out;
    for (int64_t q = 0; q < Q;) {
      const int32_t k = adapter(q);
      int64_t e = q + 1;
      while (e < Q && adapter(e) == k && e - q < most) ++e;
      out.push_back({q, e, k});
      q = e;
    }
    return out;
  }
  // Each adapter's runs (rows of no adapter left out).
  std::vector<std::vector<Run>> by_adapter() const {
    std::vector<std::vector<Run>> out(A);
    for (const Run& r : runs(Q))
      if (r.k >= 0) out[r.k].push_back(r);
    return out;
  }
};

Routing routing(ffi::Buffer<ffi::S32>& row_k, ffi::Buffer<ffi::S32>& pages,
                ffi::Buffer<ffi::S32>& layer, int64_t P, int64_t L) {
  const auto pd = pages.dimensions();
  return {row_k.dimensions()[0], pd[0], pd[1], P, L, layer.typed_data()[0],
          row_k.typed_data(), pages.typed_data()};
}

// ---------------------------------------------------------------------------------------
// u = x · A: N rows of x [·, I] times V pages of A [I, R] each -> u [N, V·R] (row stride
// ustride). The rank axis is one vector; per i, N broadcasts and N·V FMAs.

template <int N, int R, int V>
inline void rows_by_a(const float* x, int64_t I, const float* const* w, float* u,
                      int64_t ustride) {
  typedef typename Lanes<R>::type vr;
  vr acc[N][V] = {};
  for (int64_t i = 0; i < I; ++i) {
    vr wi[V];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) wi[v] = load<vr>(w[v] + i * R);
#pragma GCC unroll 8
    for (int m = 0; m < N; ++m) {
      const float xv = x[m * I + i];
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[m][v] += xv * wi[v];
    }
  }
  for (int m = 0; m < N; ++m)
    for (int v = 0; v < V; ++v) store(u + m * ustride + v * R, acc[m][v]);
}

template <int R, int V>
void piece_by_a(const float* x, int64_t I, const float* const* w, float* u, int64_t ustride,
                int64_t n) {
  constexpr int NB = block_rows(8, V * regs_of(R));  // 8 with AVX-512
  for (; n >= NB; n -= NB, x += NB * I, u += NB * ustride) rows_by_a<NB, R, V>(x, I, w, u, ustride);
  if constexpr (NB > 4)
    if (n & 4) rows_by_a<4, R, V>(x, I, w, u, ustride), x += 4 * I, u += 4 * ustride;
  if constexpr (NB > 2)
    if (n & 2) rows_by_a<2, R, V>(x, I, w, u, ustride), x += 2 * I, u += 2 * ustride;
  if constexpr (NB > 1)
    if (n & 1) rows_by_a<1, R, V>(x, I, w, u, ustride);
}

template <int R>
void a_forward(ffi::ThreadPool& pool, const Routing& rt, const float* x, int64_t I,
               const float* table, float* u) {
  const int64_t C = rt.K * R;
  const std::vector<Run> items = rt.runs(kPiece);
  const std::vector<float> zeros(I * R, 0.0f);
  parallel_for(pool, items.size(), [&](int64_t it) {
    const Run& r = items[it];
    if (r.k < 0) {
      std::memset(u + r.start * C, 0, (r.end - r.start) * C * sizeof(float));
      return;
    }
    for (int64_t kk = 0; kk < rt.K; kk += 2) {
      const float* w[2];
      for (int v = 0; v < 2 && kk + v < rt.K; ++v) {
        const int64_t off = rt.page(r.k, kk + v, I * R);
        w[v] = off < 0 ? zeros.data() : table + off;
      }
      const float* xs = x + r.start * I;
      float* us = u + r.start * C + kk * R;
      if (kk + 1 < rt.K)
        piece_by_a<R, 2>(xs, I, w, us, C, r.end - r.start);
      else
        piece_by_a<R, 1>(xs, I, w, us, C, r.end - r.start);
    }
  });
}

// ---------------------------------------------------------------------------------------
// y = u · B panel product: N rows of u [·, C] times C panel rows b[c] [O] -> y [N, O]
// (a wide output: NV vectors V along O per column block, N rows in registers).

template <int N, int NV, typename V>
inline void rows_by_panel_block(const float* u, int64_t ustride, int64_t C,
                                const float* const* b, int64_t o0, float* y,
                                int64_t ystride) {
  constexpr int lanes = sizeof(V) / sizeof(float);
  V acc[N][NV] = {};
  for (int64_t c = 0; c < C; ++c) {
    V bc[NV];
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) bc[v] = load<V>(b[c] + o0 + lanes * v);
#pragma GCC unroll 4
    for (int m = 0; m < N; ++m) {
      const float uv = u[m * ustride + c];
#pragma GCC unroll 8
      for (int v = 0; v < NV; ++v) acc[m][v] += uv * bc[v];
    }
  }
  for (int m = 0; m < N; ++m)
    for (int v = 0; v < NV; ++v) store(y + m * ystride + o0 + lanes * v, acc[m][v]);
}

// Rows C of a panel (or of a factor block) sit O floats apart: with O a power of two, all
// of them fall in one L1 set and evict each other. The loops below first copy the block
// they reuse into a contiguous buffer (pack).
inline void pack(const float* const* rows, int64_t n, int64_t o0, int64_t width, float* buf) {
  for (int64_t c = 0; c < n; ++c) std::memcpy(buf + c * width, rows[c] + o0, width * sizeof(float));
}

// n rows: the panel's column blocks outer (a block of C × 64, packed, stays in L1 over the
// rows), fours of rows inner; fewer than 4 rows (a decode batch's single rows) read the
// panel where it lies.
void piece_by_panel(const float* u, int64_t ustride, int64_t C, const float* const* b,
                    int64_t O, float* y, int64_t ystride, int64_t n) {
  float* buf = scratch<float, 0>(C * 64);
  const float** bp = scratch<const float*, 1>(C);
  for (int64_t c = 0; c < C; ++c) bp[c] = buf + c * 64;
  int64_t o = 0;
  if (n < 4) {  // each panel row is read once per row: one stream along it, y in L1
    const int64_t wide = O - O % kW;
    for (int64_t m = 0; m < n; ++m) {
      float* ym = y + m * ystride;
      std::memset(ym, 0, wide * sizeof(float));
      int64_t c = 0;
      for (; c + 4 <= C; c += 4) {
        const float* um = u + m * ustride + c;
        const float *b0 = b[c], *b1 = b[c + 1], *b2 = b[c + 2], *b3 = b[c + 3];
        for (int64_t t = 0; t < wide; t += kW) {
          fw acc = load<fw>(ym + t);
          acc += um[0] * load<fw>(b0 + t);
          acc += um[1] * load<fw>(b1 + t);
          acc += um[2] * load<fw>(b2 + t);
          acc += um[3] * load<fw>(b3 + t);
          store(ym + t, acc);
        }
      }
      for (; c < C; ++c) {
        const float uv = u[m * ustride + c];
        const float* bc = b[c];
        for (int64_t t = 0; t < wide; t += kW) store(ym + t, load<fw>(ym + t) + uv * load<fw>(bc + t));
      }
    }
    o = wide;
  }
  // A block of 64 columns: 4 rows × 4 fw with AVX-512; with AVX2, each half of it as
  // 2 rows × 2 fw (8 registers).
  constexpr int NV = 4 / kFwRegs, NR = block_rows(4, NV * kFwRegs);
  for (; o + 64 <= O; o += 64) {
    pack(b, C, o, 64, buf);
    for (int64_t h = 0; h < 64; h += NV * kW) {
      int64_t m = 0;
      for (; m + NR <= n; m += NR)
        rows_by_panel_block<NR, NV, fw>(u + m * ustride, ustride, C, bp, h, y + m * ystride + o,
                                        ystride);
      for (; m < n; ++m)
        rows_by_panel_block<1, NV, fw>(u + m * ustride, ustride, C, bp, h, y + m * ystride + o,
                                       ystride);
    }
  }
  for (; o + 8 <= O; o += 8)
    for (int64_t m = 0; m < n; ++m)
      rows_by_panel_block<1, 1, f8>(u + m * ustride, ustride, C, b, o, y + m * ystride, ystride);
  for (; o < O; ++o)
    for (int64_t m = 0; m < n; ++m) {
      float s = 0.0f;
      for (int64_t c = 0; c < C; ++c) s += u[m * ustride + c] * b[c][o];
      y[m * ystride + o] = s;
    }
}

// The C panel rows of adapter k's pages in a "b"-layout table [P, L, R, O]: page kk's row j
// is panel row kk·R + j (zeros for a page of zeros).
template <int R>
void b_rows(const Routing& rt, int32_t k, const float* table, int64_t O, const float* zeros,
            const float** b) {
  for (int64_t kk = 0; kk < rt.K; ++kk) {
    const int64_t off = rt.page(k, kk, R * O);
    for (int j = 0; j < R; ++j) b[kk * R + j] = off < 0 ? zeros : table + off + j * O;
  }
}

template <int R>
void b_forward(ffi::ThreadPool& pool, const Routing& rt, const float* u, const float* table,
               int64_t O, float* y) {
  const int64_t C = rt.K * R;
  const std::vector<Run> items = rt.runs(kPiece);
  const std::vector<float> zeros(O, 0.0f);
  parallel_for(pool, items.size(), [&](int64_t it) {
    const Run& r = items[it];
    if (r.k < 0) {
      std::memset(y + r.start * O, 0, (r.end - r.start) * O * sizeof(float));
      return;
    }
    const float** b = scratch<const float*, 2>(C);
    b_rows<R>(rt, r.k, table, O, zeros.data(), b);
    piece_by_panel(u + r.start * C, C, C, b, O, y + r.start * O, O, r.end - r.start);
  });
}

// ---------------------------------------------------------------------------------------
// Where a factor gradient goes: out into dw [A, K, …page], or added in place into the
// accumulator's pages of the layer (acc [P, L, …page], a page outside it dropped) with
// each work item noting whether its values were all finite.
struct Sink {
  const Routing& rt;
  int64_t page;  // floats per page
  float* dw;
  float* acc;
  std::vector<char>& bad;  // per work item

  // n gradient values of page kk of adapter k, from offset `off` within the page.
  void put(int64_t item, int64_t k, int64_t kk, int64_t off, const float* g, int64_t n) const {
    if (dw) {
      std::memcpy(dw + (k * rt.K + kk) * page + off, g, n * sizeof(float));
      return;
    }
    // All finite iff Σ (g − g) is 0 (inf − inf and NaN − NaN are NaN), summed 16 wide.
    fw zv = {};
    int64_t t = 0;
    for (; t + kW <= n; t += kW) {
      const fw v = load<fw>(g + t);
      zv += v - v;
    }
    float z = 0.0f;
    for (int l = 0; l < kW; ++l) z += zv[l];
    for (; t < n; ++t) z += g[t] - g[t];
    if (z != 0.0f) bad[item] = 1;
    const int64_t at = rt.page(k, kk, page);
    if (at < 0) return;
    float* a = acc + at + off;
    for (t = 0; t < n; ++t) a[t] += g[t];
  }
};

// dA [A, K, I, R] = Σ over each adapter's rows of xᵀ · du: items (adapter, (page, chunk of
// I) units); per i, N rows' du vectors in registers, a unit's sums in an L1 buffer.

constexpr int64_t kChunk = 128;

template <int N, int R>
inline void accumulate_a(const float* x, int64_t I, const float* du, int64_t dustride,
                         int64_t i0, int64_t i1, float* acc) {
  typedef typename Lanes<R>::type vr;
  vr d[N];
  for (int m = 0; m < N; ++m) d[m] = load<vr>(du + m * dustride);
  for (int64_t i = i0; i < i1; ++i) {
    vr a = load<vr>(acc + (i - i0) * R);
#pragma GCC unroll 8
    for (int m = 0; m < N; ++m) a += x[m * I + i] * d[m];
    store(acc + (i - i0) * R, a);
  }
}

// Work items of the factor gradients: (adapter, a span of its `units` column units), at
// least kItems of them where the adapters are few (one adapter's gradient split over the
// threads) and one per adapter where they are many (a unit's work is then small: its
// buffers and bookkeeping are paid once per adapter).
constexpr int64_t kItems = 32;

inline int64_t spans_per_adapter(int64_t A, int64_t units) {
  return std::min(units, std::max<int64_t>(1, (kItems + A - 1) / std::max<int64_t>(A, 1)));
}

template <int R>
void a_weight_grad(ffi::ThreadPool& pool, const Routing& rt,
                   const std::vector<std::vector<Run>>& runs, const float* x, int64_t I,
                   const float* du, const Sink& sink) {
  const int64_t C = rt.K * R, chunks = (I + kChunk - 1) / kChunk, units = rt.K * chunks;
  const int64_t spans = spans_per_adapter(rt.A, units), per = (units + spans - 1) / spans;
  sink.bad.assign(rt.A * spans, 0);
  parallel_for(pool, rt.A * spans, [&](int64_t it) {
    const int64_t k = it / spans, u0 = (it % spans) * per, u1 = std::min(units, u0 + per);
    for (int64_t unit = u0; unit < u1; ++unit) {
      const int64_t kk = unit / chunks, i0 = (unit % chunks) * kChunk;
      const int64_t i1 = std::min(I, i0 + kChunk);
      float acc[kChunk * R] = {};
      constexpr int NB = block_rows(4, regs_of(R));  // 4 with AVX-512
      for (const Run& r : runs[k]) {
        int64_t q = r.start;
        for (; q + NB <= r.end; q += NB)
          accumulate_a<NB, R>(x + q * I, I, du + q * C + kk * R, C, i0, i1, acc);
        for (; q < r.end; ++q)
          accumulate_a<1, R>(x + q * I, I, du + q * C + kk * R, C, i0, i1, acc);
      }
      sink.put(it, k, kk, i0 * R, acc, (i1 - i0) * R);
    }
  });
}

// dB [A, K, R, O] = Σ over each adapter's rows of uᵀ · dy: items (adapter, chunks of O);
// the rows in blocks of kRows, so a block of dy [kRows, 64] (packed) stays in L1 over the
// C panel rows, each accumulating in 8-wide vectors into the chunk's sums (an L1 buffer).
constexpr int64_t kRows = 64;

void b_weight_grad(ffi::ThreadPool& pool, const Routing& rt,
                   const std::vector<std::vector<Run>>& runs, const float* u, int64_t C,
                   int64_t R, const float* dy, int64_t O, const Sink& sink) {
  const int64_t chunks = (O + kChunk - 1) / kChunk;
  const int64_t spans = spans_per_adapter(rt.A, chunks), per = (chunks + spans - 1) / spans;
  sink.bad.assign(rt.A * spans, 0);
  parallel_for(pool, rt.A * spans, [&](int64_t it) {
    const int64_t k = it / spans, ch0 = (it % spans) * per, ch1 = std::min(chunks, ch0 + per);
    float* out = scratch<float, 3>(C * kChunk);  // the chunk's panel row c at out + c·w
    float* buf = scratch<float, 4>(kRows * 64);
    for (int64_t ch = ch0; ch < ch1; ++ch) {
      const int64_t o0 = ch * kChunk, w = std::min(O, o0 + kChunk) - o0;
      std::fill(out, out + C * w, 0.0f);
      for (const Run& r : runs[k])
        for (int64_t q0 = r.start; q0 < r.end; q0 += kRows) {
          const int64_t q1 = std::min(r.end, q0 + kRows);
          int64_t o = 0;
          for (; o + 64 <= w; o += 64) {
            for (int64_t q = q0; q < q1; ++q)
              std::memcpy(buf + (q - q0) * 64, dy + q * O + o0 + o, 64 * sizeof(float));
            int64_t c = 0;
            // Two panel rows share each load of dy, over the block's 4 fw (AVX-512) or
            // over each half of it (AVX2: 8 registers).
            constexpr int NV = 4 / kFwRegs;
            for (; c + 2 <= C; c += 2)
              for (int h = 0; h < 4; h += NV) {
                fw a0[NV], a1[NV];
                for (int v = 0; v < NV; ++v)
                  a0[v] = load<fw>(&out[c * w + o + kW * (h + v)]),
                  a1[v] = load<fw>(&out[(c + 1) * w + o + kW * (h + v)]);
                for (int64_t q = q0; q < q1; ++q) {
                  const float u0 = u[q * C + c], u1 = u[q * C + c + 1];
                  const float* d = buf + (q - q0) * 64 + kW * h;
#pragma GCC unroll 4
                  for (int v = 0; v < NV; ++v) {
                    const fw dv = load<fw>(d + kW * v);
                    a0[v] += u0 * dv;
                    a1[v] += u1 * dv;
                  }
                }
                for (int v = 0; v < NV; ++v)
                  store(&out[c * w + o + kW * (h + v)], a0[v]),
                      store(&out[(c + 1) * w + o + kW * (h + v)], a1[v]);
              }
            for (; c < C; ++c) {
              fw acc[4];
              for (int v = 0; v < 4; ++v) acc[v] = load<fw>(&out[c * w + o + kW * v]);
              for (int64_t q = q0; q < q1; ++q) {
                const float uv = u[q * C + c];
#pragma GCC unroll 4
                for (int v = 0; v < 4; ++v)
                  acc[v] += uv * load<fw>(buf + (q - q0) * 64 + kW * v);
              }
              for (int v = 0; v < 4; ++v) store(&out[c * w + o + kW * v], acc[v]);
            }
          }
          for (; o < w; ++o)
            for (int64_t c = 0; c < C; ++c) {
              float s = out[c * w + o];
              for (int64_t q = q0; q < q1; ++q) s += u[q * C + c] * dy[q * O + o0 + o];
              out[c * w + o] = s;
            }
        }
      for (int64_t c = 0; c < C; ++c)  // [A, K, R, O]: page c / R, its row c % R
        sink.put(it, k, c / R, (c % R) * O + o0, &out[c * w], w);
    }
  });
}

// du [Q, C] = dy · Bᵀ: per row, C dot products of length O, as 16-wide partial sums over
// chunks of O (the panel's chunk stays in L1 over the piece's rows), N rows and G panel
// rows at a time: 2 and 8 with AVX-512, 1 and 4 with AVX2 (8 registers). part: N rows of
// G partial sums each.
template <int N, int G>
inline void dots_block(const float* dy, int64_t O, const float* const* b, int64_t o0,
                       int64_t o1, fw* part) {
  fw acc[N][G];
  for (int m = 0; m < N; ++m)
    for (int c = 0; c < G; ++c) acc[m][c] = part[m * G + c];
  for (int64_t o = o0; o < o1; o += kW) {
    fw d[N];
    for (int m = 0; m < N; ++m) d[m] = load<fw>(dy + m * O + o);
#pragma GCC unroll 8
    for (int c = 0; c < G; ++c) {
      const fw bc = load<fw>(b[c] + o);
      for (int m = 0; m < N; ++m) acc[m][c] += d[m] * bc;
    }
  }
  for (int m = 0; m < N; ++m)
    for (int c = 0; c < G; ++c) part[m * G + c] = acc[m][c];
}

template <int R>
void b_input_grad(ffi::ThreadPool& pool, const Routing& rt, const float* dy, const float* table,
                  int64_t O, float* du) {
  const int64_t C = rt.K * R, C8 = (C + 7) / 8 * 8, O8 = O / kW * kW;
  const std::vector<Run> items = rt.runs(kPiece);
  const std::vector<float> zeros(O, 0.0f);
  parallel_for(pool, items.size(), [&](int64_t it) {
    const Run& r = items[it];
    const int64_t n = r.end - r.start;
    if (r.k < 0) {
      std::memset(du + r.start * C, 0, n * C * sizeof(float));
      return;
    }
    const float** b = scratch<const float*, 2>(C8);
    std::fill(b, b + C8, zeros.data());
    b_rows<R>(rt, r.k, table, O, zeros.data(), b);
    fw* part = scratch<fw, 5>(n * C8);  // [rows, C8 / 8 groups, 8 panel rows]
    std::fill(part, part + n * C8, fw{});
    float* buf = scratch<float, 6>(C8 * kChunk);
    const float** bp = scratch<const float*, 7>(C8);
    for (int64_t o0 = 0; o0 < O8; o0 += kChunk) {
      const int64_t o1 = std::min(O8, o0 + kChunk), w = o1 - o0;
      pack(b, C8, o0, w, buf);
      for (int64_t c = 0; c < C8; ++c) bp[c] = buf + c * w - o0;  // indexed by o
      if constexpr (kFwRegs == 1) {
        for (int64_t g = 0; g < C8; g += 8) {
          int64_t m = 0;
          for (; m + 2 <= n; m += 2) {
            fw p[16];
            for (int t = 0; t < 8; ++t)
              p[t] = part[m * C8 + g + t], p[8 + t] = part[(m + 1) * C8 + g + t];
            dots_block<2, 8>(dy + (r.start + m) * O, O, bp + g, o0, o1, p);
            for (int t = 0; t < 8; ++t)
              part[m * C8 + g + t] = p[t], part[(m + 1) * C8 + g + t] = p[8 + t];
          }
          if (m < n)
            dots_block<1, 8>(dy + (r.start + m) * O, O, bp + g, o0, o1, part + m * C8 + g);
        }
      } else {
        for (int64_t g = 0; g < C8; g += 4)
          for (int64_t m = 0; m < n; ++m)
            dots_block<1, 4>(dy + (r.start + m) * O, O, bp + g, o0, o1, part + m * C8 + g);
      }
    }
    for (int64_t m = 0; m < n; ++m) {
      const float* d = dy + (r.start + m) * O;
      for (int64_t c = 0; c < C; ++c) {
        float s = 0.0f;
        for (int l = 0; l < kW; ++l) s += part[m * C8 + c][l];
        for (int64_t o = O8; o < O; ++o) s += d[o] * b[c][o];
        du[(r.start + m) * C + c] = s;
      }
    }
  });
}

// dx [Q, I] = du · Aᵀ: adapter k's pages transposed once per piece into panel rows [C, I],
// then the panel product.
template <int R>
void a_input_grad(ffi::ThreadPool& pool, const Routing& rt, const float* du, const float* table,
                  int64_t I, float* dx) {
  const int64_t C = rt.K * R;
  const std::vector<Run> items = rt.runs(kPiece);
  parallel_for(pool, items.size(), [&](int64_t it) {
    const Run& r = items[it];
    if (r.k < 0) {
      std::memset(dx + r.start * I, 0, (r.end - r.start) * I * sizeof(float));
      return;
    }
    float* at = scratch<float, 8>(C * I);  // (piece_by_panel takes slots 0 and 1)
    const float** b = scratch<const float*, 9>(C);
    for (int64_t kk = 0; kk < rt.K; ++kk) {
      const int64_t off = rt.page(r.k, kk, I * R);
      if (off < 0)
        std::fill(at + kk * R * I, at + (kk + 1) * R * I, 0.0f);
      else  // by blocks of 64 columns: row by row, the R destination rows (I floats
            // apart: one L1 set for a power-of-two I) would evict each other
        for (int64_t i0 = 0; i0 < I; i0 += 64) {
          const int64_t i1 = std::min(I, i0 + 64);
          for (int j = 0; j < R; ++j) {
            float* dst = at + (kk * R + j) * I;
            const float* src = table + off + j;
            for (int64_t i = i0; i < i1; ++i) dst[i] = src[i * R];
          }
        }
    }
    for (int64_t c = 0; c < C; ++c) b[c] = at + c * I;
    piece_by_panel(du + r.start * C, C, C, b, I, dx + r.start * I, I, r.end - r.start);
  });
}

// ---------------------------------------------------------------------------------------
// FFI handlers: R (the table's last or second-to-last axis) is 4, 8, 16 or 32.

ffi::Error bad_rank() {
  return ffi::Error::InvalidArgument("jcp cpu lora: a page's rank must be 4, 8, 16 or 32");
}

#define JCP_BY_RANK(R_, CALL)         \
  if (R_ == 8) { CALL(8); }           \
  else if (R_ == 4) { CALL(4); }      \
  else if (R_ == 16) { CALL(16); }    \
  else if (R_ == 32) { CALL(32); }    \
  else return bad_rank();

ffi::Error AForward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> table,
                    ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> pages,
                    ffi::Buffer<ffi::S32> row_k, ffi::ResultBuffer<ffi::F32> u) {
  const auto td = table.dimensions();
  const Routing rt = routing(row_k, pages, layer, td[0], td[1]);
  const int64_t I = x.dimensions()[1];
#define JCP_A_FWD(R) a_forward<R>(pool, rt, x.typed_data(), I, table.typed_data(), u->typed_data())
  JCP_BY_RANK(td[3], JCP_A_FWD)
  return ffi::Error::Success();
}

ffi::Error BForward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> u, ffi::Buffer<ffi::F32> table,
                    ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> pages,
                    ffi::Buffer<ffi::S32> row_k, ffi::ResultBuffer<ffi::F32> y) {
  const auto td = table.dimensions();
  const Routing rt = routing(row_k, pages, layer, td[0], td[1]);
#define JCP_B_FWD(R) \
  b_forward<R>(pool, rt, u.typed_data(), table.typed_data(), td[3], y->typed_data())
  JCP_BY_RANK(td[2], JCP_B_FWD)
  return ffi::Error::Success();
}

// The factor gradient out (dw) or into the accumulator (acc; ok: whether each adapter's
// was all finite). grad(sink) runs the work items, an adapter's contiguous.
template <typename Grad>
ffi::Error weight_grad_into(const Routing& rt, int64_t page, float* dw, float* acc,
                            int32_t* ok, const Grad& grad) {
  std::vector<char> bad;
  const Sink sink{rt, page, dw, acc, bad};
  grad(sink);
  if (ok) {
    const int64_t n = rt.A ? static_cast<int64_t>(bad.size()) / rt.A : 0;
    for (int64_t k = 0; k < rt.A; ++k) {
      ok[k] = 1;
      for (int64_t t = 0; t < n; ++t)
        if (bad[k * n + t]) ok[k] = 0;
    }
  }
  return ffi::Error::Success();
}

ffi::Error a_backward(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::F32>& du,
                      ffi::Buffer<ffi::F32>& table, ffi::Buffer<ffi::S32>& layer,
                      ffi::Buffer<ffi::S32>& pages, ffi::Buffer<ffi::S32>& row_k, float* dx,
                      float* dw, float* acc, int32_t* ok) {
  const auto td = table.dimensions();
  const Routing rt = routing(row_k, pages, layer, td[0], td[1]);
  const int64_t I = x.dimensions()[1];
  const auto runs = rt.by_adapter();
#define JCP_A_BWD(R)                                                                     \
  a_input_grad<R>(pool, rt, du.typed_data(), table.typed_data(), I, dx);                 \
  return weight_grad_into(rt, I * R, dw, acc, ok, [&](const Sink& sink) {                \
    a_weight_grad<R>(pool, rt, runs, x.typed_data(), I, du.typed_data(), sink);          \
  });
  JCP_BY_RANK(td[3], JCP_A_BWD)
}

ffi::Error b_backward(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& u, ffi::Buffer<ffi::F32>& dy,
                      ffi::Buffer<ffi::F32>& table, ffi::Buffer<ffi::S32>& layer,
                      ffi::Buffer<ffi::S32>& pages, ffi::Buffer<ffi::S32>& row_k, float* du,
                      float* dw, float* acc, int32_t* ok) {
  const auto td = table.dimensions();
  const Routing rt = routing(row_k, pages, layer, td[0], td[1]);
  const int64_t O = td[3];
  const auto runs = rt.by_adapter();
#define JCP_B_BWD(R)                                                                        \
  b_input_grad<R>(pool, rt, dy.typed_data(), table.typed_data(), O, du);                    \
  return weight_grad_into(rt, R * O, dw, acc, ok, [&](const Sink& sink) {                   \
    b_weight_grad(pool, rt, runs, u.typed_data(), rt.K * R, R, dy.typed_data(), O, sink);  \
  });
  JCP_BY_RANK(td[2], JCP_B_BWD)
}

ffi::Error ABackward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> du,
                     ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::S32> layer,
                     ffi::Buffer<ffi::S32> pages, ffi::Buffer<ffi::S32> row_k,
                     ffi::ResultBuffer<ffi::F32> dx, ffi::ResultBuffer<ffi::F32> dw) {
  return a_backward(pool, x, du, table, layer, pages, row_k, dx->typed_data(), dw->typed_data(),
                    nullptr, nullptr);
}

ffi::Error BBackward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> u, ffi::Buffer<ffi::F32> dy,
                     ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::S32> layer,
                     ffi::Buffer<ffi::S32> pages, ffi::Buffer<ffi::S32> row_k,
                     ffi::ResultBuffer<ffi::F32> du, ffi::ResultBuffer<ffi::F32> dw) {
  return b_backward(pool, u, dy, table, layer, pages, row_k, du->typed_data(), dw->typed_data(),
                    nullptr, nullptr);
}

// The same, the factor gradient added into acc_out (acc, aliased: updated in place).
ffi::Error ABackwardInto(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> du,
                         ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::F32> acc,
                         ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> pages,
                         ffi::Buffer<ffi::S32> row_k, ffi::ResultBuffer<ffi::F32> dx,
                         ffi::ResultBuffer<ffi::F32> acc_out, ffi::ResultBuffer<ffi::S32> ok) {
  if (acc_out->typed_data() != acc.typed_data())
    std::memcpy(acc_out->typed_data(), acc.typed_data(), acc.size_bytes());
  return a_backward(pool, x, du, table, layer, pages, row_k, dx->typed_data(), nullptr,
                    acc_out->typed_data(), ok->typed_data());
}

ffi::Error BBackwardInto(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> u, ffi::Buffer<ffi::F32> dy,
                         ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::F32> acc,
                         ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> pages,
                         ffi::Buffer<ffi::S32> row_k, ffi::ResultBuffer<ffi::F32> du,
                         ffi::ResultBuffer<ffi::F32> acc_out, ffi::ResultBuffer<ffi::S32> ok) {
  if (acc_out->typed_data() != acc.typed_data())
    std::memcpy(acc_out->typed_data(), acc.typed_data(), acc.size_bytes());
  return b_backward(pool, u, dy, table, layer, pages, row_k, du->typed_data(), nullptr,
                    acc_out->typed_data(), ok->typed_data());
}

}  // namespace

// The bindings: a factor product (x, table) -> y; its backward (x, dy, table) -> (dx, dw);
// in place (x, dy, table, acc) -> (dx, acc, ok). Each then takes layer, pages and row_k.
#define JCP_F32 ffi::Buffer<ffi::F32>
#define JCP_S32 ffi::Buffer<ffi::S32>
#define JCP_ROUTING .Arg<JCP_S32>().Arg<JCP_S32>().Arg<JCP_S32>()
#define JCP_FORWARD_BIND \
  ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<JCP_F32>().Arg<JCP_F32>() JCP_ROUTING.Ret<JCP_F32>()
#define JCP_BACKWARD_BIND                                                              \
  ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<JCP_F32>().Arg<JCP_F32>().Arg<JCP_F32>() \
      JCP_ROUTING.Ret<JCP_F32>().Ret<JCP_F32>()
#define JCP_INTO_BIND                                                                    \
  ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<JCP_F32>().Arg<JCP_F32>().Arg<JCP_F32>()   \
      .Arg<JCP_F32>() JCP_ROUTING.Ret<JCP_F32>().Ret<JCP_F32>().Ret<JCP_S32>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(JcpCpuLoraAForward, AForward, JCP_FORWARD_BIND);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JcpCpuLoraBForward, BForward, JCP_FORWARD_BIND);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JcpCpuLoraABackward, ABackward, JCP_BACKWARD_BIND);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JcpCpuLoraBBackward, BBackward, JCP_BACKWARD_BIND);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JcpCpuLoraABackwardInto, ABackwardInto, JCP_INTO_BIND);
XLA_FFI_DEFINE_HANDLER_SYMBOL(JcpCpuLoraBBackwardInto, BBackwardInto, JCP_INTO_BIND);
