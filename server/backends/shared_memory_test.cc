#include "server/backends/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <limits>
#include <random>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace attn {
namespace {

constexpr char kPrefix[] = "/attnserve-test";

// A POSIX shared-memory object of `bytes` for one test, removed afterwards.
class ShmObject {
 public:
  explicit ShmObject(int64_t bytes) {
    name_ = absl::StrCat(kPrefix, "-", getpid(), "-", std::random_device{}());
    fd_ = shm_open(name_.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
    EXPECT_GE(fd_, 0) << std::strerror(errno);
    EXPECT_EQ(ftruncate(fd_, bytes), 0);
    base_ = static_cast<char*>(
        mmap(nullptr, static_cast<size_t>(bytes), PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0));
    EXPECT_NE(base_, MAP_FAILED);
    bytes_ = bytes;
  }
  ~ShmObject() {
    munmap(base_, static_cast<size_t>(bytes_));
    close(fd_);
    shm_unlink(name_.c_str());
  }
  // Writes the region header with `key` at `offset`.
  void WriteHeader(int64_t offset, const std::string& key) {
    std::memcpy(base_ + offset, kRegionMagic.data(), kRegionMagic.size());
    std::memcpy(base_ + offset + kRegionMagic.size(), key.data(), key.size());
  }
  void Truncate(int64_t bytes) { ASSERT_EQ(ftruncate(fd_, bytes), 0); }

  const std::string& name() const { return name_; }
  char* base() const { return base_; }

 private:
  std::string name_;
  int fd_ = -1;
  char* base_ = nullptr;
  int64_t bytes_ = 0;
};

const std::string kKey(kRegionKeyBytes, 'k');

RegionSpec Spec(const ShmObject& shm, int64_t offset, int64_t size, std::string key = kKey) {
  RegionSpec spec;
  spec.shm_name = shm.name();
  spec.offset = offset;
  spec.size = size;
  spec.key = std::move(key);
  return spec;
}

TEST(SharedMemoryTest, MapsTheRegionAndSharesItsBytes) {
  ShmObject shm(3 * 4096);
  shm.WriteHeader(4096 + 64, kKey);
  auto m = MapSharedMemory(Spec(shm, 4096 + 64, 8192 - 64), kPrefix);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ((*m)->size(), 8192 - 64);
  EXPECT_EQ(std::memcmp((*m)->data(), "attnserve.region", 16), 0);
  (*m)->data()[100] = 42;  // the server's writes reach the owner
  EXPECT_EQ(shm.base()[4096 + 64 + 100], 42);
  EXPECT_FALSE((*m)->broken());
}

TEST(SharedMemoryTest, RefusesWhatItMustNotOpen) {
  ShmObject shm(4096);
  shm.WriteHeader(0, kKey);
  const struct {
    RegionSpec spec;
    absl::StatusCode code;
  } cases[] = {
      {Spec(shm, 0, 4096, std::string(kRegionKeyBytes, 'x')),
       absl::StatusCode::kFailedPrecondition},
      {Spec(shm, 0, 4096, "short"), absl::StatusCode::kInvalidArgument},
      {Spec(shm, 0, 8192), absl::StatusCode::kFailedPrecondition},  // past the object's end
      {Spec(shm, 32, 1024), absl::StatusCode::kInvalidArgument},    // misaligned
      {Spec(shm, -64, 1024), absl::StatusCode::kInvalidArgument},
      {Spec(shm, 0, 16), absl::StatusCode::kInvalidArgument},  // smaller than the header
      {Spec(shm, 64, std::numeric_limits<int64_t>::max()), absl::StatusCode::kInvalidArgument},
  };
  for (const auto& c : cases) {
    EXPECT_EQ(MapSharedMemory(c.spec, kPrefix).status().code(), c.code)
        << c.spec.offset << " " << c.spec.size;
  }
  RegionSpec other = Spec(shm, 0, 4096);
  EXPECT_EQ(MapSharedMemory(other, "/someone-else").status().code(),
            absl::StatusCode::kInvalidArgument);
  for (const char* name : {"/attnserve-test/../x", "attnserve-test", "/attnserve-test x", ""}) {
    other.shm_name = name;
    EXPECT_EQ(MapSharedMemory(other, kPrefix).status().code(), absl::StatusCode::kInvalidArgument)
        << name;
  }
  other.shm_name = absl::StrCat(kPrefix, "-missing-", getpid());
  EXPECT_EQ(MapSharedMemory(other, kPrefix).status().code(), absl::StatusCode::kNotFound);
}

TEST(SharedMemoryTest, SurvivesTheOwnerTruncatingTheObject) {
  ShmObject shm(4 * 4096);
  shm.WriteHeader(0, kKey);
  auto m = MapSharedMemory(Spec(shm, 0, 4 * 4096), kPrefix);
  ASSERT_TRUE(m.ok()) << m.status();
  volatile char* data = (*m)->data();
  data[3 * 4096] = 7;
  shm.Truncate(0);
  // Without the guard this read raises SIGBUS and kills the process.
  EXPECT_EQ(data[3 * 4096], 0);
  data[2 * 4096] = 1;  // writes land in the replacement pages
  EXPECT_TRUE((*m)->broken());
}

TEST(SharedMemoryDeathTest, FaultsOutsideRegionsStillKill) {
  ShmObject shm(4096);
  shm.WriteHeader(0, kKey);
  auto m = MapSharedMemory(Spec(shm, 0, 4096), kPrefix);  // installs the handler
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_DEATH(
      {
        volatile char* own = shm.base();  // the test's own mapping, not a region
        shm.Truncate(0);
        (void)own[0];
      },
      "");
}

}  // namespace
}  // namespace attn
