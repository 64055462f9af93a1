#include "server/backends/shared_memory.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <limits>
#include <mutex>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"

namespace attn {
namespace {

// ---- The SIGBUS guard: a fixed table the signal handler can read without locks.

constexpr int kGuardSlots = 4096;

struct GuardSlot {
  std::atomic<uintptr_t> begin{0};  // 0: free
  std::atomic<uintptr_t> end{0};
  std::atomic<bool> broken{false};
};

std::array<GuardSlot, kGuardSlots> guard_slots;
struct sigaction previous_sigbus;

void OnSigbus(int sig, siginfo_t* info, void* context) {
  const auto addr = reinterpret_cast<uintptr_t>(info->si_addr);
  for (GuardSlot& slot : guard_slots) {
    const uintptr_t begin = slot.begin.load(std::memory_order_acquire);
    if (begin == 0 || addr < begin || addr >= slot.end.load(std::memory_order_acquire)) continue;
    // Zero pages over the whole mapping; the faulting access then completes. mmap is a plain
    // system call, safe in a signal handler.
    void* replaced = mmap(reinterpret_cast<void*>(begin), slot.end.load() - begin,
                          PROT_READ | PROT_WRITE, MAP_FIXED | MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (replaced != MAP_FAILED) {
      slot.broken.store(true, std::memory_order_release);
      return;
    }
    break;
  }
  // Not ours (or the replacement failed): behave as if this handler were not installed.
  if (previous_sigbus.sa_flags & SA_SIGINFO) {
    if (previous_sigbus.sa_sigaction != nullptr) {
      previous_sigbus.sa_sigaction(sig, info, context);
      return;
    }
  } else if (previous_sigbus.sa_handler != SIG_DFL && previous_sigbus.sa_handler != SIG_IGN) {
    previous_sigbus.sa_handler(sig);
    return;
  }
  signal(SIGBUS, SIG_DFL);
  raise(SIGBUS);
}

void InstallGuard() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction action = {};
    action.sa_sigaction = OnSigbus;
    action.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&action.sa_mask);
    sigaction(SIGBUS, &action, &previous_sigbus);
  });
}

int AcquireGuardSlot(char* begin, int64_t bytes) {
  const auto b = reinterpret_cast<uintptr_t>(begin);
  for (int i = 0; i < kGuardSlots; ++i) {
    uintptr_t expected = 0;
    // A slot is claimed with a placeholder begin of 1 (matches no address) until its end is set.
    if (guard_slots[i].begin.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) {
      guard_slots[i].broken.store(false, std::memory_order_relaxed);
      guard_slots[i].end.store(b + static_cast<uintptr_t>(bytes), std::memory_order_release);
      guard_slots[i].begin.store(b, std::memory_order_release);
      return i;
    }
  }
  return -1;
}

void ReleaseGuardSlot(int i) {
  guard_slots[i].begin.store(0, std::memory_order_release);
  guard_slots[i].end.store(0, std::memory_order_release);
}

bool ValidShmName(absl::string_view name) {
  if (name.size() < 2 || name.size() > 255 || name[0] != '/') return false;
  for (char c : name.substr(1)) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '_' || c == '.' || c == '-';
    if (!ok) return false;
  }
  return true;
}

// At most 64 bytes of a client's string, printable.
std::string Shown(absl::string_view s) {
  std::string out;
  for (char c : s.substr(0, 64)) out.push_back(c >= 0x20 && c < 0x7f ? c : '?');
  if (s.size() > 64) absl::StrAppend(&out, "...");
  return out;
}

}  // namespace

absl::Status CheckRegionHeader(const char* data, absl::string_view key) {
  if (key.size() != kRegionKeyBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("key has ", key.size(), " bytes; it must have ", kRegionKeyBytes));
  }
  // Compares every byte whatever the first difference, so timing does not reveal the key.
  unsigned char diff = 0;
  for (size_t i = 0; i < kRegionMagic.size(); ++i) diff |= data[i] ^ kRegionMagic[i];
  for (int i = 0; i < kRegionKeyBytes; ++i) diff |= data[kRegionMagic.size() + i] ^ key[i];
  if (diff != 0) {
    return absl::FailedPreconditionError(
        "the region does not start with \"attnserve.region\" and the request's key; write both "
        "into the memory before registering it");
  }
  return absl::OkStatus();
}

SharedMemoryMapping::~SharedMemoryMapping() {
  if (guard_slot_ >= 0) ReleaseGuardSlot(guard_slot_);
  if (map_base_ != nullptr) munmap(map_base_, static_cast<size_t>(map_bytes_));
}

bool SharedMemoryMapping::broken() const {
  return guard_slot_ >= 0 && guard_slots[guard_slot_].broken.load(std::memory_order_acquire);
}

absl::StatusOr<std::unique_ptr<SharedMemoryMapping>> MapSharedMemory(
    const RegionSpec& spec, absl::string_view name_prefix) {
  const std::string& name = spec.shm_name;
  if (!ValidShmName(name) || !absl::StartsWith(name, name_prefix)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shm_name '", Shown(name), "' must start with '", name_prefix,
        "', then up to 255 characters of [A-Za-z0-9_.-] (a POSIX shared-memory name)"));
  }
  if (spec.offset < 0 || spec.offset % kRegionMapAlignment != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "offset = ", spec.offset, " must be a non-negative multiple of ", kRegionMapAlignment));
  }
  if (spec.size < kRegionHeaderBytes ||
      spec.size > std::numeric_limits<int64_t>::max() - spec.offset) {
    return absl::InvalidArgumentError(absl::StrCat("size = ", spec.size, " must be at least ",
                                                   kRegionHeaderBytes, " and offset + size fit"));
  }
  const int fd = shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) {
    const int err = errno;
    const std::string why = absl::StrCat("shm_open('", name, "'): ", std::strerror(err));
    if (err == ENOENT) return absl::NotFoundError(why);
    return absl::FailedPreconditionError(why);
  }
  struct stat st = {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    close(fd);
    return absl::FailedPreconditionError(
        absl::StrCat("'", name, "' is not a shared-memory object"));
  }
  if (st.st_size < spec.offset + spec.size) {
    close(fd);
    return absl::FailedPreconditionError(
        absl::StrCat("region [", spec.offset, ", ", spec.offset + spec.size,
                     ") lies past the end of '", name, "' (", st.st_size, " bytes)"));
  }
  const int64_t page = sysconf(_SC_PAGESIZE);
  const int64_t map_offset = spec.offset / page * page;
  std::unique_ptr<SharedMemoryMapping> m(new SharedMemoryMapping());
  m->lead_ = spec.offset - map_offset;
  m->size_ = spec.size;
  m->map_bytes_ = m->lead_ + spec.size;
  void* base = mmap(nullptr, static_cast<size_t>(m->map_bytes_), PROT_READ | PROT_WRITE, MAP_SHARED,
                    fd, map_offset);
  const int map_errno = errno;
  close(fd);
  if (base == MAP_FAILED) {
    return absl::ResourceExhaustedError(
        absl::StrCat("mmap of '", name, "' failed: ", std::strerror(map_errno)));
  }
  m->map_base_ = static_cast<char*>(base);
  InstallGuard();
  m->guard_slot_ = AcquireGuardSlot(m->map_base_, m->map_bytes_);
  if (m->guard_slot_ < 0) {
    return absl::ResourceExhaustedError(
        absl::StrCat("the server maps ", kGuardSlots, " shared-memory regions already"));
  }
  if (absl::Status st = CheckRegionHeader(m->data(), spec.key); !st.ok()) return st;
  if (m->broken()) return absl::FailedPreconditionError("the object was truncated while mapped");
  return m;
}

}  // namespace attn
