//go:build linux

package attnserve

import (
	"crypto/rand"
	"fmt"
	"syscall"
)

// POSIX shared memory on Linux is a file of the tmpfs at /dev/shm: shm_open(name) opens
// /dev/shm/<name without its '/'>, so plain system calls do without cgo.
const shmDir = "/dev/shm"

func shmPath(name string) string { return shmDir + "/" + name[1:] }

// newShmArena creates, maps and stamps (header at 0) a shared-memory object of size bytes.
func newShmArena(size int64, prefix string, mode uint32) (*shmArena, error) {
	if size < 2*BlockAlignment {
		return nil, fmt.Errorf("an arena needs at least %d bytes, got %d", 2*BlockAlignment, size)
	}
	shmName, err := newShmName(prefix)
	if err != nil {
		return nil, err
	}
	path := shmPath(shmName)
	fd, err := syscall.Open(path, syscall.O_RDWR|syscall.O_CREAT|syscall.O_EXCL|syscall.O_CLOEXEC|
		syscall.O_NOFOLLOW, mode)
	if err != nil {
		return nil, fmt.Errorf("creating %s: %w", path, err)
	}
	defer syscall.Close(fd)
	fail := func(what string, err error) (*shmArena, error) {
		_ = syscall.Unlink(path)
		return nil, fmt.Errorf("%s %s: %w", what, path, err)
	}
	if err := syscall.Fchmod(fd, mode); err != nil { // exactly mode, whatever the umask
		return fail("chmod", err)
	}
	if err := syscall.Ftruncate(fd, size); err != nil {
		return fail("sizing", err)
	}
	mem, err := syscall.Mmap(fd, 0, int(size), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	if err != nil {
		return fail("mapping", err)
	}
	key := make([]byte, RegionKeyBytes)
	if _, err := rand.Read(key); err != nil {
		_ = syscall.Munmap(mem)
		return fail("keying", err)
	}
	copy(mem, RegionMagic)
	copy(mem[len(RegionMagic):], key)
	return &shmArena{
		name:    "go-shm-" + randomHex(regionNameRandBytes),
		shmName: shmName,
		key:     key,
		mem:     mem,
		alloc:   newAllocator(size, BlockAlignment),
		linked:  true,
	}, nil
}

func unlinkShm(name string) error { return syscall.Unlink(shmPath(name)) }

func unmapShm(mem []byte) error { return syscall.Munmap(mem) }
