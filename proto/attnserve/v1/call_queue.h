// The shared-memory layout of a call queue (attention.proto, "Call queues"): part of the public
// API, as the messages are. Server (server/rpc/call_queue.h) and clients (client/cpp/, the Python
// client's call_queue.py) follow it; it has no dependencies beyond the C++ standard library and
// Linux's futex.
//
// Segment (little-endian, offsets in bytes; every word naturally aligned):
//   [0, 48)    the region header of every region: "attnserve.region", then the 32-byte key
//   [64, 68)   doorbell        u32  futex word the server sleeps on; a caller adds 1 after each
//                                   publish and wakes it when `server_sleeping` is set
//   [68, 72)   server_sleeping u32  1 while the server thread sleeps (or is about to)
//   [72, 76)   closed          u32  set by the server once it stopped serving the queue; a
//                                   caller waiting for an answer must watch it ("Closing")
//   [128, ...) slots, each SlotStride() bytes: a 64-byte slot header, the request area, the
//              response area
// Slot header:
//   0  state          u32  kFree -> (caller) kSubmitted -> (server) kTaken -> (server) kDone ->
//                          (caller, once it read the answer) kFree; or kSubmitted -> (caller,
//                          once `closed` is set: "Closing") kFree. Futex word of the answer.
//   4  client_waiting u32  1 while the caller sleeps on `state` (the server wakes it then)
//   8  method         u32  kDecode or kPrefill
//   12 request_len    u32  bytes of the serialized request in the request area
//   16 timeout_us     i64  the call's deadline, from when the server takes it; 0: none
//   24 cancel         u32  nonzero: the caller gave up (the call is dropped if not launched)
//   32 status         i32  the answer's canonical status code (0: OK)
//   36 response_len   u32  bytes in the response area: the serialized AttentionResponse (OK),
//                          else the status message (UTF-8, at most 1 KiB)
//   40 retry_after_ms u32  with RESOURCE_EXHAUSTED from a full queue: when to retry
//
// Ordering: a caller writes the request, method, length and timeout, then stores kSubmitted
// (sequentially consistent), adds 1 to the doorbell and reads server_sleeping; the server sets
// server_sleeping, then scans the slots once more before it sleeps on the doorbell value it read
// before. So either the scan sees the slot or the caller sees the flag (and the doorbell has
// moved, so the futex wait does not sleep). The answer goes the same way: the server writes it,
// stores kDone, reads client_waiting; a caller sets client_waiting, then reads state again
// before it sleeps on the value it saw. States other than these are ignored by the server
// (values >= kClientPrivate are the caller's own, e.g. a slot being written).
//
// Closing: the server stops serving a queue when it is unregistered, when its session ends and
// at shutdown. It stores `closed` (sequentially consistent), answers the slots that wait (its
// last pass comes after every call it took was answered), wakes each slot's sleepers once and
// lets the segment go. A call published after that last pass is never taken nor answered, and
// nothing wakes its caller again: a caller that only waits for its slot's state to change waits
// forever. So a caller waiting for an answer must also watch `closed`: it reads `closed` after
// it publishes and again each time before it sleeps on `state` (after it set client_waiting and
// read `state`). In the single total order either the server's last pass read the slot after
// the publish, and the answer comes as usual, or `closed` was stored before the publish, and the
// caller sees it. Once `closed` is set and its slot still holds kSubmitted, the call will not
// run: the caller fails it as UNAVAILABLE. A caller that takes the slot back does so with a
// compare-and-swap kSubmitted -> kFree, which fails only when the server's last pass took the
// call (its answer then comes). A slot in kTaken is still answered. A caller waiting for a free
// slot (all of its slots busy) must watch `closed` as well. Every sleep should have a time
// limit: a segment the server can no longer read (truncated) gets neither answers nor `closed`,
// and only the call's own timeout ends the wait.
#pragma once

#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace attnserve::v1::call_queue {

inline constexpr uint32_t kFree = 0;
inline constexpr uint32_t kSubmitted = 1;
inline constexpr uint32_t kTaken = 2;
inline constexpr uint32_t kDone = 3;
inline constexpr uint32_t kClientPrivate = 16;

inline constexpr uint32_t kDecode = 1;
inline constexpr uint32_t kPrefill = 2;

inline constexpr size_t kDoorbell = 64;
inline constexpr size_t kServerSleeping = 68;
inline constexpr size_t kClosed = 72;
inline constexpr size_t kSlots = 128;

inline constexpr size_t kSlotHeaderBytes = 64;
inline constexpr size_t kState = 0;
inline constexpr size_t kClientWaiting = 4;
inline constexpr size_t kMethod = 8;
inline constexpr size_t kRequestLen = 12;
inline constexpr size_t kTimeoutUs = 16;
inline constexpr size_t kCancel = 24;
inline constexpr size_t kStatus = 32;
inline constexpr size_t kResponseLen = 36;
inline constexpr size_t kRetryAfterMs = 40;

// Limits of CallQueue (attention.proto).
inline constexpr int kMaxSlots = 64;
inline constexpr int kMinAreaBytes = 256;
inline constexpr int kMaxAreaBytes = 16 << 20;
inline constexpr int kAreaAlignment = 64;
// Longest status message written into a slot.
inline constexpr size_t kMaxMessageBytes = 1024;

inline constexpr size_t SlotStride(int request_bytes, int response_bytes) {
  return kSlotHeaderBytes + static_cast<size_t>(request_bytes) +
         static_cast<size_t>(response_bytes);
}
inline constexpr size_t SegmentBytes(int slots, int request_bytes, int response_bytes) {
  return kSlots + static_cast<size_t>(slots) * SlotStride(request_bytes, response_bytes);
}

// A 32-bit word of the segment, for atomic access (the segment is shared with another process).
inline std::atomic_ref<uint32_t> Word(char* base, size_t offset) {
  return std::atomic_ref<uint32_t>(*reinterpret_cast<uint32_t*>(base + offset));
}
inline std::atomic_ref<int64_t> Word64(char* base, size_t offset) {
  return std::atomic_ref<int64_t>(*reinterpret_cast<int64_t*>(base + offset));
}
static_assert(std::atomic_ref<uint32_t>::is_always_lock_free);
static_assert(std::atomic_ref<int64_t>::is_always_lock_free);

// Sleeps while the word at `word` holds `expected`, at most `timeout_ns` (< 0: no limit; the
// server always passes one). Shared (not FUTEX_PRIVATE): the other side is another process.
// Returns when woken, on timeout, on a signal, or at once when the word differs.
inline void FutexWait(char* word, uint32_t expected, int64_t timeout_ns) {
  timespec ts{};
  timespec* limit = nullptr;
  if (timeout_ns >= 0) {
    ts.tv_sec = static_cast<time_t>(timeout_ns / 1000000000);
    ts.tv_nsec = static_cast<long>(timeout_ns % 1000000000);
    limit = &ts;
  }
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT, expected, limit, nullptr, 0);
}

// Wakes up to `count` sleepers on the word at `word`.
inline void FutexWake(char* word, int count) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE, count, nullptr, nullptr, 0);
}

}  // namespace attnserve::v1::call_queue
