// tandem's native CPU kernels: what a decode step does between its matmuls, fused, and the
// GGUF 4-bit matmul computed the way llama.cpp does it.
//
// Why native code: on the 2-core CPU we serve from, every small PyTorch op costs 3-4 us of
// dispatch, and a one-row step of SmolLM2-135M runs ~35 of them per layer; torch's int4 kernel
// also multiplies bf16 activations and runs at a third of the memory bandwidth. Here:
//
// - block_matmul: activations are quantized per 32-value block to int8 (a scale per block, as
//   llama.cpp's q8_1), then multiplied with the weight's 4-bit (or 8-bit) codes by AVX-512 VNNI
//   u8 x s8 dot products, scaled in fp32: w = d*q + m gives  d*da*sum(q*a) + m*da*sum(a).
// - add_rms_norm, rope_and_store, silu_mul: one pass each over fp32 rows.
// - score_rows: a scored prompt's logprobs, ranks and top n from its rows' logits.
// - paged_decode: one query per sequence against its keys read through the block table,
//   in place in the pool (no gather into a padded batch); paged_prefill: a step's prompt rows,
//   each computed as paged_decode would compute it at its position.
// - DecodeStack: every layer of a decode-only step in one call, over the kernels above.
//
// Registered as torch ops (torch.ops.tandem.*); threads come from ATen's pool, so
// torch.set_num_threads governs them as it does every other op. fp32 activations only.
// Error messages are whole strings (std::to_string, no integers streamed by TORCH_CHECK): on the
// GPU machine (torch 2.11, g++ 13) streaming an integer into a message crashed the process.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <immintrin.h>

#if !defined(__AVX512F__) || !defined(__AVX512BW__) || !defined(__AVX512VNNI__)
#error "tandem's CPU kernels need AVX-512 (F, BW) and VNNI"
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;  // GGUF's Q4_0/Q4_1/Q8_0 block: values sharing one scale

// ---- activations as int8 blocks ---------------------------------------------------------------

struct QuantizedRows {
  int64_t blocks;
  std::vector<int8_t> q;    // (rows, blocks * 32)
  std::vector<float> d;     // (rows, blocks): value = d * q
  std::vector<float> dsum;  // (rows, blocks): d * sum(q), for the weight's minimum term
};

QuantizedRows quantize_rows(const float* x, int64_t rows, int64_t k) {
  const int64_t blocks = k / kBlock;
  QuantizedRows out{blocks, std::vector<int8_t>(rows * k), std::vector<float>(rows * blocks),
                    std::vector<float>(rows * blocks)};
  for (int64_t i = 0; i < rows * blocks; ++i) {
    const __m512 v0 = _mm512_loadu_ps(x + i * kBlock), v1 = _mm512_loadu_ps(x + i * kBlock + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv));  // rounds to nearest even
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(&out.q[i * kBlock]), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(&out.q[i * kBlock + 16]), _mm512_cvtsepi32_epi8(q1));
    out.d[i] = amax / 127.f;
    out.dsum[i] = out.d[i] * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
  }
  return out;
}

// ---- weights in groups of 16 rows -------------------------------------------------------------
//
// A weight is w = d * u + m per 32-value block, u an unsigned code: 4-bit for Q4_0/Q4_1, 8-bit
// (q + 128, m = -128 d) for Q8_0. The loader lays the codes out in groups of 16 output rows:
// for each group, block by block, 64-byte units in which byte 4r + t belongs to row r:
//   4-bit: unit c (0-3) holds code 4c + t in its low nibble and code 16 + 4c + t in its high one;
//   8-bit: unit c (0-7) holds code 4c + t.
// So one unpacked vector is "4 consecutive codes of 16 rows", and a VNNI dot product against the
// 4 matching activations broadcast gives 16 rows' partial sums at once: no horizontal sums, and
// a block's fp16 scales of 16 rows convert in one instruction. Scales are (groups, blocks, 16).

constexpr int64_t kRows = 16;
constexpr int64_t kPrefetchBlocks = 16;

template <int Bits>
struct Codes {
  static constexpr int64_t kBlockBytes = kRows * kBlock * Bits / 8;  // one block of 16 rows
  // The 8 vectors of one block of 16 rows: code chunk c (codes 4c..4c+3) in w[c].
  static inline void load(const uint8_t* p, __m512i w[8]) {
    if constexpr (Bits == 4) {
      const __m512i low = _mm512_set1_epi8(0x0F);
      for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(p + 64 * c);
        w[c] = _mm512_and_si512(v, low);
        w[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
    } else {
      for (int c = 0; c < 8; ++c) w[c] = _mm512_loadu_si512(p + 64 * c);
    }
  }
};

// out[r0 .. r0 + R, rows of group g]: the group's codes are unpacked once per block and used for
// R activation rows.
template <int Bits, int R>
void group_tile(const QuantizedRows& a, int64_t r0, const uint8_t* codes, const c10::Half* scale,
                const c10::Half* minimum, float* out, int64_t n_out) {
  const int64_t nb = a.blocks, k = nb * kBlock;
  __m512 acc[R];
  for (auto& v : acc) v = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i w[8];
    const uint8_t* here = codes + b * Codes<Bits>::kBlockBytes;
    // A one-row product streams its weight from memory once; the hardware prefetcher alone
    // reaches half the bandwidth, so ask for the blocks a few ahead (past the group's end, too:
    // the next group follows it).
    for (int64_t line = 0; line < Codes<Bits>::kBlockBytes; line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(here + kPrefetchBlocks * Codes<Bits>::kBlockBytes + line), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(scale + (b + kPrefetchBlocks) * kRows), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(minimum + (b + kPrefetchBlocks) * kRows), _MM_HINT_T0);
    Codes<Bits>::load(here, w);
    const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scale + b * kRows)));
    const __m512 mw = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(minimum + b * kRows)));
    for (int r = 0; r < R; ++r) {
      const int32_t* act = reinterpret_cast<const int32_t*>(&a.q[(r0 + r) * k + b * kBlock]);
      // Two chains, so consecutive dot products do not wait on each other.
      __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
      for (int c = 0; c < 8; c += 2) {
        even = _mm512_dpbusd_epi32(even, w[c], _mm512_set1_epi32(act[c]));
        odd = _mm512_dpbusd_epi32(odd, w[c + 1], _mm512_set1_epi32(act[c + 1]));
      }
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(even, odd));
      const int64_t i = (r0 + r) * nb + b;
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(dot, dw), _mm512_set1_ps(a.d[i]), acc[r]);
      acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(a.dsum[i]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + (r0 + r) * n_out, acc[r]);
}

// x: (M, K) fp32; codes: the laid-out codes of an (N, K) weight; scale, minimum: (N/16, K/32, 16)
// fp16. Returns x @ w.T, (M, N) fp32.
at::Tensor block_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                        const at::Tensor& minimum, int64_t bits) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "activations must be contiguous fp32 (rows, K)");
  TORCH_CHECK(bits == 4 || bits == 8, "codes are 4 or 8 bits");
  const int64_t m = x.size(0), k = x.size(1), nb = k / kBlock;
  TORCH_CHECK(k % kBlock == 0, "K must be a multiple of 32");
  TORCH_CHECK(scale.dim() == 3 && scale.size(2) == kRows && scale.scalar_type() == at::kHalf &&
                  scale.is_contiguous(),
              "scales must be fp16 (N / 16, K / 32, 16)");
  TORCH_CHECK(scale.size(1) == nb, "activations have " + std::to_string(k) +
                                       " features; the weight takes " +
                                       std::to_string(scale.size(1) * kBlock));
  TORCH_CHECK(minimum.sizes() == scale.sizes() && minimum.scalar_type() == at::kHalf &&
                  minimum.is_contiguous(),
              "minimums must be like the scales");
  const int64_t groups = scale.size(0), n = groups * kRows;
  const int64_t group_bytes = nb * kRows * kBlock * bits / 8;
  TORCH_CHECK(codes.is_contiguous() && codes.scalar_type() == at::kByte &&
                  codes.numel() == groups * group_bytes,
              "codes do not match the scales' shape");
  at::Tensor out = at::empty({m, n}, x.options());
  const QuantizedRows a = quantize_rows(x.data_ptr<float>(), m, k);
  const uint8_t* code_ptr = codes.data_ptr<uint8_t>();
  const c10::Half* scale_ptr = scale.data_ptr<c10::Half>();
  const c10::Half* min_ptr = minimum.data_ptr<c10::Half>();
  float* out_ptr = out.data_ptr<float>();
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* c = code_ptr + g * group_bytes;
      const c10::Half* d = scale_ptr + g * nb * kRows;
      const c10::Half* mn = min_ptr + g * nb * kRows;
      float* o = out_ptr + g * kRows;
      auto tiles = [&](auto bits_tag) {
        constexpr int B = decltype(bits_tag)::value;
        int64_t r = 0;
        for (; r + 4 <= m; r += 4) group_tile<B, 4>(a, r, c, d, mn, o, n);
        for (; r + 2 <= m; r += 2) group_tile<B, 2>(a, r, c, d, mn, o, n);
        for (; r < m; ++r) group_tile<B, 1>(a, r, c, d, mn, o, n);
      };
      if (bits == 4)
        tiles(std::integral_constant<int, 4>{});
      else
        tiles(std::integral_constant<int, 8>{});
    }
  });
  return out;
}

// ---- between the matmuls ---------------------------------------------------------------------

// e^x for 16 floats (Cephes' polynomial, ~1 ulp): e^x = 2^n * e^r with |r| <= ln2 / 2. Scalar
// expf costs ~5 ns a call; softmax over a decode step's keys makes tens of thousands of them.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f)),
                    _mm512_set1_ps(-87.3365447504f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  const __m512i pow2 =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(pow2));
}

void check_rows(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous(), what, " must be contiguous fp32");
}

// (rms_norm(x + residual) * weight, x + residual) in one pass over each row; with no residual
// (an undefined tensor), of x alone, and x itself is the residual stream.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  check_rows(weight, "weight");
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  TORCH_CHECK(weight.numel() == dim, "weight must have one value per feature");
  at::Tensor summed = x;
  if (residual.defined()) {
    check_rows(residual, "residual");
    TORCH_CHECK(residual.sizes() == x.sizes(), "residual must match x");
    summed = at::empty_like(x);
  }
  at::Tensor normed = at::empty_like(x);
  const float* xs = x.data_ptr<float>();
  const float* res = residual.defined() ? residual.data_ptr<float>() : nullptr;
  const float* w = weight.data_ptr<float>();
  float* sum_out = summed.data_ptr<float>();
  float* norm_out = normed.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    float* s = sum_out + r * dim;
    __m512 squares = _mm512_setzero_ps();
    for (int64_t i = 0; i < dim; i += 16) {
      const __mmask16 live = dim - i >= 16 ? 0xFFFF : (1u << (dim - i)) - 1;
      __m512 v = _mm512_maskz_loadu_ps(live, xs + r * dim + i);
      if (res != nullptr) {
        v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(live, res + r * dim + i));
        _mm512_mask_storeu_ps(s + i, live, v);
      }
      squares = _mm512_fmadd_ps(v, v, squares);
    }
    const float mean = _mm512_reduce_add_ps(squares) / static_cast<float>(dim);
    const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(mean + static_cast<float>(eps)));
    for (int64_t i = 0; i < dim; i += 16) {
      const __mmask16 live = dim - i >= 16 ? 0xFFFF : (1u << (dim - i)) - 1;
      _mm512_mask_storeu_ps(norm_out + r * dim + i, live,
                            _mm512_mul_ps(_mm512_mul_ps(_mm512_maskz_loadu_ps(live, s + i), inv),
                                          _mm512_maskz_loadu_ps(live, w + i)));
    }
  }
  return {normed, summed};
}

// The op: with no residual, the stream returned is a copy of x (an op's outputs never alias its
// inputs).
std::tuple<at::Tensor, at::Tensor> add_rms_norm_op(const at::Tensor& x,
                                                   const c10::optional<at::Tensor>& residual,
                                                   const at::Tensor& weight, double eps) {
  if (residual.has_value()) return add_rms_norm(x, *residual, weight, eps);
  auto [normed, summed] = add_rms_norm(x, at::Tensor(), weight, eps);
  return {normed, summed.clone()};
}

// qkv: (T, n_heads + 2 n_kv, hd). RoPE (rotate-half) on the Q and K heads in place; then each
// token's K and V into pool[slot] = (2, n_kv, hd).
void rope_and_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                    const at::Tensor& pool, const at::Tensor& slots, int64_t n_heads,
                    int64_t n_kv) {
  check_rows(qkv, "qkv");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  check_rows(pool, "pool");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous(), "slots must be int64");
  const int64_t t = qkv.size(0), heads = qkv.size(1), hd = qkv.size(2), half = hd / 2;
  TORCH_CHECK(heads == n_heads + 2 * n_kv && slots.numel() == t, "qkv and slots disagree");
  TORCH_CHECK(pool.dim() == 4 && pool.size(1) == 2 && pool.size(2) == n_kv && pool.size(3) == hd,
              "pool must be (slots, 2, n_kv, hd)");
  float* base = qkv.data_ptr<float>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  float* pool_ptr = pool.data_ptr<float>();
  const int64_t num_slots = pool.size(0), token_kv = 2 * n_kv * hd;
  for (int64_t i = 0; i < t; ++i) {
    TORCH_CHECK(slot[i] >= 0 && slot[i] < num_slots,
                "slot " + std::to_string(slot[i]) + " is outside the pool");
    const float* c = cos.data_ptr<float>() + i * hd;
    const float* s = sin.data_ptr<float>() + i * hd;
    for (int64_t h = 0; h < n_heads + n_kv; ++h) {
      float* x = base + (i * heads + h) * hd;
      for (int64_t j = 0; j < half; ++j) {
        const float a = x[j], b = x[j + half];
        x[j] = a * c[j] - b * s[j];
        x[j + half] = b * c[j + half] + a * s[j + half];
      }
    }
    std::copy_n(base + (i * heads + n_heads) * hd, token_kv, pool_ptr + slot[i] * token_kv);
  }
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t width = gate_up.size(-1) / 2, rows = gate_up.numel() / (2 * width);
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = width;
  at::Tensor out = at::empty(shape, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t r = 0; r < rows; ++r) {
    const float* g = in + r * 2 * width;
    const float* u = g + width;
    for (int64_t i = 0; i < width; i += 16) {
      const __mmask16 live = width - i >= 16 ? 0xFFFF : (1u << (width - i)) - 1;
      const __m512 gate = _mm512_maskz_loadu_ps(live, g + i);
      const __m512 sig = _mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), gate))));
      _mm512_mask_storeu_ps(o + r * width + i, live,
                            _mm512_mul_ps(_mm512_mul_ps(gate, sig), _mm512_maskz_loadu_ps(live, u + i)));
    }
  }
  return out;
}

// ---- scoring a prompt's rows ------------------------------------------------------------------

// Per row of logits (R, V): the log-softmax of the target token, its rank (1 + how many tokens
// score above it) and the top n tokens' ids and log-softmax. One read of the row for its max,
// the count and the top n, and a second for the sum of exponentials, while the row (a vocabulary
// of floats, 200-500 KB) is still in L2: the same in PyTorch takes seven passes and as many
// (R, V) temporaries.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> score_rows(const at::Tensor& logits,
                                                                      const at::Tensor& targets,
                                                                      int64_t top_n) {
  check_rows(logits, "logits");
  TORCH_CHECK(logits.dim() == 2, "logits must be (rows, vocab)");
  TORCH_CHECK(targets.scalar_type() == at::kLong && targets.is_contiguous(),
              "targets must be contiguous int64");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(targets.numel() == rows, "one target per row");
  TORCH_CHECK(top_n >= 0 && top_n <= vocab, "top_n must be in [0, vocab]");
  const float* x = logits.data_ptr<float>();
  const int64_t* target = targets.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(target[r] >= 0 && target[r] < vocab,
                "target " + std::to_string(target[r]) + " is outside the vocabulary");
  at::Tensor logprob = at::empty({rows}, logits.options());
  at::Tensor rank = at::empty({rows}, targets.options());
  at::Tensor top_ids = at::empty({rows, top_n}, targets.options());
  at::Tensor top_lp = at::empty({rows, top_n}, logits.options());
  float* lp = logprob.data_ptr<float>();
  int64_t* rk = rank.data_ptr<int64_t>();
  int64_t* ti = top_ids.data_ptr<int64_t>();
  float* tv = top_lp.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    std::vector<std::pair<float, int64_t>> best;  // the top n so far, best first
    for (int64_t r = r0; r < r1; ++r) {
      const float* row = x + r * vocab;
      const float chosen = row[target[r]];
      const __m512 chosen16 = _mm512_set1_ps(chosen);
      __m512 max16 = _mm512_set1_ps(-INFINITY);
      int64_t above = 0;
      best.clear();
      float floor = -INFINITY;  // the n-th best so far: only a value above it enters
      for (int64_t i = 0; i < vocab; i += 16) {
        const __mmask16 live = vocab - i >= 16 ? 0xFFFF : (1u << (vocab - i)) - 1;
        const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), live, row + i);
        max16 = _mm512_max_ps(max16, v);
        above += __builtin_popcount(_mm512_cmp_ps_mask(v, chosen16, _CMP_GT_OQ));
        if (top_n == 0) continue;
        __mmask16 enter = _mm512_cmp_ps_mask(v, _mm512_set1_ps(floor), _CMP_GT_OQ) & live;
        if ((int64_t)best.size() < top_n) enter = live;
        while (enter) {
          const int lane = __builtin_ctz(enter);
          enter &= enter - 1;
          const float value = row[i + lane];
          const bool full = (int64_t)best.size() == top_n;
          if (full && !(value > best.back().first)) continue;
          if (full) best.pop_back();
          // Ties keep the lower id first, as they arrive.
          auto at = std::upper_bound(best.begin(), best.end(), value,
                                     [](float a, const std::pair<float, int64_t>& b) { return a > b.first; });
          best.insert(at, {value, i + lane});
          if ((int64_t)best.size() == top_n) floor = best.back().first;
        }
      }
      const float top = _mm512_reduce_max_ps(max16);
      const __m512 top16 = _mm512_set1_ps(top);
      __m512 sum16v = _mm512_setzero_ps();
      for (int64_t i = 0; i < vocab; i += 16) {
        const __mmask16 live = vocab - i >= 16 ? 0xFFFF : (1u << (vocab - i)) - 1;
        const __m512 v = _mm512_maskz_loadu_ps(live, row + i);
        sum16v = _mm512_add_ps(sum16v,
                               _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(v, top16))));
      }
      const float norm = top + std::log(_mm512_reduce_add_ps(sum16v));
      lp[r] = chosen - norm;
      rk[r] = above + 1;
      for (int64_t j = 0; j < top_n; ++j) {
        ti[r * top_n + j] = best[j].second;
        tv[r * top_n + j] = best[j].first - norm;
      }
    }
  });
  return {logprob, rank, top_ids, top_lp};
}

// ---- decode attention over the paged pool ----------------------------------------------------

// Lane i of the result is the sum of v[i]'s 16 lanes: pairs, then quads within 128-bit lanes,
// then a transpose of 128-bit lanes; 45 instructions where 16 separate reductions take ~130.
inline __m512 sum16(const __m512 v[16]) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3]
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: that lane's sums of 4 consecutive vectors
    quads[i] = _mm512_add_ps(
        _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
        _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // quads[m] covers vectors 4m..4m+3, one partial sum per 128-bit lane: add the lanes up.
  const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                    _mm512_shuffle_f32x4(quads[2], quads[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(low, high, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Decode attention, head dim 16 V, kSpan keys at a time (flash-decoding: a running max and sum
// per head, so the keys are read once). A query's result is a function of its keys alone: the
// spans begin at position 0 whatever else is computed, so a prompt's row, run whole, in chunks
// or after a cached prefix, equals the decode of the same token at the same position, bit for
// bit (`attend_sequence` for one query, `attend_rows` for a prompt's rows share the span's code).
constexpr int64_t kSpan = 64;

// Where a key's slot is: (2, n_kv, hd), the keys, then the values, of one position.
struct Keys {
  const float* kv;
  const int64_t* table;
  int64_t block_size, slot_floats;
  const float* slot(int64_t pos) const {
    return kv + (table[pos / block_size] * block_size + pos % block_size) * slot_floats;
  }
  // Slots of positions [first, first + n) into `slots`; the next span's asked into the cache.
  void span(int64_t first, int64_t n, int64_t ctx, const float** slots) const {
    for (int64_t i = 0; i < n; ++i) slots[i] = slot(first + i);
    for (int64_t i = first + kSpan; i < std::min(ctx, first + 2 * kSpan); ++i) {
      const float* next = slot(i);
      for (int64_t off = 0; off < slot_floats; off += 16)
        _mm_prefetch(reinterpret_cast<const char*>(next + off), _MM_HINT_T0);
    }
  }
};

inline void attend_begin(float* ob, float* top, float* total, int64_t n_heads, int64_t hd) {
  std::fill_n(ob, n_heads * hd, 0.f);
  std::fill_n(top, n_heads, -INFINITY);
  std::fill_n(total, n_heads, 0.f);
}

// One query (n_heads x hd at qb) against the n keys at `slots`: its running max (top), sum
// (total) and unnormalised output (ob) updated.
template <int V>
void attend_span(const float* qb, float* ob, const float* const* slots, int64_t n,
                 int64_t n_heads, int64_t n_kv, float* scores, float* top, float* total) {
  constexpr int64_t hd = 16 * V;
  const int64_t group = n_heads / n_kv;
  const float scale = 1.f / std::sqrt(static_cast<float>(hd));
  // Scores 16 keys at a time: one vector of products per key, then one tree reduces the 16.
  for (int64_t h = 0; h < n_heads; ++h) {
    __m512 q[V];
    for (int j = 0; j < V; ++j) q[j] = _mm512_loadu_ps(qb + h * hd + 16 * j);
    const int64_t key = h / group * hd;
    for (int64_t c = 0; c < n; c += 16) {
      __m512 acc[16];
      for (int64_t i = 0; i < 16; ++i) {
        if (c + i >= n) {
          acc[i] = _mm512_setzero_ps();
          continue;
        }
        const float* k = slots[c + i] + key;
        acc[i] = _mm512_mul_ps(q[0], _mm512_loadu_ps(k));
        for (int j = 1; j < V; ++j) acc[i] = _mm512_fmadd_ps(q[j], _mm512_loadu_ps(k + 16 * j), acc[i]);
      }
      _mm512_storeu_ps(scores + h * kSpan + c, _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale)));
    }
  }
  for (int64_t h = 0; h < n_heads; ++h) {
    float* sc = scores + h * kSpan;
    __m512 span_top = _mm512_set1_ps(-INFINITY);
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 live = n - i >= 16 ? 0xFFFF : (1u << (n - i)) - 1;
      span_top = _mm512_mask_max_ps(span_top, live, span_top, _mm512_loadu_ps(sc + i));
    }
    const float new_top = std::max(top[h], _mm512_reduce_max_ps(span_top));
    const float rescale = std::exp(top[h] - new_top);
    top[h] = new_top;
    __m512 span_total = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 live = n - i >= 16 ? 0xFFFF : (1u << (n - i)) - 1;
      const __m512 p = _mm512_maskz_mov_ps(
          live, exp16(_mm512_sub_ps(_mm512_loadu_ps(sc + i), _mm512_set1_ps(new_top))));
      _mm512_storeu_ps(sc + i, p);
      span_total = _mm512_add_ps(span_total, p);
    }
    total[h] = total[h] * rescale + _mm512_reduce_add_ps(span_total);
    // Two sets of accumulators, so consecutive keys' FMAs do not wait on each other.
    __m512 even[V], odd[V];
    const __m512 r = _mm512_set1_ps(rescale);
    for (int j = 0; j < V; ++j) {
      even[j] = _mm512_mul_ps(_mm512_loadu_ps(ob + h * hd + 16 * j), r);
      odd[j] = _mm512_setzero_ps();
    }
    const int64_t value = (n_kv + h / group) * hd;
    int64_t i = 0;
    for (; i + 2 <= n; i += 2) {
      const __m512 p0 = _mm512_set1_ps(sc[i]), p1 = _mm512_set1_ps(sc[i + 1]);
      const float* v0 = slots[i] + value;
      const float* v1 = slots[i + 1] + value;
      for (int j = 0; j < V; ++j) {
        even[j] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(v0 + 16 * j), even[j]);
        odd[j] = _mm512_fmadd_ps(p1, _mm512_loadu_ps(v1 + 16 * j), odd[j]);
      }
    }
    if (i < n) {
      const __m512 p = _mm512_set1_ps(sc[i]);
      for (int j = 0; j < V; ++j)
        even[j] = _mm512_fmadd_ps(p, _mm512_loadu_ps(slots[i] + value + 16 * j), even[j]);
    }
    for (int j = 0; j < V; ++j)
      _mm512_storeu_ps(ob + h * hd + 16 * j, _mm512_add_ps(even[j], odd[j]));
  }
}

template <int V>
void attend_end(float* ob, const float* total, int64_t n_heads) {
  constexpr int64_t hd = 16 * V;
  for (int64_t h = 0; h < n_heads; ++h) {
    const __m512 inv = _mm512_set1_ps(1.f / total[h]);
    for (int j = 0; j < V; ++j)
      _mm512_storeu_ps(ob + h * hd + 16 * j, _mm512_mul_ps(_mm512_loadu_ps(ob + h * hd + 16 * j), inv));
  }
}

// One query against its sequence's ctx keys.
template <int V>
void attend_sequence(const float* qb, float* ob, const Keys& keys, int64_t ctx, int64_t n_heads,
                     int64_t n_kv, float* scores, float* top, float* total) {
  attend_begin(ob, top, total, n_heads, 16 * V);
  const float* slots[kSpan];
  for (int64_t first = 0; first < ctx; first += kSpan) {
    const int64_t n = std::min(kSpan, ctx - first);
    keys.span(first, n, ctx, slots);
    attend_span<V>(qb, ob, slots, n, n_heads, n_kv, scores, top, total);
  }
  attend_end<V>(ob, total, n_heads);
}

// Consecutive rows of one prompt, row r at position first_pos + r (keys up to its own): each
// row's spans as attend_sequence computes them, taken span by span across the rows, so that a
// span's keys, read once from memory, serve every row that reaches them.
template <int V>
void attend_rows(const float* q, int64_t q_stride, float* out, const Keys& keys, int64_t first_pos,
                 int64_t rows, int64_t n_heads, int64_t n_kv, float* scores, float* top,
                 float* total) {
  constexpr int64_t hd = 16 * V;
  for (int64_t r = 0; r < rows; ++r)
    attend_begin(out + r * n_heads * hd, top + r * n_heads, total + r * n_heads, n_heads, hd);
  const int64_t last_ctx = first_pos + rows;
  const float* slots[kSpan];
  for (int64_t first = 0; first < last_ctx; first += kSpan) {
    keys.span(first, std::min(kSpan, last_ctx - first), last_ctx, slots);
    // Rows whose keys end before this span are done; the rest each take their part of it.
    for (int64_t r = std::max<int64_t>(0, first - first_pos); r < rows; ++r) {
      const int64_t n = std::min(kSpan, first_pos + r + 1 - first);
      attend_span<V>(q + r * q_stride, out + r * n_heads * hd, slots, n, n_heads, n_kv, scores,
                     top + r * n_heads, total + r * n_heads);
    }
  }
  for (int64_t r = 0; r < rows; ++r) attend_end<V>(out + r * n_heads * hd, total + r * n_heads, n_heads);
}

// Query row b (n_heads x hd floats) at q + b * q_stride; pool: (slots, 2, n_kv, hd); tables:
// (B, max_blocks) block ids; context_lens: (B,). Returns (B, n_heads, hd). One task per sequence.
at::Tensor decode_attention(const float* q, int64_t q_stride, int64_t batch, int64_t n_heads,
                            const at::Tensor& pool, const at::Tensor& tables,
                            const at::Tensor& context_lens, int64_t block_size) {
  check_rows(pool, "pool");
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.is_contiguous() && tables.dim() == 2 &&
                  tables.size(0) == batch,
              "tables must be (B, max_blocks) int64");
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.is_contiguous() &&
                  context_lens.numel() == batch,
              "context_lens must be (B,) int64");
  TORCH_CHECK(pool.dim() == 4 && pool.size(1) == 2, "pool must be (slots, 2, n_kv, hd)");
  const int64_t n_kv = pool.size(2), hd = pool.size(3), max_blocks = tables.size(1);
  TORCH_CHECK(n_heads % n_kv == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(hd == 64 || hd == 128, "head dim must be 64 or 128");
  const int64_t num_slots = pool.size(0);
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* table = tables.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= max_blocks * block_size,
                "context length " + std::to_string(lens[b]) + " does not fit its block table");
    for (int64_t i = 0; i < (lens[b] + block_size - 1) / block_size; ++i)
      TORCH_CHECK(table[b * max_blocks + i] >= 0 &&
                      (table[b * max_blocks + i] + 1) * block_size <= num_slots,
                  "block " + std::to_string(table[b * max_blocks + i]) + " is outside the pool");
  }
  at::Tensor out = at::empty({batch, n_heads, hd}, pool.options());
  const float* kv = pool.data_ptr<float>();
  float* os = out.data_ptr<float>();
  at::parallel_for(0, batch, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> scores(n_heads * kSpan), top(n_heads), total(n_heads);
    for (int64_t b = b0; b < b1; ++b) {
      auto attend = hd == 64 ? attend_sequence<4> : attend_sequence<8>;
      const Keys keys{kv, table + b * max_blocks, block_size, 2 * n_kv * hd};
      attend(q + b * q_stride, os + b * n_heads * hd, keys, lens[b], n_heads, n_kv,
             scores.data(), top.data(), total.data());
    }
  });
  return out;
}

// q: (T, n_heads, hd), the step's rows, sequence by sequence: sequence s's lengths[s] rows at
// positions starts[s] on, its keys (its own rows' included, already stored) read through
// tables[s]. Each row as paged_decode would compute it at its position. The rows are cut into
// pieces of about equal work (a row's work is its context), at least kMinPiece rows each, so that
// the threads finish together and a piece's rows share each span of keys.
constexpr int64_t kMinPiece = 16;

at::Tensor paged_prefill(const at::Tensor& q, const at::Tensor& pool, const at::Tensor& tables,
                         const at::Tensor& starts, const at::Tensor& lengths, int64_t block_size) {
  check_rows(q, "q");
  check_rows(pool, "pool");
  TORCH_CHECK(pool.dim() == 4 && pool.size(1) == 2, "pool must be (slots, 2, n_kv, hd)");
  TORCH_CHECK(q.dim() == 3 && q.size(2) == pool.size(3), "q must be (T, n_heads, hd) like the pool");
  const int64_t n_seqs = tables.size(0);
  TORCH_CHECK(tables.scalar_type() == at::kLong && tables.is_contiguous() && tables.dim() == 2,
              "tables must be (S, max_blocks) int64");
  for (const at::Tensor* t : {&starts, &lengths})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == n_seqs,
                "starts and lengths must be (S,) int64");
  const int64_t n_heads = q.size(1), n_kv = pool.size(2), hd = pool.size(3);
  const int64_t max_blocks = tables.size(1), num_slots = pool.size(0);
  TORCH_CHECK(n_heads % n_kv == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(hd == 64 || hd == 128, "head dim must be 64 or 128");
  const int64_t* first = starts.data_ptr<int64_t>();
  const int64_t* count = lengths.data_ptr<int64_t>();
  const int64_t* table = tables.data_ptr<int64_t>();
  int64_t rows = 0, work = 0;
  for (int64_t s = 0; s < n_seqs; ++s) {
    const int64_t ctx = first[s] + count[s];
    TORCH_CHECK(first[s] >= 0 && count[s] >= 1 && ctx <= max_blocks * block_size,
                "context length " + std::to_string(ctx) + " does not fit its block table");
    for (int64_t i = 0; i < (ctx + block_size - 1) / block_size; ++i)
      TORCH_CHECK(table[s * max_blocks + i] >= 0 &&
                      (table[s * max_blocks + i] + 1) * block_size <= num_slots,
                  "block " + std::to_string(table[s * max_blocks + i]) + " is outside the pool");
    rows += count[s];
    work += count[s] * first[s] + count[s] * (count[s] + 1) / 2;
  }
  TORCH_CHECK(rows == q.size(0), "q has " + std::to_string(q.size(0)) + " rows, the sequences " +
                                     std::to_string(rows));
  struct Piece {
    int64_t seq, row, first_pos, rows;
  };
  std::vector<Piece> pieces;
  const int64_t share = std::max<int64_t>(1, work / (4 * at::get_num_threads()));
  for (int64_t s = 0, row = 0; s < n_seqs; row += count[s], ++s) {
    for (int64_t r = 0; r < count[s];) {
      int64_t end = r, piece_work = 0;
      while (end < count[s] && (end - r < kMinPiece || piece_work < share))
        piece_work += first[s] + ++end;
      pieces.push_back({s, row + r, first[s] + r, end - r});
      r = end;
    }
  }
  at::Tensor out = at::empty({rows, n_heads, hd}, pool.options());
  const float* kv = pool.data_ptr<float>();
  const float* qs = q.data_ptr<float>();
  float* os = out.data_ptr<float>();
  at::parallel_for(0, static_cast<int64_t>(pieces.size()), 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> scores(n_heads * kSpan), top, total;
    for (int64_t p = p0; p < p1; ++p) {
      const Piece& piece = pieces[p];
      top.resize(piece.rows * n_heads);
      total.resize(piece.rows * n_heads);
      const Keys keys{kv, table + piece.seq * max_blocks, block_size, 2 * n_kv * hd};
      auto attend = hd == 64 ? attend_rows<4> : attend_rows<8>;
      attend(qs + piece.row * n_heads * hd, n_heads * hd, os + piece.row * n_heads * hd, keys,
             piece.first_pos, piece.rows, n_heads, n_kv, scores.data(), top.data(), total.data());
    }
  });
  return out;
}

// q: (B, n_heads, hd), one query per sequence.
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& pool, const at::Tensor& tables,
                        const at::Tensor& context_lens, int64_t block_size) {
  check_rows(q, "q");
  TORCH_CHECK(q.dim() == 3 && q.size(2) == pool.size(3), "q must be (B, n_heads, hd) like the pool");
  return decode_attention(q.data_ptr<float>(), q.size(1) * q.size(2), q.size(0), q.size(1), pool,
                          tables, context_lens, block_size);
}

// ---- the layer stack of a decode step ---------------------------------------------------------

// Every layer of a decode-only step in one call, as engine/model.py's TransformerBlock computes
// it, for a model whose projections are all GGUF codes: the ~20 Python-level calls a layer
// otherwise makes cost ~2 ms of a ~7 ms one-row step on the 2-core machine.
struct DecodeStack : torch::CustomClassHolder {
  // Per layer: attention norm, FFN norm; and four projections: QKV, output, gate/up, down.
  std::vector<at::Tensor> norms, codes, scales, minimums;
  std::vector<int64_t> bits;
  int64_t n_heads, n_kv;
  double eps;

  DecodeStack(std::vector<at::Tensor> norms, std::vector<at::Tensor> codes,
              std::vector<at::Tensor> scales, std::vector<at::Tensor> minimums,
              std::vector<int64_t> bits, int64_t n_heads, int64_t n_kv, double eps)
      : norms(std::move(norms)), codes(std::move(codes)), scales(std::move(scales)),
        minimums(std::move(minimums)), bits(std::move(bits)), n_heads(n_heads), n_kv(n_kv),
        eps(eps) {
    const size_t layers = this->norms.size() / 2;
    TORCH_CHECK(this->norms.size() == 2 * layers && this->codes.size() == 4 * layers &&
                    this->scales.size() == 4 * layers && this->minimums.size() == 4 * layers &&
                    this->bits.size() == 4 * layers,
                "a decode stack needs 2 norms and 4 projections per layer");
  }

  at::Tensor project(const at::Tensor& x, size_t i) const {
    return block_matmul(x, codes[i], scales[i], minimums[i], bits[i]);
  }

  // x: (B, dim) this step's embeddings; cos, sin: (B, hd); pool: (layers, slots, 2, n_kv, hd);
  // slots: (B,) where each new token's K/V go. Returns the last layer's output and the residual
  // stream before it (the final norm adds them).
  std::tuple<at::Tensor, at::Tensor> forward(at::Tensor x, at::Tensor cos, at::Tensor sin,
                                             at::Tensor pool, at::Tensor slots, at::Tensor tables,
                                             at::Tensor context_lens, int64_t block_size) {
    const int64_t batch = x.size(0), hd = pool.size(-1);
    TORCH_CHECK(pool.dim() == 5 && pool.size(0) == static_cast<int64_t>(norms.size() / 2),
                "pool must be (layers, slots, 2, n_kv, hd)");
    at::Tensor residual;  // none before the first layer
    for (size_t i = 0; i < norms.size() / 2; ++i) {
      const at::Tensor layer_pool = pool.select(0, static_cast<int64_t>(i));
      auto [h, stream] = add_rms_norm(x, residual, norms[2 * i], eps);
      const at::Tensor qkv = project(h, 4 * i).view({batch, n_heads + 2 * n_kv, hd});
      rope_and_store(qkv, cos, sin, layer_pool, slots, n_heads, n_kv);
      const at::Tensor attended =
          decode_attention(qkv.data_ptr<float>(), (n_heads + 2 * n_kv) * hd, batch, n_heads,
                           layer_pool, tables, context_lens, block_size);
      x = project(attended.view({batch, n_heads * hd}), 4 * i + 1);
      std::tie(h, residual) = add_rms_norm(x, stream, norms[2 * i + 1], eps);
      x = project(silu_mul(project(h, 4 * i + 2)), 4 * i + 3);
    }
    return {x, residual};
  }
};

}  // namespace

TORCH_LIBRARY(tandem, m) {
  m.class_<DecodeStack>("DecodeStack")
      .def(torch::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>,
                       std::vector<at::Tensor>, std::vector<int64_t>, int64_t, int64_t, double>())
      .def("forward", &DecodeStack::forward);
  m.def("block_matmul(Tensor x, Tensor codes, Tensor scale, Tensor minimum, int bits) -> Tensor",
        block_matmul);
  m.def("add_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)",
        add_rms_norm_op);
  m.def("rope_and_store(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) pool, Tensor slots, "
        "int n_heads, int n_kv) -> ()",
        rope_and_store);
  m.def("silu_mul(Tensor gate_up) -> Tensor", silu_mul);
  m.def("score_rows(Tensor logits, Tensor targets, int top_n) -> (Tensor, Tensor, Tensor, Tensor)",
        score_rows);
  m.def("paged_decode(Tensor q, Tensor pool, Tensor tables, Tensor context_lens, int block_size) "
        "-> Tensor",
        paged_decode);
  m.def("paged_prefill(Tensor q, Tensor pool, Tensor tables, Tensor starts, Tensor lengths, "
        "int block_size) -> Tensor",
        paged_prefill);
}
