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
//     conversions are the code Tensor.to runs; the scalar tail's conversions are written
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
#include <cstring>
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
// bfloat16/float16 conversions are the very code torch's kernels and Tensor.to run.

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
    const auto x = at::vec::convert_from_float<typename VecOf<X>::T>(a, b);
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
  const auto x = at::vec::convert_from_float<typename VecOf<X>::T>(a, b);
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
    if (has_out) s.out = at::empty_like(s.master, params_out[i].options());
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

// The memo key of a list of pytree leaves (mpfunc/_checks.py, ``leaf_keys``): per leaf,
// one byte for None, else the tensor's exact type (Tensor or Parameter), dtype, device,
// ndim, sizes, strides and address, packed (each record delimits itself, so equal bytes
// mean equal metadata). None where a leaf is anything else: a subclass or another object,
// not strided, without storage, or on a device other than the CPU and CUDA. About 30 ns a
// tensor where the same tuple built in Python costs ~700 ns.
namespace mpfunc_native {
py::object meta_key(py::handle leaves) {
  PyObject* seq = leaves.ptr();
  if (!PyList_Check(seq)) return py::none();
  const Py_ssize_t n = PyList_GET_SIZE(seq);
  std::string out;
  out.reserve(static_cast<size_t>(n) * 56);
  auto put = [&out](int64_t v) { out.append(reinterpret_cast<const char*>(&v), sizeof v); };
  for (Py_ssize_t i = 0; i < n; ++i) {
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
  }
  return py::bytes(out);
}
}  // namespace mpfunc_native

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "mpfunc's native CPU kernels (see mpfunc/_native.py)";
  // The GIL is released once the lists are converted (the vectors hold the tensors),
  // as torch's own ops do, so other Python threads run during the step.
  m.def("adam_mixed_", &mpfunc_native::adam_mixed_,
        "One-pass Adam/AdamW over fp32 masters with low-precision grads in and params out",
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
