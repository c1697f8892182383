// Fused flash attention for CPU: forward (out, lse) and backward (dq, dk, dv), called
// from jcp/attention/cpu.py through the XLA FFI. Compiled on first use on the machine
// that runs it (-O3 -march=native), so the tile loops below are written for the
// compiler's vectoriser: the vector dimension is always a compile-time extent (BK keys
// or H head dims), and every product is one of three register-blocked micro-kernels.
//
// Mask (attention.tiling.visible): query r sees key t iff seg_q[r] >= 0,
// seg_q[r] == seg_k[t] and pos_k[t] <= pos_q[r]. Tiles are classified from per-tile
// segment / position ranges exactly as tiling.block_kinds does: skipped, masked (mask
// applied per pair) or fully visible (no mask arithmetic). Rows that see no key give
// out 0 and lse -inf; their gradients are 0.
//
// Layouts (the model's own): q, out, do, dq [S, Q, H]; k, v, dk, dv [T, K, H]; lse and
// delta [Q, S]; all fp32. Query head h uses kv head h / (Q / K).
//
// Threads: XLA's intra-op pool (ffi::ThreadPool). The forward splits (head, query tile)
// items over it; the backward splits query heads: each head runs the one-pass
// FlashAttention-2 backward over its own key tiles (dq of its head owned outright, dk / dv
// of its head into a per-head partial), and the M heads of a kv group are summed after.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "../cpu_parallel.h"

namespace ffi = xla::ffi;

namespace {

#ifndef JCP_BQ
#define JCP_BQ 64
#endif
#ifndef JCP_BK
#define JCP_BK 64
#endif
constexpr int BQ = JCP_BQ;  // query rows per tile
constexpr int BK = JCP_BK;  // key rows per tile (a multiple of 16)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int32_t kNoSegment = std::numeric_limits<int32_t>::min();  // padded key slots

// ---------------------------------------------------------------------------------------
// Micro-kernels, written with GCC / Clang vector extensions: V is VW floats, one of the
// widest registers the build targets (cpu_parallel.h: 16 with AVX-512, else 8). ACC
// accumulators make a register block (half the machine's vector registers: 32 with
// AVX-512, 16 below), the rest hold the loaded vectors. A is [BQ, H] rows, BT [H, BK] (a
// key tile transposed), P [BQ, BK], B [BK, H]. Each keeps a block of accumulators in
// registers so that every loaded vector feeds several FMAs. (V was 16 floats everywhere:
// on an AVX2 host, two registers each, the blocks did not fit and the kernels ran 24×
// slower than now, 20× slower than the blockwise attention: benchmarks/RESULTS.md.)

constexpr int VW = jcp_cpu::kVectorFloats, ACC = VW;
typedef float V __attribute__((vector_size(VW * sizeof(float))));
typedef float VU __attribute__((vector_size(VW * sizeof(float)), aligned(4)));

inline V load(const float* p) { return *reinterpret_cast<const VU*>(p); }
inline void store(float* p, V x) { *reinterpret_cast<VU*>(p) = x; }
inline V splat(float x) { return V{} + x; }

typedef int32_t VI __attribute__((vector_size(VW * sizeof(int32_t))));

// exp(x) for x <= 0 (scores minus a row max; -inf gives exactly 0): Cephes' expf
// polynomial on x - n·ln2 (n rounded to nearest by the 1.5·2^23 trick), |error| <= 2 ulp,
// 0 below -87 (where expf would be denormal).
inline V exp_neg(V x) {
  const V xc = x < -87.0f ? splat(-87.0f) : x;
  const V n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  V r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  V y = splat(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const VI bits = (__builtin_convertvector(n, VI) + 127) << 23;
  y = y * reinterpret_cast<const V&>(bits);
  return x < -87.0f ? splat(0.0f) : y;
}

inline float exp_neg(float x) { return exp_neg(splat(x))[0]; }

// row[t] = exp(row[t] - m) over a score row of BK floats.
inline void row_exp(float* row, float m) {
  for (int t = 0; t < BK; t += VW) store(row + t, exp_neg(load(row + t) - m));
}

// A register block: U of a row's NV vectors (the largest divisor of NV ≤ ACC) times R
// rows (a power of two ≤ 8, U · R ≤ ACC). With AVX-512 U is NV for every head dim.
constexpr int cols_per_block(int nv) {
  int u = nv < ACC ? nv : ACC;
  while (nv % u != 0) --u;
  return u;
}
constexpr int rows_per_block(int nv) {
  const int r = ACC / cols_per_block(nv);
  return r >= 8 ? 8 : r >= 4 ? 4 : r >= 2 ? 2 : 1;
}

// C[r, t] = Σ_d A[r, d] · BT[d, t]   (scores q·kᵀ, dp = do·vᵀ)
template <int H>
inline void rows_dot(const float* __restrict A, const float* __restrict BT,
                     float* __restrict C) {
  constexpr int NV = BK / VW, U = cols_per_block(NV), R = rows_per_block(NV);
  for (int r0 = 0; r0 < BQ; r0 += R)
    for (int u0 = 0; u0 < NV; u0 += U) {
      V acc[R][U] = {};
      for (int d = 0; d < H; ++d) {
        V b[U];
        for (int u = 0; u < U; ++u) b[u] = load(BT + d * BK + (u0 + u) * VW);
        for (int i = 0; i < R; ++i) {
          const V a = splat(A[(r0 + i) * H + d]);
          for (int u = 0; u < U; ++u) acc[i][u] += a * b[u];
        }
      }
      for (int i = 0; i < R; ++i)
        for (int u = 0; u < U; ++u) store(C + (r0 + i) * BK + (u0 + u) * VW, acc[i][u]);
    }
}

// C[r, :] = C[r, :] · c[r] + Σ_t P[r, t] · B[t, :]   (p·v with the online-softmax
// correction c; dq += ds·k with c null)
template <int H>
inline void rows_accum(const float* __restrict P, const float* __restrict B,
                       float* __restrict C, const float* __restrict c = nullptr) {
  constexpr int NV = H / VW, U = cols_per_block(NV), R = rows_per_block(NV);
  for (int r0 = 0; r0 < BQ; r0 += R)
    for (int u0 = 0; u0 < NV; u0 += U) {
      V acc[R][U];
      for (int i = 0; i < R; ++i)
        for (int u = 0; u < U; ++u) {
          const V x = load(C + (r0 + i) * H + (u0 + u) * VW);
          acc[i][u] = c ? x * c[r0 + i] : x;
        }
      for (int t = 0; t < BK; ++t) {
        V b[U];
        for (int u = 0; u < U; ++u) b[u] = load(B + t * H + (u0 + u) * VW);
        for (int i = 0; i < R; ++i) {
          const V p = splat(P[(r0 + i) * BK + t]);
          for (int u = 0; u < U; ++u) acc[i][u] += p * b[u];
        }
      }
      for (int i = 0; i < R; ++i)
        for (int u = 0; u < U; ++u) store(C + (r0 + i) * H + (u0 + u) * VW, acc[i][u]);
    }
}

// C[t, :] += Σ_r P[r, t] · A[r, :]   (dv += pᵀ·do, dk += dsᵀ·q)
template <int H>
inline void cols_accum(const float* __restrict P, const float* __restrict A,
                       float* __restrict C) {
  constexpr int NV = H / VW, U = cols_per_block(NV), R = rows_per_block(NV);
  for (int t0 = 0; t0 < BK; t0 += R)
    for (int u0 = 0; u0 < NV; u0 += U) {
      V acc[R][U];
      for (int i = 0; i < R; ++i)
        for (int u = 0; u < U; ++u) acc[i][u] = load(C + (t0 + i) * H + (u0 + u) * VW);
      for (int r = 0; r < BQ; ++r) {
        V a[U];
        for (int u = 0; u < U; ++u) a[u] = load(A + r * H + (u0 + u) * VW);
        for (int i = 0; i < R; ++i) {
          const V p = splat(P[r * BK + t0 + i]);
          for (int u = 0; u < U; ++u) acc[i][u] += p * a[u];
        }
      }
      for (int i = 0; i < R; ++i)
        for (int u = 0; u < U; ++u) store(C + (t0 + i) * H + (u0 + u) * VW, acc[i][u]);
    }
}

// Largest element of a score row of BK floats: lane-wise max, then a shuffle tree (no
// scalar loop; vectorises without -ffast-math, which would break the -inf of masked scores).
inline float row_max(const float* row) {
  V m = load(row);
  for (int t = VW; t < BK; t += VW) {
    const V x = load(row + t);
    m = x > m ? x : m;
  }
#if JCP_VECTOR_FLOATS == 16  // cpu_parallel.h
  V t = __builtin_shufflevector(m, m, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  m = t > m ? t : m;
  t = __builtin_shufflevector(m, m, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  m = t > m ? t : m;
  t = __builtin_shufflevector(m, m, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  m = t > m ? t : m;
  t = __builtin_shufflevector(m, m, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  m = t > m ? t : m;
#else
  V t = __builtin_shufflevector(m, m, 4, 5, 6, 7, 0, 1, 2, 3);
  m = t > m ? t : m;
  t = __builtin_shufflevector(m, m, 2, 3, 0, 1, 6, 7, 4, 5);
  m = t > m ? t : m;
  t = __builtin_shufflevector(m, m, 1, 0, 3, 2, 5, 4, 7, 6);
  m = t > m ? t : m;
#endif
  return m[0];
}

// row[t] = exp(row[t] - m) over a score row of BK floats; returns the lane sums.
inline V row_exp_sum(float* row, float m) {
  V sum = {};
  for (int t = 0; t < BK; t += VW) {
    const V p = exp_neg(load(row + t) - m);
    store(row + t, p);
    sum += p;
  }
  return sum;
}

// ---------------------------------------------------------------------------------------
// Tile summaries and kinds (tiling.block_summary / block_kinds).

struct Summary {
  bool any = false, one = true;  // some real token; all real and one segment
  int32_t s0 = std::numeric_limits<int32_t>::max(), s1 = -1;
  int32_t p0 = std::numeric_limits<int32_t>::max(), p1 = -1;
};

std::vector<Summary> summarise(const int32_t* seg, const int32_t* pos, int64_t n, int tile) {
  const int64_t tiles = (n + tile - 1) / tile;
  std::vector<Summary> out(tiles);
  for (int64_t b = 0; b < tiles; ++b) {
    Summary& s = out[b];
    for (int64_t i = b * tile; i < (b + 1) * tile; ++i) {
      if (i >= n || seg[i] < 0) {
        s.one = false;
        continue;
      }
      s.any = true;
      s.s0 = std::min(s.s0, seg[i]);
      s.s1 = std::max(s.s1, seg[i]);
      s.p0 = std::min(s.p0, pos[i]);
      s.p1 = std::max(s.p1, pos[i]);
    }
    s.one = s.one && s.any && s.s0 == s.s1;
  }
  return out;
}

// 0 skipped, 1 masked, 2 fully visible.
inline int kind(const Summary& q, const Summary& k) {
  const bool need = q.any && k.any && q.s0 <= k.s1 && k.s0 <= q.s1 && k.p0 <= q.p1;
  if (!need) return 0;
  return (q.one && k.one && q.s0 == k.s0 && k.p1 <= q.p0) ? 2 : 1;
}

// Sets s[r, t] to -inf where query r (of the tile at row q0) does not see key t.
inline void apply_mask(float* __restrict s, const int32_t* seg_q, const int32_t* pos_q,
                       const int32_t* seg_k, const int32_t* pos_k) {
  for (int r = 0; r < BQ; ++r) {
    const int32_t sq = seg_q[r], pq = pos_q[r];
    float* row = s + r * BK;
    for (int t = 0; t < BK; ++t) {
      const bool vis = sq >= 0 && sq == seg_k[t] && pos_k[t] <= pq;
      row[t] = vis ? row[t] : kNegInf;
    }
  }
}

using jcp_cpu::parallel_for;  // cpu_parallel.h: work over XLA's intra-op pool

// Shapes of one call; packed copies are padded to whole tiles (padded query rows are
// padding, padded key slots carry kNoSegment: neither is ever visible).
struct Dims {
  int64_t S, T, Q, K, M, H, nq, nk, Sp, Tp;
  Dims(int64_t s, int64_t t, int64_t q, int64_t k, int64_t h)
      : S(s), T(t), Q(q), K(k), M(q / k), H(h), nq((s + BQ - 1) / BQ),
        nk((t + BK - 1) / BK), Sp(nq * BQ), Tp(nk * BK) {}
};

// x [N, heads, H] (row stride heads·H) -> [heads, Np, H] · scale, zero padded.
std::vector<float> heads_first(const float* x, int64_t n, int64_t np, int64_t heads,
                               int64_t h, float scale) {
  std::vector<float> out(heads * np * h, 0.0f);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t g = 0; g < heads; ++g)
      for (int64_t d = 0; d < h; ++d)
        out[(g * np + i) * h + d] = x[(i * heads + g) * h + d] * scale;
  return out;
}

// x [T, K, H] -> [K, nk, H, BK]: each key tile transposed, zero padded.
std::vector<float> tiles_transposed(const float* x, const Dims& D) {
  std::vector<float> out(D.K * D.nk * D.H * BK, 0.0f);
  for (int64_t t = 0; t < D.T; ++t)
    for (int64_t g = 0; g < D.K; ++g)
      for (int64_t d = 0; d < D.H; ++d)
        out[((g * D.nk + t / BK) * D.H + d) * BK + t % BK] = x[(t * D.K + g) * D.H + d];
  return out;
}

std::vector<int32_t> padded(const int32_t* x, int64_t n, int64_t np, int32_t fill) {
  std::vector<int32_t> out(np, fill);
  std::copy(x, x + n, out.begin());
  return out;
}

// ---------------------------------------------------------------------------------------
// Forward

template <int H>
void forward(ffi::ThreadPool& pool, const Dims& D, const float* q, const float* k,
             const float* v, const int32_t* seg_q, const int32_t* pos_q,
             const int32_t* seg_k, const int32_t* pos_k, float* out, float* lse) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(H));
  const auto qh = heads_first(q, D.S, D.Sp, D.Q, H, scale);  // [Q, Sp, H], scaled
  const auto kt = tiles_transposed(k, D);                     // [K, nk, H, BK]
  const auto vh = heads_first(v, D.T, D.Tp, D.K, H, 1.0f);    // [K, Tp, H]
  const auto sq = padded(seg_q, D.S, D.Sp, -1), pq = padded(pos_q, D.S, D.Sp, 0);
  const auto sk = padded(seg_k, D.T, D.Tp, kNoSegment), pk = padded(pos_k, D.T, D.Tp, 0);
  const auto qsum = summarise(seg_q, pos_q, D.S, BQ);
  const auto ksum = summarise(seg_k, pos_k, D.T, BK);

  auto item = [&](int64_t it) {
    const int64_t h = it % D.Q, i = it / D.Q, g = h / D.M;
    alignas(64) float s[BQ * BK];
    alignas(64) float acc[BQ * H];
    alignas(64) float m[BQ], m_new[BQ], m_safe[BQ], corr[BQ];
    V l[BQ] = {};  // row sums as lane partials, reduced once at the end
    std::fill(acc, acc + BQ * H, 0.0f);
    std::fill(m, m + BQ, kNegInf);
    const float* qt = qh.data() + (h * D.Sp + i * BQ) * H;
    for (int64_t j = 0; j < D.nk; ++j) {
      const int kd = kind(qsum[i], ksum[j]);
      if (kd == 0) continue;
      rows_dot<H>(qt, kt.data() + (g * D.nk + j) * H * BK, s);
      if (kd == 1)
        apply_mask(s, sq.data() + i * BQ, pq.data() + i * BQ, sk.data() + j * BK,
                   pk.data() + j * BK);
      for (int r = 0; r < BQ; ++r) {
        m_new[r] = std::max(m[r], row_max(s + r * BK));
        m_safe[r] = m_new[r] == kNegInf ? 0.0f : m_new[r];
      }
      for (int r = 0; r < BQ; r += VW) {  // corrections of VW rows per exp
        store(corr + r, exp_neg(load(m + r) - load(m_safe + r)));
        store(m + r, load(m_new + r));
      }
      for (int r = 0; r < BQ; ++r) l[r] = l[r] * corr[r] + row_exp_sum(s + r * BK, m_safe[r]);
      rows_accum<H>(s, vh.data() + (g * D.Tp + j * BK) * H, acc, corr);
    }
    const int64_t rows = std::min<int64_t>(BQ, D.S - i * BQ);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t tok = i * BQ + r;
      float lr = 0.0f;
      for (int u = 0; u < VW; ++u) lr += l[r][u];
      const bool empty = lr == 0.0f;
      const float inv = empty ? 0.0f : 1.0f / lr;
      float* o = out + (tok * D.Q + h) * H;
      for (int d = 0; d < H; ++d) o[d] = acc[r * H + d] * inv;
      lse[h * D.S + tok] = empty ? kNegInf : m[r] + std::log(lr);
    }
  };
  parallel_for(pool, D.nq * D.Q, item);
}

// ---------------------------------------------------------------------------------------
// Backward (one pass per query head: dq of the head, and its part of dk, dv)

template <int H>
void backward(ffi::ThreadPool& pool, const Dims& D, const float* q, const float* k,
              const float* v, const float* d_out, const float* lse, const float* delta,
              const int32_t* seg_q, const int32_t* pos_q, const int32_t* seg_k,
              const int32_t* pos_k, float* dq, float* dk, float* dv) {
  const float scale = 1.0f / std::sqrt(static_cast<float>(H));
  const auto qh = heads_first(q, D.S, D.Sp, D.Q, H, scale);   // [Q, Sp, H], scaled
  const auto doh = heads_first(d_out, D.S, D.Sp, D.Q, H, 1.0f);
  const auto kh = heads_first(k, D.T, D.Tp, D.K, H, 1.0f);     // [K, Tp, H]
  const auto kt = tiles_transposed(k, D), vt = tiles_transposed(v, D);
  const auto sq = padded(seg_q, D.S, D.Sp, -1), pq = padded(pos_q, D.S, D.Sp, 0);
  const auto sk = padded(seg_k, D.T, D.Tp, kNoSegment), pk = padded(pos_k, D.T, D.Tp, 0);
  const auto qsum = summarise(seg_q, pos_q, D.S, BQ);
  const auto ksum = summarise(seg_k, pos_k, D.T, BK);
  // lse of padded rows is 0 (their p is masked to 0 anyway); -inf rows see no key.
  std::vector<float> lse_p(D.Q * D.Sp, 0.0f), delta_p(D.Q * D.Sp, 0.0f);
  for (int64_t h = 0; h < D.Q; ++h)
    for (int64_t s = 0; s < D.S; ++s) {
      lse_p[h * D.Sp + s] = lse[h * D.S + s];
      delta_p[h * D.Sp + s] = delta[h * D.S + s];
    }
  std::vector<float> dk_part(D.Q * D.Tp * H), dv_part(D.Q * D.Tp * H);

  auto head = [&](int64_t h) {
    const int64_t g = h / D.M;
    std::vector<float> dqh(D.Sp * H, 0.0f);
    alignas(64) float p[BQ * BK];
    alignas(64) float ds[BQ * BK];
    for (int64_t j = 0; j < D.nk; ++j) {
      float* dkj = dk_part.data() + (h * D.Tp + j * BK) * H;
      float* dvj = dv_part.data() + (h * D.Tp + j * BK) * H;
      std::fill(dkj, dkj + BK * H, 0.0f);
      std::fill(dvj, dvj + BK * H, 0.0f);
      const float* ktj = kt.data() + (g * D.nk + j) * H * BK;
      const float* vtj = vt.data() + (g * D.nk + j) * H * BK;
      const float* khj = kh.data() + (g * D.Tp + j * BK) * H;
      for (int64_t i = 0; i < D.nq; ++i) {
        const int kd = kind(qsum[i], ksum[j]);
        if (kd == 0) continue;
        const float* qt = qh.data() + (h * D.Sp + i * BQ) * H;
        const float* dot = doh.data() + (h * D.Sp + i * BQ) * H;
        const float* lse_i = lse_p.data() + h * D.Sp + i * BQ;
        const float* delta_i = delta_p.data() + h * D.Sp + i * BQ;
        rows_dot<H>(qt, ktj, p);
        if (kd == 1)
          apply_mask(p, sq.data() + i * BQ, pq.data() + i * BQ, sk.data() + j * BK,
                     pk.data() + j * BK);
        for (int r = 0; r < BQ; ++r) {
          const float lr = lse_i[r] == kNegInf ? 0.0f : lse_i[r];
          float* row = p + r * BK;
          row_exp(row, lr);
        }
        rows_dot<H>(dot, vtj, ds);  // dp
        for (int r = 0; r < BQ; ++r) {
          const float dr = delta_i[r];
          for (int t = 0; t < BK; ++t) ds[r * BK + t] = p[r * BK + t] * (ds[r * BK + t] - dr);
        }
        cols_accum<H>(p, dot, dvj);
        cols_accum<H>(ds, qt, dkj);  // q is scaled: dk = Σ ds·q·scale
        rows_accum<H>(ds, khj, dqh.data() + i * BQ * H);
      }
    }
    for (int64_t s = 0; s < D.S; ++s)
      for (int d = 0; d < H; ++d) dq[(s * D.Q + h) * H + d] = dqh[s * H + d] * scale;
  };
  parallel_for(pool, D.Q, head);

  auto reduce = [&](int64_t t) {
    for (int64_t g = 0; g < D.K; ++g)
      for (int d = 0; d < H; ++d) {
        float a = 0.0f, b = 0.0f;
        for (int64_t mm = 0; mm < D.M; ++mm) {
          a += dk_part[((g * D.M + mm) * D.Tp + t) * H + d];
          b += dv_part[((g * D.M + mm) * D.Tp + t) * H + d];
        }
        dk[(t * D.K + g) * H + d] = a;
        dv[(t * D.K + g) * H + d] = b;
      }
  };
  for (int64_t t = 0; t < D.T; ++t) reduce(t);
}

// ---------------------------------------------------------------------------------------
// FFI handlers

ffi::Error check(const Dims& D) {
  if (D.K <= 0 || D.Q % D.K != 0)
    return ffi::Error::InvalidArgument("jcp cpu attention: q heads must be a multiple of kv heads");
  return ffi::Error::Success();
}

#define JCP_HEAD_DIMS(X) X(16) X(32) X(64) X(96) X(128) X(256)

ffi::Error Forward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                   ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> seg_q,
                   ffi::Buffer<ffi::S32> pos_q, ffi::Buffer<ffi::S32> seg_k,
                   ffi::Buffer<ffi::S32> pos_k, ffi::ResultBuffer<ffi::F32> out,
                   ffi::ResultBuffer<ffi::F32> lse) {
  const auto qd = q.dimensions(), kd = k.dimensions();
  const Dims D(qd[0], kd[0], qd[1], kd[1], qd[2]);
  if (auto e = check(D); e.failure()) return e;
#define JCP_FWD(HD)                                                                  \
  if (D.H == HD) {                                                                   \
    forward<HD>(pool, D, q.typed_data(), k.typed_data(), v.typed_data(),             \
                seg_q.typed_data(), pos_q.typed_data(), seg_k.typed_data(),          \
                pos_k.typed_data(), out->typed_data(), lse->typed_data());           \
    return ffi::Error::Success();                                                    \
  }
  JCP_HEAD_DIMS(JCP_FWD)
  return ffi::Error::InvalidArgument("jcp cpu attention: unsupported head dim");
}

ffi::Error Backward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                    ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> d_out,
                    ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> delta,
                    ffi::Buffer<ffi::S32> seg_q, ffi::Buffer<ffi::S32> pos_q,
                    ffi::Buffer<ffi::S32> seg_k, ffi::Buffer<ffi::S32> pos_k,
                    ffi::ResultBuffer<ffi::F32> dq, ffi::ResultBuffer<ffi::F32> dk,
                    ffi::ResultBuffer<ffi::F32> dv) {
  const auto qd = q.dimensions(), kd = k.dimensions();
  const Dims D(qd[0], kd[0], qd[1], kd[1], qd[2]);
  if (auto e = check(D); e.failure()) return e;
#define JCP_BWD(HD)                                                                  \
  if (D.H == HD) {                                                                   \
    backward<HD>(pool, D, q.typed_data(), k.typed_data(), v.typed_data(),            \
                 d_out.typed_data(), lse.typed_data(), delta.typed_data(),           \
                 seg_q.typed_data(), pos_q.typed_data(), seg_k.typed_data(),         \
                 pos_k.typed_data(), dq->typed_data(), dk->typed_data(),             \
                 dv->typed_data());                                                  \
    return ffi::Error::Success();                                                    \
  }
  JCP_HEAD_DIMS(JCP_BWD)
  return ffi::Error::InvalidArgument("jcp cpu attention: unsupported head dim");
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JcpCpuFlashForward, Forward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JcpCpuFlashBackward, Backward,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// The vector width the library was built for (cpu_kernels.vector_floats).
extern "C" int JcpCpuVectorFloats() { return jcp_cpu::kVectorFloats; }
