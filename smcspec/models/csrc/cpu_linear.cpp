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
//
// Where the CPU has AMX and Linux grants the process its tiles, products of several rows run on
// the tile unit instead (see "AMX" below): int8 tiles, bit-identical to the vector path, from a
// few rows up; bf16 tiles of de-quantized weights for long prefills.

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
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AMX_BF16__) && \
    defined(__AVX512BF16__) && defined(__linux__)
#define SMCSPEC_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <mutex>
#endif
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

// The AMX path's layout (`tiles`): rows in tiles of 16, rows past `m_rows` zero, and each
// tile's `chunk` inputs stored as one A tile, 16 rows of `chunk` bytes: tile t, chunk c, row r
// at ((t * K / chunk + c) * 16 + r) * chunk. With `nibbles` (int4 weights) the inputs within a
// chunk are in the order of the unpacked weights' tile rows (see `unpack_group`): input
// 8 s + 4 h + i of the chunk at 4 s + i + h * chunk / 2.
struct TileLayout {
  int64_t chunk = 0;  // 0: plain rows [M, K]
  bool nibbles = false;
};

// The largest |x| of a group (an entry that is NaN is passed over, as std::max passes it).
inline float group_peak(const float* src, int64_t group) {
  int64_t k = 0;
  float peak = 0.f;
#if SMCSPEC_AVX512
  __m512 top = _mm512_setzero_ps();
  for (; k + 16 <= group; k += 16)  // maxps returns its second operand where one is NaN
    top = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(src + k)), top);
  peak = _mm512_reduce_max_ps(top);
#endif
  for (; k < group; ++k) peak = std::max(peak, std::fabs(src[k]));
  return peak;
}

#if SMCSPEC_AVX512
// x * inv rounded to the nearest integer, ties to even (nearbyint's rounding under the default
// mode), stored as int8; returns their sum. `group` a multiple of 16.
inline int32_t round_group(const float* src, int64_t group, float inv, int8_t* dst) {
  const __m512 factor = _mm512_set1_ps(inv);
  __m512i sum = _mm512_setzero_si512();
  for (int64_t k = 0; k < group; k += 16) {
    const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(src + k), factor));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + k), _mm512_cvtepi32_epi8(q));
    sum = _mm512_add_epi32(sum, q);
  }
  return _mm512_reduce_add_epi32(sum);
}
#endif

Rows quantize_rows(const float* x, int64_t m_rows, int64_t k_in, int64_t group,
                   TileLayout tiles = {}) {
  const int64_t groups = k_in / group, chunk = tiles.chunk;
  const int64_t padded = chunk ? (m_rows + 15) / 16 * 16 : m_rows;
  Rows r{std::vector<int8_t>(padded * k_in), std::vector<float>(m_rows * groups),
         std::vector<float>(m_rows * groups)};
  std::vector<int64_t> order(chunk);  // where a chunk's inputs go within its tile row
  for (int64_t j = 0; j < chunk; ++j)
    order[j] = tiles.nibbles ? (j / 8) * 4 + j % 4 + (j % 8 / 4) * (chunk / 2) : j;
  at::parallel_for(0, m_rows * groups, 64, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t m = i / groups, g = i % groups;
      const float* src = x + m * k_in + g * group;
      const float peak = group_peak(src, group);
      const float scale = peak / 127.f, inv = peak > 0.f ? 127.f / peak : 0.f;
      int32_t total = 0;
      const int64_t n = chunk ? chunk : group;  // inputs per stretch of consecutive bytes
      for (int64_t k0 = 0; k0 < group; k0 += n) {
        int8_t* dst = r.q.data() + m * k_in + g * group + k0;
        if (chunk) {  // tile m / 16, chunk (g * group + k0) / chunk, row m % 16
          const int64_t c = (g * group + k0) / chunk;
          dst = r.q.data() + ((m / 16 * (k_in / chunk) + c) * 16 + m % 16) * chunk;
        }
#if SMCSPEC_AVX512
        if (n % 16 == 0 && n <= 256) {  // the same roundings as below, 16 at a time
          if (!tiles.nibbles) {
            total += round_group(src + k0, n, inv, dst);
          } else {
            int8_t rounded[256];
            total += round_group(src + k0, n, inv, rounded);
            for (int64_t k = 0; k < n; ++k) dst[order[k]] = rounded[k];
          }
          continue;
        }
#endif
        for (int64_t k = 0; k < n; ++k) {
          const int32_t q = static_cast<int32_t>(std::nearbyint(src[k0 + k] * inv));
          dst[chunk ? order[k] : k] = static_cast<int8_t>(q);
          total += q;
        }
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

// A block's 16 fp16 values (a group's scales, or its offsets) as floats.
inline __m512 load_halves(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// One group's int32 sums of a row added to the row's 16 outputs: weight scale x row scale x sum,
// plus the weights' offset x the row's scaled sum. Every path (VNNI, AMX tiles) scales through
// here, in group order, so they agree bit for bit.
inline __m512 add_group(__m512 acc, __m512i dot, __m512 scale, __m512 lo, float xs, float xsum) {
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(scale, _mm512_set1_ps(xs)), acc);
  return _mm512_fmadd_ps(lo, _mm512_set1_ps(xsum), acc);
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
    const __m512 scale = load_halves(sl), lo = load_halves(sl + kLanes);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      acc[r] = add_group(acc[r], dot[r], scale, lo, v.scale[r * b.groups + g],
                         v.sum[r * b.groups + g]);
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
      const __m512 scale = load_halves(sl), lo = load_halves(sl + kLanes);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        acc[r][c] = add_group(acc[r][c], dot[r][c], scale, lo, v.scale[r * b.groups + g],
                              v.sum[r * b.groups + g]);
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

#if SMCSPEC_AMX

// AMX, first way (`multiply_amx`): a tile multiply C[16, 16] += A[16, chunk] B[chunk, 16] of int8
// by uint8 (tdpbsud), 16 rows x 16 outputs x 32 or 64 inputs per instruction. B's layout is the
// packed int8 one: a tile row holds 4 inputs of each of the 16 outputs, which is a sub-block, so
// a block's int8 weights are its tiles as they are stored. int4 weights are unpacked to int8
// tiles a group at a time (`unpack_group`), and the activations are stored tile by tile in the
// matching order (`TileLayout`). Each group's int32 sums leave the tiles and are scaled in
// AVX-512 float by `add_group`, as the VNNI loops scale theirs, group by group in order, so a
// row's outputs are bit-identical to the VNNI path's at any number of rows. That per-group
// scaling, a float multiply-add per row, block and group of 32 inputs, costs about what the
// integer products cost, and bounds this way at 1.0-1.9x the VNNI path's speed.
//
// Linux hands out tile state only to a process that asks (`arch_prctl`), once, before the first
// tile instruction; the tile configuration is per thread and is loaded by every worker before
// its tiles, since any other library on the thread (oneDNN) may have changed or released it.

constexpr int64_t kAmxRows = 16;  // rows of a tile

std::string request_amx() {
  constexpr long kGetSupported = 0x1021, kRequest = 0x1023, kTileData = 18;
  unsigned long mask = 0;
  if (syscall(SYS_arch_prctl, kGetSupported, &mask) != 0)
    return std::string("arch_prctl(ARCH_GET_XCOMP_SUPP) failed: ") + std::strerror(errno);
  if (!((mask >> kTileData) & 1)) return "the kernel does not offer AMX tile data";
  if (syscall(SYS_arch_prctl, kRequest, kTileData) != 0)
    return std::string("arch_prctl(ARCH_REQ_XCOMP_PERM) refused: ") + std::strerror(errno);
  return "";
}

// "" where this process may use the tiles, else why not (asked once).
const std::string& amx_refusal() {
  static std::once_flag once;
  static std::string why;
  std::call_once(once, [] { why = request_amx(); });
  return why;
}

// From how many rows products run on int8 tiles and on bf16 tiles, by weight bits (4, 8);
// `smcspec.models.cpu_linear` sets them from its measurements.
int64_t amx_tiles_from[2] = {16, 8}, amx_bf16_from[2] = {64, 128};
constexpr int64_t kNever = int64_t{1} << 62;

struct TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
} __attribute__((packed));

// Tiles 0-3: the sums C of two blocks for even row tiles (0, 1) and odd ones (2, 3); 4 and 5:
// the activations A of even and odd row tiles; 6 and 7: the two blocks' weights B. Rows are
// padded to whole tiles. One row tile's sums are read back while the next one's are multiplied,
// so the tile unit does not wait for the vector units.
void configure_tiles(int chunk) {
  TileConfig c;
  for (int t = 0; t < 6; ++t) c.rows[t] = kAmxRows;
  for (int t = 0; t < 4; ++t) c.colsb[t] = 64;
  c.colsb[4] = c.colsb[5] = static_cast<uint16_t>(chunk);
  c.rows[6] = c.rows[7] = static_cast<uint8_t>(chunk / 4);
  c.colsb[6] = c.colsb[7] = 64;
  _tile_loadconfig(&c);
}

// One group of a block's int4 weights (group / 8 sub-blocks of 64 bytes) as int8 tiles: for each
// `chunk` inputs, the sub-blocks' low nibbles as chunk / 8 tile rows, then their high nibbles.
void unpack_group(const uint8_t* packed, int64_t group, int64_t chunk, uint8_t* out) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  const int64_t per = chunk / 8;
  for (int64_t c = 0; c < group / chunk; ++c) {
    const uint8_t* src = packed + c * per * 64;
    uint8_t* dst = out + c * 2 * per * 64;
    for (int64_t s = 0; s < per; ++s) {
      const __m512i p = _mm512_loadu_si512(src + s * 64);
      _mm512_storeu_si512(dst + s * 64, _mm512_and_si512(p, low));
      _mm512_storeu_si512(dst + (per + s) * 64, _mm512_and_si512(_mm512_srli_epi16(p, 4), low));
    }
  }
}

struct AmxPass {
  const Rows* x;
  const uint8_t* w[2];    // group g's int8 tiles of the two blocks
  const at::Half* sl[2];  // the blocks' scales
  float* acc;             // [rows, 2, 16]: the sums so far of rows [m0, m0 + rows)
  int64_t m0, rows, k_in, groups, chunks, chunk, tile_bytes;
};

// A pass's items are (group, row tile) pairs, in that order. Item i's products go to the tiles
// of parity i % 2, and item i - 1 is read back only after item i is issued: the tile unit
// multiplies one item while the vector units scale the one before.
// (GCC's tile intrinsics name their tiles by literal numbers, hence the macros.)
#define SMCSPEC_ISSUE(C0, C1, A)                                             \
  _tile_zero(C0);                                                            \
  if constexpr (Count == 2) _tile_zero(C1);                                  \
  for (int64_t c = 0; c < p.chunks; ++c) {                                   \
    if (p.chunks > 1 || t == 0) {                                            \
      _tile_loadd(6, p.w[0] + c * p.tile_bytes, 64);                         \
      if constexpr (Count == 2) _tile_loadd(7, p.w[1] + c * p.tile_bytes, 64); \
    }                                                                        \
    _tile_loadd(A, a + c * 16 * p.chunk, p.chunk);                           \
    _tile_dpbsud(C0, A, 6);                                                  \
    if constexpr (Count == 2) _tile_dpbsud(C1, A, 7);                        \
  }

#define SMCSPEC_STORE(C0, C1, SUMS)       \
  _tile_stored(C0, SUMS[0], 64);          \
  if constexpr (Count == 2) _tile_stored(C1, SUMS[1], 64);

template <int Count>
struct AmxPipe {
  const AmxPass& p;
  alignas(64) int32_t sums[2][2][kAmxRows][kLanes];  // [parity, block, row, output]

  // Item (g, t)'s products into the tiles of `parity`.
  void issue(int parity, int64_t g, int64_t t) {
    const int8_t* a =  // the tile's A for group g's first chunk
        p.x->q.data() + ((p.m0 / kAmxRows + t) * (p.k_in / p.chunk) + g * p.chunks) * 16 * p.chunk;
    if (parity == 0) {
      SMCSPEC_ISSUE(0, 1, 4)
    } else {
      SMCSPEC_ISSUE(2, 3, 5)
    }
  }

  // Item (g, t)'s sums, from the tiles of `parity`, scaled into acc.
  void drain(int parity, int64_t g, int64_t t) {
    if (parity == 0) {
      SMCSPEC_STORE(0, 1, sums[0])
    } else {
      SMCSPEC_STORE(2, 3, sums[1])
    }
    const int64_t rows = std::min(kAmxRows, p.rows - t * kAmxRows), groups = p.groups;
    const float* __restrict xs = p.x->scale.data() + (p.m0 + t * kAmxRows) * groups + g;
    const float* __restrict xsum = p.x->sum.data() + (p.m0 + t * kAmxRows) * groups + g;
    for (int b = 0; b < Count; ++b) {
      const at::Half* s = p.sl[b] + g * 2 * kLanes;
      const __m512 scale = load_halves(s), lo = load_halves(s + kLanes);
      float* __restrict acc = p.acc + t * kAmxRows * 2 * kLanes + b * kLanes;
      const int32_t(*__restrict dots)[kLanes] = sums[parity][b];
      if (rows == kAmxRows) {
#pragma GCC unroll 16
        for (int r = 0; r < kAmxRows; ++r)
          scale_row(acc + r * 2 * kLanes, dots[r], scale, lo, xs[r * groups], xsum[r * groups]);
      } else {
        for (int r = 0; r < rows; ++r)
          scale_row(acc + r * 2 * kLanes, dots[r], scale, lo, xs[r * groups], xsum[r * groups]);
      }
    }
  }

  static inline void scale_row(float* acc, const int32_t* dot, __m512 scale, __m512 lo, float xs,
                               float xsum) {
    const __m512i d = _mm512_load_si512(dot);
    _mm512_store_ps(acc, add_group(_mm512_load_ps(acc), d, scale, lo, xs, xsum));
  }
};

// Every item of a pass over one or two blocks (`Count`) whose packed weights start at `w`.
template <int Count, int Bits>
void amx_pass(AmxPass& p, const uint8_t* w, int64_t block_bytes, int64_t group_bytes,
              uint8_t (*unpacked)[256 * kLanes]) {
  AmxPipe<Count> pipe{p, {}};
  const int64_t tiles = (p.rows + kAmxRows - 1) / kAmxRows;
  int64_t item = 0;
  for (int64_t g = 0; g < p.groups; ++g) {
    // the next pair's group g into L2 meanwhile: the weights arrive while these rows are scaled
    const char* next = reinterpret_cast<const char*>(w + 2 * block_bytes + g * group_bytes);
    for (int64_t line = 0; line < group_bytes; line += 64) {
      _mm_prefetch(next + line, _MM_HINT_T1);
      _mm_prefetch(next + block_bytes + line, _MM_HINT_T1);
    }
    for (int b = 0; b < Count; ++b) {
      const uint8_t* packed = w + b * block_bytes + g * group_bytes;
      if constexpr (Bits == 4) {
        unpack_group(packed, p.chunks * p.chunk, p.chunk, unpacked[b]);
        p.w[b] = unpacked[b];
      } else {
        p.w[b] = packed;
      }
    }
    for (int64_t t = 0; t < tiles; ++t, ++item) {
      pipe.issue(item % 2, g, t);
      if (item > 0) {
        const int64_t before = item - 1;
        pipe.drain(before % 2, before / tiles, before % tiles);
      }
    }
  }
  const int64_t last = item - 1;
  pipe.drain(last % 2, last / tiles, last % tiles);
}

constexpr int64_t kAmxSpan = 128;  // rows whose sums stay in L1 while a block pair passes

template <int Bits>
void multiply_amx(const Rows& rows, const uint8_t* w, const at::Half* sl, float* out,
                  int64_t m_rows, int64_t k_in, int64_t blocks, int64_t group, int64_t chunk) {
  constexpr int64_t sub = kSub<Bits>;
  const int64_t n_out = blocks * kLanes, groups = k_in / group;
  const int64_t block_bytes = (k_in / sub) * 64, group_bytes = group / sub * 64;
  for (int64_t m_outer = 0; m_outer < m_rows; m_outer += kAmxSpan) {
    const int64_t span = std::min(kAmxSpan, m_rows - m_outer);
    at::parallel_for(0, (blocks + 1) / 2, 1, [&](int64_t begin, int64_t end) {
      alignas(64) uint8_t unpacked[2][256 * kLanes];  // a group's int8 tiles (groups <= 256)
      alignas(64) float acc[kAmxSpan * 2 * kLanes];
      configure_tiles(static_cast<int>(chunk));
      for (int64_t blk = begin * 2; blk < std::min(end * 2, blocks); blk += 2) {
        const bool pair = blk + 1 < blocks;
        std::fill(acc, acc + span * 2 * kLanes, 0.f);
        AmxPass p{&rows, {}, {sl + blk * groups * 2 * kLanes, sl + (blk + 1) * groups * 2 * kLanes},
                  acc, m_outer, span, k_in, groups, group / chunk, chunk, chunk / 4 * 64};
        if (pair)
          amx_pass<2, Bits>(p, w + blk * block_bytes, block_bytes, group_bytes, unpacked);
        else
          amx_pass<1, Bits>(p, w + blk * block_bytes, block_bytes, group_bytes, unpacked);
        for (int64_t m = 0; m < span; ++m)
          for (int b = 0; b < 1 + pair; ++b)
            std::memcpy(out + (m_outer + m) * n_out + (blk + b) * kLanes,
                        acc + (m * 2 + b) * kLanes, kLanes * sizeof(float));
      }
      _tile_release();
    });
  }
}


// --- AMX bf16: de-quantized weights, no per-group epilogue ---------------------------------
//
// The int8 tiles above still leave each group of 32 inputs to the vector units (its int32 sums
// scaled per row and output), and that scaling costs as much as the vector units' own integer
// products: rows stay expensive. Here a block's weights are de-quantized once per call to
// bf16 tiles (scale Q + lo rounded to bf16, the work per weight, whatever the rows), the rows
// are rounded to bf16 (8 significant bits, per entry instead of per group), and tdpbf16ps sums
// every input of a row into float32 inside the tile: the vector units touch each weight once and
// each output once.
//
// A bf16 B tile holds 32 inputs x 16 outputs, row r the inputs 2 r and 2 r + 1 of each output;
// an A tile 16 rows x 32 inputs. Tiles 0-3: C for two row tiles x two blocks; 4, 5: A of the
// two row tiles; 6, 7: B of the two blocks.

constexpr int64_t kBf16Tile = 32;  // inputs per bf16 tile

void configure_bf16_tiles() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
  _tile_loadconfig(&c);
}

// The rows of x [M, K] as bf16 A tiles: row tile t, inputs [32 j, 32 j + 32) at
// ((t * K / 32 + j) * 16 + r) * 32; rows past M zero.
std::vector<uint16_t> bf16_rows(const float* x, int64_t m_rows, int64_t k_in) {
  const int64_t tiles = (m_rows + 15) / 16, per = k_in / kBf16Tile;
  std::vector<uint16_t> a(tiles * 16 * k_in, 0);
  at::parallel_for(0, m_rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m)
      for (int64_t j = 0; j < per; ++j) {
        const float* src = x + m * k_in + j * kBf16Tile;
        const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src));
        _mm512_storeu_si512(a.data() + ((m / 16 * per + j) * 16 + m % 16) * kBf16Tile,
                            reinterpret_cast<const __m512i&>(v));
      }
  });
  return a;
}

// 16 bytes of packed int8 (4 outputs x 4 inputs) as float: scale Q + lo.
inline __m512 dequant16(__m128i q, __m512 scale, __m512 lo) {
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)), scale, lo);
}

// One sub-block's Q (64 bytes: 16 outputs x 4 inputs, byte 4 l + i) as two bf16 tile rows:
// inputs 0, 1 of each output, then inputs 2, 3. scale4/lo4[q]: outputs 4 q .. 4 q + 3, each
// repeated for its 4 inputs.
inline void dequant_sub(__m512i q, const __m512* scale4, const __m512* lo4, __m512i even_odd,
                        __m512i odd_odd, uint16_t* row) {
  const __m512 f0 = dequant16(_mm512_castsi512_si128(q), scale4[0], lo4[0]);
  const __m512 f1 = dequant16(_mm512_extracti32x4_epi32(q, 1), scale4[1], lo4[1]);
  const __m512 f2 = dequant16(_mm512_extracti32x4_epi32(q, 2), scale4[2], lo4[2]);
  const __m512 f3 = dequant16(_mm512_extracti32x4_epi32(q, 3), scale4[3], lo4[3]);
  const __m512bh b01 = _mm512_cvtne2ps_pbh(f1, f0);  // outputs 0-7, 4 inputs each
  const __m512bh b23 = _mm512_cvtne2ps_pbh(f3, f2);  // outputs 8-15
  const __m512i lo = reinterpret_cast<const __m512i&>(b01);
  const __m512i hi = reinterpret_cast<const __m512i&>(b23);
  _mm512_storeu_si512(row, _mm512_permutex2var_epi16(lo, even_odd, hi));
  _mm512_storeu_si512(row + 32, _mm512_permutex2var_epi16(lo, odd_odd, hi));
}

// A block's weights as bf16 B tiles: tile j (inputs [32 j, 32 j + 32)) at j * 512 values.
template <int Bits>
void dequant_block(const uint8_t* packed, const at::Half* sl, int64_t k_in, int64_t group,
                   uint16_t* out) {
  alignas(64) int16_t pick[2][32];  // the words of inputs 0, 1 (then 2, 3) of each output
  for (int w = 0; w < 32; ++w) {
    const int l = w / 2, i = w % 2, word = 4 * l + i;  // in [outputs 0-7 | outputs 8-15]
    pick[0][w] = static_cast<int16_t>(word);
    pick[1][w] = static_cast<int16_t>(word + 2);
  }
  const __m512i even = _mm512_load_si512(pick[0]), odd = _mm512_load_si512(pick[1]);
  const __m512i quad[4] = {
      _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
      _mm512_set_epi32(7, 7, 7, 7, 6, 6, 6, 6, 5, 5, 5, 5, 4, 4, 4, 4),
      _mm512_set_epi32(11, 11, 11, 11, 10, 10, 10, 10, 9, 9, 9, 9, 8, 8, 8, 8),
      _mm512_set_epi32(15, 15, 15, 15, 14, 14, 14, 14, 13, 13, 13, 13, 12, 12, 12, 12)};
  const __m512i low = _mm512_set1_epi8(0x0F);
  constexpr int64_t sub = kSub<Bits>;
  for (int64_t g = 0; g < k_in / group; ++g) {
    const at::Half* s = sl + g * 2 * kLanes;
    const __m512 scale = load_halves(s), lo = load_halves(s + kLanes);
    __m512 scale4[4], lo4[4];
    for (int q = 0; q < 4; ++q) {
      scale4[q] = _mm512_permutexvar_ps(quad[q], scale);
      lo4[q] = _mm512_permutexvar_ps(quad[q], lo);
    }
    for (int64_t sb = g * group / sub; sb < (g + 1) * group / sub; ++sb) {
      const __m512i p = _mm512_loadu_si512(packed + sb * 64);
      if constexpr (Bits == 8) {
        // inputs 4 sb .. 4 sb + 3: rows 2 (sb % 8), + 1 of tile sb / 8
        dequant_sub(p, scale4, lo4, even, odd, out + (sb / 8) * 512 + (sb % 8) * 64);
      } else {
        // low nibbles: inputs 8 sb .. + 3, high: 8 sb + 4 .. + 7
        const int64_t first = 8 * sb;
        dequant_sub(_mm512_and_si512(p, low), scale4, lo4, even, odd,
                    out + (first / 32) * 512 + (first % 32) / 2 * 32);
        dequant_sub(_mm512_and_si512(_mm512_srli_epi16(p, 4), low), scale4, lo4, even, odd,
                    out + ((first + 4) / 32) * 512 + ((first + 4) % 32) / 2 * 32);
      }
    }
  }
}

#define SMCSPEC_BF16_STORE(C, ROW_TILE, BLOCK)                                          \
  if (t + (ROW_TILE) < tiles) {                                                           \
    _tile_stored(C, buf, 64);                                                           \
    const int64_t m0 = (t + (ROW_TILE)) * 16;                                           \
    for (int64_t r = 0; r < std::min<int64_t>(16, m_rows - m0); ++r)                    \
      std::memcpy(out + (m0 + r) * n_out + (blk + (BLOCK)) * kLanes, buf[r], 64);       \
  }

template <int Bits>
void multiply_bf16(const uint16_t* a, const uint8_t* w, const at::Half* sl, float* out,
                   int64_t m_rows, int64_t k_in, int64_t blocks, int64_t group) {
  constexpr int64_t sub = kSub<Bits>;
  const int64_t n_out = blocks * kLanes, groups = k_in / group, per = k_in / kBf16Tile;
  const int64_t block_bytes = (k_in / sub) * 64, tiles = (m_rows + 15) / 16;
  at::parallel_for(0, (blocks + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> bt(2 * k_in * kLanes);  // the pair's bf16 tiles
    alignas(64) float buf[16][16];
    configure_bf16_tiles();
    for (int64_t blk = begin * 2; blk < std::min(end * 2, blocks); blk += 2) {
      const bool pair = blk + 1 < blocks;
      for (int b = 0; b < 1 + pair; ++b)
        dequant_block<Bits>(w + (blk + b) * block_bytes, sl + (blk + b) * groups * 2 * kLanes,
                            k_in, group, bt.data() + b * k_in * kLanes);
      const uint16_t* b0 = bt.data();
      const uint16_t* b1 = bt.data() + (pair ? k_in * kLanes : 0);
      for (int64_t t = 0; t < tiles; t += 2) {
        const uint16_t* a0 = a + t * per * 512;
        const uint16_t* a1 = a + std::min(t + 1, tiles - 1) * per * 512;
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t j = 0; j < per; ++j) {
          _tile_loadd(6, b0 + j * 512, 64);
          _tile_loadd(7, b1 + j * 512, 64);
          _tile_loadd(4, a0 + j * 512, 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_loadd(5, a1 + j * 512, 64);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
        SMCSPEC_BF16_STORE(0, 0, 0)
        if (pair) { SMCSPEC_BF16_STORE(1, 0, 1) }
        SMCSPEC_BF16_STORE(2, 1, 0)
        if (pair) { SMCSPEC_BF16_STORE(3, 1, 1) }
      }
    }
    _tile_release();
  });
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
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const at::Half* sl = scales.data_ptr<at::Half>();
#if SMCSPEC_AMX
  const int which = bits == 8;
  if (m_rows >= std::min(amx_tiles_from[which], amx_bf16_from[which]) && group % 32 == 0 &&
      group <= 256 && amx_refusal().empty()) {
    if (m_rows >= amx_bf16_from[which]) {
      const std::vector<uint16_t> a = bf16_rows(xc.data_ptr<float>(), m_rows, k_in);
      if (bits == 4)
        multiply_bf16<4>(a.data(), w, sl, y.data_ptr<float>(), m_rows, k_in, blocks, group);
      else
        multiply_bf16<8>(a.data(), w, sl, y.data_ptr<float>(), m_rows, k_in, blocks, group);
      return y;
    }
    const int64_t chunk = group % 64 == 0 ? 64 : 32;  // inputs per tile multiply
    const Rows rows = quantize_rows(xc.data_ptr<float>(), m_rows, k_in, group, {chunk, bits == 4});
    if (bits == 4)
      multiply_amx<4>(rows, w, sl, y.data_ptr<float>(), m_rows, k_in, blocks, group, chunk);
    else
      multiply_amx<8>(rows, w, sl, y.data_ptr<float>(), m_rows, k_in, blocks, group, chunk);
    return y;
  }
#endif
  const Rows rows = quantize_rows(xc.data_ptr<float>(), m_rows, k_in, group);
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

// "" where products of enough rows (`set_amx_rows`) run on AMX tiles, else why they do not.
std::string amx() {
#if SMCSPEC_AMX
  return amx_refusal();
#else
  return "the kernel was built without AMX "
         "(this CPU or compiler lacks AMX-INT8, AMX-BF16 or AVX512-BF16)";
#endif
}

// From how many rows `bits`-bit weights run on AMX int8 tiles and on bf16 tiles (where
// `amx()` is ""); 0 for never. Returns the old pair.
std::vector<int64_t> set_amx_rows(int64_t bits, int64_t tiles_from, int64_t bf16_from) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8, got ", bits);
  TORCH_CHECK(tiles_from >= 0 && bf16_from >= 0, "row counts must be >= 0 (0: never)");
#if SMCSPEC_AMX
  int64_t& tiles = amx_tiles_from[bits == 8];
  int64_t& bf16 = amx_bf16_from[bits == 8];
  std::vector<int64_t> old{tiles == kNever ? 0 : tiles, bf16 == kNever ? 0 : bf16};
  tiles = tiles_from ? tiles_from : kNever;
  bf16 = bf16_from ? bf16_from : kNever;
  return old;
#else
  return {0, 0};
#endif
}

// cpu_attention.cpp
torch::Tensor attend(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor key_slots,
                     torch::Tensor row_seq, torch::Tensor positions, double scale,
                     int64_t window);

// cpu_norm.cpp
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps);
torch::Tensor head_norms(const torch::Tensor& qkv, const torch::Tensor& wq,
                         const torch::Tensor& wk, int64_t nh, int64_t nkv, double eps);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "y [M, N] = x [M, K] W^T, W int4 or int8 per group (see the source)");
  m.def("isa", &isa, "the instruction set the kernel was built for");
  m.def("amx", &amx, "'' where products run on AMX tiles, else why they do not");
  m.def("set_amx_rows", &set_amx_rows,
        "(bits, int8 tiles from, bf16 tiles from): rows from which AMX runs, 0 never; old pair");
  m.def("attend", &attend,
        "causal attention over KV slots (a sliding window's last keys where window > 0), each "
        "row's arithmetic fixed by the row alone (cpu_attention.cpp)", py::arg("q"), py::arg("k"),
        py::arg("v"), py::arg("key_slots"), py::arg("row_seq"), py::arg("positions"),
        py::arg("scale"), py::arg("window") = 0);
  m.def("rms_norm", &rms_norm,
        "RMSNorm of float32 x [..., H] times w [H], each row's sum in a fixed order "
        "(cpu_norm.cpp)");
  m.def("head_norms", &head_norms,
        "qkv [T, nh + 2 nkv, d] with q's heads RMS-normed by wq [d] and k's by wk [d] "
        "(cpu_norm.cpp)");
}
