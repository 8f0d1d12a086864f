// Causal attention of a flat batch of query tokens over the KV pool's slots, on the CPU, with
// every query row's arithmetic fixed by the row alone: the same bits whether the row is a
// decoding step, one of a verification's K+1 rows, a prefill's, or shares its pass with other
// requests. PyTorch's scaled_dot_product_attention does not promise that (its blocks over keys
// and queries follow the pass's shapes), and a step's logits then differ from the same row's in
// a verify pass, so that sd's and msd's target is not quite ar's.
//
// Row t (of sequence row_seq[t], at position positions[t]) and query head h (kv head h / G):
//
//   out[t, h] = sum_j softmax_j(scale * q[t, h] . k_j) v_j,   j = lo_t .. positions[t],
//
// lo_t = 0, or positions[t] - window + 1 (at least 0) for a sliding-window layer (window > 0):
// the keys of the row's first block below lo_t get weight 0, blocks wholly below it are skipped,
// so the blocks stay aligned to absolute positions and the row's sums its own.
//
// with k_j, v_j at slot key_slots[row_seq[t], j] of k, v [slots, kv heads, d]. The keys run in
// blocks of kBlock by absolute position, under an online softmax (a block's maximum, the running
// sum and output rescaled by exp(old max - new max)); a dot product sums its d products in 16
// lanes, then the lanes in a fixed tree; exp is one polynomial. Nothing depends on how many rows,
// sequences or threads a call has: threads split (row, kv head) pairs, each computed whole.
//
// Plain loops over 16 lanes, which the compiler turns into vector code (AVX-512, AVX2, or
// scalar): no float sum is reassociated, so the vector code computes what the loops say.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int kLanes = 16;
constexpr int kBlock = 16;  // keys per online-softmax step, aligned to absolute positions

// e^x (Cephes' expf: x = n ln 2 + r, a degree-6 polynomial in r, times 2^n): within 2 ulp for
// x in [-87, 88], 0 below.
inline float exp_poly(float x) {
  const float v = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::floor(v * 1.44269504088896341f + 0.5f);
  const float r = v - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return x < -87.0f ? 0.0f : p * two_n;
}

// The sum of 16 lanes in a fixed tree.
float sum16(float* lanes) {
  for (int w = kLanes / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) lanes[l] += lanes[l + w];
  return lanes[0];
}

// s[h][jj] = scale * q[h] . kt[:, jj] for the 16 keys of a transposed block kt [d][16], for H
// heads at once (sharing kt's loads): per head eight running sums over i = c, c + 8, .. (c = 0
// .. 7), added in a fixed tree. A head's sums are the same whichever heads share the call.
template <int H>
void scores(const float* const* q, const float* kt, int64_t d, float scale, float* const* s) {
#if defined(__AVX512F__)
  __m512 a[H][8];
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < 8; ++c) a[h][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; i += 8)
    for (int c = 0; c < 8; ++c) {
      const __m512 kc = _mm512_loadu_ps(kt + (i + c) * kLanes);
      for (int h = 0; h < H; ++h) a[h][c] = _mm512_fmadd_ps(_mm512_set1_ps(q[h][i + c]), kc, a[h][c]);
    }
  for (int h = 0; h < H; ++h) {
    for (int w = 4; w > 0; w /= 2)
      for (int c = 0; c < w; ++c) a[h][c] = _mm512_add_ps(a[h][c], a[h][c + w]);
    _mm512_storeu_ps(s[h], _mm512_mul_ps(a[h][0], _mm512_set1_ps(scale)));
  }
#else
  for (int h = 0; h < H; ++h) {
    float a[8][kLanes] = {};
    for (int64_t i = 0; i < d; i += 8)
      for (int c = 0; c < 8; ++c)
        for (int jj = 0; jj < kLanes; ++jj) a[c][jj] += q[h][i + c] * kt[(i + c) * kLanes + jj];
    for (int w = 4; w > 0; w /= 2)
      for (int c = 0; c < w; ++c)
        for (int jj = 0; jj < kLanes; ++jj) a[c][jj] += a[c + w][jj];
    for (int jj = 0; jj < kLanes; ++jj) s[h][jj] = a[0][jj] * scale;
  }
#endif
}

// acc[h] [d] = factor[h] * acc[h] + sum_jj w[h][jj] * x[jj] [d], jj = 0 .. n - 1 in order for
// every entry, for H heads at once (sharing x's loads). V = d / 16 vectors a head, held in
// registers (a compile-time count: a run-time one spills them). The same sums whichever heads
// share the call.
template <int V, int H>
void weighted_sum_v(float* const* acc, const float* factor, const float* const* w,
                    const float* const* x, int64_t n) {
#if defined(__AVX512F__)
  __m512 a[H][V];
  for (int h = 0; h < H; ++h) {
    const __m512 f = _mm512_set1_ps(factor[h]);
    for (int c = 0; c < V; ++c) a[h][c] = _mm512_mul_ps(_mm512_loadu_ps(acc[h] + c * kLanes), f);
  }
  for (int64_t jj = 0; jj < n; ++jj)
    for (int c = 0; c < V; ++c) {
      const __m512 xc = _mm512_loadu_ps(x[jj] + c * kLanes);
      for (int h = 0; h < H; ++h) a[h][c] = _mm512_fmadd_ps(_mm512_set1_ps(w[h][jj]), xc, a[h][c]);
    }
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < V; ++c) _mm512_storeu_ps(acc[h] + c * kLanes, a[h][c]);
#else
  for (int h = 0; h < H; ++h) {
    for (int i = 0; i < V * kLanes; ++i) acc[h][i] *= factor[h];
    for (int64_t jj = 0; jj < n; ++jj)
      for (int i = 0; i < V * kLanes; ++i) acc[h][i] += w[h][jj] * x[jj][i];
  }
#endif
}

template <int H>
void weighted_sum(float* const* acc, const float* factor, const float* const* w,
                  const float* const* x, int64_t n, int64_t d) {
  switch (d / kLanes) {
    case 4: return weighted_sum_v<4, H>(acc, factor, w, x, n);
    case 8: return weighted_sum_v<8, H>(acc, factor, w, x, n);
    default:  // other head sizes: a vector at a time, the same sums
      for (int64_t c = 0; c < d; c += kLanes) {
        const float* xc[kBlock];
        float* ac[H];
        for (int64_t jj = 0; jj < n; ++jj) xc[jj] = x[jj] + c;
        for (int h = 0; h < H; ++h) ac[h] = acc[h] + c;
        weighted_sum_v<1, H>(ac, factor, w, xc, n);
      }
  }
}

#if defined(__AVX512F__)
// exp_poly on 16 lanes.
__m512 exp16(__m512 x) {
  const __m512 v = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(
      _mm512_fmadd_ps(v, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                                   _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), v));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
  return _mm512_maskz_mul_ps(live, p, _mm512_castsi512_ps(bits));
}
#endif

// One block of a (row, head)'s online softmax: scores s of its first jn keys; updates the
// running maximum m and sum l, writes the block's weights p [16] (0 past jn), and returns the
// factor that rescales the output so far to the new maximum.
float softmax_block(const float* s, int64_t jn, float& m, float& l, float* p) {
  const float none = -std::numeric_limits<float>::infinity();
#if defined(__AVX512F__)
  const __mmask16 keep = static_cast<__mmask16>((1u << jn) - 1);
  const __m512 sv = _mm512_loadu_ps(s);
  const float m_new = std::max(m, _mm512_mask_reduce_max_ps(keep, sv));
  const __m512 pv = _mm512_maskz_mov_ps(keep, exp16(_mm512_sub_ps(sv, _mm512_set1_ps(m_new))));
  _mm512_storeu_ps(p, pv);
  const float block_sum = _mm512_reduce_add_ps(pv);
#else
  float top = none;
  for (int64_t jj = 0; jj < jn; ++jj) top = std::max(top, s[jj]);
  const float m_new = std::max(m, top);
  for (int jj = 0; jj < kLanes; ++jj) p[jj] = jj < jn ? exp_poly(s[jj] - m_new) : 0.0f;
  float lanes[kLanes];
  std::memcpy(lanes, p, sizeof lanes);
  const float block_sum = sum16(lanes);
#endif
  const float factor = m == none ? 1.0f : exp_poly(m - m_new);
  l = l * factor + block_sum;
  m = m_new;
  return factor;
}

// Rows r0 .. r1 - 1 of one sequence (flat rows, their query heads h0 .. h0 + group - 1, the kv
// head's keys and values at k, v with `slots`), each over keys 0 .. pos[r]. Per block of keys:
// the block transposed once ([d][16], so that 16 keys' scores are 16 lanes), then for each row
// and head its 16 scores, the online softmax, and the values.
void attend_rows(const float* q, const float* k, const float* v, const int64_t* slots,
                 const int64_t* pos, int64_t r0, int64_t r1, int64_t nh, int64_t h0,
                 int64_t group, int64_t d, int64_t slot_stride, float scale, int64_t window,
                 float* out) {
  const int64_t heads = (r1 - r0) * group;
  const float none = -std::numeric_limits<float>::infinity();
  std::vector<float> acc(heads * d, 0.0f), m(heads, none), l(heads, 0.0f), kt(d * kLanes);
  auto low = [&](int64_t r) { return window > 0 ? std::max<int64_t>(0, pos[r] - window + 1) : 0; };
  int64_t last = 0, first = pos[r0];
  for (int64_t r = r0; r < r1; ++r) {
    last = std::max(last, pos[r]);
    first = std::min(first, low(r));
  }
  for (int64_t j0 = first / kBlock * kBlock; j0 <= last; j0 += kBlock) {
    const int64_t block = std::min<int64_t>(kBlock, last + 1 - j0);
    for (int64_t jj = 0; jj < kLanes; ++jj) {
      const float* kj = k + slots[j0 + std::min(jj, block - 1)] * slot_stride;
      for (int64_t i = 0; i < d; ++i) kt[i * kLanes + jj] = kj[i];
    }
    const float* vj[kBlock];
    for (int64_t jj = 0; jj < block; ++jj) vj[jj] = v + slots[j0 + jj] * slot_stride;
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t lo = low(r);
      if (pos[r] < j0 || j0 + kBlock <= lo) continue;
      const int64_t jn = std::min<int64_t>(kBlock, pos[r] + 1 - j0);
      const int64_t skip = std::max<int64_t>(0, lo - j0);  // keys below the window
      for (int64_t g = 0; g < group; g += 2) {
        const int heads = group - g >= 2 ? 2 : 1;  // two heads a call, one left where odd
        const float* qs[2];
        float s[2][kLanes], w[2][kLanes], factor[2];
        float* sp[2] = {s[0], s[1]};
        const float* wp[2] = {w[0], w[1]};
        float* ap[2];
        for (int h = 0; h < heads; ++h) {
          qs[h] = q + (r * nh + h0 + g + h) * d;
          ap[h] = acc.data() + ((r - r0) * group + g + h) * d;
        }
        if (heads == 2)
          scores<2>(qs, kt.data(), d, scale, sp);
        else
          scores<1>(qs, kt.data(), d, scale, sp);
        for (int h = 0; h < heads; ++h) {
          const int64_t at = (r - r0) * group + g + h;
          for (int64_t jj = 0; jj < skip; ++jj) s[h][jj] = none;  // weight exactly 0
          factor[h] = softmax_block(s[h], jn, m[at], l[at], w[h]);
        }
        if (heads == 2)
          weighted_sum<2>(ap, factor, wp, vj, jn, d);
        else
          weighted_sum<1>(ap, factor, wp, vj, jn, d);
      }
    }
  }
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t g = 0; g < group; ++g) {
      const int64_t at = (r - r0) * group + g;
      float* o = out + (r * nh + h0 + g) * d;
      for (int64_t i = 0; i < d; ++i) o[i] = acc[at * d + i] / l[at];
    }
}

constexpr int64_t kRowsPerItem = 16;  // rows of one sequence that share a pass over its keys

}  // namespace

// q [T, nh, d], k and v [slots, nkv, d] float32; key_slots [B, L] int64 (sequence b's key j at
// slot key_slots[b, j]); row_seq, positions [T] int64; window: keys a row sees (0: all before
// it). Returns out [T, nh, d].
torch::Tensor attend(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor key_slots,
                     torch::Tensor row_seq, torch::Tensor positions, double scale,
                     int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes(),
              "attend: q [T, nh, d], k and v [slots, nkv, d]");
  TORCH_CHECK(q.scalar_type() == torch::kFloat && k.scalar_type() == torch::kFloat &&
                  v.scalar_type() == torch::kFloat,
              "attend: float32 tensors");
  const int64_t rows = q.size(0), nh = q.size(1), d = q.size(2), nkv = k.size(1);
  TORCH_CHECK(k.size(2) == d && d % kLanes == 0, "attend: head size a multiple of 16, got ", d);
  TORCH_CHECK(nh % nkv == 0, "attend: query heads a multiple of kv heads");
  TORCH_CHECK(row_seq.numel() == rows && positions.numel() == rows, "attend: one entry a row");
  q = q.contiguous();
  k = k.contiguous();
  v = v.contiguous();
  key_slots = key_slots.to(torch::kLong).contiguous();
  row_seq = row_seq.to(torch::kLong).contiguous();
  positions = positions.to(torch::kLong).contiguous();
  const int64_t width = key_slots.size(1), group = nh / nkv;
  const int64_t* seq = row_seq.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < rows; ++t)
    TORCH_CHECK(seq[t] >= 0 && seq[t] < key_slots.size(0) && pos[t] >= 0 && pos[t] < width,
                "attend: row ", t, " names a sequence or position outside key_slots");
  // chunks of at most kRowsPerItem consecutive rows of one sequence
  std::vector<int64_t> starts{0};
  for (int64_t t = 1; t <= rows; ++t)
    if (t == rows || seq[t] != seq[t - 1] || t - starts.back() == kRowsPerItem) starts.push_back(t);
  const int64_t chunks = static_cast<int64_t>(starts.size()) - 1;
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const int64_t* sp = key_slots.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, chunks * nkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t c = item / nkv, h = item % nkv, r0 = starts[c];
      attend_rows(qp, kp + h * d, vp + h * d, sp + seq[r0] * width, pos, r0, starts[c + 1], nh,
                  h * group, group, d, nkv * d, static_cast<float>(scale), window, op);
    }
  });
  return out;
}
