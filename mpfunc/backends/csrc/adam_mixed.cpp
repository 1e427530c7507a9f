// mpfunc's native CPU Adam/AdamW step: one pass over memory per mixed-precision update.
//
// For each leaf it reads the low-precision grad, the fp32 master, exp_avg and exp_avg_sq
// (and max_exp_avg_sq with amsgrad) once, and writes the master, the moments and the
// rounded low-precision param once: 28 bytes per element for bf16 grads and params,
// the traffic of torch's fused AdamW on an fp32 model.
//
// Numerics follow torch's fused CPU kernel (aten/src/ATen/native/cpu/FusedAdamKernel.cpp)
// operation for operation, so that the master, moments and param are bit-identical to
// `torch._fused_adam(w)_` on an fp32 copy of the grads, followed by `Tensor.to`:
//   * scalars are computed in double, as torch does, then rounded to float once;
//   * the element math is float32 with every rounding explicit. The file is compiled
//     with -ffp-contract=off and every fused multiply-add is written out, because
//     torch's build (GCC, contraction on) fuses some products and not others, and we
//     must match each one. With FMA hardware (torch's AVX2/AVX512 kernels):
//       weight decay (Adam):  g = fma(p, wd, g)
//       exp_avg (lerp):       m = fma(coeff, g - m, base)
//       exp_avg_sq:           v = fma((1 - b2) * g, g, v * b2)        (vector loop)
//                             v = fma(v, b2, ((1 - b2) * g) * g)      (scalar tail)
//     Without (torch's DEFAULT kernels) nothing is fused, here as there.
//     torch runs its vector loop over the first n - n % W elements of a tensor in memory
//     order (W = 16 for AVX512, 8 otherwise) and its scalar loop over the rest, which
//     its AVX512 build vectorizes 8 wide down to the last n % 8 (with the vector loop's
//     exp_avg_sq rounding, and its lerp's sign of zero at beta1 == 0); so do we.
//     Found by testing torch 2.9's kernels against each candidate, bit for bit.
//   * the vector loop uses ATen's own Vectorized types, so the float <-> bfloat16/float16
//     conversions are the code Tensor.to runs (or, for bf16 on CPUs with AVX512_BF16, one
//     instruction with the same bits: narrow2); the scalar tail's conversions are written
//     here and agree with Tensor.to on all 2**32 float32 patterns (round to nearest even;
//     bf16 NaN -> 0xFFFF or 0x7FC0 as torch writes it; fp16 NaN -> vcvtps2ph's quiet NaN).
//   * amsgrad's running max follows the vector `maximum` (NaN wins) in the body and
//     std::max in the tail; they differ only on NaN.
//   NaN payloads and signs are not promised (torch's own casts differ between its vector
//   and scalar paths); NaN positions are.

#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty_like.h>
#include <c10/core/InferenceMode.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace mpfunc_native {
namespace {

// The per-element helpers must inline into their loops (GCC 12 kept some out of line).
#define MPF_INLINE inline __attribute__((always_inline))

using u16 = std::uint16_t;
using u32 = std::uint32_t;

inline u32 bits_of(float f) {
  u32 u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float float_of(u32 u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// ---- element types ------------------------------------------------------------------
// Each is branch-free so that the loops below vectorize.

struct F32 {
  using T = float;
  static float load(float x) { return x; }
  static float store(float x) { return x; }
};

struct BF16 {
  using T = u16;
  // |x| * kHalfUlp bounds half the ulp of a normal x (an 8-bit significand).
  static constexpr float kHalfUlp = 0x1.0p-8f;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  static constexpr u16 kNaN = 0xFFFF;
#else
  static constexpr u16 kNaN = 0x7FC0;
#endif
  static float load(u16 h) { return float_of(u32(h) << 16); }
  // Round to nearest, ties to even, on the bits. NaN becomes what Tensor.to writes:
  // 0xFFFF from torch's vectorized conversion (its AVX2/AVX512 kernels), 0x7FC0 from
  // c10's scalar one (its DEFAULT kernels).
  static u16 store(float f) {
    const u32 u = bits_of(f);
    const u32 rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    return (u & 0x7FFFFFFFu) > 0x7F800000u ? kNaN : u16(rounded);
  }
};

struct F16 {
  using T = u16;
  static constexpr float kHalfUlp = 0x1.0p-11f;  // an 11-bit significand
  // Exact widening: normals by rebiasing the exponent with one multiply, subnormals by
  // a magic-number subtraction; both are exact in float32.
  static float load(u16 h) {
    const u32 w = u32(h) << 16;
    const u32 sign = w & 0x80000000u;
    const u32 two_w = w + w;
    const float normal = float_of((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    const float subnormal = float_of((two_w >> 17) | (126u << 23)) - 0.5f;
    const u32 mag = two_w < (1u << 27) ? bits_of(subnormal) : bits_of(normal);
    return float_of(sign | mag);
  }
  // Round to nearest even by letting the float adder round: scaling |f| so that the
  // bits below fp16's precision fall off the end of a float32 sum. Saturates to inf
  // like the hardware. NaN keeps its sign and top payload bits and is quieted, as
  // x86's vcvtps2ph (which Tensor.to uses) does.
  static u16 store(float f) {
    const u32 w = bits_of(f);
    const u32 shl1 = w + w;
    const u32 sign = w & 0x80000000u;
    float base = (std::fabs(f) * 0x1.0p+112f) * 0x1.0p-110f;
    u32 bias = shl1 & 0xFF000000u;
    bias = bias < 0x71000000u ? 0x71000000u : bias;
    base = float_of((bias >> 1) + 0x07800000u) + base;
    const u32 b = bits_of(base);
    const u32 nonsign = ((b >> 13) & 0x00007C00u) + (b & 0x00000FFFu);
    const u32 nan = 0x7E00u | ((w >> 13) & 0x03FFu);
    return u16((sign >> 16) | (shl1 > 0xFF000000u ? nan : nonsign));
  }
};

// ---- the step ---------------------------------------------------------------------------

// Per-call constants, every one rounded to float exactly as torch rounds it.
struct Hyper {
  float beta2;      // float(beta2)
  float one_m_b2;   // float(1 - beta2), the 1 - beta2 computed in double
  float eps;        // float(eps)
  float wd;         // float(weight_decay): Adam's L2 term
  float decay;      // float(1 - lr * weight_decay): AdamW's; 1 for Adam
  float coeff;      // lerp: w = float(1 - beta1); w if |w| < 0.5 else w - 1
  float w;          // float(1 - beta1), the lerp weight of the scalar form
  float one_m_w;    // 1 - w in float, the scalar form's weight of m
  bool lerp_small;  // |w| < 0.5: the lerp is based at m, else at g
  bool l2;          // Adam with weight_decay != 0
  bool has_scale;   // divide the grads by `scale`
  float scale;      // float(grad_scale)
  u32 negate;       // 0x80000000 to maximize (flips the grads' sign bit), else 0
  bool stream_out;  // write params_out with non-temporal stores where aligned
};

// Per-leaf constants from the (already incremented) step count.
struct LeafCoef {
  float neg_step_size;  // float(-lr / (1 - beta1**t))
  float bc2_sqrt;       // float(sqrt(1 - beta2**t))
};

struct Leaf {
  float* master;
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  float* max_exp_avg_sq;
  void* out;
  std::int64_t numel;
  LeafCoef coef;
};

// A multiply-add rounded once where torch's scalar tail has one (its build contracts
// a * b + c when the instruction set has FMA), else twice.
MPF_INLINE float tail_fma(float a, float b, float c) {
#if defined(__FMA__)
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

// One element in the form of torch's scalar loop, which it runs on a tensor's last
// numel % 8 elements. kVectorV: the exp_avg_sq rounding and lerp form of the vector loop
// and x86's max instead, as torch's AVX512 build gets where the compiler vectorized that scalar
// loop 8 wide (the elements between the 16-wide loop's end and the last numel % 8).
template <class G, class O, bool kAmsgrad, bool kVectorV>
MPF_INLINE void scalar_element(std::int64_t i, float* __restrict__ P,
                               const typename G::T* __restrict__ Gr, float* __restrict__ M,
                               float* __restrict__ V, float* __restrict__ VM,
                               typename O::T* __restrict__ R, const Hyper& h, const LeafCoef& c) {
  float g = G::load(Gr[i]);
  if (h.has_scale) g = g / h.scale;
  // maximize: a sign flip, as torch's tail negates.
  g = float_of(bits_of(g) ^ h.negate);
  float p = P[i];
  if constexpr (!std::is_void_v<typename O::T>) {
    // The param is the truth: one written behind the optimizer's back (p.data.fill_)
    // no longer equals its master's rounding, and the step starts from its value.
    const float q = O::load(R[i]);
    const float r = O::load(O::store(p));
    if (r != q && !(std::isnan(r) && std::isnan(q))) p = q;
  }
  if (h.l2) g = tail_fma(p, h.wd, g);
  p = p * h.decay;
  float m = M[i];
  // torch's scalar lerp: m + w * (g - m), or g - (g - m) * (1 - w). The second equals
  // the vector form g + (w - 1) * (g - m) except in the sign of a zero when w == 1, and
  // the loop's 8-wide vectorized copy (kVectorV) gets the vector form's zero.
  const float d = g - m;
  m = h.lerp_small ? tail_fma(h.w, d, m)
                   : (kVectorV ? tail_fma(h.coeff, d, g) : tail_fma(-d, h.one_m_w, g));
  const float v_old = V[i];
  const float v = kVectorV ? tail_fma(h.one_m_b2 * g, g, v_old * h.beta2)
                           : tail_fma(v_old, h.beta2, (h.one_m_b2 * g) * g);
  float vd = v;
  if constexpr (kAmsgrad) {
    // std::max keeps the old value against a NaN; the vectorized epilogue takes the new
    // one (x86 max semantics). Only NaN tells them apart.
    const float old = VM[i];
    vd = kVectorV ? (old > v ? old : v) : std::max(old, v);
    VM[i] = vd;
  }
  const float denom = std::sqrt(vd) / c.bc2_sqrt + h.eps;
  p = p + (c.neg_step_size * m) / denom;
  P[i] = p;
  M[i] = m;
  V[i] = v;
  if constexpr (!std::is_void_v<typename O::T>) R[i] = O::store(p);
}

struct NoOut {
  using T = void;
};

// ---- the vector body ----------------------------------------------------------------------
// Written with ATen's own Vectorized types, so that loads, stores and the float <->
// bfloat16/float16 conversions are the very code torch's kernels and Tensor.to run (but
// for narrow2's one-instruction bf16 rounding, which gives the same bits).

using fVec = at::vec::Vectorized<float>;
constexpr std::int64_t kW = fVec::size();
// One block is two float vectors: one vector of a 16-bit type.
constexpr std::int64_t kBlock = 2 * kW;

template <class X>
struct VecOf;  // the c10 scalar type behind one of ours
template <>
struct VecOf<BF16> {
  using T = c10::BFloat16;
};
template <>
struct VecOf<F16> {
  using T = c10::Half;
};

// Two float vectors rounded to one vector of X (bf16 or fp16), to nearest even: the bits
// Tensor.to writes (torch's own conversion). Where the CPU has AVX512_BF16 (the build adds
// -mavx512bf16 -DMPF_AVX512BF16 then, see _native._isa_flags), bf16 takes vcvtne2ps2bf16,
// one instruction for torch's ~8 a vector. It rounds to nearest even too, but reads a
// subnormal input as zero and keeps a NaN's payload where torch writes 0xFFFF, so a block
// holding either takes torch's conversion. vfpclassps finds them; with the CPU's
// denormals-are-zero flag on (torch.set_flush_denormal(True), or a library built with
// -ffast-math loaded) it classifies a subnormal as a zero, while torch's conversion, on the
// bits, still rounds it: so zeros are sent to torch's conversion too. (A test of the bits
// instead, two compares a vector more, cost the whole gain: kahan + bf16 0.94x the old
// build's time against 0.79x.) Blocks with an exact zero (a moment that never moved, a
// compensation at a bf16 value) lose the gain, not the bits.
// Measured on Zen 4 (bench.native_builds, one AdamW step of 8M params, 1 thread, thread
// time, 15 rounds): "kahan" + bf16 state 0.86x the time with torch's conversion, "none" +
// bf16 0.87x, "stochastic" + bf16 0.81x; the fp32-state pairs and the 8-bit ones unchanged.
template <class X>
MPF_INLINE at::vec::Vectorized<typename VecOf<X>::T> narrow2(const fVec& a, const fVec& b) {
#if defined(MPF_AVX512BF16) && defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<X, BF16>) {
    constexpr int kSpecial = 0x01 | 0x02 | 0x04 | 0x20 | 0x80;  // QNaN, +0, -0, subnormal, SNaN
    const __mmask16 odd = _mm512_fpclass_ps_mask(__m512(a), kSpecial) |
                          _mm512_fpclass_ps_mask(__m512(b), kSpecial);
    if (__builtin_expect(odd == 0, 1)) {
      return at::vec::Vectorized<c10::BFloat16>(
          (__m512i)_mm512_cvtne2ps_pbh(__m512(b), __m512(a)));  // a: lanes 0..15
    }
  }
#endif
  return at::vec::convert_from_float<typename VecOf<X>::T>(a, b);
}

// Two float vectors from kBlock elements (`count` of them valid, the rest zeros).
template <class X, bool kFull>
MPF_INLINE void load2(const void* p, std::int64_t count, fVec& a, fVec& b) {
  if constexpr (std::is_same_v<X, F32>) {
    const auto* f = static_cast<const float*>(p);
    if constexpr (kFull) {
      a = fVec::loadu(f);
      b = fVec::loadu(f + kW);
    } else {
      a = fVec::loadu(f, std::min(count, kW));
      b = count > kW ? fVec::loadu(f + kW, count - kW) : fVec(0.0f);
    }
  } else {
    using L = at::vec::Vectorized<typename VecOf<X>::T>;
    const L x = kFull ? L::loadu(p) : L::loadu(p, count);
    std::tie(a, b) = at::vec::convert_to_float<typename VecOf<X>::T>(x);
  }
}

template <class X, bool kFull>
MPF_INLINE void store2(void* p, std::int64_t count, const fVec& a, const fVec& b) {
  if constexpr (std::is_same_v<X, F32>) {
    auto* f = static_cast<float*>(p);
    if constexpr (kFull) {
      a.store(f);
      b.store(f + kW);
    } else {
      a.store(f, std::min(count, kW));
      if (count > kW) b.store(f + kW, count - kW);
    }
  } else {
    const auto x = narrow2<X>(a, b);
    if constexpr (kFull) {
      x.store(p);
    } else {
      x.store(p, count);
    }
  }
}

// The rounded params are only written, never read, by the step: a non-temporal store
// sends them to memory without first reading each line into the cache (which a plain
// store must do), saving 2 of 30 bytes per element. Needs the block's address aligned
// to the vector; run_range checks that once per range.
template <class X>
MPF_INLINE void stream2(void* p, const fVec& a, const fVec& b) {
  const auto x = narrow2<X>(a, b);
#if defined(CPU_CAPABILITY_AVX512)
  _mm512_stream_si512(static_cast<__m512i*>(p), __m512i(x));
#elif defined(CPU_CAPABILITY_AVX2)
  _mm256_stream_si256(static_cast<__m256i*>(p), __m256i(x));
#else
  x.store(p);
#endif
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
constexpr bool kCanStream = true;
// Orders the streamed stores before anything the caller does next.
inline void stream_fence() { _mm_sfence(); }
#else
constexpr bool kCanStream = false;
inline void stream_fence() {}
#endif

// Uniform constants as vectors, built once per range.
struct VHyper {
  fVec beta2, one_m_b2, eps, wd, decay, coeff, scale, neg_step_size, bc2_sqrt;
  explicit VHyper(const Hyper& h, const LeafCoef& c)
      : beta2(h.beta2),
        one_m_b2(h.one_m_b2),
        eps(h.eps),
        wd(h.wd),
        decay(h.decay),
        coeff(h.coeff),
        scale(h.scale),
        neg_step_size(c.neg_step_size),
        bc2_sqrt(c.bc2_sqrt) {}
};

// The master a step starts from, where params are written: the param's own value where
// it no longer equals the master rounded to its dtype (written behind the optimizer's
// back, e.g. p.data.fill_ or p.data = t), else the master. Costs one read of the param.
template <class O, bool kFull>
MPF_INLINE void refresh(const void* out, std::int64_t count, fVec& p0, fVec& p1) {
  fVec q0, q1;
  load2<O, kFull>(out, count, q0, q1);
  fVec r0 = p0, r1 = p1;
  if constexpr (!std::is_same_v<O, F32>) {
    using T = typename VecOf<O>::T;
    std::tie(r0, r1) = at::vec::convert_to_float<T>(narrow2<O>(p0, p1));
  }
  // Differ: unequal (a NaN compares unequal), unless both are NaN (then the master
  // keeps its own NaN's bits). x ^ (both NaN) clears exactly that case.
  p0 = fVec::blendv(p0, q0, (r0 != q0) ^ ((r0 != r0) & (q0 != q0)));
  p1 = fVec::blendv(p1, q1, (r1 != q1) ^ ((r1 != r1) & (q1 != q1)));
}

// torch's vector loop on one float vector of every stream; returns the new master.
template <bool kAmsgrad>
MPF_INLINE fVec vector_math(fVec g, fVec p, fVec& m, fVec& v, fVec& vm, const Hyper& h,
                            const VHyper& k) {
  if (h.has_scale) g = g / k.scale;
  if (h.negate) g = g.neg();
  if (h.l2) g = at::vec::fmadd(p, k.wd, g);
  p = p * k.decay;
  m = at::vec::fmadd(k.coeff, g - m, h.lerp_small ? m : g);
  v = at::vec::fmadd(k.one_m_b2 * g, g, v * k.beta2);
  fVec vd = v;
  if constexpr (kAmsgrad) {
    vm = at::vec::maximum(vm, v);
    vd = vm;
  }
  const fVec denom = vd.sqrt() / k.bc2_sqrt + k.eps;
  return p + (k.neg_step_size * m) / denom;
}

// One block of kBlock elements starting at i (count valid when not kFull).
template <class G, class O, bool kAmsgrad, bool kFull, bool kStream = false>
MPF_INLINE void vector_block(const Leaf& L, std::int64_t i, std::int64_t count, const Hyper& h,
                             const VHyper& k) {
  fVec g0, g1, p0, p1, m0, m1, v0, v1, vm0, vm1;
  load2<G, kFull>(static_cast<const typename G::T*>(L.grad) + i, count, g0, g1);
  load2<F32, kFull>(L.master + i, count, p0, p1);
  load2<F32, kFull>(L.exp_avg + i, count, m0, m1);
  load2<F32, kFull>(L.exp_avg_sq + i, count, v0, v1);
  if constexpr (kAmsgrad) load2<F32, kFull>(L.max_exp_avg_sq + i, count, vm0, vm1);
  if constexpr (!std::is_void_v<typename O::T>) {
    refresh<O, kFull>(static_cast<const typename O::T*>(L.out) + i, count, p0, p1);
  }
  p0 = vector_math<kAmsgrad>(g0, p0, m0, v0, vm0, h, k);
  p1 = vector_math<kAmsgrad>(g1, p1, m1, v1, vm1, h, k);
  store2<F32, kFull>(L.master + i, count, p0, p1);
  store2<F32, kFull>(L.exp_avg + i, count, m0, m1);
  store2<F32, kFull>(L.exp_avg_sq + i, count, v0, v1);
  if constexpr (kAmsgrad) store2<F32, kFull>(L.max_exp_avg_sq + i, count, vm0, vm1);
  if constexpr (!std::is_void_v<typename O::T>) {
    auto* out = static_cast<typename O::T*>(L.out) + i;
    if constexpr (kStream) {
      stream2<O>(out, p0, p1);
    } else {
      store2<O, kFull>(out, count, p0, p1);
    }
  }
}

// Elements [begin, end) of one leaf. Where each element falls in the leaf decides which
// of torch's loops computed it, and so its form: [0, n - n % kW) its vector loop,
// [n - n % kW, n - n % 8) the compiler's 8-wide epilogue (AVX512 only, kW = 16),
// [n - n % 8, n) its scalar loop.
template <class G, class O, bool kAmsgrad>
void run_range(const Leaf& leaf, std::int64_t begin, std::int64_t end, const Hyper& h) {
  const VHyper k(h, leaf.coef);
  const std::int64_t n = leaf.numel;
  const std::int64_t vec_end = std::min(end, n - n % kW);
  const std::int64_t mid_end = std::min(end, n - n % 8);
  std::int64_t i = begin;
  constexpr bool kLowOut = std::is_same_v<O, BF16> || std::is_same_v<O, F16>;
  if constexpr (kLowOut && kCanStream) {
    // A block of 16-bit params is one vector as wide as a float vector; streaming
    // stores fault unless it is aligned to that width.
    constexpr std::uintptr_t kAlign = sizeof(fVec);
    const auto* out = static_cast<const typename O::T*>(leaf.out) + begin;
    if (h.stream_out && reinterpret_cast<std::uintptr_t>(out) % kAlign == 0) {
      for (; i + kBlock <= vec_end; i += kBlock) {
        vector_block<G, O, kAmsgrad, true, true>(leaf, i, kBlock, h, k);
      }
      stream_fence();
    }
  }
  for (; i + kBlock <= vec_end; i += kBlock) {
    vector_block<G, O, kAmsgrad, true>(leaf, i, kBlock, h, k);
  }
  if (i < vec_end) {
    vector_block<G, O, kAmsgrad, false>(leaf, i, vec_end - i, h, k);
    i = vec_end;
  }
  const auto* Gr = static_cast<const typename G::T*>(leaf.grad);
  auto* R = static_cast<typename O::T*>(leaf.out);
  for (; i < mid_end; ++i) {
    scalar_element<G, O, kAmsgrad, true>(i, leaf.master, Gr, leaf.exp_avg, leaf.exp_avg_sq,
                                         leaf.max_exp_avg_sq, R, h, leaf.coef);
  }
  for (; i < end; ++i) {
    scalar_element<G, O, kAmsgrad, false>(i, leaf.master, Gr, leaf.exp_avg, leaf.exp_avg_sq,
                                          leaf.max_exp_avg_sq, R, h, leaf.coef);
  }
}

using RangeFn = void (*)(const Leaf&, std::int64_t, std::int64_t, const Hyper&);

template <class G, class O>
RangeFn pick_ams(bool amsgrad) {
  return amsgrad ? &run_range<G, O, true> : &run_range<G, O, false>;
}

template <class G>
RangeFn pick_out(std::optional<c10::ScalarType> out, bool amsgrad) {
  if (!out) return pick_ams<G, NoOut>(amsgrad);
  switch (*out) {
    case c10::ScalarType::BFloat16:
      return pick_ams<G, BF16>(amsgrad);
    case c10::ScalarType::Half:
      return pick_ams<G, F16>(amsgrad);
    default:
      return pick_ams<G, F32>(amsgrad);
  }
}

RangeFn pick(c10::ScalarType grad, std::optional<c10::ScalarType> out, bool amsgrad) {
  switch (grad) {
    case c10::ScalarType::BFloat16:
      return pick_out<BF16>(out, amsgrad);
    case c10::ScalarType::Half:
      return pick_out<F16>(out, amsgrad);
    default:
      return pick_out<F32>(out, amsgrad);
  }
}

// ---- checks -----------------------------------------------------------------------------

constexpr const char* kFn = "adam_mixed_";

// How mpfunc's Python checks describe things (`_checks.describe`): torch.float32, (2, 3).
std::string dtype_name(c10::ScalarType t) {
  switch (t) {
    case c10::ScalarType::Float:
      return "torch.float32";
    case c10::ScalarType::Double:
      return "torch.float64";
    case c10::ScalarType::Half:
      return "torch.float16";
    case c10::ScalarType::BFloat16:
      return "torch.bfloat16";
    case c10::ScalarType::Int:
      return "torch.int32";
    case c10::ScalarType::Long:
      return "torch.int64";
    case c10::ScalarType::Bool:
      return "torch.bool";
    default:
      return std::string("torch.") + c10::toString(t);
  }
}

std::string shape_str(const at::Tensor& t) {
  std::ostringstream s;
  s << "(";
  const auto sizes = t.sizes();
  for (std::size_t d = 0; d < sizes.size(); ++d) {
    if (d) s << ", ";
    s << sizes[d];
  }
  if (sizes.size() == 1) s << ",";
  s << ")";
  return s.str();
}

std::string describe(const at::Tensor& t) {
  std::ostringstream s;
  s << dtype_name(t.scalar_type()) << " ";
  if (t.layout() != c10::kStrided) s << t.layout() << " ";
  s << "tensor of shape " << shape_str(t) << " on " << t.device();
  return s.str();
}

[[noreturn]] void fail_type(const std::string& path, const std::string& expected,
                            const at::Tensor& got) {
  TORCH_CHECK_TYPE(false, kFn, ": at '", path, "': expected ", expected, ", got ", describe(got));
}

[[noreturn]] void fail_value(const std::string& path, const std::string& expected,
                             const std::string& got) {
  TORCH_CHECK_VALUE(false, kFn, ": at '", path, "': expected ", expected, ", got ", got);
}

std::string at_index(const char* name, std::size_t i) {
  return std::string(name) + "[" + std::to_string(i) + "]";
}

bool is_low_or_f32(c10::ScalarType t) {
  return t == c10::ScalarType::Float || t == c10::ScalarType::BFloat16 ||
         t == c10::ScalarType::Half;
}

void check_scalar(const char* name, const std::optional<at::Tensor>& t, bool or_bool = false) {
  if (!t) return;
  const bool kind_ok = t->is_floating_point() || (or_bool && t->scalar_type() == c10::kBool);
  if (!(t->device().is_cpu() && t->numel() == 1 && kind_ok)) {
    fail_type(name,
              or_bool ? "a one-element floating-point or bool CPU tensor"
                      : "a one-element floating-point CPU tensor",
              *t);
  }
}

float read_scalar(const at::Tensor& t) { return t.item<float>(); }

// ---- the entry point ---------------------------------------------------------------------

// Elements per work item; a multiple of 64 so that two threads never share a cache line
// of any of the streams.
constexpr std::int64_t kChunk = 1 << 15;
// Benchmark knobs (see `_tune`): the work item size and non-temporal param stores.
std::int64_t g_chunk = kChunk;
bool g_stream_out = true;

// Below this many elements in all, one thread does everything: waking the pool costs more.
constexpr std::int64_t kSerialBelow = 1 << 15;
// From this many elements in all (about 120 MB of traffic), params are streamed to memory.
constexpr std::int64_t kStreamFrom = 1 << 22;

// Runs fn(leaf, begin, end) over every element of leaves of sizes `numels` (`total` in
// all), in work items of at most g_chunk elements, in memory order. Each thread takes the
// items that start in its equal share of the elements, so a mix of tiny and huge leaves
// still splits evenly (to within one item), and each thread walks one contiguous run of
// items. Item boundaries fall on multiples of g_chunk (64 elements or more) within a leaf.
template <class Fn>
void for_each_item(const std::vector<std::int64_t>& numels, std::int64_t total, const Fn& fn) {
  struct Item {
    std::uint32_t leaf;
    std::int64_t begin, end, start;  // start: elements before the item
  };
  std::vector<Item> items;
  items.reserve(numels.size());
  std::int64_t before = 0;
  for (std::size_t i = 0; i < numels.size(); ++i) {
    for (std::int64_t b = 0; b < numels[i]; b += g_chunk) {
      items.push_back({std::uint32_t(i), b, std::min(numels[i], b + g_chunk), before + b});
    }
    before += numels[i];
  }
  auto run_items = [&](std::size_t lo, std::size_t hi) {
    for (std::size_t k = lo; k < hi; ++k) fn(items[k].leaf, items[k].begin, items[k].end);
  };
  const std::int64_t parts =
      total < kSerialBelow ? 1 : std::min<std::int64_t>(at::get_num_threads(), items.size());
  if (parts <= 1) {
    run_items(0, items.size());
    return;
  }
  auto first_item_at = [&](std::int64_t element) {
    return std::size_t(
        std::lower_bound(items.begin(), items.end(), element,
                         [](const Item& it, std::int64_t e) { return it.start < e; }) -
        items.begin());
  };
  at::parallel_for(0, parts, 1, [&](std::int64_t lo, std::int64_t hi) {
    for (std::int64_t t = lo; t < hi; ++t) {
      run_items(first_item_at(total / parts * t + std::min(t, total % parts)),
                first_item_at(total / parts * (t + 1) + std::min(t + 1, total % parts)));
    }
  });
}

void adam_mixed_(const std::vector<at::Tensor>& masters, const std::vector<at::Tensor>& grads,
                 const std::vector<at::Tensor>& exp_avgs,
                 const std::vector<at::Tensor>& exp_avg_sqs,
                 const std::vector<at::Tensor>& max_exp_avg_sqs,
                 const std::vector<at::Tensor>& steps, const std::vector<at::Tensor>& params_out,
                 double lr, const std::optional<at::Tensor>& lr_tensor, double beta1, double beta2,
                 double eps, double weight_decay, bool decoupled, bool amsgrad, bool maximize,
                 const std::optional<at::Tensor>& grad_scale,
                 const std::optional<at::Tensor>& found_inf) {
  const std::size_t n = masters.size();
  auto check_len = [&](const char* name, std::size_t len) {
    if (len != n) {
      fail_value(name, "a list of " + std::to_string(n) + " tensors (one per master)",
                 "a list of " + std::to_string(len));
    }
  };
  check_len("grads", grads.size());
  check_len("exp_avg", exp_avgs.size());
  check_len("exp_avg_sq", exp_avg_sqs.size());
  check_len("steps", steps.size());
  if (amsgrad) {
    check_len("max_exp_avg_sq", max_exp_avg_sqs.size());
  } else if (!max_exp_avg_sqs.empty()) {
    fail_value("max_exp_avg_sq", "an empty list (amsgrad=False)",
               "a list of " + std::to_string(max_exp_avg_sqs.size()));
  }
  const bool has_out = !params_out.empty();
  if (has_out) check_len("params_out", params_out.size());
  check_scalar("lr", lr_tensor);
  check_scalar("grad_scale", grad_scale);
  check_scalar("found_inf", found_inf, /*or_bool=*/true);

  const c10::ScalarType grad_dtype = n ? grads[0].scalar_type() : c10::ScalarType::Float;
  std::optional<c10::ScalarType> out_dtype;
  if (has_out && n) out_dtype = params_out[0].scalar_type();

  // Leaves whose tensors do not share one dense layout go through contiguous copies.
  std::vector<std::size_t> staged;
  for (std::size_t i = 0; i < n; ++i) {
    const at::Tensor& p = masters[i];
    auto check_f32 = [&](const char* name, const at::Tensor& t) {
      if (!(t.scalar_type() == c10::ScalarType::Float && t.device().is_cpu() &&
            t.layout() == c10::kStrided)) {
        fail_type(at_index(name, i), "a float32 strided CPU tensor", t);
      }
    };
    auto check_shape = [&](const char* name, const at::Tensor& t) {
      if (t.sizes() != p.sizes()) {
        fail_value(at_index(name, i), "shape " + shape_str(p) + " (the master's)",
                   "shape " + shape_str(t));
      }
    };
    check_f32("masters", p);
    const at::Tensor& g = grads[i];
    if (!(is_low_or_f32(g.scalar_type()) && g.device().is_cpu() && g.layout() == c10::kStrided)) {
      fail_type(at_index("grads", i), "a float32, bfloat16 or float16 strided CPU tensor", g);
    }
    if (g.scalar_type() != grad_dtype) {
      fail_type(at_index("grads", i), "the dtype of grads[0] (" + dtype_name(grad_dtype) + ")", g);
    }
    check_shape("grads", g);
    check_f32("exp_avg", exp_avgs[i]);
    check_shape("exp_avg", exp_avgs[i]);
    check_f32("exp_avg_sq", exp_avg_sqs[i]);
    check_shape("exp_avg_sq", exp_avg_sqs[i]);
    if (amsgrad) {
      check_f32("max_exp_avg_sq", max_exp_avg_sqs[i]);
      check_shape("max_exp_avg_sq", max_exp_avg_sqs[i]);
    }
    if (has_out) {
      const at::Tensor& o = params_out[i];
      if (!(is_low_or_f32(o.scalar_type()) && o.device().is_cpu() && o.layout() == c10::kStrided)) {
        fail_type(at_index("params_out", i), "a float32, bfloat16 or float16 strided CPU tensor",
                  o);
      }
      if (o.scalar_type() != *out_dtype) {
        fail_type(at_index("params_out", i),
                  "the dtype of params_out[0] (" + dtype_name(*out_dtype) + ")", o);
      }
      check_shape("params_out", o);
    }
    const at::Tensor& s = steps[i];
    if (!(s.scalar_type() == c10::ScalarType::Float && s.device().is_cpu() && s.numel() == 1)) {
      fail_type(at_index("steps", i), "a one-element float32 CPU tensor", s);
    }
    // A written tensor whose elements overlap would be written twice per element.
    auto check_own = [&](const char* name, const at::Tensor& t) {
      if (at::has_internal_overlap(t) == at::MemOverlap::Yes) {
        fail_value(at_index(name, i), "a tensor whose elements do not overlap",
                   "an expanded or self-overlapping view of shape " + shape_str(t));
      }
      // Its version counter could not be bumped: torch refuses such in-place updates.
      if (t.is_inference() && !c10::InferenceMode::is_enabled()) {
        fail_value(at_index(name, i), "a tensor that can be updated in place",
                   "an inference tensor outside torch.inference_mode()");
      }
    };
    check_own("steps", s);
    check_own("masters", p);
    check_own("exp_avg", exp_avgs[i]);
    check_own("exp_avg_sq", exp_avg_sqs[i]);
    if (amsgrad) check_own("max_exp_avg_sq", max_exp_avg_sqs[i]);
    if (has_out) check_own("params_out", params_out[i]);

    // The fast path walks memory linearly, which pairs elements by logical index only
    // when every tensor of the leaf is dense with the master's strides.
    bool same = p.is_non_overlapping_and_dense();
    auto same_layout = [&](const at::Tensor& t) { same = same && t.strides() == p.strides(); };
    same_layout(g);
    same_layout(exp_avgs[i]);
    same_layout(exp_avg_sqs[i]);
    if (amsgrad) same_layout(max_exp_avg_sqs[i]);
    if (has_out) same_layout(params_out[i]);
    if (!same && p.numel() > 0) staged.push_back(i);
  }

  // Every check has passed; from here on we write.
  if (found_inf && read_scalar(*found_inf) != 0.0f) return;

  // Version counters move as they would under torch's in-place ops, so autograd still
  // notices a tensor it saved being changed underneath it.
  for (std::size_t i = 0; i < n; ++i) {
    masters[i].unsafeGetTensorImpl()->bump_version();
    exp_avgs[i].unsafeGetTensorImpl()->bump_version();
    exp_avg_sqs[i].unsafeGetTensorImpl()->bump_version();
    steps[i].unsafeGetTensorImpl()->bump_version();
    if (amsgrad) max_exp_avg_sqs[i].unsafeGetTensorImpl()->bump_version();
    if (has_out) params_out[i].unsafeGetTensorImpl()->bump_version();
  }

  const double lr_value = lr_tensor ? lr_tensor->item<double>() : lr;
  Hyper hyper{};
  hyper.beta2 = float(beta2);
  hyper.one_m_b2 = float(1 - beta2);
  hyper.eps = float(eps);
  hyper.wd = float(weight_decay);
  hyper.l2 = !decoupled && weight_decay != 0;
  hyper.decay = (decoupled && weight_decay != 0) ? float(1 - lr_value * weight_decay) : 1.0f;
  const float w = float(1 - beta1);
  hyper.lerp_small = std::fabs(w) < 0.5f;
  hyper.coeff = hyper.lerp_small ? w : w - 1.0f;
  hyper.w = w;
  hyper.one_m_w = 1.0f - w;
  hyper.has_scale = grad_scale.has_value();
  hyper.scale = grad_scale ? read_scalar(*grad_scale) : 1.0f;
  hyper.negate = maximize ? 0x80000000u : 0u;

  // Staged leaves compute on contiguous copies, written back at the end.
  struct Stage {
    std::size_t i;
    at::Tensor master, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, out;
  };
  std::vector<Stage> stages;
  stages.reserve(staged.size());
  for (std::size_t i : staged) {
    Stage s{i,
            masters[i].contiguous(),
            grads[i].contiguous(),
            exp_avgs[i].contiguous(),
            exp_avg_sqs[i].contiguous(),
            at::Tensor(),
            at::Tensor()};
    if (amsgrad) s.max_exp_avg_sq = max_exp_avg_sqs[i].contiguous();
    // (read too: a param that no longer equals its master's rounding refreshes it)
    if (has_out) s.out = params_out[i].contiguous();
    stages.push_back(std::move(s));
  }

  std::vector<Leaf> leaves(n);
  double last_step = -1;
  LeafCoef last{};
  for (std::size_t i = 0; i < n; ++i) {
    float* step_ptr = steps[i].data_ptr<float>();
    const float step = *step_ptr + 1.0f;
    *step_ptr = step;
    if (double(step) != last_step) {
      // Exactly torch's scalar math, in double.
      const double bc1 = 1 - std::pow(beta1, double(step));
      const double bc2 = 1 - std::pow(beta2, double(step));
      last.neg_step_size = float(-(lr_value / bc1));
      last.bc2_sqrt = float(std::sqrt(bc2));
      last_step = double(step);
    }
    Leaf& L = leaves[i];
    L.master = masters[i].data_ptr<float>();
    L.grad = grads[i].data_ptr();
    L.exp_avg = exp_avgs[i].data_ptr<float>();
    L.exp_avg_sq = exp_avg_sqs[i].data_ptr<float>();
    L.max_exp_avg_sq = amsgrad ? max_exp_avg_sqs[i].data_ptr<float>() : nullptr;
    L.out = has_out ? params_out[i].data_ptr() : nullptr;
    L.numel = masters[i].numel();
    L.coef = last;
  }
  for (Stage& s : stages) {
    Leaf& L = leaves[s.i];
    L.master = s.master.data_ptr<float>();
    L.grad = s.grad.data_ptr();
    L.exp_avg = s.exp_avg.data_ptr<float>();
    L.exp_avg_sq = s.exp_avg_sq.data_ptr<float>();
    if (amsgrad) L.max_exp_avg_sq = s.max_exp_avg_sq.data_ptr<float>();
    if (has_out) L.out = s.out.data_ptr();
  }

  std::vector<std::int64_t> numels(n);
  std::int64_t total = 0;
  for (std::size_t i = 0; i < n; ++i) total += numels[i] = leaves[i].numel;
  // Streaming stores leave the params out of the cache; worth it only when the step's
  // traffic would not fit in a last-level cache anyway.
  hyper.stream_out = g_stream_out && total >= kStreamFrom;
  const RangeFn fn = pick(grad_dtype, out_dtype, amsgrad);
  for_each_item(numels, total, [&](std::size_t i, std::int64_t b, std::int64_t e) {
    fn(leaves[i], b, e, hyper);
  });

  for (Stage& s : stages) {
    const std::size_t i = s.i;
    auto back = [](const at::Tensor& dst, const at::Tensor& src) {
      if (!dst.is_same(src)) dst.copy_(src);
    };
    back(masters[i], s.master);
    back(exp_avgs[i], s.exp_avg);
    back(exp_avg_sqs[i], s.exp_avg_sq);
    if (amsgrad) back(max_exp_avg_sqs[i], s.max_exp_avg_sq);
    if (has_out) back(params_out[i], s.out);
  }
}

// ---- the composed step: every master strategy with every state format ----------------------
//
// A step over masters kept by a strategy ("remainder", "kahan", "stochastic", "none" or
// plain fp32) with moments kept in a state format (fp32, bf16 or 8-bit blocks) is the
// fp32 step above run on fp32 tiles: per tile of kTile elements, the strategy's load
// and the format's decode fill cache-resident fp32 scratch (or lend the stored fp32
// tensors themselves), run_range computes torch's fused Adam on it, and the format's
// encode and the strategy's store write it back. Memory is read and written once per
// step, as in the fp32 kernel; the scratch never leaves the core's cache. Each piece is
// written once, and pieces compose at run time per tile (a switch per 1024 elements),
// so a new strategy or format is one load and one store here, not a kernel per pair.
//
// Bits: every piece computes what its torch twin computes (mpfunc/_strategy_*.py,
// _remainder.py, _quantize.py, _rng.py) with the same IEEE operations in the same order,
// so the result equals the torch path (load, torch's fused kernel, store) bit for bit,
// NaN payloads aside.

namespace composed {

enum Strategy : std::int64_t { kFP32 = 0, kRemainder = 1, kKahan = 2, kStochastic = 3, kNone = 4 };
enum Format : std::int64_t { kF32 = 0, kBF16 = 1, kU8 = 2, kU4 = 3 };
// The formats of 32-element blocks with bf16 scales (8-bit codes, or 4-bit two a byte).
constexpr bool blocked(Format f) { return f == kU8 || f == kU4; }

// A multiple of the 8-bit format's 32-element block and of 64 (work items start at
// multiples of g_chunk, itself a multiple of 64), so tiles never split a block.
constexpr std::int64_t kTile = 1024;
// The tile of the 16- and 32-bit formats: small enough that the four scratch rows stay
// in L1 between load, math and store.
constexpr std::int64_t kSmallTile = 256;
constexpr std::int64_t kQBlock = 32;
constexpr float kTiny = 0x1.0p-126f;  // fp32's smallest normal
// bf16's largest finite value: block scales are clamped to it (_quantize.BF16_MAX).
constexpr float kBF16Max = 0x1.FEp127f;

// ---- _rng: MurmurHash3's finalizer as a counter-based generator ----------------------------
constexpr u32 kGolden = 0x9E3779B1u;

MPF_INLINE u32 fmix(u32 x) {
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  x ^= x >> 16;
  return x;
}
// 32 random bits of element i (row-major) under key: mix(mix(i * golden + key) ^ key).
MPF_INLINE u32 draw(u32 key, u32 i) { return fmix(fmix(i * kGolden + key) ^ key); }
// A draw in [0, 1) with 24 random bits.
MPF_INLINE float uniform(u32 bits) { return float(bits >> 8) * 0x1.0p-24f; }

// ---- _remainder: the fp32 master as its bf16 param (nearest even), its low 16 bits and a
// tie bit (set at an exact tie that rounded up, and for NaNs whose payload lies in the low
// half, whose param is the quiet NaN). The tie bits follow the param's logical layout
// (_remainder.tie_shape: rows along the last dim, each padded to whole bytes), so an
// element's bit is found from its memory offset through the leaf's sizes and strides
// (tie_at). A bit is set only where it matters (tie_matters), so the pass reads and writes
// one only there: an exact tie or a NaN param, rare in training.
constexpr u32 kInfHigh = 0x7F80;
constexpr u32 kQNaNHigh = 0x7FC0;

MPF_INLINE float join(u16 p, u16 r, u32 t) {
  const u32 mag = p & 0x7FFFu;
  const u32 low = r;
  // The rounding went up where the remainder's top bit is set, except at an exact tie,
  // where the tie bit says; a NaN param kept its high half, or stands for high 0x7F80.
  const u32 up = low == 0x8000u ? t : low >> 15;
  // Nothing rounds up to a zero param: a remainder that says so is stale (the param was
  // written, e.g. zeroed by pruning) and the master is the param itself, +-0 (it would
  // wrap to NaN).
  if (mag == 0 && up) return float_of(u32(p & 0x8000u) << 16);
  const u32 high = mag <= kInfHigh ? mag - up : (t ? kInfHigh : mag);
  return float_of((high << 16) | low | (u32(p & 0x8000u) << 16));
}

// Returns the tie bit.
MPF_INLINE u32 split(float x, u16& p, u16& r) {
  const u32 b = bits_of(x);
  const u32 mag32 = b & 0x7FFFFFFFu;
  const u32 high = mag32 >> 16, low = b & 0xFFFFu;
  u32 mag, tie;
  if (mag32 > 0x7F800000u) {  // NaN
    tie = high == kInfHigh;
    mag = tie ? kQNaNHigh : high;
  } else {
    const u32 odd = high & 1u;
    mag = (mag32 + 0x7FFFu + odd) >> 16;
    tie = low == 0x8000u ? odd : 0u;
  }
  p = u16(mag | ((b >> 16) & 0x8000u));
  r = u16(low);
  return tie;
}
// Whether join reads the tie bit of (p, r): an exact tie of a finite or infinite param, or a
// NaN param (split sets bits only there, so everywhere else the bit is 0).
MPF_INLINE bool tie_matters(u16 p, u16 r) { return (p & 0x7FFFu) > kInfHigh || r == 0x8000u; }

// Where a leaf's tie bits are: its param's sizes and strides (dense, any order of strides)
// and the bytes of one row.
constexpr int kTieDims = 8;
struct TieMap {
  std::uint8_t* bits = nullptr;
  int nd = 0;
  std::int64_t row_bytes = 1;
  std::int64_t size[kTieDims] = {};
  std::int64_t stride[kTieDims] = {};
};

// The byte and bit of the element at memory offset o. In a dense tensor each stride is the
// product of the sizes of the dims with smaller strides, so (o / stride) % size is that
// dim's index whatever the order of the strides (transposed, channels_last).
MPF_INLINE std::int64_t tie_at(const TieMap& T, std::int64_t o, int& bit) {
  std::int64_t row = 0, col = 0;
  for (int d = 0; d < T.nd; ++d) {
    const std::int64_t idx = T.size[d] == 1 ? 0 : (o / T.stride[d]) % T.size[d];
    if (d + 1 < T.nd) {
      row = row * T.size[d] + idx;
    } else {
      col = idx;
    }
  }
  bit = int(col & 7);
  return row * T.row_bytes + (col >> 3);
}
// A row's byte can hold elements that two threads step (rows need not split at a thread's
// boundary), so the rare reads and writes of a bit are atomic on its byte.
MPF_INLINE u32 tie_get(const TieMap& T, std::int64_t o) {
  int bit;
  const std::int64_t byte = tie_at(T, o, bit);
  return (u32(__atomic_load_n(T.bits + byte, __ATOMIC_RELAXED)) >> bit) & 1u;
}
TieMap tie_map(const at::Tensor& param, const at::Tensor& ties) {
  TieMap T;
  T.bits = static_cast<std::uint8_t*>(ties.data_ptr());
  T.nd = int(param.dim());
  for (int d = 0; d < T.nd; ++d) {
    T.size[d] = param.size(d);
    T.stride[d] = param.stride(d);
  }
  T.row_bytes = T.nd ? (param.size(-1) + 7) / 8 : 1;
  return T;
}
MPF_INLINE void tie_put(const TieMap& T, std::int64_t o, u32 t) {
  int bit;
  const std::int64_t byte = tie_at(T, o, bit);
  if (t) {
    __atomic_fetch_or(T.bits + byte, std::uint8_t(1u << bit), __ATOMIC_RELAXED);
  } else {
    __atomic_fetch_and(T.bits + byte, std::uint8_t(~(1u << bit)), __ATOMIC_RELAXED);
  }
}

// ---- _quantize: 32-element blocks, bf16 absmax scales, companded codes ----------------------
struct Tables {
  float s[256];  // code + 128 -> value (index 0: NaN)
  float u[256];  // code -> value (255: +inf)
  Tables() {
    s[0] = std::numeric_limits<float>::quiet_NaN();
    for (int k = -127; k <= 127; ++k) {
      const double t = double(k) / 127;
      s[k + 128] = float(t / (2 - std::fabs(t)));
    }
    for (int k = 0; k <= 254; ++k) {
      const double t = double(k) / 254;
      u[k] = float(t / (2 - t));
    }
    u[255] = std::numeric_limits<float>::infinity();  // the mark: +inf (_quantize)
  }
};
const Tables& tables() {
  static const Tables t;
  return t;
}

MPF_INLINE float flush(float x) { return std::fabs(x) < kTiny ? 0.0f : x; }

// out[j] = T[idx[j]] for one block. Plain loads: on the machines measured (AMD Zen 4)
// they beat AVX-512 gathers (27 ms against 34 ms for an 8-bit AdamW step of 8M elements).
MPF_INLINE void gather_block(const float* __restrict__ T, const std::int32_t* __restrict__ idx,
                             float* __restrict__ out) {
  for (int j = 0; j < kQBlock; ++j) out[j] = T[idx[j]];
}

// Per element of a tile, its block's scale: ex[i] = per_block[i / kQBlock].
MPF_INLINE void expand(const float* __restrict__ per_block, std::int64_t blocks,
                       float* __restrict__ ex) {
  for (std::int64_t k = 0; k < blocks; ++k) {
    const float s = per_block[k];
    for (int j = 0; j < kQBlock; ++j) ex[k * kQBlock + j] = s;
  }
}

// The 8-bit format works on a whole tile in phases (flags and magnitudes, block scales,
// codes), each a loop over all of the tile's elements that the compiler vectorizes:
// block by block, each block's chain of dependent operations (max, scale, divisions,
// table reads) would leave the core waiting on latency.

// fp32 values of elements [b, e) (b block-aligned, e - b <= kTile) from codes and scales.
template <bool kSigned>
void decode(const void* codes, const u16* scales, std::int64_t b, std::int64_t e, float* out) {
  const float* __restrict__ T = kSigned ? tables().s : tables().u;
  const std::int64_t n = e - b, blocks = (n + kQBlock - 1) / kQBlock;
  alignas(64) std::int32_t idx[kTile];
  alignas(64) float sc[kTile / kQBlock], ex[kTile], val[kTile];
  if constexpr (kSigned) {
    const auto* c = static_cast<const std::int8_t*>(codes) + b;
    for (std::int64_t i = 0; i < n; ++i) idx[i] = std::int32_t(c[i]) + 128;
  } else {
    const auto* c = static_cast<const std::uint8_t*>(codes) + b;
    for (std::int64_t i = 0; i < n; ++i) idx[i] = std::int32_t(c[i]);
  }
  for (std::int64_t i = n; i < blocks * kQBlock; ++i) idx[i] = kSigned ? 128 : 0;
  for (std::int64_t k = 0; k < blocks; ++k) {
    const float f = BF16::load(scales[b / kQBlock + k]);
    // Unsigned: a zero scale reads as fp32's smallest normal, so the mark is +inf in any
    // block (_quantize._decode's clamp; std::max keeps a NaN scale NaN, as clamp does).
    sc[k] = kSigned ? f : std::max(f, kTiny);
  }
  expand(sc, blocks, ex);
  for (std::int64_t k = 0; k < blocks; ++k) gather_block(T, idx + k * kQBlock, val + k * kQBlock);
  for (std::int64_t i = 0; i < n; ++i) {
    float y = val[i] * ex[i];
    if (!kSigned) y = y * y;
    out[i] = std::fabs(y) < kTiny ? 0.0f : y;
  }
}

// Phases 1 and 2 of an encode, 8-bit and 4-bit alike: which of the n elements at `in` are
// coded (ok: finite, and for unsigned moments not negative; keep: also not below kTiny),
// the magnitudes the scale covers (v: the value, or its sqrt for unsigned moments; padding
// up to `padded` is 0), and per block the bf16 absmax scale (written to `scales`) and the
// divisor its codes are made with (dd: the scale, or 1 for an all-zero block, whose codes
// stay 0).
template <bool kSigned>
void encode_scales(const float* in, std::int64_t n, std::int64_t padded, float* v,
                   std::int32_t* ok, std::int32_t* keep, u16* scales, float* dd) {
  for (std::int64_t i = 0; i < padded; ++i) {
    const float x = i < n ? in[i] : 0.0f;
    // finite: x - x is 0 for finite x, NaN for inf and NaN.
    const bool okj = (x - x) == 0.0f && (kSigned || x > -kTiny);
    const bool keepj = okj && std::fabs(x) >= kTiny;
    float vj = keepj ? x : 0.0f;
    if (!kSigned) vj = std::sqrt(vj);
    v[i] = vj;
    ok[i] = okj;
    keep[i] = keepj;
  }
  for (std::int64_t k = 0; k < padded / kQBlock; ++k) {
    fVec m = fVec::loadu(v + k * kQBlock).abs();
    for (int j = kW; j < kQBlock; j += kW) m = at::vec::maximum(m, fVec::loadu(v + k * kQBlock + j).abs());
    const float amax = at::vec::vec_reduce_all<float>(
        [](const fVec& p, const fVec& q) { return at::vec::maximum(p, q); }, m);
    const u16 scale = BF16::store(std::min(amax, kBF16Max));
    scales[k] = scale;
    const float sf = BF16::load(scale);
    dd[k] = sf > 0.0f ? sf : 1.0f;
  }
}

// The codes (int32, one per element of [b, e), b block-aligned, e - b <= kTile) and scales
// of a companded map with `levels` levels a side, decode table T (T[c + off] for code c;
// signed to nearest, or with kNoise unsigned rounded stochastically with the draws of (key,
// element index)) and `mark` for a non-finite value: the 8-bit and 4-bit encoders alike
// (_quantize._encode and _quantize4._encode, each element's operations in their order),
// written in phases, each a loop over the tile the compiler vectorizes.
template <bool kSigned, bool kNoise>
MPF_INLINE void encode_codes(const float* in, std::int64_t b, std::int64_t e, const float* T,
                             float levels, std::int32_t mark, u16* scales, u32 key,
                             std::int32_t* code) {
  static_assert(kSigned != kNoise, "signed to nearest, unsigned stochastically");
  const float low = kSigned ? -levels : 0.0f;
  const std::int64_t n = e - b, blocks = (n + kQBlock - 1) / kQBlock, padded = blocks * kQBlock;
  alignas(64) float v[kTile], ex[kTile], y[kTile], dd[kTile / kQBlock];
  alignas(64) std::int32_t ok[kTile], keep[kTile];
  // Phases 1 and 2: flags and magnitudes, block scales and divisors.
  encode_scales<kSigned>(in, n, padded, v, ok, keep, scales + b / kQBlock, dd);
  expand(dd, blocks, ex);
  // Phase 3: the companded value and its code.
  if constexpr (!kNoise) {
    for (std::int64_t i = 0; i < padded; ++i) {
      const float q = v[i] / ex[i];
      const float yj = std::fabs(q) < kTiny ? 0.0f : q;
      const float t = (yj + yj) / (std::fabs(yj) + 1.0f);
      const float r = std::nearbyint(t * levels);
      code[i] = std::int32_t(std::min(std::max(r, low), levels));
    }
  } else {
    alignas(64) float u[kTile], lo_v[kTile], hi_v[kTile];
    const fVec tiny(kTiny), one(1.0f), zero(0.0f);
    // (the compiler leaves this loop scalar; written with ATen's vectors instead)
    for (std::int64_t i = 0; i < padded; i += kW) {
      const fVec q = fVec::loadu(v + i) / fVec::loadu(ex + i);
      const fVec yj = fVec::blendv(q, zero, q.abs() < tiny);
      const fVec t = (yj + yj) / (yj.abs() + one);
      // floor(t * levels) clamped to [0, levels - 1] (clamping first is the same).
      const fVec x = at::vec::minimum(at::vec::maximum(t * fVec(levels), zero),
                                      fVec(levels - 1.0f));
      yj.store(y + i);
      at::vec::convert_to_int_of_same_size(x.floor()).store(code + i);
    }
    // (lo <= levels - 1, so lo + 1 is the next entry)
    for (std::int64_t k = 0; k < blocks; ++k) {
      gather_block(T, code + k * kQBlock, lo_v + k * kQBlock);
      gather_block(T + 1, code + k * kQBlock, hi_v + k * kQBlock);
    }
    const u32 base = u32(b);
    for (std::int64_t i = 0; i < padded; ++i) u[i] = uniform(draw(key, base + u32(i)));
    for (std::int64_t i = 0; i < padded; ++i) {
      const float yy = y[i] * y[i];
      const float value = std::fabs(yy) < kTiny ? 0.0f : yy;
      const float a = lo_v[i] * lo_v[i], h = hi_v[i] * hi_v[i];
      code[i] = code[i] + std::int32_t(u[i] < (value - a) / (h - a));
    }
  }
  // Phase 4: a positive second moment never decodes to 0; non-finite values get the mark.
  for (std::int64_t i = 0; i < n; ++i) {
    std::int32_t c = code[i];
    if (!kSigned) c = keep[i] && c < 1 ? 1 : c;
    code[i] = ok[i] ? c : mark;
  }
}

// Codes and scales of elements [b, e) (b block-aligned, e - b <= kTile) from fp32 values;
// signed to nearest, or with kNoise (unsigned moments) rounded stochastically with the draws
// of (key, element index): _quantize._encode, one code a byte.
template <bool kSigned, bool kNoise>
void encode(const float* in, std::int64_t b, std::int64_t e, void* codes, u16* scales, u32 key) {
  alignas(64) std::int32_t code[kTile];
  encode_codes<kSigned, kNoise>(in, b, e, kSigned ? tables().s : tables().u,
                                kSigned ? 127.0f : 254.0f, kSigned ? -128 : 255, scales, key,
                                code);
  const std::int64_t n = e - b;
  if constexpr (kSigned) {
    auto* o = static_cast<std::int8_t*>(codes) + b;
    for (std::int64_t i = 0; i < n; ++i) o[i] = std::int8_t(code[i]);
  } else {
    auto* o = static_cast<std::uint8_t*>(codes) + b;
    for (std::int64_t i = 0; i < n; ++i) o[i] = std::uint8_t(code[i]);
  }
}

// ---- _quantize4: 4-bit codes, two a byte, in the 8-bit format's 32-element blocks ----------
// Nibble n -> value: the signed map's n - 16 above 7 (8: the mark, NaN), over 7 levels; the
// unsigned map's n over 14 levels (15: the mark, +inf). _quantize4._decode_table, rounded
// once from double to float as there.
struct Tables4 {
  alignas(64) float s[16];
  alignas(64) float u[16];
  Tables4() {
    for (int n = 0; n < 16; ++n) {
      const double ts = double(n >= 8 ? n - 16 : n) / 7;
      s[n] = float(ts / (2 - std::fabs(ts)));
      const double tu = double(n) / 14;
      u[n] = float(tu / (2 - std::fabs(tu)));
    }
    s[8] = std::numeric_limits<float>::quiet_NaN();
    u[15] = std::numeric_limits<float>::infinity();
  }
};
const Tables4& tables4() {
  static const Tables4 t;
  return t;
}

// fp32 values of elements [b, e) (b block-aligned, e - b <= kTile) from packed nibbles
// (element j: byte j / 2, low nibble first) and scales: _quantize4.dequantize4's operations,
// in decode's phases (nibbles, scales, table reads, products).
template <bool kSigned>
void decode4(const void* codes, const u16* scales, std::int64_t b, std::int64_t e, float* out) {
  const float* __restrict__ T = kSigned ? tables4().s : tables4().u;
  const auto* c = static_cast<const std::uint8_t*>(codes) + b / 2;
  const std::int64_t n = e - b, blocks = (n + kQBlock - 1) / kQBlock;
  alignas(64) std::int32_t idx[kTile];
  alignas(64) float sc[kTile / kQBlock], ex[kTile], val[kTile];
  for (std::int64_t p = 0; p < blocks * kQBlock / 2; ++p) {  // (past n: the padding's 0s)
    const std::int32_t byte = 2 * p < n ? c[p] : 0;
    idx[2 * p] = byte & 15;
    idx[2 * p + 1] = 2 * p + 1 < n ? byte >> 4 : 0;
  }
  for (std::int64_t k = 0; k < blocks; ++k) {
    const float f = BF16::load(scales[b / kQBlock + k]);
    // Unsigned: a zero scale reads as fp32's smallest normal (std::max keeps a NaN).
    sc[k] = kSigned ? f : std::max(f, kTiny);
  }
  expand(sc, blocks, ex);
  for (std::int64_t k = 0; k < blocks; ++k) gather_block(T, idx + k * kQBlock, val + k * kQBlock);
  for (std::int64_t i = 0; i < n; ++i) {
    float y = val[i] * ex[i];
    if (!kSigned) y = y * y;
    out[i] = std::fabs(y) < kTiny ? 0.0f : y;
  }
}

// Packed nibbles and scales of elements [b, e) (b block-aligned, e - b <= kTile) from fp32
// values, the two forms the pass stores (signed to nearest, unsigned stochastically):
// _quantize4._encode, _round_stochastic and _pack; an odd last element leaves its byte's
// high nibble 0.
template <bool kSigned, bool kNoise>
void encode4(const float* in, std::int64_t b, std::int64_t e, void* codes, u16* scales, u32 key) {
  alignas(64) std::int32_t code[kTile];
  encode_codes<kSigned, kNoise>(in, b, e, kSigned ? tables4().s : tables4().u,
                                kSigned ? 7.0f : 14.0f, kSigned ? -8 : 15, scales, key, code);
  const std::int64_t n = e - b;
  if (n % 2) code[n] = 0;  // the padding's code: its byte's high nibble
  auto* o = static_cast<std::uint8_t*>(codes) + b / 2;
  for (std::int64_t p = 0; p < (n + 1) / 2; ++p) {
    o[p] = std::uint8_t((code[2 * p] & 15) | ((code[2 * p + 1] & 15) << 4));
  }
}

// dst[0, n) <- float(src[0, n)) for a 16-bit type X, with ATen's vector conversions.
template <class X>
void widen(const u16* __restrict__ src, float* __restrict__ dst, std::int64_t n) {
  std::int64_t i = 0;
  fVec a, b;
  for (; i + kBlock <= n; i += kBlock) {
    load2<X, true>(src + i, kBlock, a, b);
    store2<F32, true>(dst + i, kBlock, a, b);
  }
  if (i < n) {
    load2<X, false>(src + i, n - i, a, b);
    store2<F32, false>(dst + i, n - i, a, b);
  }
}

// dst[0, n) <- src[0, n) rounded to X as Tensor.to rounds (the same vector code).
template <class X>
void narrow(const float* __restrict__ src, u16* __restrict__ dst, std::int64_t n) {
  std::int64_t i = 0;
  fVec a, b;
  for (; i + kBlock <= n; i += kBlock) {
    load2<F32, true>(src + i, kBlock, a, b);
    store2<X, true>(dst + i, kBlock, a, b);
  }
  if (i < n) {
    load2<F32, false>(src + i, n - i, a, b);
    store2<X, false>(dst + i, n - i, a, b);
  }
}

// One leaf of the composed step.
struct CLeaf {
  void* prim;        // the fp32 master, or the unit's param
  void* aux;         // remainder (int16) or compensation (param dtype); else null
  TieMap ties;       // "remainder": where the tie bits are
  u32 key;           // "stochastic": the key this step draws with
  bool half;         // the param is float16 (else bfloat16)
  const void* grad;
  void* out;         // "fp32" with params_out: the rounded param
  void* data[3];     // exp_avg, exp_avg_sq, max_exp_avg_sq: fp32/bf16 tensor or codes
  u16* scale[3];     // the 8-bit format's scales
  u32 vkey;          // the 8-bit format's draw key of its squares at this step
  std::int64_t numel;
  LeafCoef coef;
};

// The compensation a Kahan master adds to its param (_strategy_kahan._load): -0.0 (which
// keeps either zero) where it cannot belong to this param, else itself. A store leaves
// |compensation| <= half the param's ulp <= |param| * 2^-8 (bf16; 2^-11 for fp16), and a
// zero (or subnormal) param a zero compensation; any other is stale, left by a write to the
// param (pruning, a re-init to smaller values), and the master is the written value.
template <class X>
MPF_INLINE fVec kahan_comp(const fVec& p, const fVec& c) {
  const fVec stale = (p == fVec(0.0f)) | (c.abs() > p.abs() * fVec(X::kHalfUlp));
  return fVec::blendv(c, fVec(-0.0f), stale);
}
template <class X>
MPF_INLINE float kahan_comp(float p, float c) {
  return p == 0.0f || std::fabs(c) > std::fabs(p) * X::kHalfUlp ? -0.0f : c;
}

// Equal strides where they matter: a dim of size 1 is never stepped along, so its stride
// (1 for a transposed (40, 1) -> (1, 40) param, 40 for its contiguous grad) says nothing
// about which elements pair by memory position. (Sizes are compared apart.)
inline bool same_strides(const at::Tensor& t, const at::Tensor& p) {
  const auto a = t.strides(), b = p.strides(), n = p.sizes();
  for (std::size_t d = 0; d < n.size(); ++d) {
    if (n[d] != 1 && a[d] != b[d]) return false;
  }
  return true;
}

// x = float(param) + float(compensation), as _strategy_kahan's load.
template <class X>
void load_kahan(const CLeaf& L, std::int64_t b, std::int64_t e, float* dst) {
  const auto* P = static_cast<const u16*>(L.prim) + b;
  const auto* C = static_cast<const u16*>(L.aux) + b;
  const std::int64_t n = e - b;
  std::int64_t i = 0;
  fVec p0, p1, c0, c1;
  for (; i + kBlock <= n; i += kBlock) {
    load2<X, true>(P + i, kBlock, p0, p1);
    load2<X, true>(C + i, kBlock, c0, c1);
    store2<F32, true>(dst + i, kBlock, p0 + kahan_comp<X>(p0, c0), p1 + kahan_comp<X>(p1, c1));
  }
  for (; i < n; ++i) {
    const float p = X::load(P[i]);
    dst[i] = p + kahan_comp<X>(p, X::load(C[i]));
  }
}

template <class X>
void load_param(const CLeaf& L, std::int64_t b, std::int64_t e, float* dst) {
  widen<X>(static_cast<const u16*>(L.prim) + b, dst, e - b);
}

// param = x rounded to nearest even; compensation = (x - param) rounded (exact in fp32).
template <class X>
void store_kahan(const CLeaf& L, std::int64_t b, std::int64_t e, const float* src) {
  auto* P = static_cast<u16*>(L.prim) + b;
  auto* C = static_cast<u16*>(L.aux) + b;
  const std::int64_t n = e - b;
  std::int64_t i = 0;
  using T = typename VecOf<X>::T;
  fVec x0, x1, r0, r1;
  for (; i + kBlock <= n; i += kBlock) {
    load2<F32, true>(src + i, kBlock, x0, x1);
    const auto p = narrow2<X>(x0, x1);
    std::tie(r0, r1) = at::vec::convert_to_float<T>(p);
    p.store(P + i);
    store2<X, true>(C + i, kBlock, x0 - r0, x1 - r1);
  }
  for (; i < n; ++i) {
    const float x = src[i];
    const u16 p = X::store(x);
    P[i] = p;
    C[i] = X::store(x - X::load(p));
  }
}

template <class X>
void store_nearest(const CLeaf& L, std::int64_t b, std::int64_t e, const float* src) {
  narrow<X>(src, static_cast<u16*>(L.prim) + b, e - b);
}

// The master's fp32 values of [b, e): the master itself for "fp32", else `scratch`.
float* load_master(Strategy s, const CLeaf& L, std::int64_t b, std::int64_t e, float* scratch) {
  switch (s) {
    case kFP32:
      return static_cast<float*>(L.prim) + b;
    case kRemainder: {
      const auto* P = static_cast<const u16*>(L.prim);
      const auto* R = static_cast<const u16*>(L.aux);
      for (std::int64_t i = b; i < e; ++i) {
        const u32 t = tie_matters(P[i], R[i]) ? tie_get(L.ties, i) : 0u;
        scratch[i - b] = join(P[i], R[i], t);
      }
      break;
    }
    case kKahan:
      L.half ? load_kahan<F16>(L, b, e, scratch) : load_kahan<BF16>(L, b, e, scratch);
      break;
    case kStochastic:
    case kNone:
      L.half ? load_param<F16>(L, b, e, scratch) : load_param<BF16>(L, b, e, scratch);
      break;
  }
  return scratch;
}

void store_master(Strategy s, const CLeaf& L, std::int64_t b, std::int64_t e, const float* x) {
  switch (s) {
    case kFP32:
      return;
    case kRemainder: {
      auto* P = static_cast<u16*>(L.prim);
      auto* R = static_cast<u16*>(L.aux);
      for (std::int64_t i = b; i < e; ++i) {
        const bool was = tie_matters(P[i], R[i]);  // its bit may be set: rewrite it
        const u32 t = split(x[i - b], P[i], R[i]);
        if (was || t) tie_put(L.ties, i, t);
      }
      return;
    }
    case kKahan:
      L.half ? store_kahan<F16>(L, b, e, x) : store_kahan<BF16>(L, b, e, x);
      return;
    case kStochastic: {
      // Add 16 random bits below the bf16 cut and truncate: up with probability
      // (distance to the value below) / (gap). NaN rounds to nearest (stays NaN).
      auto* P = static_cast<u16*>(L.prim);
      for (std::int64_t i = b; i < e; ++i) {
        const float v = x[i - b];
        const u32 t = (bits_of(v) + (draw(L.key, u32(i)) & 0xFFFFu)) >> 16;
        P[i] = v != v ? BF16::store(v) : u16(t);
      }
      return;
    }
    case kNone:
      L.half ? store_nearest<F16>(L, b, e, x) : store_nearest<BF16>(L, b, e, x);
      return;
  }
}

// A moment's fp32 values of [b, e): the stored tensor itself for fp32, else `scratch`.
float* load_state(Format f, bool is_signed, const CLeaf& L, int k, std::int64_t b,
                  std::int64_t e, float* scratch) {
  switch (f) {
    case kF32:
      return static_cast<float*>(L.data[k]) + b;
    case kBF16:
      widen<BF16>(static_cast<const u16*>(L.data[k]) + b, scratch, e - b);
      break;
    case kU8:
      is_signed ? decode<true>(L.data[k], L.scale[k], b, e, scratch)
                : decode<false>(L.data[k], L.scale[k], b, e, scratch);
      break;
    case kU4:
      is_signed ? decode4<true>(L.data[k], L.scale[k], b, e, scratch)
                : decode4<false>(L.data[k], L.scale[k], b, e, scratch);
      break;
  }
  return scratch;
}

void store_state(Format f, bool is_signed, const CLeaf& L, int k, std::int64_t b,
                 std::int64_t e, const float* x) {
  switch (f) {
    case kF32:
      return;
    case kBF16:
      narrow<BF16>(x, static_cast<u16*>(L.data[k]) + b, e - b);
      return;
    case kU8:
      if (is_signed) {
        encode<true, false>(x, b, e, L.data[k], L.scale[k], 0);
      } else {
        encode<false, true>(x, b, e, L.data[k], L.scale[k], L.vkey);
      }
      return;
    case kU4:
      if (is_signed) {
        encode4<true, false>(x, b, e, L.data[k], L.scale[k], 0);
      } else {
        encode4<false, true>(x, b, e, L.data[k], L.scale[k], L.vkey);
      }
      return;
  }
}

// Elements [begin, end) of one leaf, tile by tile.
// ---- the fused vector path -----------------------------------------------------------------
// For the 16- and 32-bit state formats, the strategy's load/store and the format's
// widen/narrow compose per block of kBlock elements, around the same vector_math the
// tiles run: every stream is read and written once, in registers, with no scratch pass.
// Each piece is the tile path's own operation on one block (the same ATen conversions,
// the same integer formulas), so the bits are the same; elements past the leaf's last
// whole block (torch's 8-wide and scalar loops) go through the tiles.

// Strategy pieces: load(L, i, p0, p1) and store(L, i, p0, p1, carry) for elements
// [i, i + kBlock); load returns the carry, a mask of the block's elements its store must
// revisit (the remainder's rare elements; 0 for the others).
template <class X>
struct SNearest {  // "none": the param itself, rounded to nearest
  static MPF_INLINE u32 load(const CLeaf& L, std::int64_t i, fVec& p0, fVec& p1) {
    load2<X, true>(static_cast<const u16*>(L.prim) + i, kBlock, p0, p1);
    return 0;
  }
  static MPF_INLINE void store(const CLeaf& L, std::int64_t i, const fVec& p0, const fVec& p1,
                               u32) {
    store2<X, true>(static_cast<u16*>(L.prim) + i, kBlock, p0, p1);
  }
};

template <class O>
struct SFp32 {  // "fp32": the master in place; with params out, refreshed and rounded out
  static MPF_INLINE u32 load(const CLeaf& L, std::int64_t i, fVec& p0, fVec& p1) {
    load2<F32, true>(static_cast<const float*>(L.prim) + i, kBlock, p0, p1);
    if constexpr (!std::is_void_v<typename O::T>) {
      refresh<O, true>(static_cast<const typename O::T*>(L.out) + i, kBlock, p0, p1);
    }
    return 0;
  }
  static MPF_INLINE void store(const CLeaf& L, std::int64_t i, const fVec& p0, const fVec& p1,
                               u32) {
    store2<F32, true>(static_cast<float*>(L.prim) + i, kBlock, p0, p1);
    if constexpr (!std::is_void_v<typename O::T>) {
      store2<O, true>(static_cast<typename O::T*>(L.out) + i, kBlock, p0, p1);
    }
  }
};

template <class X>
struct SKahan {  // param + compensation (kahan_comp); store_kahan's block
  static MPF_INLINE u32 load(const CLeaf& L, std::int64_t i, fVec& p0, fVec& p1) {
    fVec c0, c1;
    load2<X, true>(static_cast<const u16*>(L.prim) + i, kBlock, p0, p1);
    load2<X, true>(static_cast<const u16*>(L.aux) + i, kBlock, c0, c1);
    p0 = p0 + kahan_comp<X>(p0, c0);
    p1 = p1 + kahan_comp<X>(p1, c1);
    return 0;
  }
  static MPF_INLINE void store(const CLeaf& L, std::int64_t i, const fVec& x0, const fVec& x1,
                               u32) {
    using T = typename VecOf<X>::T;
    const auto p = narrow2<X>(x0, x1);
    fVec r0, r1;
    std::tie(r0, r1) = at::vec::convert_to_float<T>(p);
    p.store(static_cast<u16*>(L.prim) + i);
    store2<X, true>(static_cast<u16*>(L.aux) + i, kBlock, x0 - r0, x1 - r1);
  }
};

#if defined(CPU_CAPABILITY_AVX512)
using iVec = __m512i;  // 16 lanes of 32 bits: half a block
MPF_INLINE iVec i32(std::uint32_t v) { return _mm512_set1_epi32(std::int32_t(v)); }
MPF_INLINE iVec widen16(const u16* p) {
  return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
MPF_INLINE void narrow16(iVec x, u16* p) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(x));
}

// join() and split() on a block of 32 elements, in 16-bit lanes. The common block has no
// rare element (an exact tie, remainder 0x8000, a NaN param, or a zero param whose
// remainder says it rounded up: stale, see join), and there the rounding went up exactly
// where the remainder's top bit is set: join subtracts it from the
// param's magnitude, split adds it to the master's high half. Rare elements are left to
// join_rare/split_rare, out of line; the masks say which (bit j: element j).
MPF_INLINE __m512i u16s(u32 v) { return _mm512_set1_epi16(short(v)); }

// x0, x1 <- join of P, R[0, 32) (right where no bit is set in the returned mask).
MPF_INLINE u32 join32(const u16* P, const u16* R, fVec& x0, fVec& x1) {
  const __m512i p = _mm512_loadu_si512(P), low = _mm512_loadu_si512(R);
  const __m512i mag = _mm512_and_si512(p, u16s(0x7FFFu));
  const u32 rare =
      u32(_mm512_cmpgt_epu16_mask(mag, u16s(kInfHigh)) |
          _mm512_cmpeq_epi16_mask(low, u16s(0x8000u)) |
          _mm512_mask_cmpge_epu16_mask(_mm512_testn_epi16_mask(mag, mag), low, u16s(0x8000u)));
  // high = (mag - top bit) | sign (a zero param with the top bit set is rare: join).
  const __m512i high =
      _mm512_ternarylogic_epi32(_mm512_sub_epi16(mag, _mm512_srli_epi16(low, 15)), p,
                                u16s(0x8000u), 0xF8);  // a | (b & c)
  // Interleave low and high halves into fp32 lanes: qwords reordered so that each 128-bit
  // lane's low (high) half holds elements of the first (second) 16, then unpack.
  const __m512i order = _mm512_setr_epi64(0, 4, 1, 5, 2, 6, 3, 7);
  const __m512i l = _mm512_permutexvar_epi64(order, low);
  const __m512i h = _mm512_permutexvar_epi64(order, high);
  x0 = fVec(_mm512_castsi512_ps(_mm512_unpacklo_epi16(l, h)));
  x1 = fVec(_mm512_castsi512_ps(_mm512_unpackhi_epi16(l, h)));
  return rare;
}

// P, R[0, 32) <- split of x0, x1 (right where no bit is set in the returned mask).
MPF_INLINE u32 split32(const fVec& x0, const fVec& x1, u16* P, u16* R) {
  // The even (odd) 16-bit halves of 32 fp32 lanes: their low (high) halves, in order.
  const __m512i even = _mm512_setr_epi32(
      0x00020000, 0x00060004, 0x000A0008, 0x000E000C, 0x00120010, 0x00160014, 0x001A0018,
      0x001E001C, 0x00220020, 0x00260024, 0x002A0028, 0x002E002C, 0x00320030, 0x00360034,
      0x003A0038, 0x003E003C);
  const __m512i odd = _mm512_add_epi16(even, u16s(1));
  const __m512i a = _mm512_castps_si512(__m512(x0)), b = _mm512_castps_si512(__m512(x1));
  const __m512i low = _mm512_permutex2var_epi16(a, even, b);
  const __m512i high = _mm512_permutex2var_epi16(a, odd, b);
  const u32 rare =
      u32(_mm512_cmpgt_epu16_mask(_mm512_and_si512(high, u16s(0x7FFFu)), u16s(kInfHigh)) |
          _mm512_cmpeq_epi16_mask(low, u16s(0x8000u)));
  _mm512_storeu_si512(P, _mm512_add_epi16(high, _mm512_srli_epi16(low, 15)));
  _mm512_storeu_si512(R, low);
  return rare;
}

// x[j] for the rare elements j in m of a block at i: joined with their tie bits.
__attribute__((noinline, cold)) void join_rare(const CLeaf& L, std::int64_t i, u32 m, float* x) {
  const auto* P = static_cast<const u16*>(L.prim) + i;
  const auto* R = static_cast<const u16*>(L.aux) + i;
  for (; m; m &= m - 1) {
    const int j = __builtin_ctz(m);
    x[j] = join(P[j], R[j], tie_get(L.ties, i + j));
  }
}

// The elements m of a block at i split again with their tie bits: the rare ones and those
// whose bit was read at the load (it may be set: rewritten).
__attribute__((noinline, cold)) void split_rare(const CLeaf& L, std::int64_t i, u32 m,
                                                const float* x) {
  auto* P = static_cast<u16*>(L.prim) + i;
  auto* R = static_cast<u16*>(L.aux) + i;
  for (; m; m &= m - 1) {
    const int j = __builtin_ctz(m);
    tie_put(L.ties, i + j, split(x[j], P[j], R[j]));
  }
}

// fmix() and draw() on 16 lanes of element indices.
MPF_INLINE iVec fmix16(iVec x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, i32(0x85EBCA6Bu));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 13));
  x = _mm512_mullo_epi32(x, i32(0xC2B2AE35u));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}
// (first + j) * golden + key, mod 2**32, is first * golden + key (one scalar product per
// 16 lanes) plus the constant j * golden: one add where a vector multiply was.
MPF_INLINE iVec draw16(u32 key, u32 first) {
  constexpr u32 G = kGolden;
  const iVec jg = _mm512_setr_epi32(
      int(0 * G), int(1 * G), int(2 * G), int(3 * G), int(4 * G), int(5 * G), int(6 * G),
      int(7 * G), int(8 * G), int(9 * G), int(10 * G), int(11 * G), int(12 * G), int(13 * G),
      int(14 * G), int(15 * G));
  const iVec k = i32(key);
  return fmix16(_mm512_xor_si512(fmix16(_mm512_add_epi32(i32(first * G + key), jg)), k));
}

// The "stochastic" store on 16 lanes: 16 random bits added below the bf16 cut, truncated;
// NaN rounds as BF16::store rounds it.
MPF_INLINE void round16(const fVec& x, u32 key, u32 first, u16* P) {
  const iVec b = _mm512_castps_si512(__m512(x));
  const iVec t = _mm512_srli_epi32(
      _mm512_add_epi32(b, _mm512_and_si512(draw16(key, first), i32(0xFFFFu))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(__m512(x), __m512(x), _CMP_UNORD_Q);
  narrow16(_mm512_mask_mov_epi32(t, nan, i32(BF16::kNaN)), P);
}

struct SRemainder {  // bf16 params only
  // Returns the block's rare elements, whose tie bits the store rewrites.
  static MPF_INLINE u32 load(const CLeaf& L, std::int64_t i, fVec& p0, fVec& p1) {
    const auto* P = static_cast<const u16*>(L.prim) + i;
    const auto* R = static_cast<const u16*>(L.aux) + i;
    const u32 rare = join32(P, R, p0, p1);
    if (__builtin_expect(rare != 0, 0)) {
      alignas(64) float x[kBlock];
      p0.store(x);
      p1.store(x + kW);
      join_rare(L, i, rare, x);
      p0 = fVec::loadu(x);
      p1 = fVec::loadu(x + kW);
    }
    return rare;
  }
  static MPF_INLINE void store(const CLeaf& L, std::int64_t i, const fVec& p0, const fVec& p1,
                               u32 was) {
    auto* P = static_cast<u16*>(L.prim) + i;
    auto* R = static_cast<u16*>(L.aux) + i;
    const u32 m = split32(p0, p1, P, R) | was;
    if (__builtin_expect(m != 0, 0)) {
      alignas(64) float x[kBlock];
      p0.store(x);
      p1.store(x + kW);
      split_rare(L, i, m, x);
    }
  }
};

struct SStochastic {  // bf16 params only
  static MPF_INLINE u32 load(const CLeaf& L, std::int64_t i, fVec& p0, fVec& p1) {
    load2<BF16, true>(static_cast<const u16*>(L.prim) + i, kBlock, p0, p1);
    return 0;
  }
  static MPF_INLINE void store(const CLeaf& L, std::int64_t i, const fVec& p0, const fVec& p1,
                               u32) {
    auto* P = static_cast<u16*>(L.prim) + i;
    round16(p0, L.key, u32(i), P);
    round16(p1, L.key, u32(i + kW), P + kW);
  }
};
#endif

// State format piece: moment k of elements [i, i + kBlock), stored as X (F32 or BF16).
template <class X>
struct FMoment {
  static MPF_INLINE void load(const CLeaf& L, int k, std::int64_t i, fVec& a, fVec& b) {
    load2<X, true>(static_cast<const typename X::T*>(L.data[k]) + i, kBlock, a, b);
  }
  static MPF_INLINE void store(const CLeaf& L, int k, std::int64_t i, const fVec& a,
                               const fVec& b) {
    store2<X, true>(static_cast<typename X::T*>(L.data[k]) + i, kBlock, a, b);
  }
};

#if defined(CPU_CAPABILITY_AVX512)
// encode's phases 1 and 2 on NB consecutive blocks, the 8-bit and 4-bit formats alike
// (encode_scales on 16 lanes): which lanes are coded (ok: finite, and for unsigned moments
// not negative; keep: also not below kTiny), the magnitudes the scale covers (v: the value,
// or its sqrt for unsigned moments), and per block the bf16 scale (written to scale[j]) and
// the divisor its codes are made with (dd[j] in every lane: the scale, or 1 for an all-zero
// block, whose codes stay 0). Each phase runs over all NB blocks before the next, so the
// blocks' chains interleave.
template <bool kSigned, int NB>
MPF_INLINE void flags_and_scales(const __m512 (&x)[2 * NB], __mmask16 (&ok)[2 * NB],
                                 __mmask16 (&keep)[2 * NB], __m512 (&v)[2 * NB], u16* scale,
                                 __m512 (&dd)[NB]) {
  const __m512 tiny = _mm512_set1_ps(kTiny), zero = _mm512_setzero_ps();
  for (int h = 0; h < 2 * NB; ++h) {
    // finite: not a NaN (quiet 0x01, signalling 0x80) nor an infinity (0x08, 0x10).
    ok[h] = ~_mm512_fpclass_ps_mask(x[h], 0x99);
    if constexpr (!kSigned) ok[h] &= _mm512_cmp_ps_mask(x[h], _mm512_set1_ps(-kTiny), _CMP_GT_OQ);
    keep[h] = ok[h] & _mm512_cmp_ps_mask(_mm512_abs_ps(x[h]), tiny, _CMP_GE_OQ);
    v[h] = _mm512_maskz_mov_ps(keep[h], x[h]);
    if constexpr (!kSigned) v[h] = _mm512_sqrt_ps(v[h]);
  }
  // The block's scale in every lane, without leaving the registers: the largest
  // magnitude by a butterfly of maxima (the values are finite and non-negative, so the
  // order does not matter), clamped, and rounded to bf16 as BF16::store rounds a finite
  // value (ties to even, on the bits); its bf16 value is the rounded bits' top half.
  const __m512 one = _mm512_set1_ps(1.0f);
  __m512 mx[NB];
  for (int j = 0; j < NB; ++j) {
    mx[j] = _mm512_max_ps(_mm512_abs_ps(v[2 * j]), _mm512_abs_ps(v[2 * j + 1]));
  }
  for (int j = 0; j < NB; ++j) {
    mx[j] = _mm512_max_ps(mx[j], _mm512_shuffle_f32x4(mx[j], mx[j], _MM_SHUFFLE(1, 0, 3, 2)));
  }
  for (int j = 0; j < NB; ++j) {
    mx[j] = _mm512_max_ps(mx[j], _mm512_shuffle_f32x4(mx[j], mx[j], _MM_SHUFFLE(2, 3, 0, 1)));
  }
  for (int j = 0; j < NB; ++j) {
    mx[j] = _mm512_max_ps(mx[j], _mm512_permute_ps(mx[j], _MM_SHUFFLE(1, 0, 3, 2)));
  }
  for (int j = 0; j < NB; ++j) {
    mx[j] = _mm512_max_ps(mx[j], _mm512_permute_ps(mx[j], _MM_SHUFFLE(2, 3, 0, 1)));
  }
  for (int j = 0; j < NB; ++j) {
    const iVec mb = _mm512_castps_si512(_mm512_min_ps(mx[j], _mm512_set1_ps(kBF16Max)));
    const iVec rb = _mm512_and_si512(
        _mm512_add_epi32(_mm512_add_epi32(mb, i32(0x7FFFu)),
                         _mm512_and_si512(_mm512_srli_epi32(mb, 16), i32(1))),
        i32(0xFFFF0000u));
    scale[j] = u16(u32(_mm_cvtsi128_si32(_mm512_castsi512_si128(rb))) >> 16);
    const __m512 sf = _mm512_castsi512_ps(rb);
    // An all-zero block has scale 0; dividing by 1 instead keeps its codes 0.
    dd[j] = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(sf, zero, _CMP_GT_OQ), one, sf);
  }
}

// State format piece of the 8-bit moments: one fused block (kBlock = 32 elements) is one
// quantization block, so a block's codes and its scale are decoded into, and encoded from,
// two registers, with no table and no scratch. The decode tables are k / (levels' - |k|)
// (Tables: t / (2 - |t|) with t = k / levels), and one IEEE division gives every entry's
// fp32 bits (checked for all 510 entries in tests/test_native_composed.py), so each
// operation below is decode's or encode's own, on 16 lanes, in the same order.
struct FU8 {
  // Codes 0..31 of a block as two 16-lane int32 vectors.
  template <bool kSigned>
  static MPF_INLINE void codes(const void* p, iVec& c0, iVec& c1) {
    const __m256i raw = _mm256_loadu_si256(static_cast<const __m256i*>(p));
    const __m128i lo = _mm256_castsi256_si128(raw), hi = _mm256_extracti128_si256(raw, 1);
    if constexpr (kSigned) {
      c0 = _mm512_cvtepi8_epi32(lo);
      c1 = _mm512_cvtepi8_epi32(hi);
    } else {
      c0 = _mm512_cvtepu8_epi32(lo);
      c1 = _mm512_cvtepu8_epi32(hi);
    }
  }
  // The table's entry for 16 codes (signed: -127..127, the mark -128 -> NaN; unsigned:
  // 0..254, the mark 255 -> +inf).
  template <bool kSigned>
  static MPF_INLINE __m512 table(iVec c) {
    const __m512 k = _mm512_cvtepi32_ps(c);
    if constexpr (kSigned) {
      const __m512 den = _mm512_sub_ps(_mm512_set1_ps(254.0f), _mm512_abs_ps(k));
      const __m512 q = _mm512_div_ps(k, den);
      return _mm512_mask_mov_ps(q, _mm512_cmpeq_epi32_mask(c, i32(u32(-128))),
                                _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN()));
    } else {
      const __m512 q = _mm512_div_ps(k, _mm512_sub_ps(_mm512_set1_ps(508.0f), k));
      return _mm512_mask_mov_ps(q, _mm512_cmpeq_epi32_mask(c, i32(255)),
                                _mm512_set1_ps(std::numeric_limits<float>::infinity()));
    }
  }
  static MPF_INLINE __m512 flush16(__m512 y) {
    return _mm512_maskz_mov_ps(
        _mm512_cmp_ps_mask(_mm512_abs_ps(y), _mm512_set1_ps(kTiny), _CMP_NLT_UQ), y);
  }
  template <bool kSigned, bool kFlush>
  static MPF_INLINE __m512 value(iVec c, __m512 s) {
    __m512 y = _mm512_mul_ps(table<kSigned>(c), s);
    if constexpr (!kSigned) y = _mm512_mul_ps(y, y);
    return kFlush ? flush16(y) : y;
  }
  // Scales from which no decoded value of the block can be subnormal, so decode's flush
  // changes nothing: a nonzero code's table entry is at least 1/253 > 2**-8 (signed) or
  // 1/507 > 2**-9 (unsigned, then squared), and code 0 decodes to 0. (A NaN or negative
  // scale, never written but readable from a file, takes the flush.)
  static constexpr float kNoFlushS = 0x1.0p-117f;  // 2**-8 * 2**-117 > 2**-126
  static constexpr float kNoFlushU = 0x1.0p-53f;   // (2**-9 * 2**-53)**2 > 2**-126

  static MPF_INLINE void load(const CLeaf& L, int k, std::int64_t i, fVec& a, fVec& b) {
    const float f = BF16::load(L.scale[k][i / kQBlock]);
    iVec c0, c1;
    if (k == 0) {
      codes<true>(static_cast<const std::int8_t*>(L.data[k]) + i, c0, c1);
      const __m512 s = _mm512_set1_ps(f);
      if (f >= kNoFlushS) {
        a = fVec(value<true, false>(c0, s));
        b = fVec(value<true, false>(c1, s));
      } else {
        a = fVec(value<true, true>(c0, s));
        b = fVec(value<true, true>(c1, s));
      }
    } else {
      codes<false>(static_cast<const std::uint8_t*>(L.data[k]) + i, c0, c1);
      const __m512 s = _mm512_set1_ps(std::max(f, kTiny));  // decode's clamp
      if (f >= kNoFlushU) {
        a = fVec(value<false, false>(c0, s));
        b = fVec(value<false, false>(c1, s));
      } else {
        a = fVec(value<false, true>(c0, s));
        b = fVec(value<false, true>(c1, s));
      }
    }
  }

  // encode<kSigned, kNoise> on NB consecutive blocks (elements first.. first + 32 NB, scales
  // scale[0, NB)); returns the codes as 2 NB int32 vectors. The blocks' independent chains
  // are written phase by phase, interleaved, so that the core overlaps their latencies.
  template <bool kSigned, int NB>
  static MPF_INLINE void encode2(const __m512 (&x)[2 * NB], u32 key, std::int64_t first,
                                 u16* scale, iVec (&code)[2 * NB]) {
    constexpr float kLevels = kSigned ? 127.0f : 254.0f;
    const __m512 one = _mm512_set1_ps(1.0f);
    __mmask16 ok[2 * NB], keep[2 * NB];
    __m512 v[2 * NB], dd[NB];
    flags_and_scales<kSigned, NB>(x, ok, keep, v, scale, dd);
    // Three of encode's operations are left out here, each provably without effect on a
    // code (tests/test_native_u8_boundaries.py puts values on every decision boundary):
    // * the flush of y = v / dd: a y below 2**-126 gives t below 2**-125, whose codes
    //   (127 t and floor(254 t)) are 0 flushed or not, and whose square is flushed below;
    // * the flush of the square y * y: it is below 2**-126 only where lo = 0 (so a = 0)
    //   and keep is set (else v = 0), where a positive second moment is raised to code 1
    //   whether or not it rounded up;
    // * the signed clamp to [-127, 127] and the unsigned one from below (t >= 0 there):
    //   the scale is the block's largest magnitude rounded to bf16 (relative error
    //   <= 2**-9) or bf16's largest value (fp32's largest is 1.0039 times it), so |y| <=
    //   1.0039, |t| = 2|y| / (1 + |y|) <= 1.002 and |127 t| <= 127.25 rounds into range.
    for (int h = 0; h < 2 * NB; ++h) {
      const __m512 yj = _mm512_div_ps(v[h], dd[h / 2]);
      iVec c;
      if constexpr (kSigned) {
        const __m512 t = _mm512_div_ps(_mm512_add_ps(yj, yj), _mm512_add_ps(_mm512_abs_ps(yj), one));
        const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(t, _mm512_set1_ps(kLevels)),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        c = _mm512_mask_mov_epi32(_mm512_cvttps_epi32(r), ~ok[h], i32(u32(-128)));
      } else {
        // (y >= 0: |y| is y.)
        const __m512 t = _mm512_div_ps(_mm512_add_ps(yj, yj), _mm512_add_ps(yj, one));
        const __m512 xx = _mm512_min_ps(_mm512_mul_ps(t, _mm512_set1_ps(kLevels)),
                                        _mm512_set1_ps(kLevels - 1.0f));
        const iVec lo = _mm512_cvttps_epi32(
            _mm512_roundscale_ps(xx, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC));
        const __m512 lf = _mm512_cvtepi32_ps(lo);
        const __m512 l1 = _mm512_add_ps(lf, one);
        __m512 a = _mm512_div_ps(lf, _mm512_sub_ps(_mm512_set1_ps(508.0f), lf));
        __m512 b = _mm512_div_ps(l1, _mm512_sub_ps(_mm512_set1_ps(508.0f), l1));
        const __m512 val = _mm512_mul_ps(yj, yj);
        a = _mm512_mul_ps(a, a);
        b = _mm512_mul_ps(b, b);
        const iVec bits = draw16(key, u32(first + 16 * h));
        const __m512 u = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bits, 8)),
                                       _mm512_set1_ps(0x1.0p-24f));
        const __mmask16 up = _mm512_cmp_ps_mask(
            u, _mm512_div_ps(_mm512_sub_ps(val, a), _mm512_sub_ps(b, a)), _CMP_LT_OQ);
        c = _mm512_mask_add_epi32(lo, up, lo, i32(1));
        // A positive second moment never decodes to 0; non-finite values get the mark.
        c = _mm512_mask_max_epi32(c, keep[h], c, i32(1));
        c = _mm512_mask_mov_epi32(c, ~ok[h], i32(255));
      }
      code[h] = c;
    }
  }

  // One block: store_blocks<1>.
  static MPF_INLINE void store(const CLeaf& L, int k, std::int64_t i, const fVec& a,
                               const fVec& b) {
    const fVec y[2] = {a, b};
    store_blocks<1>(L, k, i, y);
  }
  // store() on the NB blocks from i, their encodes interleaved.
  template <int NB>
  static MPF_INLINE void store_blocks(const CLeaf& L, int k, std::int64_t i,
                                      const fVec (&y)[2 * NB]) {
    __m512 x[2 * NB];
    for (int h = 0; h < 2 * NB; ++h) x[h] = __m512(y[h]);
    iVec c[2 * NB];
    u16* scale = L.scale[k] + i / kQBlock;
    if (k == 0) {
      encode2<true, NB>(x, 0, i, scale, c);
    } else {
      encode2<false, NB>(x, L.vkey, i, scale, c);
    }
    auto* out = static_cast<std::uint8_t*>(L.data[k]) + i;
    for (int h = 0; h < 2 * NB; ++h) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16 * h), _mm512_cvtepi32_epi8(c[h]));
    }
  }
};
#endif

#if defined(CPU_CAPABILITY_AVX512)
// State format piece of the 4-bit moments: as FU8, one fused block is one quantization
// block, its 16 packed bytes decoded into two registers and encoded back from them. The
// 16-entry tables (Tables4) are one register each, indexed by a lane permute; every other
// operation is decode4's or encode4's own, on 16 lanes, in the same order, except the
// flushes and clamps that FU8 proves cannot change a code, left out by the same arguments
// for 7 and 14 levels (tests/test_native_u8_boundaries.py, the 4-bit cases).
struct FU4 {
  static MPF_INLINE __m512 table(bool is_signed) {
    return _mm512_load_ps(is_signed ? tables4().s : tables4().u);
  }
  // Scales from which no decoded value of the block can be subnormal, so decode4's flush
  // changes nothing: a nonzero code's entry is at least 1/13 > 2**-4 (signed) or
  // 1/27 > 2**-5 (unsigned, then squared); code 0 decodes to 0 and the marks to NaN and
  // +inf. (A NaN or negative scale takes the flush.)
  static constexpr float kNoFlushS = 0x1.0p-121f;  // 2**-4 * 2**-121 > 2**-126
  static constexpr float kNoFlushU = 0x1.0p-57f;   // (2**-5 * 2**-57)**2 > 2**-126

  template <bool kFlush>
  static MPF_INLINE void decode2(const iVec& n0, const iVec& n1, const __m512 T, const __m512 s,
                                 bool square, fVec& a, fVec& b) {
    __m512 y0 = _mm512_mul_ps(_mm512_permutexvar_ps(n0, T), s);
    __m512 y1 = _mm512_mul_ps(_mm512_permutexvar_ps(n1, T), s);
    if (square) {
      y0 = _mm512_mul_ps(y0, y0);
      y1 = _mm512_mul_ps(y1, y1);
    }
    a = fVec(kFlush ? FU8::flush16(y0) : y0);
    b = fVec(kFlush ? FU8::flush16(y1) : y1);
  }

  static MPF_INLINE void load(const CLeaf& L, int k, std::int64_t i, fVec& a, fVec& b) {
    const bool is_signed = k == 0;
    const float f = BF16::load(L.scale[k][i / kQBlock]);
    const __m128i raw = _mm_loadu_si128(
        reinterpret_cast<const __m128i*>(static_cast<const std::uint8_t*>(L.data[k]) + i / 2));
    const __m128i m = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(raw, m), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), m);
    // Elements 0..15 and 16..31: each byte's low nibble, then its high one.
    const iVec n0 = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi));
    const iVec n1 = _mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi));
    const __m512 T = table(is_signed);
    const __m512 s = _mm512_set1_ps(is_signed ? f : std::max(f, kTiny));  // decode4's clamp
    if (f >= (is_signed ? kNoFlushS : kNoFlushU)) {
      decode2<false>(n0, n1, T, s, !is_signed, a, b);
    } else {
      decode2<true>(n0, n1, T, s, !is_signed, a, b);
    }
  }

  // encode4<kSigned, !kSigned> on NB consecutive blocks (FU8::encode2's contract): the codes
  // as 2 NB int32 vectors. Left out, each without effect on a code (FU8's arguments): the
  // flush of y (a y below 2**-126 has t below 2**-125: code 0 signed, lo 0 unsigned with a
  // square of 0 either way); the flush of y * y (below 2**-126 only where lo = 0 and
  // keep is set, raised to code 1 whether or not it rounds up); the signed clamp (|y| <=
  // 1.0039, so |7 t| <= 7.014 rounds into range), the unsigned clamp from below (t >= 0)
  // and the masks of the table indices lo and lo + 1 (in 0..14).
  template <bool kSigned, int NB>
  static MPF_INLINE void encode2(const __m512 (&x)[2 * NB], u32 key, std::int64_t first,
                                 u16* scale, iVec (&code)[2 * NB]) {
    constexpr float kLevels = kSigned ? 7.0f : 14.0f;
    const __m512 one = _mm512_set1_ps(1.0f);
    __mmask16 ok[2 * NB], keep[2 * NB];
    __m512 v[2 * NB], dd[NB];
    flags_and_scales<kSigned, NB>(x, ok, keep, v, scale, dd);
    const __m512 T = table(kSigned);
    for (int h = 0; h < 2 * NB; ++h) {
      const __m512 y = _mm512_div_ps(v[h], dd[h / 2]);
      iVec c;
      if constexpr (kSigned) {
        const __m512 t = _mm512_div_ps(_mm512_add_ps(y, y), _mm512_add_ps(_mm512_abs_ps(y), one));
        const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(t, _mm512_set1_ps(kLevels)),
                                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        c = _mm512_mask_mov_epi32(_mm512_cvttps_epi32(r), ~ok[h], i32(u32(-8)));
      } else {
        // (y >= 0: |y| is y.)
        const __m512 t = _mm512_div_ps(_mm512_add_ps(y, y), _mm512_add_ps(y, one));
        const __m512 xx = _mm512_min_ps(_mm512_mul_ps(t, _mm512_set1_ps(kLevels)),
                                        _mm512_set1_ps(kLevels - 1.0f));
        const iVec lo = _mm512_cvttps_epi32(
            _mm512_roundscale_ps(xx, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC));
        __m512 a = _mm512_permutexvar_ps(lo, T);
        __m512 b = _mm512_permutexvar_ps(_mm512_add_epi32(lo, i32(1)), T);
        const __m512 value = _mm512_mul_ps(y, y);
        a = _mm512_mul_ps(a, a);
        b = _mm512_mul_ps(b, b);
        const iVec bits = draw16(key, u32(first + 16 * h));
        const __m512 u = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bits, 8)),
                                       _mm512_set1_ps(0x1.0p-24f));
        const __mmask16 up = _mm512_cmp_ps_mask(
            u, _mm512_div_ps(_mm512_sub_ps(value, a), _mm512_sub_ps(b, a)), _CMP_LT_OQ);
        c = _mm512_mask_add_epi32(lo, up, lo, i32(1));
        c = _mm512_mask_max_epi32(c, keep[h], c, i32(1));
        c = _mm512_mask_mov_epi32(c, ~ok[h], i32(15));
      }
      code[h] = c;
    }
  }

  // Two nibbles a byte, low first: 16-bit word j holds elements 2j and 2j + 1 as bytes.
  static MPF_INLINE __m128i pack8(iVec c) {
    const __m128i e = _mm512_cvtepi32_epi8(_mm512_and_si512(c, i32(15)));
    return _mm_and_si128(_mm_or_si128(e, _mm_srli_epi16(e, 4)), _mm_set1_epi16(0xFF));
  }

  // One block: store_blocks<1>.
  static MPF_INLINE void store(const CLeaf& L, int k, std::int64_t i, const fVec& a,
                               const fVec& b) {
    const fVec y[2] = {a, b};
    store_blocks<1>(L, k, i, y);
  }
  // store() on the NB blocks from i, their encodes interleaved.
  template <int NB>
  static MPF_INLINE void store_blocks(const CLeaf& L, int k, std::int64_t i,
                                      const fVec (&y)[2 * NB]) {
    __m512 x[2 * NB];
    for (int h = 0; h < 2 * NB; ++h) x[h] = __m512(y[h]);
    iVec c[2 * NB];
    u16* scale = L.scale[k] + i / kQBlock;
    if (k == 0) {
      encode2<true, NB>(x, 0, i, scale, c);
    } else {
      encode2<false, NB>(x, L.vkey, i, scale, c);
    }
    auto* out = static_cast<std::uint8_t*>(L.data[k]) + i / 2;
    for (int j = 0; j < NB; ++j) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16 * j),
                       _mm_packus_epi16(pack8(c[2 * j]), pack8(c[2 * j + 1])));
    }
  }
};
#endif

// How many blocks run_fused steps at a time (FS::store_blocks) where more than one:
// measured in one process against the previous builds (1 thread, 8M params, thread CPU
// time): 8-bit 2 (4 was no faster), 4-bit 4 (its encode is shorter; ~5-10% over 2).
template <class FS>
constexpr int kGroup = 1;
#if defined(CPU_CAPABILITY_AVX512)
template <>
constexpr int kGroup<FU8> = 2;
template <>
constexpr int kGroup<FU4> = 4;
#endif

// Whole blocks of [begin, end) inside the leaf's vector loop; returns where it stopped.
template <class S, class FS, class G, bool kAmsgrad>
std::int64_t run_fused(const CLeaf& L, std::int64_t begin, std::int64_t end, const Hyper& h) {
  const VHyper k(h, L.coef);
  const std::int64_t n = L.numel;
  const std::int64_t vec_end = std::min(end, n - n % kW);
  const auto* Gr = static_cast<const typename G::T*>(L.grad);
  std::int64_t i = begin;
  if constexpr (kGroup<FS> > 1) {
    // kGroup blocks a step: one block's chain (decode, math, scale, codes) is longer than
    // the core's window reaches, so several blocks' chains are written side by side.
    constexpr int kG = kGroup<FS>;
    for (; i + kG * kBlock <= vec_end; i += kG * kBlock) {
      fVec g[2 * kG], p[2 * kG], m[2 * kG], v[2 * kG], vm[2 * kG];
      u32 carry[kG];
      for (int j = 0; j < kG; ++j) {
        const std::int64_t o = i + j * kBlock;
        load2<G, true>(Gr + o, kBlock, g[2 * j], g[2 * j + 1]);
        carry[j] = S::load(L, o, p[2 * j], p[2 * j + 1]);
        FS::load(L, 0, o, m[2 * j], m[2 * j + 1]);
        FS::load(L, 1, o, v[2 * j], v[2 * j + 1]);
        if constexpr (kAmsgrad) FS::load(L, 2, o, vm[2 * j], vm[2 * j + 1]);
      }
      for (int q = 0; q < 2 * kG; ++q) {
        p[q] = vector_math<kAmsgrad>(g[q], p[q], m[q], v[q], vm[q], h, k);
      }
      FS::template store_blocks<kG>(L, 0, i, m);
      FS::template store_blocks<kG>(L, 1, i, v);
      if constexpr (kAmsgrad) FS::template store_blocks<kG>(L, 2, i, vm);
      for (int j = 0; j < kG; ++j) {
        S::store(L, i + j * kBlock, p[2 * j], p[2 * j + 1], carry[j]);
      }
    }
  }
  for (; i + kBlock <= vec_end; i += kBlock) {
    fVec g0, g1, p0, p1, m0, m1, v0, v1, vm0, vm1;
    load2<G, true>(Gr + i, kBlock, g0, g1);
    const u32 carry = S::load(L, i, p0, p1);
    FS::load(L, 0, i, m0, m1);
    FS::load(L, 1, i, v0, v1);
    if constexpr (kAmsgrad) FS::load(L, 2, i, vm0, vm1);
    p0 = vector_math<kAmsgrad>(g0, p0, m0, v0, vm0, h, k);
    p1 = vector_math<kAmsgrad>(g1, p1, m1, v1, vm1, h, k);
    FS::store(L, 0, i, m0, m1);
    FS::store(L, 1, i, v0, v1);
    if constexpr (kAmsgrad) FS::store(L, 2, i, vm0, vm1);
    S::store(L, i, p0, p1, carry);
  }
  return i;
}

using FusedFn = std::int64_t (*)(const CLeaf&, std::int64_t, std::int64_t, const Hyper&);

template <class S, class FS, class G>
FusedFn fused_ams(bool amsgrad) {
  return amsgrad ? &run_fused<S, FS, G, true> : &run_fused<S, FS, G, false>;
}

template <class S, class FS>
FusedFn fused_grad(c10::ScalarType grad, bool amsgrad) {
  switch (grad) {
    case c10::ScalarType::BFloat16:
      return fused_ams<S, FS, BF16>(amsgrad);
    case c10::ScalarType::Half:
      return fused_ams<S, FS, F16>(amsgrad);
    default:
      return fused_ams<S, FS, F32>(amsgrad);
  }
}

template <class S>
FusedFn fused_format(Format f, c10::ScalarType grad, bool amsgrad) {
  switch (f) {
    case kF32:
      return fused_grad<S, FMoment<F32>>(grad, amsgrad);
    case kBF16:
      return fused_grad<S, FMoment<BF16>>(grad, amsgrad);
#if defined(CPU_CAPABILITY_AVX512)
    case kU8:
      return fused_grad<S, FU8>(grad, amsgrad);
    case kU4:
      return fused_grad<S, FU4>(grad, amsgrad);
#endif
    default:
      return nullptr;
  }
}

// The fused path of a (strategy, format, grad dtype, param dtype), or null (tiles only).
// `out`: the dtype of the params "fp32" masters write, if any.
FusedFn pick_fused(Strategy s, Format f, c10::ScalarType grad, bool half, bool amsgrad,
                   std::optional<c10::ScalarType> out) {
  switch (s) {
    case kFP32:
      if (f == kF32) return nullptr;  // (adam_mixed_'s plain pass takes this pair)
      if (!out) return fused_format<SFp32<NoOut>>(f, grad, amsgrad);
      switch (*out) {
        case c10::ScalarType::BFloat16:
          return fused_format<SFp32<BF16>>(f, grad, amsgrad);
        case c10::ScalarType::Half:
          return fused_format<SFp32<F16>>(f, grad, amsgrad);
        default:
          return fused_format<SFp32<F32>>(f, grad, amsgrad);
      }
    case kNone:
      return half ? fused_format<SNearest<F16>>(f, grad, amsgrad)
                  : fused_format<SNearest<BF16>>(f, grad, amsgrad);
    case kKahan:
      return half ? fused_format<SKahan<F16>>(f, grad, amsgrad)
                  : fused_format<SKahan<BF16>>(f, grad, amsgrad);
#if defined(CPU_CAPABILITY_AVX512)
    case kRemainder:
      return fused_format<SRemainder>(f, grad, amsgrad);
    case kStochastic:
      return fused_format<SStochastic>(f, grad, amsgrad);
#endif
    default:
      return nullptr;
  }
}

void run_item(Strategy s, Format f, bool amsgrad, RangeFn math, FusedFn fused, const CLeaf& L,
              std::int64_t begin, std::int64_t end, const Hyper& h) {
  if (fused != nullptr) begin = fused(L, begin, end, h);
  if (begin >= end) return;
  alignas(64) float sp[kTile], sm[kTile], sv[kTile], svm[kTile];
  // Small tiles keep the scratch in L1 between load, math and store; the 8-bit
  // format's table phases run better on longer loops. Measured on Zen 4 (8M params,
  // ratio to torch's fused fp32 step, 1 / 2 threads): kahan + bf16 1.28x with
  // 1,024-element tiles, 0.87x / 0.67x with 256; uint8 5.1x with 1,024, 5.5x with 512.
  const std::int64_t tile = blocked(f) ? kTile : kSmallTile;
  for (std::int64_t b = begin; b < end; b += tile) {
    const std::int64_t e = std::min(end, b + tile);
    float* P = load_master(s, L, b, e, sp);
    float* M = load_state(f, true, L, 0, b, e, sm);
    float* V = load_state(f, false, L, 1, b, e, sv);
    float* VM = amsgrad ? load_state(f, false, L, 2, b, e, svm) : nullptr;
    // run_range indexes its streams by the element's place in the leaf (which decides
    // torch's loop form): pointers based so that index b lands on each tile's start.
    Leaf leaf;
    leaf.master = P - b;
    leaf.grad = L.grad;
    leaf.exp_avg = M - b;
    leaf.exp_avg_sq = V - b;
    leaf.max_exp_avg_sq = VM ? VM - b : nullptr;
    leaf.out = L.out;
    leaf.numel = L.numel;
    leaf.coef = L.coef;
    math(leaf, b, e, h);
    store_state(f, true, L, 0, b, e, M);
    store_state(f, false, L, 1, b, e, V);
    if (amsgrad) store_state(f, false, L, 2, b, e, VM);
    store_master(s, L, b, e, P);
  }
}

}  // namespace composed

// A leaf's metadata lives in scattered heap objects (each tensor's TensorImpl, StorageImpl
// and version counter). With many small leaves they are out of cache on every call (the
// step's data streams through it between calls), so a pass over them waits on dependent
// misses per tensor: the passes below ask for the objects of a leaf a few places ahead
// while they work on this one. Prefetches are hints only: they never fault, whatever the
// address.
MPF_INLINE void prefetch_impl(const at::Tensor& t) {
  const char* p = reinterpret_cast<const char*>(t.unsafeGetTensorImpl());
  __builtin_prefetch(p);
  __builtin_prefetch(p + 64);
  __builtin_prefetch(p + 128);
}
// What data_ptr() and bump_version() read behind the TensorImpl: the StorageImpl and the
// version counter (a VariableVersion is one intrusive_ptr; read as a raw pointer here for
// the hint alone).
static_assert(sizeof(c10::VariableVersion) == sizeof(void*), "VariableVersion: one pointer");
MPF_INLINE void prefetch_behind(const at::Tensor& t) {
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  __builtin_prefetch(impl->unsafe_storage().unsafeGetStorageImpl());
  __builtin_prefetch(*reinterpret_cast<void* const*>(&impl->version_counter()), 1);
}

// Calls fn(t) for every tensor of leaf i of a composed call's lists (sizes checked).
template <class Fn>
MPF_INLINE void for_leaf_tensors(std::size_t i, std::size_t n, bool aux, bool ties, bool out,
                                 std::size_t fields, bool blocked,
                                 const std::vector<at::Tensor>& prims,
                                 const std::vector<at::Tensor>& auxs,
                                 const std::vector<at::Tensor>& grads,
                                 const std::vector<std::vector<at::Tensor>>& data,
                                 const std::vector<std::vector<at::Tensor>>& scales,
                                 const std::vector<at::Tensor>& steps,
                                 const std::vector<at::Tensor>& params_out, const Fn& fn) {
  fn(prims[i]);
  if (aux) fn(auxs[i]);
  if (ties) fn(auxs[n + i]);
  fn(grads[i]);
  fn(steps[i]);
  if (out) fn(params_out[i]);
  for (std::size_t k = 0; k < fields; ++k) {
    fn(data[k][i]);
    if (blocked) fn(scales[k][i]);
  }
}

// The checks of a composed call (step_composed_, step_rule_): lists aligned by leaf, every
// tensor of a leaf with the master's shape and strides, the strategy's and state format's
// dtypes; `fields` state tensors per leaf, and per-leaf salts where `salted`. Run before
// anything is written.
void check_composed(const char* fn, composed::Strategy s, composed::Format f, std::size_t fields,
                    bool salted, const std::vector<at::Tensor>& prims,
                    const std::vector<at::Tensor>& auxs, const std::vector<at::Tensor>& grads,
                    const std::vector<std::vector<at::Tensor>>& data,
                    const std::vector<std::vector<at::Tensor>>& scales,
                    const std::vector<at::Tensor>& steps,
                    const std::vector<at::Tensor>& params_out,
                    const std::vector<std::int64_t>& salts,
                    const std::optional<at::Tensor>& lr_tensor,
                    const std::optional<at::Tensor>& grad_scale,
                    const std::optional<at::Tensor>& found_inf) {
  using namespace composed;
  const std::size_t n = prims.size();
  const bool has_aux = s == kRemainder || s == kKahan || s == kStochastic;
  const bool has_out = !params_out.empty();
  // "remainder": auxs holds the n remainders, then the n tie-bit tensors.
  const std::size_t n_aux = s == kRemainder ? 2 * n : n;
  TORCH_CHECK_VALUE(grads.size() == n && steps.size() == n && (!has_aux || auxs.size() == n_aux) &&
                        data.size() == fields && (!blocked(f) || scales.size() == fields) &&
                        (!has_out || (s == kFP32 && params_out.size() == n)) &&
                        (!salted || !blocked(f) || salts.size() == n),
                    fn, ": expected lists of one length, one per leaf");
  for (std::size_t k = 0; k < fields; ++k) {
    TORCH_CHECK_VALUE(data[k].size() == n && (!blocked(f) || scales[k].size() == n), fn,
                      ": expected one state tensor per leaf");
  }
  check_scalar("lr", lr_tensor);
  check_scalar("grad_scale", grad_scale);
  check_scalar("found_inf", found_inf, /*or_bool=*/true);
  // Draws, blocks and tie bits follow the index.
  const bool positional = s == kStochastic || blocked(f);
  const c10::ScalarType grad_dtype = n ? grads[0].scalar_type() : c10::ScalarType::Float;
  std::optional<c10::ScalarType> out_dtype;
  if (has_out && n) out_dtype = params_out[0].scalar_type();
  const c10::ScalarType state_dtype = f == kF32    ? c10::ScalarType::Float
                                      : f == kBF16 ? c10::ScalarType::BFloat16
                                                   : c10::ScalarType::Byte;
  for (std::size_t i = 0; i < n; ++i) {
    if (i + 2 < n) {
      for_leaf_tensors(i + 2, n, has_aux, s == kRemainder, has_out, fields, blocked(f), prims,
                       auxs, grads, data, scales, steps, params_out, prefetch_impl);
    }
    const at::Tensor& p = prims[i];
    const auto pt = p.scalar_type();
    const bool p_ok = s == kFP32 ? pt == c10::ScalarType::Float
                      : (s == kKahan || s == kNone)
                          ? (pt == c10::ScalarType::BFloat16 || pt == c10::ScalarType::Half)
                          : pt == c10::ScalarType::BFloat16;
    TORCH_CHECK_TYPE(p_ok && p.device().is_cpu() && p.layout() == c10::kStrided, fn, ": at [",
                     i, "]: the master's tensor does not fit the strategy: ", describe(p));
    TORCH_CHECK_VALUE(positional ? p.is_contiguous() : p.is_non_overlapping_and_dense(), fn,
                      ": at [", i, "]: expected a ", positional ? "contiguous" : "dense",
                      " master, got strides ", p.strides());
    // (``written``: the step writes it, so no inference tensor outside inference mode; a
    // grad is only read, and the torch path and the fp32 pass take one.)
    auto fits = [&](const char* what, const at::Tensor& t, std::optional<c10::ScalarType> dt,
                    bool like, bool written = true) {
      TORCH_CHECK_TYPE(t.device().is_cpu() && t.layout() == c10::kStrided &&
                           (!dt || t.scalar_type() == *dt),
                       fn, ": at [", i, "]: ", what, ": unexpected ", describe(t));
      if (like) {
        TORCH_CHECK_VALUE(t.sizes() == p.sizes() && same_strides(t, p), fn, ": at [", i, "]: ",
                          what, ": expected the master's shape and strides");
      }
      TORCH_CHECK_VALUE(!(written && t.is_inference() && !c10::InferenceMode::is_enabled()), fn,
                        ": at [", i, "]: ", what,
                        ": an inference tensor outside torch.inference_mode()");
    };
    if (s == kRemainder) {
      fits("remainder", auxs[i], c10::ScalarType::Short, true);
      const at::Tensor& t = auxs[n + i];
      fits("ties", t, c10::ScalarType::Byte, false);
      std::vector<std::int64_t> want(p.sizes().begin(), p.sizes().end());
      if (!want.empty()) want.back() = (want.back() + 7) / 8;
      TORCH_CHECK_VALUE(t.is_contiguous() && t.sizes() == c10::IntArrayRef(want) &&
                            p.dim() <= kTieDims,
                        fn, ": at [", i, "]: expected tie bits of shape ", c10::IntArrayRef(want),
                        " (contiguous; at most ", kTieDims, " dims), got ", describe(t),
                        " for a master of shape ", p.sizes());
    }
    if (s == kKahan) fits("compensation", auxs[i], pt, true);
    if (s == kStochastic) {
      fits("key", auxs[i], c10::ScalarType::Int, false);
      TORCH_CHECK_VALUE(auxs[i].numel() == 1, fn, ": at [", i, "]: expected a one-element key");
    }
    const at::Tensor& g = grads[i];
    TORCH_CHECK_TYPE(is_low_or_f32(g.scalar_type()) && g.scalar_type() == grad_dtype, fn,
                     ": at [", i, "]: grads: expected one float dtype, got ", describe(g));
    fits("grad", g, std::nullopt, true, /*written=*/false);
    if (has_out) {
      TORCH_CHECK_TYPE(params_out[i].scalar_type() == *out_dtype &&
                           is_low_or_f32(*out_dtype),
                       fn, ": at [", i, "]: params_out: unexpected ", describe(params_out[i]));
      fits("params_out", params_out[i], std::nullopt, true);
    }
    for (std::size_t k = 0; k < fields; ++k) {
      const at::Tensor& t = data[k][i];
      const auto want = blocked(f) && k == 0 ? c10::ScalarType::Char : state_dtype;
      if (f == kU4) {  // packed nibbles: flat, two elements a byte
        fits("state", t, want, false);
        TORCH_CHECK_VALUE(t.is_contiguous() && t.dim() == 1 && t.numel() == (p.numel() + 1) / 2,
                          fn, ": at [", i, "]: state: expected ", (p.numel() + 1) / 2,
                          " contiguous packed bytes, got shape ", t.sizes());
      } else {
        fits("state", t, want, true);
      }
      if (blocked(f)) {
        const at::Tensor& sc = scales[k][i];
        fits("scale", sc, c10::ScalarType::BFloat16, false);
        TORCH_CHECK_VALUE(sc.is_contiguous() && sc.numel() == (p.numel() + kQBlock - 1) / kQBlock,
                          fn, ": at [", i, "]: expected one scale per 32 elements");
      }
    }
    TORCH_CHECK_VALUE(steps[i].scalar_type() == c10::ScalarType::Float &&
                          steps[i].device().is_cpu() && steps[i].numel() == 1,
                      fn, ": at [", i, "]: expected a one-element float32 step count");
  }
}

// Version counters move as under torch's in-place ops (see adam_mixed_): leaf i's written
// tensors (`auxs` empty where the strategy has none).
MPF_INLINE void bump_leaf(std::size_t i, composed::Format f, std::size_t fields,
                          const std::vector<at::Tensor>& prims,
                          const std::vector<at::Tensor>& auxs,
                          const std::vector<at::Tensor>& steps,
                          const std::vector<at::Tensor>& params_out,
                          const std::vector<std::vector<at::Tensor>>& data,
                          const std::vector<std::vector<at::Tensor>>& scales) {
  const std::size_t n = prims.size();
  prims[i].unsafeGetTensorImpl()->bump_version();
  if (!auxs.empty()) auxs[i].unsafeGetTensorImpl()->bump_version();
  if (auxs.size() == 2 * n) auxs[n + i].unsafeGetTensorImpl()->bump_version();
  steps[i].unsafeGetTensorImpl()->bump_version();
  if (!params_out.empty()) params_out[i].unsafeGetTensorImpl()->bump_version();
  for (std::size_t k = 0; k < fields; ++k) {
    data[k][i].unsafeGetTensorImpl()->bump_version();
    if (composed::blocked(f)) scales[k][i].unsafeGetTensorImpl()->bump_version();
  }
}
void bump_composed(composed::Format f, std::size_t fields, const std::vector<at::Tensor>& prims,
                   const std::vector<at::Tensor>& auxs, const std::vector<at::Tensor>& steps,
                   const std::vector<at::Tensor>& params_out,
                   const std::vector<std::vector<at::Tensor>>& data,
                   const std::vector<std::vector<at::Tensor>>& scales) {
  const std::size_t n = prims.size();
  for (std::size_t i = 0; i < n; ++i) bump_leaf(i, f, fields, prims, auxs, steps, params_out, data, scales);
}

// _rng.advance: the next key of each "stochastic" leaf, so the next step draws fresh bits.
void advance_keys(const std::vector<at::Tensor>& auxs) {
  for (const at::Tensor& a : auxs) {
    auto* k = a.data_ptr<std::int32_t>();
    *k = std::int32_t(composed::fmix(u32(*k) + composed::kGolden));
  }
}

// step_composed_'s per-leaf arrays, one set per calling thread (see there).
struct ComposedScratch {
  static constexpr std::size_t kKeepLeaves = 1 << 16;
  std::vector<composed::CLeaf> leaves;
  std::vector<std::int64_t> numels;
  struct Release {  // gives large arrays back at the end of the call, however it ends
    ComposedScratch& s;
    std::size_t n;
    ~Release() {
      if (n > kKeepLeaves) {
        std::vector<composed::CLeaf>().swap(s.leaves);
        std::vector<std::int64_t>().swap(s.numels);
      }
    }
  };
};
ComposedScratch& composed_scratch() {
  thread_local ComposedScratch scratch;
  return scratch;
}

// The composed step's entry: lists aligned by leaf, as adam_mixed_ takes them, plus the
// strategy's second tensor (`auxs`: remainder, compensation or 0-d int32 key), the moments'
// scales for the 8-bit format, and each leaf's salt (its place in the tree) for the draws
// of the 8-bit second moments. mpfunc's planner checked the tree; these checks keep a
// wrong call from touching memory it does not own, and run before anything is written.
void step_composed_(std::int64_t strategy, std::int64_t format,
                    const std::vector<at::Tensor>& prims, const std::vector<at::Tensor>& auxs,
                    const std::vector<at::Tensor>& grads,
                    const std::vector<std::vector<at::Tensor>>& data,
                    const std::vector<std::vector<at::Tensor>>& scales,
                    const std::vector<at::Tensor>& steps,
                    const std::vector<at::Tensor>& params_out,
                    const std::vector<std::int64_t>& salts, double lr,
                    const std::optional<at::Tensor>& lr_tensor, double beta1, double beta2,
                    double eps, double weight_decay, bool decoupled, bool amsgrad, bool maximize,
                    const std::optional<at::Tensor>& grad_scale,
                    const std::optional<at::Tensor>& found_inf) {
  using namespace composed;
  constexpr const char* fn = "step_composed_";
  TORCH_CHECK_VALUE(strategy >= kFP32 && strategy <= kNone, fn, ": unknown strategy ", strategy);
  TORCH_CHECK_VALUE(format >= kF32 && format <= kU4, fn, ": unknown state format ", format);
  const auto s = static_cast<Strategy>(strategy);
  const auto f = static_cast<Format>(format);
  const std::size_t n = prims.size();
  const std::size_t fields = amsgrad ? 3 : 2;
  const bool has_aux = s == kRemainder || s == kKahan || s == kStochastic;
  const bool has_out = !params_out.empty();
  check_composed(fn, s, f, fields, /*salted=*/true, prims, auxs, grads, data, scales, steps,
                 params_out, salts, lr_tensor, grad_scale, found_inf);
  const c10::ScalarType grad_dtype = n ? grads[0].scalar_type() : c10::ScalarType::Float;
  std::optional<c10::ScalarType> out_dtype;
  if (has_out && n) out_dtype = params_out[0].scalar_type();

  if (found_inf && read_scalar(*found_inf) != 0.0f) return;

  const double lr_value = lr_tensor ? lr_tensor->item<double>() : lr;
  Hyper hyper{};
  hyper.beta2 = float(beta2);
  hyper.one_m_b2 = float(1 - beta2);
  hyper.eps = float(eps);
  hyper.wd = float(weight_decay);
  hyper.l2 = !decoupled && weight_decay != 0;
  hyper.decay = (decoupled && weight_decay != 0) ? float(1 - lr_value * weight_decay) : 1.0f;
  const float w = float(1 - beta1);
  hyper.lerp_small = std::fabs(w) < 0.5f;
  hyper.coeff = hyper.lerp_small ? w : w - 1.0f;
  hyper.w = w;
  hyper.one_m_w = 1.0f - w;
  hyper.has_scale = grad_scale.has_value();
  hyper.scale = grad_scale ? read_scalar(*grad_scale) : 1.0f;
  hyper.negate = maximize ? 0x80000000u : 0u;

  // The per-leaf arrays are kept by the thread from call to call (2.7 MB at 10,000 leaves,
  // which a fresh allocation would map, zero and fault in again every step); given back
  // after a call above kKeepLeaves leaves.
  ComposedScratch& scratch = composed_scratch();
  ComposedScratch::Release release{scratch, n};
  std::vector<CLeaf>& leaves = scratch.leaves;
  std::vector<std::int64_t>& numels = scratch.numels;
  leaves.resize(n);
  numels.resize(n);
  std::int64_t total = 0;
  double last_step = -1;
  LeafCoef last{};
  const std::vector<at::Tensor> no_auxs;
  const std::vector<at::Tensor>& bumped_auxs = has_aux ? auxs : no_auxs;
  for (std::size_t i = 0; i < n; ++i) {
    // (the checks above read every TensorImpl; this pass reads what lies behind them)
    if (i + 2 < n) {
      for_leaf_tensors(i + 2, n, has_aux, s == kRemainder, has_out, fields, blocked(f), prims,
                       auxs, grads, data, scales, steps, params_out, prefetch_behind);
    }
    bump_leaf(i, f, fields, prims, bumped_auxs, steps, params_out, data, scales);
    float* step_ptr = steps[i].data_ptr<float>();
    const float step = *step_ptr + 1.0f;
    *step_ptr = step;
    if (double(step) != last_step) {
      const double bc1 = 1 - std::pow(beta1, double(step));
      const double bc2 = 1 - std::pow(beta2, double(step));
      last.neg_step_size = float(-(lr_value / bc1));
      last.bc2_sqrt = float(std::sqrt(bc2));
      last_step = double(step);
    }
    CLeaf& L = leaves[i];
    L.prim = prims[i].data_ptr();
    L.aux = has_aux ? auxs[i].data_ptr() : nullptr;
    L.ties = s == kRemainder ? tie_map(prims[i], auxs[n + i]) : TieMap{};
    L.key = s == kStochastic ? u32(*auxs[i].data_ptr<std::int32_t>()) : 0u;
    L.half = prims[i].scalar_type() == c10::ScalarType::Half;
    L.grad = grads[i].data_ptr();
    L.out = has_out ? params_out[i].data_ptr() : nullptr;
    for (std::size_t k = 0; k < 3; ++k) {
      L.data[k] = k < fields ? data[k][i].data_ptr() : nullptr;
      L.scale[k] = blocked(f) && k < fields ? static_cast<u16*>(scales[k][i].data_ptr()) : nullptr;
    }
    // _state_format._keys: the step count (truncated to int32) mixed with the leaf's salt.
    L.vkey = blocked(f) ? fmix(u32(std::int32_t(step)) * kGolden + u32(salts[i])) : 0u;
    L.numel = prims[i].numel();
    L.coef = last;
    total += numels[i] = L.numel;
  }
  hyper.stream_out = g_stream_out && total >= kStreamFrom;
  const RangeFn math = pick(grad_dtype, has_out ? out_dtype : std::nullopt, amsgrad);
  // (MPFUNC_NATIVE_TILES=1: the tiles alone, to compare the two paths.)
  const char* tiles_env = std::getenv("MPFUNC_NATIVE_TILES");  // (read per call: a bench flips it)
  const bool tiles_only = tiles_env != nullptr && tiles_env[0] == '1';
  const auto out = has_out ? out_dtype : std::nullopt;
  const FusedFn fused_bf = tiles_only ? nullptr : pick_fused(s, f, grad_dtype, false, amsgrad, out);
  const FusedFn fused_h = tiles_only ? nullptr : pick_fused(s, f, grad_dtype, true, amsgrad, out);
  for_each_item(numels, total, [&](std::size_t i, std::int64_t b, std::int64_t e) {
    const CLeaf& L = leaves[i];
    run_item(s, f, amsgrad, math, L.half ? fused_h : fused_bf, L, b, e, hyper);
  });
  if (s == kStochastic) {  // advance_keys, through the pointers the setup read
    for (std::size_t i = 0; i < n; ++i) {
      if (i + 8 < n) __builtin_prefetch(leaves[i + 8].aux, 1);
      auto* k = static_cast<std::int32_t*>(leaves[i].aux);
      *k = std::int32_t(fmix(u32(*k) + kGolden));
    }
  }
}

// ---- SGD and Lion in the composed pass --------------------------------------------------------
//
// The same pieces as Adam's composed step (a strategy's load/store, a state format's
// load/store, the grads widened and unscaled in the loads), around another optimizer's
// math: `rule_math`, SGD's or Lion's element step. One state field at most (SGD's momentum
// buffer, Lion's exp_avg; SGD without momentum has none), a signed moment in the 8-bit format.
//
// Bits: the specification is the torch path, which runs `_sgd._foreach`/`_lion._foreach`
// (torch's foreach ops, one ATen kernel per op and tensor) on fp32 temporaries. Each op
// rounds once, and the ones that multiply and add are fused multiply-adds in every
// element of torch 2.9's AVX512 kernels, vector loop and tail alike (probed element by
// element at lengths 40 to 100,000, 1 and 2 threads): add(alpha=) is fma(other, alpha,
// self), addcmul(self, g, c) is fma(g, c, self), lerp(m, g, w) is fma(w, g - m, m) for
// |w| < 0.5, else fma(w - 1, g - m, g). The one exception: lerp's scalar form for
// |w| >= 0.5 is fma(-(g - m), 1 - w, g), which differs from the vector form only in the sign
// of a zero when w == 1 (beta == 0). ATen's lerp takes the scalar form on the last
// len % 16 elements of each part its TensorIterator splits a tensor into (one part below
// 32,768 elements or with one thread; else min(threads, ceil(n / 32768)) parts of
// ceil(n / parts)); `tail_of` says where those are, and the pass mirrors them. (16 with
// torch's AVX512, AVX2 and DEFAULT kernels alike, 1 to 5 threads. mpfunc probes each
// process's torch against this pass before using it: _native.serves.)

namespace composed {

enum Rule : std::int64_t { kSGD = 0, kLion = 1 };

// Per-call constants, each rounded to float as torch's ops round their Scalars.
struct RHyper {
  bool lion;
  bool has_scale;
  float scale;
  u32 negate;         // maximize
  bool lr_tensor;     // p - g * lr (torch.mul by the lr tensor, then sub)
  float lr;           // float(lr)
  float neg_lr;       // float(-lr): add(g, alpha=-lr)
  // SGD
  bool l2;            // weight_decay != 0: g = fma(p, wd, g)
  float wd;
  bool momentum_on, damp_on, nesterov;
  float momentum;
  // Lion
  bool decay_on;      // weight_decay != 0: p = p * decay
  float decay;        // float(1 - lr * wd), in double for a float lr, in float for a tensor lr
  bool small1, small2;       // |w| < 0.5 for w = 1 - beta1, 1 - beta2
  float w1, coeff1, one_m_w1, w2, coeff2, one_m_w2;
  bool positional;    // a lerp whose scalar form differs (w == 1): mirror torch's split
  std::int64_t threads;
};

struct RVec {
  fVec scale, lr, neg_lr, wd, momentum, damp, decay, w1, coeff1, one_m_w1, w2, coeff2, one_m_w2;
  RVec(const RHyper& h, float damp_coef)
      : scale(h.scale), lr(h.lr), neg_lr(h.neg_lr), wd(h.wd), momentum(h.momentum),
        damp(damp_coef), decay(h.decay), w1(h.w1), coeff1(h.coeff1), one_m_w1(h.one_m_w1),
        w2(h.w2), coeff2(h.coeff2), one_m_w2(h.one_m_w2) {}
};

// torch.lerp(m, g, w) in the vector form of ATen's kernel, or in its scalar form (kTail).
template <bool kTail>
MPF_INLINE fVec lerp(const fVec& m, const fVec& g, const fVec& d, bool small, const fVec& w,
                     const fVec& coeff, const fVec& one_m_w) {
  if (small) return at::vec::fmadd(w, d, m);
  return kTail ? at::vec::fmadd(d.neg(), one_m_w, g) : at::vec::fmadd(coeff, d, g);
}

// One element step of `_sgd._foreach` or `_lion._foreach`, op for op; returns the master.
template <bool kTail>
MPF_INLINE fVec rule_math(fVec g, fVec p, fVec& m, const RHyper& h, const RVec& k) {
  if (h.has_scale) g = g / k.scale;
  if (h.negate) g = g.neg();
  if (!h.lion) {
    if (h.l2) g = at::vec::fmadd(p, k.wd, g);
    if (h.momentum_on) {
      m = m * k.momentum;
      // addcmul(m, g, coef) with coef 1 on a leaf's first step: fma(g, 1, m) == m + g.
      m = h.damp_on ? at::vec::fmadd(g, k.damp, m) : m + g;
      g = h.nesterov ? at::vec::fmadd(m, k.momentum, g) : m;
    }
    return h.lr_tensor ? p - g * k.lr : at::vec::fmadd(g, k.neg_lr, p);
  }
  if (h.decay_on) p = p * k.decay;
  const fVec d = g - m;
  const fVec c = lerp<kTail>(m, g, d, h.small1, k.w1, k.coeff1, k.one_m_w1);
  // ATen's vector sign: (0 < c) - (c < 0); zeros and NaN give +0.
  const fVec zero(0.0f), one(1.0f);
  const fVec dir = fVec::blendv(zero, one, zero < c) - fVec::blendv(zero, one, c < zero);
  p = h.lr_tensor ? p - dir * k.lr : at::vec::fmadd(dir, k.neg_lr, p);
  m = lerp<kTail>(m, g, d, h.small2, k.w2, k.coeff2, k.one_m_w2);
  return p;
}

// The part of torch's split of an n-element op that holds element i: [part begin, part end)
// and where its scalar tail starts (see the section's note).
struct TailSpan {
  std::int64_t tail_begin, end;
};
MPF_INLINE TailSpan tail_of(std::int64_t n, std::int64_t threads, std::int64_t i) {
  constexpr std::int64_t kGrain = 32768;  // at::internal::GRAIN_SIZE
  std::int64_t parts = 1;
  if (n >= kGrain && threads > 1) parts = std::min(threads, (n + kGrain - 1) / kGrain);
  const std::int64_t c = (n + parts - 1) / parts;
  constexpr std::int64_t kLerpTail = 16;
  const std::int64_t b = i / c * c, e = std::min(n, b + c);
  return {e - (e - b) % kLerpTail, e};
}

// A state format piece with no state (SGD without momentum).
struct FNone {
  static MPF_INLINE void load(const CLeaf&, int, std::int64_t, fVec&, fVec&) {}
  static MPF_INLINE void store(const CLeaf&, int, std::int64_t, const fVec&, const fVec&) {}
};

struct RLeaf {
  CLeaf c;
  float damp;  // SGD's addcmul coefficient at this leaf's step
};

// Whole blocks of [begin, end) in the vector form, registers only; returns where it stopped.
template <class S, class FS, class G>
std::int64_t rule_fused(const RLeaf& R, std::int64_t begin, std::int64_t end, const RHyper& h) {
  const CLeaf& L = R.c;
  const RVec k(h, R.damp);
  const auto* Gr = static_cast<const typename G::T*>(L.grad);
  std::int64_t i = begin;
  for (; i + kBlock <= end; i += kBlock) {
    fVec g0, g1, p0, p1, m0, m1;
    load2<G, true>(Gr + i, kBlock, g0, g1);
    const u32 carry = S::load(L, i, p0, p1);
    FS::load(L, 0, i, m0, m1);
    p0 = rule_math<false>(g0, p0, m0, h, k);
    p1 = rule_math<false>(g1, p1, m1, h, k);
    FS::store(L, 0, i, m0, m1);
    S::store(L, i, p0, p1, carry);
  }
  return i;
}

using RuleFusedFn = std::int64_t (*)(const RLeaf&, std::int64_t, std::int64_t, const RHyper&);

template <class S, class FS>
RuleFusedFn rule_fused_grad(c10::ScalarType grad) {
  switch (grad) {
    case c10::ScalarType::BFloat16:
      return &rule_fused<S, FS, BF16>;
    case c10::ScalarType::Half:
      return &rule_fused<S, FS, F16>;
    default:
      return &rule_fused<S, FS, F32>;
  }
}

template <class S>
RuleFusedFn rule_fused_format(Format f, bool state, c10::ScalarType grad) {
  if (!state) return rule_fused_grad<S, FNone>(grad);
  switch (f) {
    case kF32:
      return rule_fused_grad<S, FMoment<F32>>(grad);
    case kBF16:
      return rule_fused_grad<S, FMoment<BF16>>(grad);
#if defined(CPU_CAPABILITY_AVX512)
    case kU8:
      return rule_fused_grad<S, FU8>(grad);
    case kU4:
      return rule_fused_grad<S, FU4>(grad);
#endif
    default:
      return nullptr;  // uint8 without AVX-512: the tiles
  }
}

// pick_fused's choice of strategy piece, for the rules.
RuleFusedFn rule_pick_fused(Strategy s, Format f, bool state, c10::ScalarType grad, bool half,
                            std::optional<c10::ScalarType> out) {
  switch (s) {
    case kFP32:
      if (!out) return rule_fused_format<SFp32<NoOut>>(f, state, grad);
      switch (*out) {
        case c10::ScalarType::BFloat16:
          return rule_fused_format<SFp32<BF16>>(f, state, grad);
        case c10::ScalarType::Half:
          return rule_fused_format<SFp32<F16>>(f, state, grad);
        default:
          return rule_fused_format<SFp32<F32>>(f, state, grad);
      }
    case kNone:
      return half ? rule_fused_format<SNearest<F16>>(f, state, grad)
                  : rule_fused_format<SNearest<BF16>>(f, state, grad);
    case kKahan:
      return half ? rule_fused_format<SKahan<F16>>(f, state, grad)
                  : rule_fused_format<SKahan<BF16>>(f, state, grad);
#if defined(CPU_CAPABILITY_AVX512)
    case kRemainder:
      return rule_fused_format<SRemainder>(f, state, grad);
    case kStochastic:
      return rule_fused_format<SStochastic>(f, state, grad);
#endif
    default:
      return nullptr;
  }
}

// Elements [b, e) on fp32 rows P and M (indexed by the element's place in the leaf), in one
// form; grads read as G, the "fp32" strategy's params refreshed from and written to O.
template <class G, class O, bool kTail>
void rule_rows(float* P, float* M, const void* grad, void* out, std::int64_t b, std::int64_t e,
               const RHyper& h, const RVec& k) {
  const auto* Gr = static_cast<const typename G::T*>(grad);
  auto* Ro = static_cast<typename O::T*>(out);
  auto block = [&](auto full, std::int64_t i, std::int64_t count) {
    constexpr bool kFull = decltype(full)::value;
    fVec g0, g1, p0, p1, m0(0.0f), m1(0.0f);
    load2<G, kFull>(Gr + i, count, g0, g1);
    load2<F32, kFull>(P + i, count, p0, p1);
    if (M != nullptr) load2<F32, kFull>(M + i, count, m0, m1);
    if constexpr (!std::is_void_v<typename O::T>) refresh<O, kFull>(Ro + i, count, p0, p1);
    p0 = rule_math<kTail>(g0, p0, m0, h, k);
    p1 = rule_math<kTail>(g1, p1, m1, h, k);
    store2<F32, kFull>(P + i, count, p0, p1);
    if (M != nullptr) store2<F32, kFull>(M + i, count, m0, m1);
    if constexpr (!std::is_void_v<typename O::T>) store2<O, kFull>(Ro + i, count, p0, p1);
  };
  std::int64_t i = b;
  for (; i + kBlock <= e; i += kBlock) block(std::true_type{}, i, kBlock);
  if (i < e) block(std::false_type{}, i, e - i);
}

using RowsFn = void (*)(float*, float*, const void*, void*, std::int64_t, std::int64_t,
                        const RHyper&, const RVec&);

template <class G, class O>
std::pair<RowsFn, RowsFn> rule_rows_out() {
  return {&rule_rows<G, O, false>, &rule_rows<G, O, true>};
}

template <class G>
std::pair<RowsFn, RowsFn> rule_rows_grad(std::optional<c10::ScalarType> out) {
  if (!out) return rule_rows_out<G, NoOut>();
  switch (*out) {
    case c10::ScalarType::BFloat16:
      return rule_rows_out<G, BF16>();
    case c10::ScalarType::Half:
      return rule_rows_out<G, F16>();
    default:
      return rule_rows_out<G, F32>();
  }
}

// (vector form, scalar form) row functions of a grad and params-out dtype.
std::pair<RowsFn, RowsFn> rule_pick_rows(c10::ScalarType grad, std::optional<c10::ScalarType> out) {
  switch (grad) {
    case c10::ScalarType::BFloat16:
      return rule_rows_grad<BF16>(out);
    case c10::ScalarType::Half:
      return rule_rows_grad<F16>(out);
    default:
      return rule_rows_grad<F32>(out);
  }
}

// Elements [begin, end) of one leaf: fused blocks where it can, tiles for the rest (the
// 8-bit format, partial blocks, and torch's scalar tails where they differ).
void rule_item(Strategy s, Format f, bool state, std::pair<RowsFn, RowsFn> rows,
               RuleFusedFn fused, const RLeaf& R, std::int64_t begin, std::int64_t end,
               const RHyper& h) {
  const CLeaf& L = R.c;
  const RVec k(h, R.damp);
  alignas(64) float sp[kTile], sm[kTile];
  // Tiles from `b`: block-aligned for the 8-bit format (items start at multiples of 64).
  auto tiles = [&](std::int64_t b, std::int64_t e) {
    const std::int64_t tile = blocked(f) ? kTile : kSmallTile;
    for (std::int64_t tb = b; tb < e; tb += tile) {
      const std::int64_t te = std::min(e, tb + tile);
      float* P = load_master(s, L, tb, te, sp) - tb;
      float* M = state ? load_state(f, true, L, 0, tb, te, sm) - tb : nullptr;
      for (std::int64_t i = tb; i < te;) {
        // (without a positional lerp every element takes the vector form)
        const TailSpan t = h.positional ? tail_of(L.numel, h.threads, i) : TailSpan{te, te};
        const bool tail = i >= t.tail_begin;
        const std::int64_t j = std::min(te, tail ? t.end : t.tail_begin);
        (tail ? rows.second : rows.first)(P, M, L.grad, L.out, i, j, h, k);
        i = j;
      }
      if (state) store_state(f, true, L, 0, tb, te, M + tb);
      store_master(s, L, tb, te, P + tb);
    }
  };
  // A positional tail (a lerp at weight 1) need not end on an 8-bit block, and the 8-bit
  // tiles must start on one: such a leaf takes the tiles alone.
  if (fused == nullptr || (blocked(f) && h.positional)) {
    tiles(begin, end);
    return;
  }
  for (std::int64_t i = begin; i < end;) {
    // Fused blocks up to the next scalar tail (or the item's end), then tiles to its end.
    const std::int64_t stop =
        h.positional ? std::min(end, tail_of(L.numel, h.threads, i).tail_begin) : end;
    i = fused(R, i, stop, h);
    const std::int64_t next = h.positional ? std::min(end, tail_of(L.numel, h.threads, i).end) : end;
    const std::int64_t upto = i < stop ? stop : next;
    tiles(i, upto);
    i = upto;
  }
}

}  // namespace composed

// SGD (rule 0: a = momentum, b = dampening) or Lion (rule 1: a = beta1, b = beta2) over any
// master strategy with no state, or one state field in fp32, bf16 or 8-bit: `_sgd._foreach` or
// `_lion._foreach` on the strategy's fp32 values, in one pass. Lists as step_composed_ takes
// them (`data`: zero or one state field).
void step_rule_(std::int64_t rule, std::int64_t strategy, std::int64_t format,
                const std::vector<at::Tensor>& prims, const std::vector<at::Tensor>& auxs,
                const std::vector<at::Tensor>& grads,
                const std::vector<std::vector<at::Tensor>>& data,
                const std::vector<std::vector<at::Tensor>>& scales,
                const std::vector<at::Tensor>& steps, const std::vector<at::Tensor>& params_out,
                double lr, const std::optional<at::Tensor>& lr_tensor, double a, double b,
                double weight_decay, bool nesterov, bool maximize,
                const std::optional<at::Tensor>& grad_scale,
                const std::optional<at::Tensor>& found_inf) {
  using namespace composed;
  constexpr const char* fn = "step_rule_";
  TORCH_CHECK_VALUE(rule == kSGD || rule == kLion, fn, ": unknown rule ", rule);
  TORCH_CHECK_VALUE(strategy >= kFP32 && strategy <= kNone, fn, ": unknown strategy ", strategy);
  TORCH_CHECK_VALUE(format >= kF32 && format <= kU4, fn, ": unknown state format ", format);
  const auto s = static_cast<Strategy>(strategy);
  const auto f = static_cast<Format>(format);
  const std::size_t n = prims.size();
  const std::size_t fields = data.size();
  TORCH_CHECK_VALUE(fields <= 1 && (rule == kSGD || fields == 1), fn,
                    ": expected at most one state field (Lion: one), got ", fields);
  const bool state = fields == 1;
  const bool has_aux = s == kRemainder || s == kKahan || s == kStochastic;
  const bool has_out = !params_out.empty();
  check_composed(fn, s, f, fields, /*salted=*/false, prims, auxs, grads, data, scales, steps,
                 params_out, {}, lr_tensor, grad_scale, found_inf);
  if (found_inf && read_scalar(*found_inf) != 0.0f) return;
  bump_composed(f, fields, prims, has_aux ? auxs : std::vector<at::Tensor>{}, steps, params_out,
                data, scales);

  RHyper h{};
  h.lion = rule == kLion;
  h.has_scale = grad_scale.has_value();
  h.scale = grad_scale ? read_scalar(*grad_scale) : 1.0f;
  h.negate = maximize ? 0x80000000u : 0u;
  h.lr_tensor = lr_tensor.has_value();
  const double lr_value = lr_tensor ? lr_tensor->item<double>() : lr;
  h.lr = float(lr_value);
  h.neg_lr = float(-lr_value);
  if (!h.lion) {
    h.l2 = weight_decay != 0;
    h.wd = float(weight_decay);
    h.momentum_on = a != 0;
    h.momentum = float(a);
    h.damp_on = b != 0;
    h.nesterov = nesterov;
  } else {
    h.decay_on = weight_decay != 0;
    // `1 - lr * wd`: Python's doubles for a float lr; torch's float32 ops on the 0-d lr.
    h.decay = lr_tensor ? 1.0f - float(h.lr * float(weight_decay))
                        : float(1 - lr_value * weight_decay);
    const float w1 = float(1 - a), w2 = float(1 - b);
    h.small1 = std::fabs(w1) < 0.5f;
    h.small2 = std::fabs(w2) < 0.5f;
    h.w1 = w1;
    h.coeff1 = w1 - 1.0f;
    h.one_m_w1 = 1.0f - w1;
    h.w2 = w2;
    h.coeff2 = w2 - 1.0f;
    h.one_m_w2 = 1.0f - w2;
    h.positional = (!h.small1 && w1 == 1.0f) || (!h.small2 && w2 == 1.0f);
  }
  h.threads = at::in_parallel_region() ? 1 : at::get_num_threads();

  std::vector<RLeaf> leaves(n);
  std::vector<std::int64_t> numels(n);
  std::int64_t total = 0;
  const float keep = float(1.0 - b);  // 1 - dampening in double, rounded once (as torch)
  for (std::size_t i = 0; i < n; ++i) {
    float* step_ptr = steps[i].data_ptr<float>();
    const float before = *step_ptr;
    *step_ptr = before + 1.0f;
    RLeaf& R = leaves[i];
    // _sgd's _dampened: m * fp32(1 - dampening) + (1 - m), m = min(step, 1) before the
    // increment (1 on the first step, exact for m in {0, 1}; NaN stays NaN).
    const float c = before != before ? before : std::min(before, 1.0f);
    R.damp = float(c * keep) + (1.0f - c);
    CLeaf& L = R.c;
    L.prim = prims[i].data_ptr();
    L.aux = has_aux ? auxs[i].data_ptr() : nullptr;
    L.ties = s == kRemainder ? tie_map(prims[i], auxs[n + i]) : TieMap{};
    L.key = s == kStochastic ? u32(*auxs[i].data_ptr<std::int32_t>()) : 0u;
    L.half = prims[i].scalar_type() == c10::ScalarType::Half;
    L.grad = grads[i].data_ptr();
    L.out = has_out ? params_out[i].data_ptr() : nullptr;
    for (std::size_t k = 0; k < 3; ++k) {
      L.data[k] = k < fields ? data[k][i].data_ptr() : nullptr;
      L.scale[k] = blocked(f) && k < fields ? static_cast<u16*>(scales[k][i].data_ptr()) : nullptr;
    }
    L.vkey = 0;
    L.numel = prims[i].numel();
    L.coef = LeafCoef{};
    total += numels[i] = L.numel;
  }
  const c10::ScalarType grad_dtype = n ? grads[0].scalar_type() : c10::ScalarType::Float;
  std::optional<c10::ScalarType> out;
  if (has_out && n) out = params_out[0].scalar_type();
  const auto rows = rule_pick_rows(grad_dtype, out);
  const char* tiles_env = std::getenv("MPFUNC_NATIVE_TILES");
  const bool tiles_only = tiles_env != nullptr && tiles_env[0] == '1';
  const RuleFusedFn fused_bf =
      tiles_only ? nullptr : rule_pick_fused(s, f, state, grad_dtype, false, out);
  const RuleFusedFn fused_h =
      tiles_only ? nullptr : rule_pick_fused(s, f, state, grad_dtype, true, out);
  for_each_item(numels, total, [&](std::size_t i, std::int64_t b, std::int64_t e) {
    const RLeaf& R = leaves[i];
    rule_item(s, f, state, rows, R.c.half ? fused_h : fused_bf, R, b, e, h);
  });
  if (s == kStochastic) advance_keys(auxs);
}

// ---- conversions on their own ---------------------------------------------------------

template <class From, class To>
void convert_range(const void* src, void* dst, std::int64_t begin, std::int64_t end) {
  const auto* __restrict__ S = static_cast<const typename From::T*>(src);
  auto* __restrict__ D = static_cast<typename To::T*>(dst);
  for (std::int64_t i = begin; i < end; ++i) D[i] = To::store(From::load(S[i]));
}

// dst <- src with the kernel's own conversions: float32 -> bfloat16/float16 rounds as the
// step's params_out does, bfloat16/float16 -> float32 widens as it reads grads. Both
// contiguous, same number of elements. Exposed for tests and for strategies that split
// or join masters with the same rounding.
void convert_(const at::Tensor& src, const at::Tensor& dst) {
  constexpr const char* fn = "convert_";
  TORCH_CHECK_VALUE(src.device().is_cpu() && dst.device().is_cpu() && src.is_contiguous() &&
                        dst.is_contiguous() && src.numel() == dst.numel(),
                    fn, ": expected contiguous CPU tensors of equal numel");
  using Fn = void (*)(const void*, void*, std::int64_t, std::int64_t);
  const auto s = src.scalar_type(), d = dst.scalar_type();
  Fn f = nullptr;
  if (s == c10::ScalarType::Float && d == c10::ScalarType::BFloat16) f = &convert_range<F32, BF16>;
  if (s == c10::ScalarType::Float && d == c10::ScalarType::Half) f = &convert_range<F32, F16>;
  if (s == c10::ScalarType::BFloat16 && d == c10::ScalarType::Float) f = &convert_range<BF16, F32>;
  if (s == c10::ScalarType::Half && d == c10::ScalarType::Float) f = &convert_range<F16, F32>;
  TORCH_CHECK_TYPE(f != nullptr, fn, ": expected float32 -> bfloat16/float16 or back, got ",
                   dtype_name(s), " -> ", dtype_name(d));
  dst.unsafeGetTensorImpl()->bump_version();
  const void* sp = src.data_ptr();
  void* dp = dst.data_ptr();
  at::parallel_for(0, src.numel(), kChunk,
                   [&](std::int64_t b, std::int64_t e) { f(sp, dp, b, e); });
}

// ---- grouped casts ----------------------------------------------------------------------
// dst[i] <- src[i] between float32 and bfloat16/float16, as Tensor.to / copy_ compute it:
// every element goes through ATen's Vectorized conversions (full or partial vectors),
// which torch's copy kernel runs on the same elements. What makes it faster than
// torch._foreach_copy_ (a loop of copy_ calls, each a TensorIterator and a parallel_for
// of its own): one parallel region for the whole list, split by elements; and, from
// kStreamFrom elements on, non-temporal stores, which skip reading each destination
// line before overwriting it (a plain store's read-for-ownership: 4 of a widening's
// 10 bytes per element, 2 of a narrowing's 8).

template <class X>
MPF_INLINE void stream_f32(float* p, const fVec& a, const fVec& b) {
#if defined(CPU_CAPABILITY_AVX512)
  _mm512_stream_ps(p, __m512(a));
  _mm512_stream_ps(p + kW, __m512(b));
#elif defined(CPU_CAPABILITY_AVX2)
  _mm256_stream_ps(p, __m256(a));
  _mm256_stream_ps(p + kW, __m256(b));
#else
  a.store(p);
  b.store(p + kW);
#endif
}

template <class From, class To>
void cast_range(const void* src, void* dst, std::int64_t begin, std::int64_t end, bool stream) {
  const auto* S = static_cast<const typename From::T*>(src);
  auto* D = static_cast<typename To::T*>(dst);
  std::int64_t i = begin;
  fVec a, b;
  if constexpr (kCanStream) {
    // Streaming stores need the destination block aligned to a whole vector.
    constexpr std::uintptr_t kAlign = sizeof(fVec);
    if (stream && reinterpret_cast<std::uintptr_t>(D + begin) % kAlign == 0) {
      for (; i + kBlock <= end; i += kBlock) {
        load2<From, true>(S + i, kBlock, a, b);
        if constexpr (std::is_same_v<To, F32>) {
          stream_f32<To>(D + i, a, b);
        } else {
          stream2<To>(D + i, a, b);
        }
      }
      stream_fence();
    }
  }
  for (; i + kBlock <= end; i += kBlock) {
    load2<From, true>(S + i, kBlock, a, b);
    store2<To, true>(D + i, kBlock, a, b);
  }
  if (i < end) {
    load2<From, false>(S + i, end - i, a, b);
    store2<To, false>(D + i, end - i, a, b);
  }
}

void cast_(const std::vector<at::Tensor>& dsts, const std::vector<at::Tensor>& srcs) {
  constexpr const char* fn = "cast_";
  TORCH_CHECK_VALUE(dsts.size() == srcs.size(), fn, ": expected lists of equal length, got ",
                    dsts.size(), " and ", srcs.size());
  const std::size_t n = dsts.size();
  if (n == 0) return;
  const auto s = srcs[0].scalar_type(), d = dsts[0].scalar_type();
  using Fn = void (*)(const void*, void*, std::int64_t, std::int64_t, bool);
  Fn f = nullptr;
  if (s == c10::ScalarType::Float && d == c10::ScalarType::BFloat16) f = &cast_range<F32, BF16>;
  if (s == c10::ScalarType::Float && d == c10::ScalarType::Half) f = &cast_range<F32, F16>;
  if (s == c10::ScalarType::BFloat16 && d == c10::ScalarType::Float) f = &cast_range<BF16, F32>;
  if (s == c10::ScalarType::Half && d == c10::ScalarType::Float) f = &cast_range<F16, F32>;
  TORCH_CHECK_TYPE(f != nullptr, fn, ": expected float32 -> bfloat16/float16 or back, got ",
                   dtype_name(s), " -> ", dtype_name(d));
  std::vector<std::int64_t> numels(n);
  std::int64_t total = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const at::Tensor &src = srcs[i], &dst = dsts[i];
    TORCH_CHECK_TYPE(src.scalar_type() == s && dst.scalar_type() == d && src.device().is_cpu() &&
                         dst.device().is_cpu() && src.layout() == c10::kStrided &&
                         dst.layout() == c10::kStrided,
                     fn, ": at [", i, "]: expected strided CPU tensors ", dtype_name(s), " -> ",
                     dtype_name(d), ", got ", describe(src), " -> ", describe(dst));
    // Memory order is index order only when both are dense with one stride.
    TORCH_CHECK_VALUE(src.sizes() == dst.sizes() && src.strides() == dst.strides() &&
                          dst.is_non_overlapping_and_dense(),
                      fn, ": at [", i, "]: expected two dense tensors of one shape and stride");
    TORCH_CHECK_VALUE(!(dst.is_inference() && !c10::InferenceMode::is_enabled()), fn, ": at [",
                      i, "]: expected a tensor that can be updated in place, got an inference ",
                      "tensor outside torch.inference_mode()");
    total += numels[i] = dst.numel();
  }
  for (const at::Tensor& t : dsts) t.unsafeGetTensorImpl()->bump_version();
  const bool stream = g_stream_out && total >= kStreamFrom;
  for_each_item(numels, total, [&](std::size_t i, std::int64_t b, std::int64_t e) {
    f(srcs[i].data_ptr(), dsts[i].data_ptr(), b, e, stream);
  });
}

// Sets the benchmark knobs; returns the previous (chunk, stream_out). chunk is rounded
// down to a multiple of 64 elements (so no two work items share a cache line).
std::tuple<std::int64_t, bool> tune(std::int64_t chunk, bool stream_out) {
  TORCH_CHECK_VALUE(chunk >= 64, "_tune: chunk must be at least 64, got ", chunk);
  const auto before = std::make_tuple(g_chunk, g_stream_out);
  g_chunk = chunk / 64 * 64;
  g_stream_out = stream_out;
  return before;
}

}  // namespace
}  // namespace mpfunc_native

// The memo key of a list of pytree leaves (mpfunc/core/_checks.py, ``leaf_keys``): per leaf,
// one byte for None, else the tensor's exact type (Tensor or Parameter), dtype, device,
// ndim, sizes, strides, address, storage size and the inference/negative/conjugate
// flags, packed (each record delimits itself, so equal bytes
// mean equal metadata). None where a leaf is anything else: a subclass or another object,
// not strided, without storage, or on a device other than the CPU and CUDA. 40-100 ns a
// tensor at 10,000 leaves between steps (metadata out of cache; 100-1,300 ns before the
// prefetches below, uint4 state the worst) where the same tuple built in Python costs ~700 ns.
namespace mpfunc_native {
py::object meta_key(py::handle leaves) {
  PyObject* seq = leaves.ptr();
  if (!PyList_Check(seq)) return py::none();
  const Py_ssize_t n = PyList_GET_SIZE(seq);
  std::string out;
  out.reserve(static_cast<size_t>(n) * 56);
  auto put = [&out](int64_t v) { out.append(reinterpret_cast<const char*>(&v), sizeof v); };
  // Each tensor costs two dependent cache misses where its metadata is cold (at 10,000
  // leaves, after every step): its TensorImpl, then its StorageImpl (the address and the
  // storage size). So the loop asks for them ahead, in three stages: the Python object 16
  // places ahead, its TensorImpl 8 ahead, its StorageImpl 4 ahead (prefetches never fault).
  auto impl_at = [seq](Py_ssize_t j) -> const c10::TensorImpl* {
    PyObject* o = PyList_GET_ITEM(seq, j);
    return THPVariable_CheckExact(o) ? THPVariable_Unpack(o).unsafeGetTensorImpl() : nullptr;
  };
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (i + 16 < n) __builtin_prefetch(PyList_GET_ITEM(seq, i + 16));
    if (i + 8 < n) {
      if (const auto* p = reinterpret_cast<const char*>(impl_at(i + 8))) {
        __builtin_prefetch(p);
        __builtin_prefetch(p + 64);
        __builtin_prefetch(p + 128);
      }
    }
    if (i + 4 < n) {
      if (const c10::TensorImpl* p = impl_at(i + 4)) {
        const char* st = reinterpret_cast<const char*>(p->unsafe_storage().unsafeGetStorageImpl());
        __builtin_prefetch(st);
        __builtin_prefetch(st + 64);
      }
    }
    PyObject* obj = PyList_GET_ITEM(seq, i);
    if (obj == Py_None) {
      out.push_back(0);
      continue;
    }
    if (!THPVariable_CheckExact(obj)) return py::none();
    const at::Tensor& t = THPVariable_Unpack(obj);
    if (t.layout() != at::kStrided || !t.has_storage()) return py::none();
    const c10::Device dev = t.device();
    if (!(dev.is_cpu() || dev.is_cuda())) return py::none();
    out.push_back(Py_TYPE(obj) == reinterpret_cast<PyTypeObject*>(ParameterClass) ? 2 : 1);
    out.push_back(static_cast<char>(t.scalar_type()));
    out.push_back(static_cast<char>(dev.type()));
    out.push_back(static_cast<char>(dev.index()));
    put(t.dim());
    for (int64_t s : t.sizes()) put(s);
    for (int64_t s : t.strides()) put(s);
    put(static_cast<int64_t>(reinterpret_cast<intptr_t>(t.data_ptr())));
    // What a check may refuse although nothing above changed: a storage freed or shrunk
    // and reallocated at the same address, an inference tensor at a tensor's old address,
    // a negative or conjugate view of the same memory.
    put(static_cast<int64_t>(t.storage().nbytes()));
    out.push_back(static_cast<char>(int(t.is_inference()) | int(t.is_neg()) << 1 |
                                    int(t.is_conj()) << 2));
  }
  return py::bytes(out);
}
}  // namespace mpfunc_native

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "mpfunc's native CPU kernels (see mpfunc/backends/_native.py)";
  // The GIL is released once the lists are converted (the vectors hold the tensors),
  // as torch's own ops do, so other Python threads run during the step.
  m.def("adam_mixed_", &mpfunc_native::adam_mixed_,
        "One-pass Adam/AdamW over fp32 masters with low-precision grads in and params out",
        py::call_guard<py::gil_scoped_release>());
  m.def("step_composed_", &mpfunc_native::step_composed_,
        "One-pass Adam/AdamW over any master strategy with fp32, bf16 or 8-bit moments",
        py::call_guard<py::gil_scoped_release>());
  m.def("step_rule_", &mpfunc_native::step_rule_,
        "One-pass SGD or Lion over any master strategy with no, fp32, bf16 or 8-bit state",
        py::call_guard<py::gil_scoped_release>());
  m.def("convert_", &mpfunc_native::convert_, "dst <- src with the kernel's own rounding",
        py::call_guard<py::gil_scoped_release>());
  m.def("cast_", &mpfunc_native::cast_,
        "dst[i] <- src[i] between float32 and bfloat16/float16, as Tensor.to rounds",
        py::call_guard<py::gil_scoped_release>());
  m.def("meta_key", &mpfunc_native::meta_key,
        "The memo key of a list of leaves as bytes, or None where one may not be remembered");
  m.def("_tune", &mpfunc_native::tune, "Benchmark knobs: (chunk, stream_out) -> previous");
  m.attr("CHUNK") = mpfunc_native::kChunk;
}
