// Host bytes passed between the RPC edge and the backends without copies.
//
// HostBytes: bytes that may lie in several pieces, in order -- a tensor as it arrived in the
// slices of a gRPC message, read in place instead of being copied into one string first. The
// pieces are borrowed: whoever made the HostBytes keeps them alive.
//
// SharedBytes: a backend's output (one call's rows of a launch's output buffer) handed to the
// RPC edge, which sends it straight from that buffer; the buffer stays alive (and out of reuse)
// until the last SharedBytes referring to it is gone.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <memory>
#include <utility>

#include "absl/container/inlined_vector.h"

namespace attn {

class HostBytes {
 public:
  HostBytes() = default;
  HostBytes(const char* data, size_t size) { Append(data, size); }

  void Append(const char* data, size_t size) {
    if (size == 0) return;
    if (!pieces_.empty() && pieces_.back().first + pieces_.back().second == data) {
      pieces_.back().second += size;  // adjacent: one piece
    } else {
      pieces_.emplace_back(data, size);
    }
    size_ += size;
  }

  size_t size() const { return size_; }
  bool empty() const { return size_ == 0; }
  size_t num_pieces() const { return pieces_.size(); }
  // The bytes when they are one piece (or none), else nullptr.
  const char* contiguous() const {
    if (pieces_.empty()) return "";
    return pieces_.size() == 1 ? pieces_.front().first : nullptr;
  }

  // Copies bytes [offset, offset + n) into dst; offset + n <= size().
  void CopyTo(char* dst, size_t offset, size_t n) const {
    for (const auto& [data, size] : pieces_) {
      if (n == 0) return;
      if (offset >= size) {
        offset -= size;
        continue;
      }
      const size_t take = std::min(size - offset, n);
      std::memcpy(dst, data + offset, take);
      dst += take;
      n -= take;
      offset = 0;
    }
  }
  void CopyTo(char* dst) const { CopyTo(dst, 0, size_); }

  // Calls f(data, size) for each piece in order.
  template <typename F>
  void ForEachPiece(F&& f) const {
    for (const auto& [data, size] : pieces_) f(data, size);
  }

 private:
  absl::InlinedVector<std::pair<const char*, size_t>, 2> pieces_;
  size_t size_ = 0;
};

struct SharedBytes {
  std::shared_ptr<const void> owner;  // keeps `data` alive
  const char* data = nullptr;
  size_t size = 0;
};

}  // namespace attn
