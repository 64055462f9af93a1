// Builds random paged batches in host memory for kernel tests (CPU backend now, CUDA later): the
// cache with every slot that holds no real token set to NaN, shuffled non-contiguous page tables,
// random queries and new K/V, and NaN-poisoned outputs, plus the params struct pointing into them.
// Independent of every backend; depends only on kernels/attention.h.
#pragma once

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kernels/attention.h"

namespace attn::testing {

// One sequence of a batch. With append, kv_len counts the new tokens too (the page table is the
// one after the append), as in the service API.
struct SeqSpec {
  int q_len = 1;
  int kv_len = 0;
  int layer = 0;
};

struct BatchOptions {
  bool decode = false;   // qo_indptr = nullptr; every q_len must be 1
  bool append = false;   // set k_new / v_new; the last q_len positions of a sequence start as NaN
  bool with_lse = true;  // allocate lse (else params.lse = nullptr)
  bool causal = true;
  // Give kv_last_page_len batch_size + 1 entries (a trailing 0), as some published workloads do.
  bool pad_last_page_len = false;
  // Always pass seq_layer (otherwise only when some sequence uses a layer other than 0).
  bool force_seq_layer = false;
  int extra_pages = 3;  // pool pages no sequence owns (NaN everywhere)
  // Hand out the pool's pages in a random order (else in order: every sequence's pages
  // contiguous, which benchmarks use to tell scattered reads' cost apart from the kernel's).
  bool shuffle_pages = true;
  float query_scale = 1.f;  // queries are uniform in [-query_scale, query_scale]
  float sm_scale = 0.f;     // 0: 1 / sqrt(query dimension)
};

struct GqaGeometry {
  int num_layers = 1;
  int page_size = 16;
  int num_qo_heads = 8;
  int num_kv_heads = 2;
  int head_dim = 64;
};

struct MlaGeometry {
  int num_layers = 1;
  int page_size = 64;
  int num_heads = 16;
};

// The CSR page table of a batch. View() points into this object's vectors: valid while it lives
// (a moved-to object keeps them; a copy has its own, so call View() on the copy).
struct HostPageTable {
  std::vector<SeqSpec> seqs;
  int total_q = 0;
  bool decode = false;
  std::vector<int32_t> qo_indptr;         // empty for decode
  std::vector<int32_t> kv_indptr;         // [batch_size + 1]
  std::vector<int32_t> kv_indices;        // shuffled distinct page ids
  std::vector<int32_t> kv_last_page_len;  // [batch_size] or [batch_size + 1]
  std::vector<int32_t> seq_layer;         // empty: nullptr
  int num_pages = 0;                      // pool size

  PagedBatch View() const;
  // First query row of sequence seq in q / out.
  int QBegin(int seq) const { return decode ? seq : qo_indptr[seq]; }
};

struct GqaHostBatch {
  GqaGeometry geometry;
  HostPageTable table;
  std::vector<bf16> cache;  // [num_layers, num_pages, 2, page_size, num_kv_heads, head_dim]
  std::vector<bf16> q;      // [total_q, num_qo_heads, head_dim]
  std::vector<bf16> k_new;  // [total_q, num_kv_heads, head_dim] or empty
  std::vector<bf16> v_new;
  std::vector<bf16> out;   // [total_q, num_qo_heads, head_dim], NaN
  std::vector<float> lse;  // [total_q, num_qo_heads], NaN, or empty
  float sm_scale = 0.f;
  bool causal = true;

  // Host pointers into this object's buffers.
  GqaParams Params();
};

struct MlaHostBatch {
  MlaGeometry geometry;
  HostPageTable table;
  std::vector<bf16> cache;    // [num_layers, num_pages, page_size, kMlaTokenDim]
  std::vector<bf16> q_nope;   // [total_q, num_heads, kMlaCkvDim]
  std::vector<bf16> q_pe;     // [total_q, num_heads, kMlaKpeDim]
  std::vector<bf16> ckv_new;  // [total_q, kMlaCkvDim] or empty
  std::vector<bf16> kpe_new;  // [total_q, kMlaKpeDim] or empty
  std::vector<bf16> out;      // [total_q, num_heads, kMlaCkvDim], NaN
  std::vector<float> lse;     // [total_q, num_heads], NaN, or empty
  float sm_scale = 0.f;
  bool causal = true;

  MlaParams Params();
};

// Builds a batch of the given sequences. K/V (ckv/kpe) and new rows are uniform in [-1, 1],
// queries uniform in [-query_scale, query_scale], all rounded to bf16. Pages of all sequences are
// distinct ids drawn from a shuffled pool of total pages + extra_pages.
GqaHostBatch MakeGqaBatch(const GqaGeometry& geometry, const std::vector<SeqSpec>& seqs,
                          const BatchOptions& options, std::mt19937_64& rng);
MlaHostBatch MakeMlaBatch(const MlaGeometry& geometry, const std::vector<SeqSpec>& seqs,
                          const BatchOptions& options, std::mt19937_64& rng);

// Makes every element of out NaN and of lse NaN again (before rerunning a kernel on the batch).
void PoisonOutputs(std::vector<bf16>& out, std::vector<float>& lse);

// ---- Logits past float32's range (docs/design.md, "Attention semantics": such rows are NaN).

enum class Overflow {
  kHugeQuery,  // every query element 1e38: every logit is +inf
  kHugeScale,  // sm_scale 1e38: every scaled logit is +inf
  kMinusInf,   // every query element -1e38: every logit is -inf
};

// Rewrites a batch made above so that the float32 logit of every query with every key overflows,
// whatever the backend's summation order: the cache's tokens, the new rows and the queries become
// positive (0.5 + |x| / 2, in [0.5, 1]), so every partial sum of a dot product grows the same way,
// then `how` is applied. out and lse are filled with 1, a finite value, so that a row a kernel
// does not write cannot pass for NaN.
void MakeLogitsOverflow(Overflow how, GqaHostBatch* b);
void MakeLogitsOverflow(Overflow how, MlaHostBatch* b);

// The contract's answer for such a batch: a row that sees a key has every output element and its
// lse NaN; a row that sees none has output 0 and lse kEmptyRowLse. Returns the number of (row,
// head) vectors that differ and appends up to max_report descriptions to *report.
int64_t CheckOverflowRows(const HostPageTable& t, int page_size, bool causal, int num_heads,
                          int v_dim, const std::vector<bf16>& out, const std::vector<float>& lse,
                          std::string* report, int max_report = 8);

// ---- Judging results (docs/design.md, "Attention semantics": tolerance).

// An element fails only if |x - ref| > 1e-2 and |x - ref| / (|ref| + 1e-8) > 1e-2.
bool WithinTolerance(double x, double ref);

// Compares got with ref element by element; non-finite got values always fail. Returns the number
// of failures and appends up to max_report descriptions ("what[index]: got x, ref y") to *report.
int64_t CompareBf16(const std::string& what, const bf16* got, const bf16* ref, int64_t n,
                    std::string* report, int max_report = 8);
int64_t CompareFloat(const std::string& what, const float* got, const float* ref, int64_t n,
                     std::string* report, int max_report = 8);

}  // namespace attn::testing
