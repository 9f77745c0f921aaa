// Tandem's CPU kernels, float32: decode attention read in place from the paged KV cache,
// and the fused small ops around it (RMSNorm with the residual add, rotary embedding with
// the KV cache write). Each replaces several torch ops: at decode batch sizes
// the Python and dispatch cost between ops was a tenth or more of a step. And a linear
// layer for a few rows (small_linear), near the memory bandwidth where the GEMM libraries
// are not.
//
// Built and loaded at run time by shared/model/cpu_kernels.py (which says why).
//
// Attention: one query token per sequence. Each sequence is one task: it walks its blocks through its
// block table, scores every key against the query heads that share each KV head
// (grouped-query attention), takes the softmax, and sums the values. Keys and values are
// read once, where they lie; nothing is gathered into a copy first (the gather and the
// attention over the copy were 22% of a decode step: docs/benchmarks-log.md).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

// Sixteen floats as one value: one AVX-512 register, or two AVX2 ones (GCC's vector
// extension; -march=native picks the instructions). aligned(4): rows need not be 64-aligned.
typedef float v16 __attribute__((vector_size(64), aligned(4)));
constexpr int64_t kWidth = 16;
constexpr int64_t kMaxQueryHeads = 256;
constexpr int64_t kMaxDim = 256;  // head dim, a multiple of kWidth

inline float hsum(v16 x) {
  float s = 0.f;
  for (int i = 0; i < kWidth; ++i) s += x[i];
  return s;
}

// One sequence, every head: scores of its `n` keys against each query head, softmax, and
// the weighted sums of the values, into out[query_heads][dim]. A token's keys (or values)
// for all KV heads are one contiguous row, read whole and once: a task per (sequence, KV
// head) reading its head's slice of each row ran at half the speed (the prefetchers
// fetched each row once per head).
void attend_sequence(const float* __restrict q, int64_t kv_heads, int64_t rep, int64_t dim,
                     const int64_t* blocks, int64_t n, const float* __restrict kbase,
                     const float* __restrict vbase, int64_t block_size, int64_t block_stride,
                     int64_t token_stride, float scale, float* __restrict scores,
                     v16* __restrict acc, float* __restrict out) {
  const int64_t lanes = dim / kWidth, qheads = kv_heads * rep;
  const v16* qv = reinterpret_cast<const v16*>(q);
  for (int64_t t = 0; t < n; ++t) {  // pass 1: each key row once, against every query head
    const float* row =
        kbase + blocks[t / block_size] * block_stride + (t % block_size) * token_stride;
    for (int64_t h = 0; h < kv_heads; ++h) {
      const v16* k = reinterpret_cast<const v16*>(row + h * dim);
      for (int64_t r = 0; r < rep; ++r) {
        const v16* qr = qv + (h * rep + r) * lanes;
        v16 sum = qr[0] * k[0];
        for (int64_t i = 1; i < lanes; ++i) sum += qr[i] * k[i];
        scores[(h * rep + r) * n + t] = hsum(sum) * scale;
      }
    }
  }
  float inv[kMaxQueryHeads];
  for (int64_t j = 0; j < qheads; ++j) {  // softmax per query head
    float* s = scores + j * n;
    float m = s[0];
    for (int64_t t = 1; t < n; ++t) m = std::max(m, s[t]);
    float z = 0.f;
    for (int64_t t = 0; t < n; ++t) {
      s[t] = std::exp(s[t] - m);
      z += s[t];
    }
    inv[j] = 1.f / z;
  }
  for (int64_t i = 0; i < qheads * lanes; ++i) acc[i] = v16{};
  for (int64_t t = 0; t < n; ++t) {  // pass 2: each value row once
    const float* row =
        vbase + blocks[t / block_size] * block_stride + (t % block_size) * token_stride;
    for (int64_t h = 0; h < kv_heads; ++h) {
      const v16* v = reinterpret_cast<const v16*>(row + h * dim);
      for (int64_t r = 0; r < rep; ++r) {
        const int64_t j = h * rep + r;
        const float p = scores[j * n + t];
        for (int64_t i = 0; i < lanes; ++i) acc[j * lanes + i] += p * v[i];
      }
    }
  }
  for (int64_t j = 0; j < qheads; ++j)
    for (int64_t i = 0; i < lanes; ++i)
      *reinterpret_cast<v16*>(out + (j * lanes + i) * kWidth) = acc[j * lanes + i] * inv[j];
}

// q: [batch, kv_heads, rep, dim]; cache: one layer's [2, num_blocks, block_size, kv_heads,
// dim]; tables: [batch, max_blocks] int64; lengths: [batch] int64 (keys per sequence).
// Returns [batch, kv_heads, rep, dim].
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& cache,
                                  const at::Tensor& tables, const at::Tensor& lengths,
                                  double scale) {
  TORCH_CHECK(q.device().is_cpu() && cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.scalar_type() == at::kFloat && cache.scalar_type() == at::kFloat,
              "float32 only");
  TORCH_CHECK(q.dim() == 4 && cache.dim() == 5 && tables.dim() == 2 && lengths.dim() == 1,
              "bad ranks");
  TORCH_CHECK(cache.is_contiguous() && tables.scalar_type() == at::kLong &&
                  lengths.scalar_type() == at::kLong,
              "cache contiguous, tables and lengths int64");
  const at::Tensor qc = q.contiguous();
  const at::Tensor tc = tables.contiguous();
  const at::Tensor lc = lengths.contiguous();
  const int64_t batch = qc.size(0), heads = qc.size(1), rep = qc.size(2), dim = qc.size(3);
  const int64_t num_blocks = cache.size(1), block_size = cache.size(2);
  TORCH_CHECK(cache.size(0) == 2 && cache.size(3) == heads && cache.size(4) == dim,
              "cache and query disagree");
  TORCH_CHECK(dim % kWidth == 0 && dim <= kMaxDim && heads * rep <= kMaxQueryHeads,
              "head dim must be a multiple of 16 up to 256, and query heads at most 256");
  TORCH_CHECK(tc.size(0) == batch && lc.size(0) == batch, "one table and length per sequence");
  const int64_t max_blocks = tc.size(1);
  const int64_t* table = tc.data_ptr<int64_t>();
  const int64_t* len = lc.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(len[b] > 0 && len[b] <= max_blocks * block_size, "length outside its table");
    for (int64_t j = 0; j * block_size < len[b]; ++j) {
      const int64_t id = table[b * max_blocks + j];
      TORCH_CHECK(id >= 0 && id < num_blocks, "block id out of range");
    }
  }
  at::Tensor out = at::empty_like(qc);
  const float* qp = qc.data_ptr<float>();
  const float* kbase = cache.data_ptr<float>();
  const float* vbase = kbase + num_blocks * block_size * heads * dim;
  float* op = out.data_ptr<float>();
  const int64_t token_stride = heads * dim;
  const int64_t block_stride = block_size * token_stride;
  const float sc = static_cast<float>(scale);
  const int64_t per_sequence = heads * rep * dim;

  at::parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<v16> acc(heads * rep * (dim / kWidth));
    for (int64_t b = begin; b < end; ++b) {
      scores.resize(heads * rep * len[b]);
      attend_sequence(qp + b * per_sequence, heads, rep, dim, table + b * max_blocks, len[b],
                      kbase, vbase, block_size, block_stride, token_stride, sc, scores.data(),
                      acc.data(), op + b * per_sequence);
    }
  });
  return out;
}

// ---- the small ops around attention ----------------------------------------------------
// Rows are split between threads only when there are enough of them: a decode step has one
// row per sequence, too little work to wake a second thread for.

constexpr int64_t kGrainElements = 1 << 15;

void check_rows(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous(), what,
              ": contiguous float32 CPU tensor expected");
}

int64_t grain(int64_t row_elements) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements));
}

// y = x / sqrt(mean(x^2) + eps) * weight, per row, as transformers' LlamaRMSNorm in float32.
void rms_norm_rows(const float* x, const float* w, float* y, int64_t rows, int64_t d,
                   float eps) {
  at::parallel_for(0, rows, grain(d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x + r * d;
      float* yr = y + r * d;
      float acc[kWidth] = {0};
      int64_t i = 0;
      for (; i + kWidth <= d; i += kWidth)
        for (int l = 0; l < kWidth; ++l) acc[l] += xr[i + l] * xr[i + l];
      float sum = 0.f;
      for (int l = 0; l < kWidth; ++l) sum += acc[l];
      for (; i < d; ++i) sum += xr[i] * xr[i];
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(d) + eps);
      for (int64_t j = 0; j < d; ++j) yr[j] = w[j] * (xr[j] * inv);
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "rms_norm x");
  check_rows(weight, "rms_norm weight");
  const int64_t d = x.size(-1);
  TORCH_CHECK(weight.numel() == d, "rms_norm: weight and rows disagree");
  at::Tensor y = at::empty_like(x);
  rms_norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(), y.data_ptr<float>(),
                x.numel() / d, d, static_cast<float>(eps));
  return y;
}

// h += x (the residual stream gains a sublayer's output), then rms_norm(h).
at::Tensor add_rms_norm(at::Tensor h, const at::Tensor& x, const at::Tensor& weight,
                        double eps) {
  check_rows(h, "add_rms_norm h");
  check_rows(x, "add_rms_norm x");
  TORCH_CHECK(h.sizes() == x.sizes(), "add_rms_norm: shapes differ");
  float* hp = h.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const int64_t n = h.numel();
  at::parallel_for(0, n, kGrainElements, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) hp[i] += xp[i];
  });
  return rms_norm(h, weight, eps);
}

// Rotary embedding in place on q [n, q_heads, d] and k [n, kv_heads, d] (transformers'
// rotate_half convention), then k and v stored at token `slots` of one layer's cache
// [2, num_blocks, block_size, kv_heads, d]. Multiplies and adds stay separate (no FMA
// contraction), so the rotation is bit-identical to transformers' q * cos + rotate_half(q)
// * sin.
__attribute__((optimize("fp-contract=off"))) void rotate(float* x, const float* cos,
                                                          const float* sin, int64_t heads,
                                                          int64_t d) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* xh = x + h * d;
    for (int64_t i = 0; i < half; ++i) {
      const float a = xh[i], b = xh[i + half];
      xh[i] = a * cos[i] + (-b) * sin[i];
      xh[i + half] = b * cos[i + half] + a * sin[i + half];
    }
  }
}

void rope_store(at::Tensor q, at::Tensor k, const at::Tensor& v, const at::Tensor& cos,
                const at::Tensor& sin, at::Tensor cache, const at::Tensor& slots) {
  check_rows(q, "rope_store q");
  check_rows(k, "rope_store k");
  check_rows(v, "rope_store v");
  check_rows(cos, "rope_store cos");
  check_rows(sin, "rope_store sin");
  check_rows(cache, "rope_store cache");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && k.sizes() == v.sizes() && cache.dim() == 5,
              "rope_store: bad ranks");
  const int64_t n = q.size(0), qh = q.size(1), kh = k.size(1), d = q.size(2);
  TORCH_CHECK(k.size(0) == n && k.size(2) == d && d % 2 == 0, "rope_store: q and k disagree");
  TORCH_CHECK(cos.numel() == n * d && sin.numel() == n * d, "rope_store: cos/sin shape");
  TORCH_CHECK(cache.size(0) == 2 && cache.size(3) == kh && cache.size(4) == d,
              "rope_store: cache and k disagree");
  const at::Tensor sl = slots.to(at::kLong).contiguous();
  TORCH_CHECK(sl.numel() == n, "rope_store: one slot per token");
  const int64_t capacity = cache.size(1) * cache.size(2);
  const int64_t* slot = sl.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(slot[i] >= 0 && slot[i] < capacity, "rope_store: slot out of range");
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* kc = cache.data_ptr<float>();
  float* vc = kc + capacity * kh * d;
  at::parallel_for(0, n, grain((qh + kh) * d), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      rotate(qp + i * qh * d, cp + i * d, sp + i * d, qh, d);
      rotate(kp + i * kh * d, cp + i * d, sp + i * d, kh, d);
      std::copy_n(kp + i * kh * d, kh * d, kc + slot[i] * kh * d);
      std::copy_n(vp + i * kh * d, kh * d, vc + slot[i] * kh * d);
    }
  });
}

// A linear layer (no bias) for a few rows of x, the decode steps of small batches:
// y[m][o] = dot(x[m], W[o]). Each weight row is read once, start to end, for all of x's
// rows, and a thread walks its weight rows in order: the whole weight goes by in one
// sequential pass, which keeps a core near its memory bandwidth. (On a Zen 4 core, one row:
// 24-27 GB/s, against 9-15 GB/s through oneDNN and 10-15 through MKL; docs/benchmarks-log.md.)
// A row's sums do not depend on how many rows come with it.
// With two rows or more a weight row takes longer to use than to arrive, and the hardware
// prefetchers fall behind: the row kPrefetchRows ahead is asked into L2 first (Zen 4, one
// core: 4 rows 15 -> 22 GB/s, 8 rows 8 -> 16 GB/s). At one row it only got in the way.
constexpr int64_t kMaxSmallRows = 8;
constexpr int64_t kPrefetchRows = 4;

// Built without -fassociative-math (which the other kernels take, cpu_kernels.py) and
// without fused multiply-adds: with them GCC split and fused the sums as it liked, and
// differently for each M (on an AVX2 core, where 8 rows' accumulators spill), so a row's
// sums changed with the rows beside it. Each row now sums its products in one order.
template <int M>
__attribute__((optimize("no-associative-math", "fp-contract=off"))) void small_rows(
    const float* __restrict x, const float* __restrict w, float* __restrict y, int64_t out,
    int64_t in, int64_t begin, int64_t end) {
  const int64_t lanes = in / kWidth;
  for (int64_t o = begin; o < end; ++o) {
    const float* wr = w + o * in;
    if (M > 1 && o + kPrefetchRows < end) {
      const char* ahead = reinterpret_cast<const char*>(wr + kPrefetchRows * in);
      for (int64_t b = 0; b < in * static_cast<int64_t>(sizeof(float)); b += 64)
        __builtin_prefetch(ahead + b, 0, 2);  // read, into L2 (prefetcht1)
    }
    const v16* wv = reinterpret_cast<const v16*>(wr);
    v16 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = v16{};
    for (int64_t i = 0; i < lanes; ++i) {
      const v16 wi = wv[i];
      for (int m = 0; m < M; ++m) acc[m] += wi * reinterpret_cast<const v16*>(x + m * in)[i];
    }
    for (int m = 0; m < M; ++m) {
      float s = hsum(acc[m]);
      for (int64_t i = lanes * kWidth; i < in; ++i) s += wr[i] * x[m * in + i];
      y[m * out + o] = s;
    }
  }
}

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& weight) {
  check_rows(x, "small_linear x");
  check_rows(weight, "small_linear weight");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "small_linear: x [rows, in] and weight [out, in] expected");
  const int64_t rows = x.size(0), out = weight.size(0), in = weight.size(1);
  TORCH_CHECK(rows >= 1 && rows <= kMaxSmallRows, "small_linear: 1 to ", kMaxSmallRows,
              " rows, not ", rows);
  at::Tensor y = at::empty({rows, out}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, out, grain(in), [&](int64_t begin, int64_t end) {
    switch (rows) {
      case 1: small_rows<1>(xp, wp, yp, out, in, begin, end); break;
      case 2: small_rows<2>(xp, wp, yp, out, in, begin, end); break;
      case 3: small_rows<3>(xp, wp, yp, out, in, begin, end); break;
      case 4: small_rows<4>(xp, wp, yp, out, in, begin, end); break;
      case 5: small_rows<5>(xp, wp, yp, out, in, begin, end); break;
      case 6: small_rows<6>(xp, wp, yp, out, in, begin, end); break;
      case 7: small_rows<7>(xp, wp, yp, out, in, begin, end); break;
      default: small_rows<8>(xp, wp, yp, out, in, begin, end); break;
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(tandem, m) {
  m.def("paged_decode_attention(Tensor q, Tensor cache, Tensor tables, Tensor lengths, "
        "float scale) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) h, Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rope_store(Tensor(a!) q, Tensor(b!) k, Tensor v, Tensor cos, Tensor sin, "
        "Tensor(c!) cache, Tensor slots) -> ()");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, TORCH_FN(paged_decode_attention));
  m.impl("rms_norm", c10::DispatchKey::CPU, TORCH_FN(rms_norm));
  m.impl("add_rms_norm", c10::DispatchKey::CPU, TORCH_FN(add_rms_norm));
  m.impl("rope_store", c10::DispatchKey::CPU, TORCH_FN(rope_store));
  m.def("small_linear(Tensor x, Tensor weight) -> Tensor");
  m.impl("small_linear", c10::DispatchKey::CPU, TORCH_FN(small_linear));
}
