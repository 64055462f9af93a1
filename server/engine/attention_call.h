// A validated Prefill or Decode call, as the batcher and the backends see it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "kernels/attention.h"
#include "server/engine/host_bytes.h"

namespace attn {

enum class Op { kPrefill, kDecode };

inline const char* OpName(Op op) { return op == Op::kPrefill ? "prefill" : "decode"; }

// One bf16 input tensor of a call: in host memory (pieces of the request message, or a slice of
// a shared-memory region) or in device memory on the backend's device (a slice of a CUDA IPC
// region). Whatever holds the bytes outlives the call.
struct CallInput {
  bool present = false;          // the request carries this tensor (possibly of 0 rows)
  HostBytes host;                // the bytes, when in host memory
  const char* device = nullptr;  // the bytes, when in device memory
  // The host bytes are in a region the backend page-locked (its copies may read them straight).
  bool registered = false;
  size_t bytes = 0;

  bool on_device() const { return device != nullptr; }
};

// Where one output of a call goes: into a region slice the caller named (host memory of a
// shared-memory region, or device memory of a CUDA IPC region), or -- neither set -- into
// `result`, which the backend fills with bytes of a buffer of its own for the response.
struct CallOutput {
  char* host = nullptr;
  char* device = nullptr;
  SharedBytes result;

  bool in_region() const { return host != nullptr || device != nullptr; }
};

// Views point into the request message (or memory it names) and stay valid until the call is
// answered.
struct AttentionCall {
  // Move-only: the page-table spans may point into `table`, which a copy would not own (moving a
  // vector keeps its buffer).
  AttentionCall() = default;
  AttentionCall(AttentionCall&&) = default;
  AttentionCall& operator=(AttentionCall&&) = default;
  AttentionCall(const AttentionCall&) = delete;
  AttentionCall& operator=(const AttentionCall&) = delete;

  Op op = Op::kPrefill;
  int layer = 0;
  int batch_size = 0;
  int total_q = 0;

  // Page table. qo_indptr is empty for Decode (one query row per sequence). The spans point into
  // the request, or into `table` when the page table came from a region.
  absl::Span<const int32_t> qo_indptr;    // [batch_size + 1]
  absl::Span<const int32_t> kv_indptr;    // [batch_size + 1]
  absl::Span<const int32_t> kv_indices;   // [kv_indptr[batch_size]]
  std::vector<int32_t> kv_last_page_len;  // [batch_size], normalized: 0 for sequences w/o pages
  std::vector<int32_t> table;             // the call's own copy of a page table from a region
  // Nonzero when the page table is a plan's (Plan::id(): unique for the process's life, and the
  // table never changes under it), so a backend may keep what it derived from the table for the
  // next call that names the same id.
  uint64_t table_id = 0;

  // bf16 inputs. GQA: q [total_q, H, D], k_new/v_new [total_q, H_kv, D].
  // MLA: q = q_nope [total_q, H, 512], q_pe [total_q, H, 64], k_new = ckv [total_q, 512],
  // v_new = kpe [total_q, 64]. k_new and v_new are both present or both absent (no append).
  CallInput q, q_pe, k_new, v_new;

  float sm_scale = 0.f;
  bool return_lse = false;
  // Set by a lane that refused this call of a launch that ran (Lane::Run): the call fails with
  // it, the other calls of the launch are unaffected.
  absl::Status refused;

  // out: [total_q, H, out_dim] bf16 (out_dim: head_dim for GQA, 512 for MLA); lse: [total_q, H]
  // float32, when return_lse.
  CallOutput out, lse;

  // The pages the appended rows land in, as AppendKey(page, layer); empty when nothing is
  // appended. Validation has checked that no two sequences of the call share one.
  std::vector<int64_t> append_pages;

  bool appends() const { return k_new.present; }
  // Whether any input or output is in device memory (a CUDA IPC region).
  bool uses_device_memory() const {
    return q.on_device() || q_pe.on_device() || k_new.on_device() || v_new.on_device() ||
           out.device != nullptr || lse.device != nullptr;
  }
};

// One page of one layer (a page id holds every layer's rows of its tokens).
inline int64_t AppendKey(int32_t page, int layer) {
  return (int64_t{page} << 32) | static_cast<uint32_t>(layer);
}
inline int32_t AppendKeyPage(int64_t key) { return static_cast<int32_t>(key >> 32); }
inline int AppendKeyLayer(int64_t key) { return static_cast<int>(key & 0xffffffff); }

}  // namespace attn
