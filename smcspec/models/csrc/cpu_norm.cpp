// RMSNorm on the CPU, one call for what PyTorch spends ~7 ops on (pow, mean, add, rsqrt, two
// multiplies, a dtype check): at the hidden sizes of small models (640 for Gemma 3 270M) each op
// costs a few microseconds of dispatch for well under one of arithmetic, and a Gemma 3 layer
// normalises 6 times (its block's input and output around attention and the MLP, and each
// head's q and k).
//
//   y[r, k] = (x[r, k] * inv_r) * w[k],   inv_r = 1 / sqrt(sum_k x[r, k]^2 / H + eps)
//
// in float32, as PyTorch's float32 rms_norm computes it, but for the order of the sum: H squares
// summed in 16 lanes (input k into lane k % 16), then the lanes in a fixed tree. Every row is
// computed alone, so a row's result does not depend on how many rows share the call (the same
// rule as cpu_attention.cpp), and plain loops over 16 lanes let the compiler vectorise without
// reassociating a sum.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

constexpr int kLanes = 16;

// 1 / sqrt(mean of x[0..h)^2 + eps), the sum in 16 lanes and a fixed tree.
inline float inverse_rms(const float* x, int64_t h, float eps) {
  float lanes[kLanes] = {};
  int64_t k = 0;
  for (; k + kLanes <= h; k += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] += x[k + l] * x[k + l];
  for (int l = 0; k < h; ++k, ++l) lanes[l] += x[k] * x[k];
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  return 1.f / std::sqrt(lanes[0] / static_cast<float>(h) + eps);
}

inline void norm_row(const float* x, const float* w, float* y, int64_t h, float eps) {
  const float inv = inverse_rms(x, h, eps);
  for (int64_t k = 0; k < h; ++k) y[k] = (x[k] * inv) * w[k];
}

// rows per thread's share: a call on a few rows runs on the calling thread alone
inline int64_t grain(int64_t h) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(h, 1)); }

void check_weight(const torch::Tensor& w, int64_t h, const char* name) {
  TORCH_CHECK(w.dim() == 1 && w.numel() == h && w.scalar_type() == at::kFloat &&
                  w.is_contiguous(),
              name, " must be a contiguous float32 [", h, "]");
}

}  // namespace

// RMSNorm of x [..., H] (float32) times w [H] over its last dimension: a new [..., H] tensor.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() >= 1 && x.scalar_type() == at::kFloat, "x must be float32 [..., H]");
  const int64_t h = x.size(-1);
  check_weight(w, h, "w");
  const torch::Tensor xc = x.contiguous();
  torch::Tensor y = torch::empty_like(xc);
  const int64_t rows = h ? xc.numel() / h : 0;
  const float *src = xc.data_ptr<float>(), *wt = w.data_ptr<float>();
  float* dst = y.data_ptr<float>();
  at::parallel_for(0, rows, grain(h), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      norm_row(src + r * h, wt, dst + r * h, h, static_cast<float>(eps));
  });
  return y;
}

// qkv [T, nh + 2 nkv, d] (float32) with each of the nh q heads normalised over its d by wq [d]
// and each of the nkv k heads by wk [d], the v heads as they are: a new tensor (Qwen3's and
// Gemma 3's norms of q and k, before RoPE).
torch::Tensor head_norms(const torch::Tensor& qkv, const torch::Tensor& wq,
                         const torch::Tensor& wk, int64_t nh, int64_t nkv, double eps) {
  TORCH_CHECK(qkv.dim() == 3 && qkv.scalar_type() == at::kFloat && qkv.size(1) == nh + 2 * nkv,
              "qkv must be float32 [T, nh + 2 nkv, d]");
  const int64_t d = qkv.size(2), heads = qkv.size(1), normed = nh + nkv;
  check_weight(wq, d, "wq");
  check_weight(wk, d, "wk");
  const torch::Tensor xc = qkv.contiguous();
  torch::Tensor y = torch::empty_like(xc);
  const float *src = xc.data_ptr<float>(), *q_w = wq.data_ptr<float>(), *k_w = wk.data_ptr<float>();
  float* dst = y.data_ptr<float>();
  at::parallel_for(0, xc.size(0) * heads, grain(d), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t head = i % heads;
      const float* x = src + i * d;
      float* out = dst + i * d;
      if (head < normed)
        norm_row(x, head < nh ? q_w : k_w, out, d, static_cast<float>(eps));
      else
        std::copy(x, x + d, out);
    }
  });
  return y;
}
