// y = x W^T on the CPU for int4 or int8 weights and int8 activations, both per group of inputs.
//
// W[n, k] ~= Q[n, k] * scale[n, g] + lo[n, g] with Q in 0..15 (int4) or 0..255 (int8) and
// g = k / group; each row of x is quantized per group too: x[m, k] ~= xq[m, k] * xs[m, g] with xq
// in -127..127. Then
//
//   y[m, n] = sum_g xs[m, g] * (scale[n, g] * sum_{k in g} Q[n, k] xq[m, k]
//                               + lo[n, g]  * sum_{k in g} xq[m, k])
//
// and the inner sum is an integer dot product of unsigned by signed bytes: one VNNI instruction
// (vpdpbusd) adds four of its products into each 32-bit lane.
//
// Layout (made by `smcspec.models.cpu_linear.pack`): outputs in blocks of 16 (one float32 vector
// of AVX-512), inputs in sub-blocks of 64 bytes per block: 8 inputs for int4, 4 for int8.
// `packed` [N / 16, K / sub, 64] uint8. int4: byte 4 l + i of a sub-block holds Q[16 b + l,
// 8 s + i] in its low nibble and Q[16 b + l, 8 s + 4 + i] in its high one, so masking the low
// nibbles of 64 bytes gives the 16 outputs' first four inputs, lane by lane, as vpdpbusd wants
// them. int8: byte 4 l + i holds Q[16 b + l, 4 s + i]. `scales` [N / 16, G, 2, 16] float16: a
// block's 16 scales, then its 16 lo, per group.
//
// A block's weights are read once for up to kRows rows: a verification of N x (K+1) rows costs
// about one row's weight traffic, which is what speculative decoding needs from the target.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define SMCSPEC_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define SMCSPEC_AVX2 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kLanes = 16;  // outputs per block
template <int Bits>
constexpr int64_t kSub = 32 / Bits;  // inputs per sub-block (64 bytes)
constexpr int64_t kTile = 32;   // rows whose activations stay in cache while every block passes

#if SMCSPEC_AVX512
constexpr int64_t kStep = 2;  // blocks per pass (see rows_of_pair)
constexpr int kRows = 6;  // rows per pass over a block: 2 integer sums + 1 float sum each
#elif SMCSPEC_AVX2
constexpr int64_t kStep = 1;
constexpr int kRows = 3;
#else
constexpr int64_t kStep = 1;
constexpr int kRows = 4;
#endif

// The rows' activations as the kernel reads them: xq [M, K] int8, and per row and group the
// scale xs [M, G] and the group's sum xs * sum(xq) [M, G].
struct Rows {
  std::vector<int8_t> q;
  std::vector<float> scale, sum;
};

Rows quantize_rows(const float* x, int64_t m_rows, int64_t k_in, int64_t group) {
  const int64_t groups = k_in / group;
  Rows r{std::vector<int8_t>(m_rows * k_in), std::vector<float>(m_rows * groups),
         std::vector<float>(m_rows * groups)};
  at::parallel_for(0, m_rows * groups, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t m = i / groups, g = i % groups;
      const float* src = x + m * k_in + g * group;
      int8_t* dst = r.q.data() + m * k_in + g * group;
      float peak = 0.f;
      for (int64_t k = 0; k < group; ++k) peak = std::max(peak, std::fabs(src[k]));
      const float scale = peak / 127.f, inv = peak > 0.f ? 127.f / peak : 0.f;
      int32_t total = 0;
      for (int64_t k = 0; k < group; ++k) {
        const int32_t q = static_cast<int32_t>(std::nearbyint(src[k] * inv));
        dst[k] = static_cast<int8_t>(q);
        total += q;
      }
      r.scale[i] = scale;
      r.sum[i] = scale * static_cast<float>(total);
    }
  });
  return r;
}

struct Block {
  const uint8_t* packed;  // [K / 8, 64] of one block of outputs
  const at::Half* scales;  // [G, 2, 16]
  int64_t groups, subs;    // groups per row, sub-blocks per group
};

struct View {
  const int8_t* q;  // the first row's xq; rows K apart
  const float* scale;
  const float* sum;  // rows G apart
  int64_t k_in;
  float* y;  // the first row's 16 outputs; rows N apart
  int64_t n_out;
};

#if SMCSPEC_AVX512

inline __m512i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

template <int Bits, int R>
void rows_of_block(const Block& b, const View& v) {
  constexpr int64_t sub = kSub<Bits>;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < b.groups; ++g) {
    __m512i dot[R];  // one chain per row: with several rows, vpdpbusd's latency hides itself
    for (int r = 0; r < R; ++r) dot[r] = _mm512_setzero_si512();
    const uint8_t* w = b.packed + g * b.subs * 64;
    const int8_t* x = v.q + g * b.subs * sub;
#pragma GCC unroll 4
    for (int64_t s = 0; s < b.subs; ++s) {
      const __m512i packed = _mm512_loadu_si512(w + s * 64);
      if constexpr (Bits == 4) {
        const __m512i w_lo = _mm512_and_si512(packed, low);
        const __m512i w_hi = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = x + r * v.k_in + s * sub;
          dot[r] = _mm512_dpbusd_epi32(dot[r], w_lo, broadcast4(xr));
          dot[r] = _mm512_dpbusd_epi32(dot[r], w_hi, broadcast4(xr + 4));
        }
      } else {  // vpdpbusd adds its four products without saturating: 4 * 255 * 127 fits
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r)
          dot[r] = _mm512_dpbusd_epi32(dot[r], packed, broadcast4(x + r * v.k_in + s * sub));
      }
    }
    const at::Half* sl = b.scales + g * 2 * kLanes;
    const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sl)));
    const __m512 lo =
        _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sl + kLanes)));
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 s = _mm512_mul_ps(scale, _mm512_set1_ps(v.scale[r * b.groups + g]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), s, acc[r]);
      acc[r] = _mm512_fmadd_ps(lo, _mm512_set1_ps(v.sum[r * b.groups + g]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(v.y + r * v.n_out, acc[r]);
}

// Two adjacent blocks (32 outputs) for up to kPairRows rows: each broadcast of a row's four
// activations feeds both blocks, so a vpdpbusd costs half the loads of the one-block loop above,
// which at several rows is what bounds it. `next`: from a block's weights to the next block's.
constexpr int kPairRows = 4;

template <int Bits, int R>
void rows_of_pair(const Block& b, int64_t next, const View& v) {
  constexpr int64_t sub = kSub<Bits>;
  const __m512i low = _mm512_set1_epi8(0x0F);
  const at::Half* scales[2] = {b.scales, b.scales + b.groups * 2 * kLanes};
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < b.groups; ++g) {
    __m512i dot[R][2];
    for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm512_setzero_si512();
    const uint8_t* w = b.packed + g * b.subs * 64;
    const int8_t* x = v.q + g * b.subs * sub;
#pragma GCC unroll 2
    for (int64_t s = 0; s < b.subs; ++s) {
      const __m512i p0 = _mm512_loadu_si512(w + s * 64);
      const __m512i p1 = _mm512_loadu_si512(w + next + s * 64);
      if constexpr (Bits == 4) {
        const __m512i lo0 = _mm512_and_si512(p0, low), lo1 = _mm512_and_si512(p1, low);
        const __m512i hi0 = _mm512_and_si512(_mm512_srli_epi16(p0, 4), low);
        const __m512i hi1 = _mm512_and_si512(_mm512_srli_epi16(p1, 4), low);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const int8_t* xr = x + r * v.k_in + s * sub;
          const __m512i first = broadcast4(xr), second = broadcast4(xr + 4);
          dot[r][0] = _mm512_dpbusd_epi32(dot[r][0], lo0, first);
          dot[r][1] = _mm512_dpbusd_epi32(dot[r][1], lo1, first);
          dot[r][0] = _mm512_dpbusd_epi32(dot[r][0], hi0, second);
          dot[r][1] = _mm512_dpbusd_epi32(dot[r][1], hi1, second);
        }
      } else {
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m512i xr = broadcast4(x + r * v.k_in + s * sub);
          dot[r][0] = _mm512_dpbusd_epi32(dot[r][0], p0, xr);
          dot[r][1] = _mm512_dpbusd_epi32(dot[r][1], p1, xr);
        }
      }
    }
#pragma GCC unroll 2
    for (int c = 0; c < 2; ++c) {
      const at::Half* sl = scales[c] + g * 2 * kLanes;
      const __m512 scale =
          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sl)));
      const __m512 lo =
          _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sl + kLanes)));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 s = _mm512_mul_ps(scale, _mm512_set1_ps(v.scale[r * b.groups + g]));
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r][c]), s, acc[r][c]);
        acc[r][c] = _mm512_fmadd_ps(lo, _mm512_set1_ps(v.sum[r * b.groups + g]), acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(v.y + r * v.n_out, acc[r][0]);
    _mm512_storeu_ps(v.y + r * v.n_out + kLanes, acc[r][1]);
  }
}

template <int Bits, int R>
void pair_rows_upto(const Block& b, int64_t next, const View& v, int rows) {
  if constexpr (R > 1) {
    if (rows < R) return pair_rows_upto<Bits, R - 1>(b, next, v, rows);
  }
  rows_of_pair<Bits, R>(b, next, v);
}

#elif SMCSPEC_AVX2

// Without VNNI: maddubs multiplies unsigned by signed bytes into pairs of int16 (at most
// 2 * 15 * 127, no saturation), madd by ones sums the pairs into int32 lanes. An int8 weight
// (2 * 255 * 127 would saturate) is taken as its two nibbles, the high one's sum times 16.
inline __m256i dot4(__m256i w, const int8_t* x, __m256i ones) {
  int32_t v;
  std::memcpy(&v, x, 4);
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, _mm256_set1_epi32(v)), ones);
}

template <int Bits, int R>
void rows_of_block(const Block& b, const View& v) {
  constexpr int64_t sub = kSub<Bits>;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < b.groups; ++g) {
    __m256i dot[R][2];
    for (int r = 0; r < R; ++r) dot[r][0] = dot[r][1] = _mm256_setzero_si256();
    for (int64_t s = g * b.subs; s < (g + 1) * b.subs; ++s) {
      for (int h = 0; h < 2; ++h) {  // outputs 0-7, then 8-15
        const __m256i w =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.packed + s * 64 + h * 32));
        const __m256i w_lo = _mm256_and_si256(w, low);
        const __m256i w_hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
        for (int r = 0; r < R; ++r) {
          const int8_t* x = v.q + r * v.k_in + s * sub;
          if constexpr (Bits == 4) {
            dot[r][h] = _mm256_add_epi32(dot[r][h], dot4(w_lo, x, ones));
            dot[r][h] = _mm256_add_epi32(dot[r][h], dot4(w_hi, x + 4, ones));
          } else {
            const __m256i high = _mm256_slli_epi32(dot4(w_hi, x, ones), 4);
            dot[r][h] = _mm256_add_epi32(dot[r][h], _mm256_add_epi32(dot4(w_lo, x, ones), high));
          }
        }
      }
    }
    const at::Half* sl = b.scales + g * 2 * kLanes;
    for (int h = 0; h < 2; ++h) {
      const __m256 scale =
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sl + h * 8)));
      const __m256 lo =
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sl + kLanes + h * 8)));
      for (int r = 0; r < R; ++r) {
        const __m256 s = _mm256_mul_ps(scale, _mm256_set1_ps(v.scale[r * b.groups + g]));
        acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r][h]), s, acc[r][h]);
        acc[r][h] = _mm256_fmadd_ps(lo, _mm256_set1_ps(v.sum[r * b.groups + g]), acc[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(v.y + r * v.n_out, acc[r][0]);
    _mm256_storeu_ps(v.y + r * v.n_out + 8, acc[r][1]);
  }
}

#else

template <int Bits, int R>
void rows_of_block(const Block& b, const View& v) {
  constexpr int64_t sub = kSub<Bits>;
  float acc[R][kLanes] = {};
  for (int64_t g = 0; g < b.groups; ++g) {
    int32_t dot[R][kLanes] = {};
    for (int64_t s = g * b.subs; s < (g + 1) * b.subs; ++s) {
      const uint8_t* w = b.packed + s * 64;
      for (int r = 0; r < R; ++r) {
        const int8_t* x = v.q + r * v.k_in + s * sub;
        for (int l = 0; l < kLanes; ++l)
          for (int i = 0; i < 4; ++i) {
            const uint8_t byte = w[4 * l + i];
            if constexpr (Bits == 4)
              dot[r][l] += (byte & 0x0F) * x[i] + (byte >> 4) * x[4 + i];
            else
              dot[r][l] += byte * x[i];
          }
      }
    }
    const at::Half* sl = b.scales + g * 2 * kLanes;
    for (int r = 0; r < R; ++r)
      for (int l = 0; l < kLanes; ++l)
        acc[r][l] += static_cast<float>(sl[l]) * v.scale[r * b.groups + g] * dot[r][l] +
                     static_cast<float>(sl[kLanes + l]) * v.sum[r * b.groups + g];
  }
  for (int r = 0; r < R; ++r) std::memcpy(v.y + r * v.n_out, acc[r], sizeof(acc[r]));
}

#endif

template <int Bits, int R>
void rows_upto(const Block& b, const View& v, int rows) {
  if constexpr (R > 1) {
    if (rows < R) return rows_upto<Bits, R - 1>(b, v, rows);
  }
  rows_of_block<Bits, R>(b, v);
}

template <int Bits>
void multiply(const Rows& rows, const uint8_t* w, const at::Half* sl, float* out, int64_t m_rows,
              int64_t k_in, int64_t blocks, int64_t group) {
  constexpr int64_t sub = kSub<Bits>;
  const int64_t n_out = blocks * kLanes, groups = k_in / group;
  for (int64_t m0 = 0; m0 < m_rows; m0 += kTile) {
    const int64_t tile = std::min(kTile, m_rows - m0);
    // with AVX-512, blocks go two at a time (the last alone when their count is odd)
    at::parallel_for(0, (blocks + kStep - 1) / kStep, 1, [&](int64_t begin, int64_t end) {
      for (int64_t blk = begin * kStep; blk < std::min(end * kStep, blocks); blk += kStep) {
        const Block b{w + blk * (k_in / sub) * 64, sl + blk * groups * 2 * kLanes, groups,
                      group / sub};
        const bool pair = kStep == 2 && blk + 1 < blocks;
        const int per_pass = pair ? kPairRows : kRows;
        for (int64_t m = m0; m < m0 + tile; m += per_pass) {
          const View v{rows.q.data() + m * k_in, rows.scale.data() + m * groups,
                       rows.sum.data() + m * groups, k_in, out + m * n_out + blk * kLanes, n_out};
          const int n = static_cast<int>(std::min<int64_t>(per_pass, m0 + tile - m));
#if SMCSPEC_AVX512
          if (pair) {
            pair_rows_upto<Bits, kPairRows>(b, (k_in / sub) * 64, v, n);
            continue;
          }
#endif
          rows_upto<Bits, kRows>(b, v, n);
        }
      }
    });
  }
}

}  // namespace

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& packed,
                     const torch::Tensor& scales, int64_t group, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8, got ", bits);
  const int64_t sub = 32 / bits;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "x must be float32 [M, K]");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.size(2) == 64,
              "packed must be uint8 [N / 16, K / ", sub, ", 64]");
  TORCH_CHECK(scales.dim() == 4 && scales.scalar_type() == at::kHalf && scales.size(2) == 2 &&
                  scales.size(3) == kLanes,
              "scales must be float16 [N / 16, K / group, 2, 16]");
  TORCH_CHECK(packed.is_contiguous() && scales.is_contiguous(), "weights must be contiguous");
  const int64_t m_rows = x.size(0), k_in = x.size(1), blocks = packed.size(0);
  TORCH_CHECK(group > 0 && group % 8 == 0 && k_in % group == 0,
              "group must divide K and be a multiple of 8");
  TORCH_CHECK(packed.size(1) * sub == k_in, "packed holds ", packed.size(1) * sub,
              " inputs, x has ", k_in);
  TORCH_CHECK(scales.size(0) == blocks && scales.size(1) == k_in / group, "scales' shape");
  const torch::Tensor xc = x.contiguous();
  torch::Tensor y = torch::empty({m_rows, blocks * kLanes}, x.options());
  if (m_rows == 0) return y;
  const Rows rows = quantize_rows(xc.data_ptr<float>(), m_rows, k_in, group);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const at::Half* sl = scales.data_ptr<at::Half>();
  if (bits == 4)
    multiply<4>(rows, w, sl, y.data_ptr<float>(), m_rows, k_in, blocks, group);
  else
    multiply<8>(rows, w, sl, y.data_ptr<float>(), m_rows, k_in, blocks, group);
  return y;
}

std::string isa() {
#if SMCSPEC_AVX512
  return "avx512-vnni";
#elif SMCSPEC_AVX2
  return "avx2";
#else
  return "portable";
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "y [M, N] = x [M, K] W^T, W int4 or int8 per group (see the source)");
  m.def("isa", &isa, "the instruction set the kernel was built for");
}
