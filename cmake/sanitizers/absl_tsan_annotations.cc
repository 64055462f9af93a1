// ThreadSanitizer annotations for the distribution's (uninstrumented) absl::Mutex and
// absl::Notification. Linked into the tsan preset's test binaries only
// (ATTN_TSAN_ABSL_ANNOTATIONS).
//
// Debian's libabsl is not built with -fsanitize=thread, so TSan does not see absl::Mutex lock and
// unlock (their fast paths are atomics in the shared library) and reports every access guarded by
// an absl::Mutex as a data race. This file defines the Mutex and Notification entry points in the
// test binary itself; the dynamic linker binds every call to them (ours and the library's own) to
// these definitions, which call the library's implementation (dlsym(RTLD_NEXT)) and tell TSan
// what happened with the same __tsan_mutex_* annotations absl emits when it is built with TSan.
//
// Waiting on a Condition (Await, LockWhen, AwaitWithDeadline, ...) is reimplemented as polling
// with the lock held while the condition is evaluated: absl evaluates conditions inside its
// unlock/relock paths, which annotations around the library calls cannot cover. Slower, but only
// TSan test binaries use it. absl::CondVar is not covered (no gRPC-free unit uses it): a unit that
// starts using it gets false reports until it is added here.
#include <dlfcn.h>
#include <sanitizer/tsan_interface.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/base/options.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

#if !defined(__SANITIZE_THREAD__)
#error "absl_tsan_annotations.cc belongs in -fsanitize=thread builds only"
#endif

namespace {

#define ATTN_STR2(x) #x
#define ATTN_STR(x) ATTN_STR2(x)

// Itanium-mangled name of absl::<inline namespace>::<cls>::<member>, e.g. Mutex::Lock():
// _ZN4absl7debian35Mutex4LockEv. `tail` is the member's mangled name and parameters.
std::string Mangled(const char* cls, const char* tail, bool is_const = false) {
  std::string name = is_const ? "_ZNK4absl" : "_ZN4absl";
#if ABSL_OPTION_USE_INLINE_NAMESPACE
  const std::string ns = ATTN_STR(ABSL_OPTION_INLINE_NAMESPACE_NAME);
  name += std::to_string(ns.size()) + ns;
#endif
  name += std::to_string(std::string(cls).size()) + cls + tail;
  return name;
}

void* Real(const std::string& symbol) {
  void* fn = dlsym(RTLD_NEXT, symbol.c_str());
  if (fn == nullptr) {
    std::fprintf(stderr, "absl_tsan_annotations: %s not found in libabsl\n", symbol.c_str());
    std::abort();
  }
  return fn;
}

using MutexFn = void (*)(absl::Mutex*);
using MutexTryFn = bool (*)(absl::Mutex*);
using NotifyFn = void (*)(absl::Notification*);

MutexFn RealLock() {
  static const auto fn = reinterpret_cast<MutexFn>(Real(Mangled("Mutex", "4LockEv")));
  return fn;
}
MutexFn RealUnlock() {
  static const auto fn = reinterpret_cast<MutexFn>(Real(Mangled("Mutex", "6UnlockEv")));
  return fn;
}
MutexFn RealReaderLock() {
  static const auto fn = reinterpret_cast<MutexFn>(Real(Mangled("Mutex", "10ReaderLockEv")));
  return fn;
}
MutexFn RealReaderUnlock() {
  static const auto fn = reinterpret_cast<MutexFn>(Real(Mangled("Mutex", "12ReaderUnlockEv")));
  return fn;
}
MutexTryFn RealTryLock() {
  static const auto fn = reinterpret_cast<MutexTryFn>(Real(Mangled("Mutex", "7TryLockEv")));
  return fn;
}
MutexTryFn RealReaderTryLock() {
  static const auto fn = reinterpret_cast<MutexTryFn>(Real(Mangled("Mutex", "13ReaderTryLockEv")));
  return fn;
}
MutexFn RealDestroy() {
  static const auto fn = reinterpret_cast<MutexFn>(Real(Mangled("Mutex", "D2Ev")));
  return fn;
}
NotifyFn RealNotify() {
  static const auto fn = reinterpret_cast<NotifyFn>(Real(Mangled("Notification", "6NotifyEv")));
  return fn;
}

// Polling interval of the condition waits.
constexpr absl::Duration kPoll = absl::Microseconds(50);

// Waits with `mu` held (exclusive or shared) until cond is true or `deadline` passes; returns
// cond's value. The lock is dropped between evaluations.
bool PollCondition(absl::Mutex* mu, const absl::Condition& cond, absl::Time deadline, bool shared) {
  while (!cond.Eval()) {
    if (absl::Now() >= deadline) return false;
    if (shared) {
      mu->ReaderUnlock();
    } else {
      mu->Unlock();
    }
    absl::SleepFor(kPoll);
    if (shared) {
      mu->ReaderLock();
    } else {
      mu->Lock();
    }
  }
  return true;
}

}  // namespace

namespace absl {
ABSL_NAMESPACE_BEGIN

Mutex::~Mutex() {
  __tsan_mutex_destroy(this, __tsan_mutex_not_static);
  RealDestroy()(this);
}

void Mutex::Lock() {
  __tsan_mutex_pre_lock(this, 0);
  RealLock()(this);
  __tsan_mutex_post_lock(this, 0, 0);
}

void Mutex::Unlock() {
  __tsan_mutex_pre_unlock(this, 0);
  RealUnlock()(this);
  __tsan_mutex_post_unlock(this, 0);
}

void Mutex::ReaderLock() {
  __tsan_mutex_pre_lock(this, __tsan_mutex_read_lock);
  RealReaderLock()(this);
  __tsan_mutex_post_lock(this, __tsan_mutex_read_lock, 0);
}

void Mutex::ReaderUnlock() {
  __tsan_mutex_pre_unlock(this, __tsan_mutex_read_lock);
  RealReaderUnlock()(this);
  __tsan_mutex_post_unlock(this, __tsan_mutex_read_lock);
}

bool Mutex::TryLock() {
  __tsan_mutex_pre_lock(this, __tsan_mutex_try_lock);
  const bool locked = RealTryLock()(this);
  __tsan_mutex_post_lock(this, locked ? __tsan_mutex_try_lock : __tsan_mutex_try_lock_failed, 0);
  return locked;
}

bool Mutex::ReaderTryLock() {
  __tsan_mutex_pre_lock(this, __tsan_mutex_try_read_lock);
  const bool locked = RealReaderTryLock()(this);
  __tsan_mutex_post_lock(
      this, locked ? __tsan_mutex_try_read_lock : __tsan_mutex_try_read_lock_failed, 0);
  return locked;
}

// Await and friends: absl requires the caller to hold the lock; writer mode is assumed (absl
// itself tracks the mode, but every use here holds it exclusively).
void Mutex::Await(const Condition& cond) { PollCondition(this, cond, InfiniteFuture(), false); }
bool Mutex::AwaitWithTimeout(const Condition& cond, Duration timeout) {
  return PollCondition(this, cond, Now() + timeout, false);
}
bool Mutex::AwaitWithDeadline(const Condition& cond, Time deadline) {
  return PollCondition(this, cond, deadline, false);
}

void Mutex::LockWhen(const Condition& cond) {
  Lock();
  PollCondition(this, cond, InfiniteFuture(), false);
}
void Mutex::ReaderLockWhen(const Condition& cond) {
  ReaderLock();
  PollCondition(this, cond, InfiniteFuture(), true);
}
bool Mutex::LockWhenWithTimeout(const Condition& cond, Duration timeout) {
  Lock();
  return PollCondition(this, cond, Now() + timeout, false);
}
bool Mutex::ReaderLockWhenWithTimeout(const Condition& cond, Duration timeout) {
  ReaderLock();
  return PollCondition(this, cond, Now() + timeout, true);
}
bool Mutex::LockWhenWithDeadline(const Condition& cond, Time deadline) {
  Lock();
  return PollCondition(this, cond, deadline, false);
}
bool Mutex::ReaderLockWhenWithDeadline(const Condition& cond, Time deadline) {
  ReaderLock();
  return PollCondition(this, cond, deadline, true);
}

// Notification: Notify releases, a wait that saw the notification acquires.
void Notification::Notify() {
  __tsan_release(this);
  RealNotify()(this);
}

void Notification::WaitForNotification() const {
  while (!HasBeenNotified()) SleepFor(kPoll);
  __tsan_acquire(const_cast<Notification*>(this));
}

bool Notification::WaitForNotificationWithTimeout(Duration timeout) const {
  return WaitForNotificationWithDeadline(Now() + timeout);
}

bool Notification::WaitForNotificationWithDeadline(Time deadline) const {
  while (!HasBeenNotified()) {
    if (Now() >= deadline) return false;
    SleepFor(kPoll);
  }
  __tsan_acquire(const_cast<Notification*>(this));
  return true;
}

ABSL_NAMESPACE_END
}  // namespace absl
