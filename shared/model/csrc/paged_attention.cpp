// Decode attention read straight from the paged KV cache, on CPU, in float32.
//
// One query token per sequence. Each sequence is one task: it walks its blocks through its
// block table, scores every key against the query heads that share each KV head
// (grouped-query attention), takes the softmax, and sums the values. Keys and values are
// read once, where they lie; nothing is gathered into a copy first (the gather and the
// attention over the copy were 22% of a decode step: docs/benchmarks.md).
//
// Built and loaded at run time by shared/model/paged_attention.py (which says why).

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

}  // namespace

TORCH_LIBRARY(tandem, m) {
  m.def("paged_decode_attention(Tensor q, Tensor cache, Tensor tables, Tensor lengths, "
        "float scale) -> Tensor");
  m.impl("paged_decode_attention", c10::DispatchKey::CPU, TORCH_FN(paged_decode_attention));
}
