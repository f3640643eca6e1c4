// fairserve's CPU kernels: RMSNorm (with the residual add), SiLU-and-multiply, paged
// attention with rotary embedding and the KV-cache write, and LoRA's grouped update,
// registered as torch.ops.fairserve.*.
//
// NOTE: row invariance. Every output row here is computed by one thread, by the same loops, from
// that row's inputs alone (and, for attention, the cached keys and values of its own sequence):
// nothing depends on how many rows the call holds, how a prompt was cut into chunks, or how the
// rows are split between threads. A token at position p attends to keys lo..p in that order,
// in fixed 16-lane partial sums added in a fixed order, so the same query over the same cache
// gives the same bits whether it runs in a decode step of 1 or 32 sequences or inside a prefill
// chunk. torch's SDPA on CPU changes its blocking with the key length and the number of query
// rows, and its reductions with the tensor shapes; in bfloat16 those differences flip greedy
// choices, which would break the promise that a migrated request (resumed by a prefill of the
// tokens it had sent) continues with the text it would have had (replicas/engine/resume_rules.py).
//
// Arithmetic: inputs and outputs are float32 or bfloat16 (the model's dtype); everything in
// between is float32. bfloat16 results round to nearest even, as torch's casts do.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

// float32 and bfloat16 only
#define FAIRSERVE_DISPATCH(TYPE, NAME, ...)                  \
  AT_DISPATCH_SWITCH(TYPE, NAME,                             \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

namespace {

constexpr int64_t kLanes = 16;

inline float load(float x) { return x; }
// bfloat16 is float32's upper half: a shift, written so that loops over it vectorize
inline float load(c10::BFloat16 x) {
  return __builtin_bit_cast(float, static_cast<uint32_t>(x.x) << 16);
}

// lanes summed pairwise, in the same fixed order every time (vectorizes, unlike a running sum)
inline float sum_lanes(float* acc) {
  for (int64_t width = kLanes / 2; width >= 1; width /= 2) {
    for (int64_t l = 0; l < width; ++l) acc[l] += acc[l + width];
  }
  return acc[0];
}
template <typename T>
inline T store(float x) { return static_cast<T>(x); }

// 16 floats as one value (GCC vector extension: AVX-512 where the CPU has it, two AVX2
// halves elsewhere); bfloat16 rows widen to it by a shift
using vf = float __attribute__((vector_size(64)));
using vu32 = uint32_t __attribute__((vector_size(64)));
using vu16 = uint16_t __attribute__((vector_size(32)));
static_assert(sizeof(vf) == kLanes * sizeof(float));

inline vf load_vec(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline vf load_vec(const c10::BFloat16* p) {
  vu16 half;
  std::memcpy(&half, p, sizeof(half));
  return (vf)(__builtin_convertvector(half, vu32) << 16);
}
inline void store_vec(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }
// float32 to bfloat16 rounding to nearest even, as c10::BFloat16's constructor does (NaN aside:
// no NaN reaches here)
inline void store_vec(c10::BFloat16* p, vf v) {
  vu32 bits;
  std::memcpy(&bits, &v, sizeof(bits));
  bits += ((bits >> 16) & 1u) + 0x7FFFu;
  const vu16 half = __builtin_convertvector(bits >> 16, vu16);
  std::memcpy(p, &half, sizeof(half));
}

inline float sum_vec(vf v) {
  float lanes[kLanes];
  std::memcpy(lanes, &v, sizeof(v));
  return sum_lanes(lanes);
}

// sum over d of a[d] * b[d]: 16 lanes, then the lanes pairwise, then the tail
template <typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  vf acc = {};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) acc += load_vec(a + d) * load_vec(b + d);
  float tail = 0.f;
  for (; d < n; ++d) tail += a[d] * load(b[d]);
  return sum_vec(acc) + tail;
}

// acc[d] += w * x[d]
template <typename T>
inline void axpy(float* acc, float w, const T* x, int64_t n) {
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) store_vec(acc + d, load_vec(acc + d) + w * load_vec(x + d));
  for (; d < n; ++d) acc[d] += w * load(x[d]);
}

template <typename T>
inline float sum_squares(const T* x, int64_t n) {
  vf acc = {};
  int64_t d = 0;
  for (; d + kLanes <= n; d += kLanes) {
    const vf v = load_vec(x + d);
    acc += v * v;
  }
  float tail = 0.f;
  for (; d < n; ++d) tail += load(x[d]) * load(x[d]);
  return sum_vec(acc) + tail;
}

// sum of x[0..n), in lanes (fixed order)
inline float sum_array(const float* x, int64_t n) {
  float acc[kLanes] = {0.f};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) acc[l] += x[i + l];
  }
  float tail = 0.f;
  for (; i < n; ++i) tail += x[i];
  return sum_lanes(acc) + tail;
}

inline float max_array(const float* x, int64_t n) {
  float acc[kLanes];
  for (int64_t l = 0; l < kLanes; ++l) acc[l] = x[0];
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) acc[l] = acc[l] > x[i + l] ? acc[l] : x[i + l];
  }
  float mx = x[0];
  for (int64_t l = 0; l < kLanes; ++l) mx = mx > acc[l] ? mx : acc[l];
  for (; i < n; ++i) mx = mx > x[i] ? mx : x[i];
  return mx;
}

// exp(x) for x <= 0 (softmax after subtracting the max), branch-free so the loop vectorizes:
// 2^n * p(r) with r = x - n ln2 in [-ln2/2, ln2/2], p a degree-6 Taylor polynomial (relative
// error < 2e-7, float32's own precision). Below -87 it returns ~0 (float32 underflows there).
inline void exp_nonpositive(float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i] > -87.0f ? x[i] : -87.0f;
    const float k = std::floor(v * 1.44269504088896341f + 0.5f);
    const float r = (v - k * 0.693145751953125f) - k * 1.42860682030941723212e-6f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
    x[i] = p * __builtin_bit_cast(float, bits);
  }
}

// ---- RMSNorm ----------------------------------------------------------------------------------

// out = weight * to_dtype(x * rsqrt(mean(x^2) + eps)); transformers' LlamaRMSNorm arithmetic
template <typename T>
void rms_norm_rows(const T* x, const T* weight, T* out, int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * hidden;
      T* outr = out + r * hidden;
      const float inv = 1.0f / std::sqrt(sum_squares(xr, hidden) / hidden + eps);
      for (int64_t d = 0; d < hidden; ++d) {
        const float normed = load(store<T>(load(xr[d]) * inv));
        outr[d] = store<T>(load(weight[d]) * normed);
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "rms_norm: x must be contiguous (rows, hidden)");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm: weight dtype differs from x");
  auto out = at::empty_like(x);
  FAIRSERVE_DISPATCH(x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), weight.contiguous().data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), x.size(0), x.size(1),
                            static_cast<float>(eps));
  });
  return out;
}

// residual += x (rounded to the dtype, as torch's add), then returns rms_norm(residual)
at::Tensor add_rms_norm(at::Tensor residual, const at::Tensor& x, const at::Tensor& weight,
                        double eps) {
  TORCH_CHECK(residual.is_contiguous() && x.is_contiguous(), "add_rms_norm: contiguous rows");
  TORCH_CHECK(residual.sizes() == x.sizes(), "add_rms_norm: shapes differ");
  FAIRSERVE_DISPATCH(x.scalar_type(), "add_rms_norm", [&] {
    scalar_t* res = residual.data_ptr<scalar_t>();
    const scalar_t* add = x.data_ptr<scalar_t>();
    const int64_t n = residual.numel();
    at::parallel_for(0, n, 4096, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) res[i] = store<scalar_t>(load(res[i]) + load(add[i]));
    });
  });
  return rms_norm(residual, weight, eps);
}

// ---- SiLU and multiply ------------------------------------------------------------------------

// (rows, 2 * inter) [gate | up] -> (rows, inter): silu(gate) * up
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be contiguous (rows, 2 * intermediate)");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  auto out = at::empty({rows, inter}, gate_up.options());
  FAIRSERVE_DISPATCH(gate_up.scalar_type(), "silu_mul", [&] {
    const scalar_t* in = gate_up.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> e(inter);
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* gate = in + r * 2 * inter;
        const scalar_t* up = gate + inter;
        // silu(g) = g * sigmoid(g), sigmoid from e = exp(-|g|) (an argument <= 0): 1 / (1 + e)
        // for g >= 0, e / (1 + e) below
        for (int64_t i = 0; i < inter; ++i) e[i] = -std::fabs(load(gate[i]));
        exp_nonpositive(e.data(), inter);
        for (int64_t i = 0; i < inter; ++i) {
          const float g = load(gate[i]);
          const float sig = (g >= 0.f ? 1.0f : e[i]) / (1.0f + e[i]);
          o[r * inter + i] = store<scalar_t>(g * sig * load(up[i]));
        }
      }
    });
  });
  return out;
}

// ---- paged attention --------------------------------------------------------------------------

struct AttentionShape {
  int64_t num_tokens, num_heads, num_kv_heads, head_dim, block_size, max_blocks, window;
  float scale;
};

// rotate one head in place: first half x1*c - x2*s, second half x2*c + x1*s (as transformers)
inline void rotate(float* x, const float* cos, const float* sin, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = x[i], x2 = x[i + half];
    x[i] = x1 * cos[i] - x2 * sin[i];
    x[i + half] = x2 * cos[i] + x1 * sin[i];
  }
}

// queries roped into q_out (float32, rounded through the dtype); keys roped and values written to
// the cache at their slots
template <typename T>
void rope_and_write(const T* qkv, const int64_t* positions, const float* cos, const float* sin,
                    const int64_t* slots, T* k_cache, T* v_cache, float* q_out,
                    const AttentionShape& s) {
  const int64_t D = s.head_dim, half = D / 2;
  const int64_t q_size = s.num_heads * D, kv_size = s.num_kv_heads * D;
  at::parallel_for(0, s.num_tokens, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> head(D);
    for (int64_t t = begin; t < end; ++t) {
      const T* row = qkv + t * (q_size + 2 * kv_size);
      const float* c = cos + positions[t] * half;
      const float* sn = sin + positions[t] * half;
      for (int64_t h = 0; h < s.num_heads; ++h) {
        for (int64_t d = 0; d < D; ++d) head[d] = load(row[h * D + d]);
        rotate(head.data(), c, sn, half);
        float* q = q_out + (t * s.num_heads + h) * D;
        for (int64_t d = 0; d < D; ++d) q[d] = load(store<T>(head[d]));
      }
      T* k_dst = k_cache + slots[t] * kv_size;
      T* v_dst = v_cache + slots[t] * kv_size;
      for (int64_t h = 0; h < s.num_kv_heads; ++h) {
        for (int64_t d = 0; d < D; ++d) head[d] = load(row[q_size + h * D + d]);
        rotate(head.data(), c, sn, half);
        for (int64_t d = 0; d < D; ++d) k_dst[h * D + d] = store<T>(head[d]);
      }
      for (int64_t i = 0; i < kv_size; ++i) v_dst[i] = row[q_size + kv_size + i];
    }
  });
}

// fn(j, slot) for the keys lo..lo+n-1 in order, walking the block table block by block
template <typename Fn>
inline void for_each_key(const int64_t* table, int64_t lo, int64_t n, int64_t block_size, Fn fn) {
  int64_t j = 0;
  while (j < n) {
    const int64_t key = lo + j, offset = key % block_size;
    const int64_t base = table[key / block_size] * block_size + offset;
    const int64_t count = std::min(block_size - offset, n - j);
    for (int64_t c = 0; c < count; ++c) fn(j + c, base + c);
    j += count;
  }
}

// x[0..n) <- softmax(x), in place
inline void softmax(float* x, int64_t n) {
  const float mx = max_array(x, n);
  for (int64_t j = 0; j < n; ++j) x[j] -= mx;
  exp_nonpositive(x, n);
  const float inv = 1.0f / sum_array(x, n);
  for (int64_t j = 0; j < n; ++j) x[j] *= inv;
}

// one token's query heads of one KV head against keys lo..p of its sequence
template <typename T>
void attend_row(const float* q, const T* k_cache, const T* v_cache, const int64_t* table,
                int64_t lo, int64_t p, int64_t kv_head, int64_t group, const AttentionShape& s,
                std::vector<float>& scores, std::vector<float>& acc, T* out) {
  const int64_t D = s.head_dim, n = p - lo + 1, kv_size = s.num_kv_heads * D;
  scores.resize(static_cast<size_t>(group * n));
  for_each_key(table, lo, n, s.block_size, [&](int64_t j, int64_t slot) {
    const T* k = k_cache + slot * kv_size + kv_head * D;
    for (int64_t g = 0; g < group; ++g) scores[g * n + j] = dot(q + g * D, k, D) * s.scale;
  });
  acc.assign(static_cast<size_t>(group * D), 0.f);
  for (int64_t g = 0; g < group; ++g) softmax(scores.data() + g * n, n);
  for_each_key(table, lo, n, s.block_size, [&](int64_t j, int64_t slot) {
    const T* v = v_cache + slot * kv_size + kv_head * D;
    for (int64_t g = 0; g < group; ++g) axpy(acc.data() + g * D, scores[g * n + j], v, D);
  });
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t d = 0; d < D; ++d) out[g * D + d] = store<T>(acc[g * D + d]);
  }
}

// ---- the same rows, a tile at a time -----------------------------------------------------------
//
// A long prompt's chunk is hundreds of rows of one sequence: attend_row per row reads each of
// its thousands of keys and values once per row and sums every score's lanes alone. A tile
// (up to kTileRows consecutive rows of one sequence and one KV head) widens 16 keys at a time
// once for all its queries, sums the 16 scores' lanes together (reduce16), and adds 16 values
// into each query's sums held in registers. Every row's arithmetic is attend_row's, operation
// for operation (the same products, the same lane order, the same pairwise tree, the same key
// order): a row's result is bit for bit what attend_row gives, whatever tile or batch it is in
// (tests/replicas/torch_engine/test_cpu_kernels.py holds both). Head sizes that are not a
// multiple of 16 lanes keep attend_row.

constexpr int64_t kTileRows = 8;

using vi32 = int32_t __attribute__((vector_size(64)));

// lane k of the result: sum_lanes of a[k] (its lanes added pairwise: l + l+8, then l + l+4,
// l + l+2, l + l+1, exactly as sum_vec), for 16 vectors at once
inline vf reduce16(const vf* a) {
  static const vi32 kLow8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  static const vi32 kHigh8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  static const vi32 kLow4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  static const vi32 kHigh4 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
  static const vi32 kLow2 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  static const vi32 kHigh2 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
  static const vi32 kLow1 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  static const vi32 kHigh1 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
  vf b[8], c[4], d[2];
  // b[p]: keys 2p, 2p+1, 8 lanes each; c[p]: keys 4p..4p+3, 4 lanes each; d[p]: 8p..8p+7, 2
  for (int p = 0; p < 8; ++p) {
    b[p] = __builtin_shuffle(a[2 * p], a[2 * p + 1], kLow8) +
           __builtin_shuffle(a[2 * p], a[2 * p + 1], kHigh8);
  }
  for (int p = 0; p < 4; ++p) {
    c[p] = __builtin_shuffle(b[2 * p], b[2 * p + 1], kLow4) +
           __builtin_shuffle(b[2 * p], b[2 * p + 1], kHigh4);
  }
  for (int p = 0; p < 2; ++p) {
    d[p] = __builtin_shuffle(c[2 * p], c[2 * p + 1], kLow2) +
           __builtin_shuffle(c[2 * p], c[2 * p + 1], kHigh2);
  }
  return __builtin_shuffle(d[0], d[1], kLow1) + __builtin_shuffle(d[0], d[1], kHigh1);
}

// keys j0..j0+count-1 of a sequence (count <= 16) of one KV head, widened to float32 rows of D
// (the rest zero)
template <typename T>
void widen_keys(const T* cache, const int64_t* table, int64_t j0, int64_t count,
                int64_t kv_head, const AttentionShape& s, float* rows) {
  const int64_t D = s.head_dim, kv_size = s.num_kv_heads * D;
  for (int64_t c = 0; c < kLanes; ++c) {
    float* row = rows + c * D;
    if (c >= count) {
      std::fill(row, row + D, 0.f);
      continue;
    }
    const int64_t key = j0 + c;
    const T* src = cache + (table[key / s.block_size] * s.block_size + key % s.block_size) *
                               kv_size + kv_head * D;
    for (int64_t d = 0; d < D; d += kLanes) store_vec(row + d, load_vec(src + d));
  }
}

// rows t0..t0+m-1 (one sequence's, consecutive) of KV head kv_head: attend_row for each, a tile
// at a time (see above; D a multiple of 16)
template <typename T>
void attend_tile(const float* qf, const T* k_cache, const T* v_cache, const int64_t* table,
                 const int64_t* pos, int64_t t0, int64_t m, int64_t kv_head, int64_t group,
                 const AttentionShape& s, std::vector<float>& scores, std::vector<float>& wide,
                 T* out) {
  const int64_t D = s.head_dim;
  int64_t lo[kTileRows], hi[kTileRows], offset[kTileRows + 1];
  offset[0] = 0;
  for (int64_t r = 0; r < m; ++r) {
    hi[r] = pos[t0 + r];
    lo[r] = s.window > 0 ? std::max<int64_t>(0, hi[r] - s.window + 1) : 0;
    offset[r + 1] = offset[r] + group * (hi[r] - lo[r] + 1);
  }
  const int64_t first = *std::min_element(lo, lo + m), last = *std::max_element(hi, hi + m);
  scores.resize(static_cast<size_t>(offset[m]));
  wide.resize(static_cast<size_t>(kLanes * D));
  const auto query = [&](int64_t r, int64_t g) {
    return qf + ((t0 + r) * s.num_heads + kv_head * group + g) * D;
  };
  // fn(j0, r, c0, c1): keys j0 + c0 .. j0 + c1 - 1 (of the 16 from j0, widened into `wide`)
  // are row r's
  const auto for_each_group = [&](const T* cache, auto fn) {
    for (int64_t j0 = first; j0 <= last; j0 += kLanes) {
      const int64_t count = std::min<int64_t>(kLanes, last - j0 + 1);
      widen_keys(cache, table, j0, count, kv_head, s, wide.data());
      for (int64_t r = 0; r < m; ++r) {
        if (j0 > hi[r] || j0 + kLanes <= lo[r]) continue;
        fn(j0, r, std::max<int64_t>(0, lo[r] - j0), std::min(count, hi[r] - j0 + 1));
      }
    }
  };
  // scores: 16 keys at a time, each as dot() gives it, times the scale
  for_each_group(k_cache, [&](int64_t j0, int64_t r, int64_t c0, int64_t c1) {
    const int64_t n = hi[r] - lo[r] + 1;
    for (int64_t g = 0; g < group; ++g) {
      const float* q = query(r, g);
      vf acc[kLanes] = {};
      for (int64_t d = 0; d < D; d += kLanes) {
        const vf qd = load_vec(q + d);
#pragma GCC unroll 16
        for (int64_t c = 0; c < kLanes; ++c) acc[c] += qd * load_vec(wide.data() + c * D + d);
      }
      const vf tail = {};  // dot's tail, empty here
      float sums[kLanes];
      store_vec(sums, (reduce16(acc) + tail) * s.scale);
      float* sg = scores.data() + offset[r] + g * n;
      for (int64_t c = c0; c < c1; ++c) sg[j0 + c - lo[r]] = sums[c];
    }
  });
  // each query's softmax, as attend_row's
  for (int64_t r = 0; r < m; ++r) {
    const int64_t n = hi[r] - lo[r] + 1;
    for (int64_t g = 0; g < group; ++g) softmax(scores.data() + offset[r] + g * n, n);
  }
  // values: 16 at a time, added in key order into each query's sums (axpy's arithmetic)
  const int64_t num_queries = m * group;
  std::vector<float> acc(static_cast<size_t>(num_queries * D), 0.f);
  for_each_group(v_cache, [&](int64_t j0, int64_t r, int64_t c0, int64_t c1) {
    const int64_t n = hi[r] - lo[r] + 1;
    for (int64_t g = 0; g < group; ++g) {
      const float* w = scores.data() + offset[r] + g * n + (j0 - lo[r]);
      float* a = acc.data() + (r * group + g) * D;
      for (int64_t d = 0; d < D; d += kLanes) {
        vf sum = load_vec(a + d);
        for (int64_t c = c0; c < c1; ++c) sum = sum + w[c] * load_vec(wide.data() + c * D + d);
        store_vec(a + d, sum);
      }
    }
  });
  for (int64_t r = 0; r < m; ++r) {
    T* o = out + (t0 + r) * s.num_heads * D + kv_head * group * D;
    const float* a = acc.data() + r * group * D;
    for (int64_t i = 0; i < group * D; ++i) o[i] = store<T>(a[i]);
  }
}

// where each tile of rows starts (and num_tokens at the end): runs of consecutive rows of one
// sequence, at most kTileRows long
inline std::vector<int64_t> tile_starts(const int64_t* seq, int64_t num_tokens) {
  std::vector<int64_t> starts;
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (starts.empty() || seq[t] != seq[starts.back()] || t - starts.back() == kTileRows) {
      starts.push_back(t);
    }
  }
  starts.push_back(num_tokens);
  return starts;
}

// qkv: (num_tokens, (num_heads + 2 * num_kv_heads) * head_dim), the fused projection's output.
// positions, slots, token_seq: (num_tokens,) long; block_tables: (num_seqs, max_blocks) long;
// cos, sin: (max_positions, head_dim / 2) float32; caches: (num_blocks, block_size, kv_heads,
// head_dim). A token at position p sees keys max(0, p - window + 1)..p (window 0: all).
// Returns (num_tokens, num_heads * head_dim). by_rows: attend_row for every row, never a tile
// (the same bits, slower: for the tests and the benchmark that compare the two).
at::Tensor paged_attention(const at::Tensor& qkv, const at::Tensor& positions,
                           const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                           at::Tensor v_cache, const at::Tensor& slots,
                           const at::Tensor& token_seq, const at::Tensor& block_tables,
                           int64_t num_heads, int64_t num_kv_heads, int64_t window,
                           double scale, bool by_rows) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous(), "paged_attention: qkv (tokens, width)");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_attention: caches");
  TORCH_CHECK(k_cache.scalar_type() == qkv.scalar_type(), "paged_attention: cache dtype");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "paged_attention: cos/sin must be float32");
  TORCH_CHECK(num_heads % num_kv_heads == 0, "paged_attention: heads not a multiple of kv heads");
  for (const auto* t : {&positions, &slots, &token_seq, &block_tables}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(),
                "paged_attention: index tensors must be contiguous int64");
  }
  AttentionShape s{qkv.size(0), num_heads, num_kv_heads, k_cache.size(3), k_cache.size(1),
                   block_tables.size(1), window, static_cast<float>(scale)};
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * s.head_dim,
              "paged_attention: qkv width does not match the heads");
  const int64_t group = num_heads / num_kv_heads, D = s.head_dim;
  auto out = at::empty({s.num_tokens, num_heads * D}, qkv.options());
  auto q = at::empty({s.num_tokens, num_heads * D}, qkv.options().dtype(at::kFloat));
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* seq = token_seq.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  FAIRSERVE_DISPATCH(qkv.scalar_type(), "paged_attention", [&] {
    scalar_t* kc = k_cache.data_ptr<scalar_t>();
    scalar_t* vc = v_cache.data_ptr<scalar_t>();
    rope_and_write<scalar_t>(qkv.data_ptr<scalar_t>(), pos, cos.data_ptr<float>(),
                             sin.data_ptr<float>(), slots.data_ptr<int64_t>(), kc, vc,
                             q.data_ptr<float>(), s);
    const float* qf = q.data_ptr<float>();
    scalar_t* o = out.data_ptr<scalar_t>();
    // every key of the step is in the cache before any row attends (a chunk sees its own keys)
    if (D % kLanes == 0 && !by_rows) {
      const std::vector<int64_t> tiles = tile_starts(seq, s.num_tokens);
      const int64_t num_tiles = static_cast<int64_t>(tiles.size()) - 1;
      at::parallel_for(0, num_tiles * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> scores, wide;
        for (int64_t task = begin; task < end; ++task) {
          const int64_t i = task / num_kv_heads, h = task % num_kv_heads, t0 = tiles[i];
          attend_tile<scalar_t>(qf, kc, vc, tables + seq[t0] * s.max_blocks, pos, t0,
                                tiles[i + 1] - t0, h, group, s, scores, wide, o);
        }
      });
      return;
    }
    at::parallel_for(0, s.num_tokens * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores, acc;
      for (int64_t task = begin; task < end; ++task) {
        const int64_t t = task / num_kv_heads, h = task % num_kv_heads;
        const int64_t p = pos[t];
        const int64_t lo = window > 0 ? std::max<int64_t>(0, p - window + 1) : 0;
        attend_row<scalar_t>(qf + (t * num_heads + h * group) * D, kc, vc,
                             tables + seq[t] * s.max_blocks, lo, p, h, group, s, scores, acc,
                             o + (t * num_heads + h * group) * D);
      }
    });
  });
  return out;
}

// ---- LoRA ---------------------------------------------------------------------------------------

// One adapter's weights for one projection: A (M r, in: its M modules' A one under the other,
// each row one rank's) and B (r, out: the modules' B side by side, as their columns tile the
// output).
template <typename WT>
struct LoraWeights {
  const WT* a = nullptr;
  const WT* b = nullptr;
  int64_t rank = 0;
};

// kBlocks x 16 columns of y += sum over k of h[k] * b[k][c], the sums held in registers
template <int64_t kBlocks, typename XT, typename WT>
inline void expand_block(XT* yr, const float* h, const WT* b, int64_t out, int64_t rank) {
  vf s[kBlocks] = {};
  for (int64_t k = 0; k < rank; ++k) {
    const WT* br = b + k * out;
#pragma GCC unroll 4
    for (int64_t v = 0; v < kBlocks; ++v) s[v] += h[k] * load_vec(br + v * kLanes);
  }
#pragma GCC unroll 4
  for (int64_t v = 0; v < kBlocks; ++v) {
    store_vec(yr + v * kLanes, load_vec(yr + v * kLanes) + s[v]);
  }
}

template <typename XT, typename WT>
void lora_row(XT* yr, const XT* xr, const LoraWeights<WT>& w, const int64_t* start,
              int64_t in, int64_t out, int64_t modules, float* xf, float* h) {
  const int64_t rank = w.rank, mr = modules * rank;
  for (int64_t d = 0; d < in; ++d) xf[d] = load(xr[d]);
  // shrink: h[j] = x . A[j], four rows of A at a time (four sums in flight)
  int64_t j = 0;
  for (; j + 4 <= mr; j += 4) {
    const WT* r0 = w.a + j * in;
    vf s0 = {}, s1 = {}, s2 = {}, s3 = {};
    int64_t d = 0;
    for (; d + kLanes <= in; d += kLanes) {
      const vf xv = load_vec(xf + d);
      s0 += xv * load_vec(r0 + d);
      s1 += xv * load_vec(r0 + in + d);
      s2 += xv * load_vec(r0 + 2 * in + d);
      s3 += xv * load_vec(r0 + 3 * in + d);
    }
    float t[4] = {0.f, 0.f, 0.f, 0.f};
    for (; d < in; ++d) {
      for (int64_t q = 0; q < 4; ++q) t[q] += xf[d] * load(r0[q * in + d]);
    }
    h[j] = sum_vec(s0) + t[0];
    h[j + 1] = sum_vec(s1) + t[1];
    h[j + 2] = sum_vec(s2) + t[2];
    h[j + 3] = sum_vec(s3) + t[3];
  }
  for (; j < mr; ++j) h[j] = dot(xf, w.a + j * in, in);
  // expand: each module's columns, 64 at a time, then the rest one by one
  for (int64_t m = 0; m < modules; ++m) {
    const float* hm = h + m * rank;
    int64_t c = start[m];
    const int64_t c1 = start[m + 1];
    for (; c + 4 * kLanes <= c1; c += 4 * kLanes) expand_block<4>(yr + c, hm, w.b + c, out, rank);
    for (; c + kLanes <= c1; c += kLanes) expand_block<1>(yr + c, hm, w.b + c, out, rank);
    for (; c < c1; ++c) {
      float sum = 0.f;
      for (int64_t k = 0; k < rank; ++k) sum += hm[k] * load(w.b[k * out + c]);
      yr[c] = store<XT>(load(yr[c]) + sum);
    }
  }
}

template <typename XT, typename WT>
void lora_rows(XT* ys, const XT* xs, const int64_t* row, const int64_t* slot,
               const std::vector<LoraWeights<WT>>& weights, const int64_t* start, int64_t n,
               int64_t in, int64_t out, int64_t modules) {
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(in), h;
    for (int64_t i = begin; i < end; ++i) {
      const LoraWeights<WT>& w = weights[slot[i]];
      if (w.rank == 0) continue;  // this adapter leaves the projection alone
      h.resize(modules * w.rank);
      lora_row(ys + row[i] * out, xs + row[i] * in, w, start, in, out, modules, xf.data(),
               h.data());
    }
  });
}

template <typename WT>
std::vector<LoraWeights<WT>> lora_weights(const std::vector<at::Tensor>& a,
                                          const std::vector<at::Tensor>& b, int64_t in,
                                          int64_t out, int64_t modules) {
  std::vector<LoraWeights<WT>> weights(a.size());
  for (size_t s = 0; s < a.size(); ++s) {
    if (a[s].numel() == 0) continue;
    const int64_t rank = b[s].size(0);
    TORCH_CHECK(a[s].dim() == 2 && b[s].dim() == 2 && a[s].is_contiguous() &&
                    b[s].is_contiguous() && a[s].size(1) == in &&
                    a[s].size(0) == modules * rank && b[s].size(1) == out,
                "lora_apply: adapter ", s, ": a (M r, in) and b (r, out), contiguous");
    weights[s] = {a[s].data_ptr<WT>(), b[s].data_ptr<WT>(), rank};
  }
  return weights;
}

// y[rows[i]] += the LoRA update of adapter slots[i] of that row of x, in place, for one
// projection: h = x_row A_s, then each module j adds h[j r .. (j + 1) r) B_s[:, starts[j] ..
// starts[j + 1]) to its own columns (an empty A: the adapter leaves the projection alone).
// The weights are in the model's dtype (a decode step is bound by the bytes it reads: in
// bfloat16, half of float32's), any rank; the arithmetic is float32 and the row's update is
// added to y with one rounding. Every row by the same loops from its own inputs (row
// invariance, as above); the rows come grouped by adapter, so an adapter's weights are read
// from memory once for all its rows (Punica's SGMV, on a CPU).
at::Tensor lora_apply(at::Tensor y, const at::Tensor& x, const at::Tensor& rows,
                      const at::Tensor& slots, at::TensorList a, at::TensorList b,
                      const at::Tensor& starts) {
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.is_contiguous() && y.is_contiguous() &&
                  x.size(0) == y.size(0) && x.scalar_type() == y.scalar_type(),
              "lora_apply: x (rows, in) and y (rows, out) contiguous, of one dtype");
  TORCH_CHECK(rows.scalar_type() == at::kLong && slots.scalar_type() == at::kLong &&
                  starts.scalar_type() == at::kLong && rows.numel() == slots.numel() &&
                  a.size() == b.size(),
              "lora_apply: rows, slots and starts are int64; an a and a b per adapter");
  for (size_t s = 0; s < a.size(); ++s) {
    TORCH_CHECK(a[s].numel() == 0 || (a[s].scalar_type() == x.scalar_type() &&
                                      b[s].scalar_type() == x.scalar_type()),
                "lora_apply: the adapters' weights are in x's dtype");
  }
  const int64_t in = x.size(1), out = y.size(1), modules = starts.numel() - 1, n = rows.numel();
  TORCH_CHECK(modules >= 1, "lora_apply: starts holds each module's first column and the end");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(slot[i] >= 0 && slot[i] < static_cast<int64_t>(a.size()), "lora_apply: slot");
  }
  const std::vector<at::Tensor> as(a.begin(), a.end()), bs(b.begin(), b.end());
  FAIRSERVE_DISPATCH(x.scalar_type(), "lora_apply", [&] {
    lora_rows(y.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), rows.data_ptr<int64_t>(), slot,
              lora_weights<scalar_t>(as, bs, in, out, modules), starts.data_ptr<int64_t>(), n,
              in, out, modules);
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(fairserve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) residual, Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def(
      "paged_attention(Tensor qkv, Tensor positions, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
      "Tensor(b!) v_cache, Tensor slots, Tensor token_seq, Tensor block_tables, int num_heads, "
      "int num_kv_heads, int window, float scale, bool by_rows=False) -> Tensor");
  m.def(
      "lora_apply(Tensor(a!) y, Tensor x, Tensor rows, Tensor slots, Tensor[] a, Tensor[] b, "
      "Tensor starts) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(fairserve, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("add_rms_norm", add_rms_norm);
  m.impl("silu_mul", silu_mul);
  m.impl("paged_attention", paged_attention);
  m.impl("lora_apply", lora_apply);
}
