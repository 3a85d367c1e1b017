// Fused host AdamW steps: one pass over memory per element, multithreaded (torch's intra-op pool), vectorised by the
// compiler. Built at first use by memtrain/optim/host_kernels.py (torch.utils.cpp_extension) and cached.
//
// - adamw_lean_: weights, gradient and moments of any of fp32 / bf16 storage; every bf16 value written is rounded
//   stochastically with counter-based noise (element j of a tensor adds the high 16 bits of (key + j) x a Weyl
//   constant to its fp32 bit pattern, then drops the low 16 bits), so a step is a function of its inputs and keys
//   only: any thread split gives the same bits, and a resumed run rounds as the straight one.
// - adamw_int8_: bitsandbytes' block-wise 8-bit AdamW state layout (codes, one fp32 absmax per 256 elements, sorted
//   code books): each block is decoded, stepped in fp32 and encoded to the nearest code in one pass.
// The arithmetic is torch's fused AdamW's (lerp for the first moment, decoupled weight decay), in fp32.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

constexpr uint32_t kWeyl = 0x9E3779B1u;
constexpr int64_t kGrain = 1 << 15;  // elements a thread takes at least (about 100 us of work)
constexpr int64_t kBlock = 256;      // bitsandbytes' block-wise quantisation block

struct Hyper {
  float lr_wd;          // 1 - lr * weight_decay
  float beta1, beta2;
  float one_beta1, one_beta2;  // 1 - beta1, 1 - beta2 (in double, then rounded: 1 - 0.999f is not 0.001f)
  float step_size;      // lr / (1 - beta1 ** step)
  float bc2_sqrt;       // sqrt(1 - beta2 ** step)
  float eps;
  float inv_scale;      // 1 / grad_scale (1 when unscaled)
};

inline float bits_to_float(uint32_t b) { float f; std::memcpy(&f, &b, 4); return f; }
inline uint32_t float_to_bits(float f) { uint32_t b; std::memcpy(&b, &f, 4); return b; }

inline float load(const float* x, int32_t j) { return x[j]; }
inline float load(const uint16_t* x, int32_t j) { return bits_to_float(static_cast<uint32_t>(x[j]) << 16); }

inline void store(float* x, int32_t j, float value, uint32_t) { x[j] = value; }
// Stochastic rounding to bf16: the noise in [0, 2**16) carries into the kept bits with probability (dropped bits) /
// 2**16. inf and NaN stay so with no test: their low 16 bits are zero here (values computed from bf16 inputs, or the
// default NaN), so the noise never carries into their exponent (NOTE: the largest finite values may round to inf).
inline void store(uint16_t* x, int32_t j, float value, uint32_t noise) {
  x[j] = static_cast<uint16_t>((float_to_bits(value) + noise) >> 16);
}

// Element j's noise for a tensor whose key is k: the high 16 bits of (k + j) x kWeyl, written as j x kWeyl (once an
// element) plus k x kWeyl (once a tensor): the same value mod 2**32.
inline uint32_t noise(uint32_t key_weyl, uint32_t j_weyl) { return (key_weyl + j_weyl) >> 16; }

// One thread's piece of a tensor (fewer than 2**31 elements: 32-bit indices keep the noise's integer arithmetic in
// 32-bit lanes); wp, wm, wv are the piece's first element's noise keys times kWeyl.
template <typename TP, typename TG, typename TM>
inline __attribute__((always_inline)) void lean_piece(TP* __restrict__ p, const TG* __restrict__ g,
                                                      TM* __restrict__ m, TM* __restrict__ v, const int32_t len,
                                                      const Hyper& h, const uint32_t wp, const uint32_t wm,
                                                      const uint32_t wv) {
  const float lr_wd = h.lr_wd, beta2 = h.beta2, one_beta1 = h.one_beta1, one_beta2 = h.one_beta2;
  const float step_size = h.step_size, eps = h.eps, inv_bc2 = 1.0f / h.bc2_sqrt, inv_scale = h.inv_scale;
  for (int32_t j = 0; j < len; ++j) {
    const uint32_t jw = static_cast<uint32_t>(j) * kWeyl;
    const float grad = load(g, j) * inv_scale;
    float mj = load(m, j), vj = load(v, j);
    mj = mj + one_beta1 * (grad - mj);
    vj = beta2 * vj + one_beta2 * grad * grad;
    const float denom = std::sqrt(vj) * inv_bc2 + eps;
    const float pj = load(p, j) * lr_wd - step_size * mj / denom;
    store(p, j, pj, noise(wp, jw));
    store(m, j, mj, noise(wm, jw));
    store(v, j, vj, noise(wv, jw));
  }
}

// bf16 weights (pure bf16) step faster in 256-bit vectors, fp32 ones in 512-bit ones, where the machine has both
// (measured with benchmarks/bench_host_step.py): the narrow variant is compiled for 256-bit vectors.
#if defined(__x86_64__) && defined(__AVX512F__)
#pragma GCC push_options
#pragma GCC target("prefer-vector-width=256")
#endif
// (Plain functions: GCC applies a target pragma to the functions defined under it, not to template instances.)
#define MEMTRAIN_NARROW_PIECE(TG, TM)                                                                           \
  __attribute__((noinline)) void lean_piece_narrow(uint16_t* p, const TG* g, TM* m, TM* v, int32_t len,     \
                                                   const Hyper& h, uint32_t wp, uint32_t wm, uint32_t wv) { \
    lean_piece(p, g, m, v, len, h, wp, wm, wv);                                                                \
  }
MEMTRAIN_NARROW_PIECE(float, float)
MEMTRAIN_NARROW_PIECE(float, uint16_t)
MEMTRAIN_NARROW_PIECE(uint16_t, float)
MEMTRAIN_NARROW_PIECE(uint16_t, uint16_t)
#undef MEMTRAIN_NARROW_PIECE
#if defined(__x86_64__) && defined(__AVX512F__)
#pragma GCC pop_options
#endif

template <typename TP, typename TG, typename TM>
void lean_piece_wide(TP* p, const TG* g, TM* m, TM* v, int32_t len, const Hyper& h, uint32_t wp, uint32_t wm,
                     uint32_t wv) {
  lean_piece(p, g, m, v, len, h, wp, wm, wv);
}

template <typename TP, typename TG, typename TM>
void lean_step(TP* p, const TG* g, TM* m, TM* v, int64_t n, const Hyper h, const uint32_t kp, const uint32_t km,
               const uint32_t kv) {
  at::parallel_for(0, n, kGrain, [=](int64_t begin, int64_t end) {
    for (int64_t start = begin; start < end; start += kGrain) {
      const auto len = static_cast<int32_t>(std::min(kGrain, end - start));
      const auto base = static_cast<uint32_t>(start);
      const uint32_t wp = (kp + base) * kWeyl, wm = (km + base) * kWeyl, wv = (kv + base) * kWeyl;
      if constexpr (std::is_same_v<TP, uint16_t>) {
        lean_piece_narrow(p + start, g + start, m + start, v + start, len, h, wp, wm, wv);
      } else {
        lean_piece_wide(p + start, g + start, m + start, v + start, len, h, wp, wm, wv);
      }
    }
  });
}

template <typename T>
T* ptr(const torch::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }

template <typename TP, typename TG>
void lean_by_moments(const torch::Tensor& p, const torch::Tensor& g, const torch::Tensor& m, const torch::Tensor& v,
                     Hyper h, uint32_t kp, uint32_t km, uint32_t kv) {
  if (m.scalar_type() == at::kBFloat16) {
    lean_step(ptr<TP>(p), ptr<const TG>(g), ptr<uint16_t>(m), ptr<uint16_t>(v), p.numel(), h, kp, km, kv);
  } else {
    lean_step(ptr<TP>(p), ptr<const TG>(g), ptr<float>(m), ptr<float>(v), p.numel(), h, kp, km, kv);
  }
}

void check(const torch::Tensor& t, const torch::Tensor& p, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.numel() == p.numel(),
              "memtrain host AdamW: ", what, " must be a contiguous CPU tensor of the parameter's size");
  auto s = t.scalar_type();
  TORCH_CHECK(s == at::kFloat || s == at::kBFloat16, "memtrain host AdamW: ", what, " must be fp32 or bf16");
}

Hyper hyper(double lr, double beta1, double beta2, double eps, double weight_decay, double step, double inv_scale) {
  double bc1 = 1.0 - std::pow(beta1, step);
  double bc2 = 1.0 - std::pow(beta2, step);
  return Hyper{static_cast<float>(1.0 - lr * weight_decay), static_cast<float>(beta1), static_cast<float>(beta2),
               static_cast<float>(1.0 - beta1), static_cast<float>(1.0 - beta2),
               static_cast<float>(lr / bc1), static_cast<float>(std::sqrt(bc2)), static_cast<float>(eps),
               static_cast<float>(inv_scale)};
}

}  // namespace

float scalar(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.numel() == 1 && t.scalar_type() == at::kFloat,
              "memtrain host AdamW: ", what, " must be a one-element fp32 CPU tensor");
  return *reinterpret_cast<const float*>(t.data_ptr());  // read without a dispatch: it is host memory
}

// One AdamW step of one tensor, in place. Weights and gradient fp32 or bf16, the moments both fp32 or both bf16;
// step (the count including this step), grad_scale and found_inf are one-element fp32 CPU tensors, as torch's fused
// AdamW takes them: a found_inf other than 0 skips the step, the gradient is divided by grad_scale.
void adamw_lean_(torch::Tensor p, torch::Tensor g, torch::Tensor m, torch::Tensor v, torch::Tensor step, double lr,
                 double beta1, double beta2, double eps, double weight_decay, c10::optional<torch::Tensor> grad_scale,
                 c10::optional<torch::Tensor> found_inf, int64_t key_p, int64_t key_m, int64_t key_v) {
  check(p, p, "the parameter");
  check(g, p, "the gradient");
  check(m, p, "exp_avg");
  check(v, p, "exp_avg_sq");
  TORCH_CHECK(m.scalar_type() == v.scalar_type(), "memtrain host AdamW: both moments must have one dtype");
  if (found_inf.has_value() && scalar(*found_inf, "found_inf") != 0.0f) return;
  double inv_scale = grad_scale.has_value() ? 1.0 / scalar(*grad_scale, "grad_scale") : 1.0;
  Hyper h = hyper(lr, beta1, beta2, eps, weight_decay, scalar(step, "step"), inv_scale);
  auto kp = static_cast<uint32_t>(key_p), km = static_cast<uint32_t>(key_m), kv = static_cast<uint32_t>(key_v);
  bool p16 = p.scalar_type() == at::kBFloat16, g16 = g.scalar_type() == at::kBFloat16;
  if (!p16 && !g16) lean_by_moments<float, float>(p, g, m, v, h, kp, km, kv);
  else if (!p16) lean_by_moments<float, uint16_t>(p, g, m, v, h, kp, km, kv);
  else if (!g16) lean_by_moments<uint16_t, float>(p, g, m, v, h, kp, km, kv);
  else lean_by_moments<uint16_t, uint16_t>(p, g, m, v, h, kp, km, kv);
}

namespace {

// The decode-step-encode of one block of at most kBlock elements (bitsandbytes' arithmetic: m = beta1 m + (1 - beta1)
// g, v = beta2 v + (1 - beta2) g^2, p = p (1 - lr wd) - lr / (1 - beta1^t) m / (sqrt(v) / sqrt(1 - beta2^t) + eps),
// then each moment's new absmax and its nearest codes). Each loop is one the compiler vectorises (gathers for the code
// books, an integer max over the bit patterns of |x|, which order as the values do).
inline void int8_block(float* __restrict__ p, const float* __restrict__ g, uint8_t* __restrict__ c1,
                       uint8_t* __restrict__ c2, float* __restrict__ a1, float* __restrict__ a2,
                       const float* __restrict__ q1, const float* __restrict__ q2, const int64_t* __restrict__ t1,
                       const int64_t* __restrict__ t2,
                       const Hyper& h, const int32_t len, float* __restrict__ m, float* __restrict__ v) {
  const float s1 = *a1, s2 = *a2, beta1 = h.beta1, beta2 = h.beta2, one_beta1 = h.one_beta1, one_beta2 = h.one_beta2;
  const float lr_wd = h.lr_wd, step_size = h.step_size;
  const float inv_bc2 = 1.0f / h.bc2_sqrt, eps = h.eps, inv_scale = h.inv_scale;
  int32_t i = 0;
#ifdef __AVX512F__
  // The decode's gathers by byte codes, 16 at a time (the compiler loads them one by one).
  const __m512 b1v = _mm512_set1_ps(beta1), b2v = _mm512_set1_ps(beta2), o1v = _mm512_set1_ps(one_beta1),
               o2v = _mm512_set1_ps(one_beta2), s1v = _mm512_set1_ps(s1), s2v = _mm512_set1_ps(s2),
               wdv = _mm512_set1_ps(lr_wd), stv = _mm512_set1_ps(step_size), bcv = _mm512_set1_ps(inv_bc2),
               epv = _mm512_set1_ps(eps), scv = _mm512_set1_ps(inv_scale);
  for (; i + 16 <= len; i += 16) {
    const __m512 grad = _mm512_mul_ps(_mm512_loadu_ps(g + i), scv);
    const __m512i k1 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c1 + i)));
    const __m512i k2 = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c2 + i)));
    const __m512 mj = _mm512_add_ps(_mm512_mul_ps(b1v, _mm512_mul_ps(_mm512_i32gather_ps(k1, q1, 4), s1v)),
                                    _mm512_mul_ps(o1v, grad));
    const __m512 vj = _mm512_add_ps(_mm512_mul_ps(b2v, _mm512_mul_ps(_mm512_i32gather_ps(k2, q2, 4), s2v)),
                                    _mm512_mul_ps(_mm512_mul_ps(o2v, grad), grad));
    const __m512 denom = _mm512_add_ps(_mm512_mul_ps(_mm512_sqrt_ps(vj), bcv), epv);
    const __m512 pj = _mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(p + i), wdv),
                                    _mm512_div_ps(_mm512_mul_ps(stv, mj), denom));
    _mm512_storeu_ps(p + i, pj);
    _mm512_storeu_ps(m + i, mj);
    _mm512_storeu_ps(v + i, vj);
  }
#endif
  for (int32_t j = i; j < len; ++j) {
    const float grad = g[j] * inv_scale;
    const float mj = beta1 * (q1[c1[j]] * s1) + one_beta1 * grad;
    const float vj = beta2 * (q2[c2[j]] * s2) + one_beta2 * grad * grad;
    p[j] = p[j] * lr_wd - step_size * mj / (std::sqrt(vj) * inv_bc2 + eps);
    m[j] = mj;
    v[j] = vj;
  }
  uint32_t max1 = 0, max2 = 0;
  for (int32_t j = 0; j < len; ++j) {
    const uint32_t x1 = float_to_bits(m[j]) & 0x7FFFFFFFu, x2 = float_to_bits(v[j]) & 0x7FFFFFFFu;
    max1 = x1 > max1 ? x1 : max1;
    max2 = x2 > max2 ? x2 : max2;
  }
  const float n1 = bits_to_float(max1), n2 = bits_to_float(max2);
  *a1 = n1;
  *a2 = n2;
  const float i1 = n1 > 0.0f ? 1.0f / n1 : 0.0f, i2 = n2 > 0.0f ? 1.0f / n2 : 0.0f;
  // The nearest code: a table indexed by x's top 16 bits gives the lowest code any value with those bits can be
  // nearest to (low 32 bits) and the midpoint above that code (high 32 bits, +inf after the last code); one comparison
  // decides. The Python side checks that no 16-bit interval of [-1, 1] holds two midpoints.
  int32_t j = 0;
#ifdef __AVX512F__
  // The compiler does not vectorise this loop (a gather indexed by computed keys): 16 elements at a time by hand, each
  // table entry (code and midpoint) one 64-bit load.
  const __m512 lo = _mm512_set1_ps(-1.0f), hi = _mm512_set1_ps(1.0f), i1v = _mm512_set1_ps(i1),
               i2v = _mm512_set1_ps(i2);
  const __m512i one = _mm512_set1_epi32(1);
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, one);
  const auto encode16 = [&](const __m512 x, const int64_t* table) {
    const __m512i key = _mm512_srli_epi32(_mm512_castps_si512(x), 16);
    const __m512i e0 = _mm512_i32gather_epi64(_mm512_castsi512_si256(key), table, 8);
    const __m512i e1 = _mm512_i32gather_epi64(_mm512_extracti64x4_epi64(key, 1), table, 8);
    const __m512i code = _mm512_permutex2var_epi32(e0, even, e1);
    const __m512 bound = _mm512_castsi512_ps(_mm512_permutex2var_epi32(e0, odd, e1));
    return _mm512_cvtepi32_epi8(_mm512_mask_add_epi32(code, _mm512_cmp_ps_mask(x, bound, _CMP_GT_OQ), code, one));
  };
  for (; j + 16 <= len; j += 16) {
    const __m512 x1 = _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(_mm512_loadu_ps(m + j), i1v), lo), hi);
    const __m512 x2 = _mm512_min_ps(_mm512_mul_ps(_mm512_loadu_ps(v + j), i2v), hi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(c1 + j), encode16(x1, t1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(c2 + j), encode16(x2, t2));
  }
#endif
  for (; j < len; ++j) {
    float x1 = m[j] * i1, x2 = v[j] * i2;  // in [-1, 1] and [0, 1] but for rounding: clamped
    x1 = x1 < -1.0f ? -1.0f : (x1 > 1.0f ? 1.0f : x1);
    x2 = x2 > 1.0f ? 1.0f : x2;
    const int64_t e1 = t1[static_cast<int32_t>(float_to_bits(x1) >> 16)];
    const int64_t e2 = t2[static_cast<int32_t>(float_to_bits(x2) >> 16)];
    const auto k1 = static_cast<uint32_t>(e1), k2 = static_cast<uint32_t>(e2);
    c1[j] = static_cast<uint8_t>(k1 + (x1 > bits_to_float(static_cast<uint32_t>(static_cast<uint64_t>(e1) >> 32))));
    c2[j] = static_cast<uint8_t>(k2 + (x2 > bits_to_float(static_cast<uint32_t>(static_cast<uint64_t>(e2) >> 32))));
  }
}

}  // namespace

// One bitsandbytes-layout 8-bit AdamW step of one fp32 tensor, in place: codes1/codes2 (uint8), absmax1/absmax2
// (fp32, one per 256 elements), the sorted code books qmap1/qmap2 and their 65,536-entry int64 tables table1/table2
// (see int8_block).
void adamw_int8_(torch::Tensor p, torch::Tensor g, torch::Tensor codes1, torch::Tensor codes2, torch::Tensor absmax1,
                 torch::Tensor absmax2, torch::Tensor qmap1, torch::Tensor qmap2, torch::Tensor table1,
                 torch::Tensor table2, double lr, double beta1,
                 double beta2, double eps, double weight_decay, double step) {
  TORCH_CHECK(p.scalar_type() == at::kFloat && g.scalar_type() == at::kFloat && p.is_contiguous() &&
              g.is_contiguous() && codes1.is_contiguous() && codes2.is_contiguous(),
              "memtrain host AdamW (int8): contiguous fp32 weights and gradient");
  const int64_t n = p.numel();
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  TORCH_CHECK(absmax1.numel() >= blocks && absmax2.numel() >= blocks && codes1.numel() == n && codes2.numel() == n &&
              table1.numel() == 65536 && table2.numel() == 65536 && table1.scalar_type() == at::kLong &&
              table2.scalar_type() == at::kLong,
              "memtrain host AdamW (int8): state or tables of the wrong size");
  const Hyper h = hyper(lr, beta1, beta2, eps, weight_decay, step, 1.0);
  float* pp = ptr<float>(p);
  const float* gp = ptr<const float>(g);
  uint8_t *c1 = ptr<uint8_t>(codes1), *c2 = ptr<uint8_t>(codes2);
  float *a1 = ptr<float>(absmax1), *a2 = ptr<float>(absmax2);
  const float *q1 = ptr<const float>(qmap1), *q2 = ptr<const float>(qmap2);
  const int64_t *t1 = ptr<const int64_t>(table1), *t2 = ptr<const int64_t>(table2);
  at::parallel_for(0, blocks, kGrain / kBlock, [=](int64_t begin, int64_t end) {
    alignas(64) float m[kBlock];
    alignas(64) float v[kBlock];
    for (int64_t b = begin; b < end; ++b) {
      const int64_t start = b * kBlock;
      const auto len = static_cast<int32_t>(std::min(kBlock, n - start));
      int8_block(pp + start, gp + start, c1 + start, c2 + start, a1 + b, a2 + b, q1, q2, t1, t2, h, len, m, v);
    }
  });
}

// The GIL is released while a kernel runs: an offloaded optimizer steps on its worker thread while the training
// loop's thread goes on (backward's hooks, the next micro-batch), as torch's own ops allow.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("adamw_lean_", &adamw_lean_, "fused host AdamW step, fp32/bf16 storage, stochastic rounding",
             pybind11::call_guard<pybind11::gil_scoped_release>());
  module.def("adamw_int8_", &adamw_int8_, "fused host AdamW step, bitsandbytes' block-wise 8-bit state",
             pybind11::call_guard<pybind11::gil_scoped_release>());
}
