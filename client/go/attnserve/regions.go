package attnserve

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"sort"
	"strings"
	"sync"

	pb "attnserve/client/go/gen/attnservev1"
)

// Registered memory (attention.proto "Registered memory"): a session may register memory it
// shares with the server, and calls then name slices of it instead of carrying tensors, page
// tables and outputs as bytes. This client registers POSIX shared memory of its own (arenas:
// /dev/shm/attnserve-<32 hex digits>, 128 random bits, created O_EXCL with mode 0600) that
// starts with the 48-byte proof of access the server checks (RegionMagic, then a random 32-byte
// key). The name is unlinked as soon as the server has mapped the object, so a client that dies
// afterwards leaves nothing in /dev/shm; the server's mapping goes with the region's session.

// Transport says how a client's calls carry their tensors (WithTransport).
type Transport string

const (
	// TransportAuto uses shared memory for unix: and loopback addresses when the server's
	// ServerInfo.DataPlane allows it (asked once, on the first attention call), bytes otherwise.
	TransportAuto Transport = "auto"
	// TransportBytes carries every tensor and page table in the messages.
	TransportBytes Transport = "bytes"
	// TransportSHM puts tensors, staged page tables and outputs in shared memory; a server that
	// refuses the region fails the call.
	TransportSHM Transport = "shm"
)

// ParseTransport accepts "auto", "bytes" and "shm" (CUDA IPC is the Python client's).
func ParseTransport(s string) (Transport, error) {
	switch t := Transport(s); t {
	case TransportAuto, TransportBytes, TransportSHM:
		return t, nil
	case "cuda":
		return "", errors.New("transport cuda is the Python client's (torch CUDA tensors); the Go client has auto, bytes and shm")
	}
	return "", fmt.Errorf("transport must be auto, bytes or shm, got %q", s)
}

// Region header and alignment (attention.proto).
const (
	RegionMagic       = "attnserve.region"
	RegionKeyBytes    = 32
	RegionHeaderBytes = len(RegionMagic) + RegionKeyBytes // 48
	// SliceAlignment: RegionSlice offsets are multiples of it. The client allocates blocks of
	// BlockAlignment (whole cache lines).
	SliceAlignment      = 16
	BlockAlignment      = 64
	DefaultShmPrefix    = "/attnserve"
	DefaultArenaBytes   = 64 << 20
	defaultShmMode      = 0o600
	regionNameRandBytes = 8
)

// IsLocalAddress reports whether a gRPC target is on this node: unix: sockets and loopback.
func IsLocalAddress(address string) bool {
	a := strings.TrimSpace(address)
	if strings.HasPrefix(a, "unix:") || strings.HasPrefix(a, "unix-abstract:") {
		return true
	}
	for _, scheme := range []string{"dns:///", "dns:", "ipv4:", "ipv6:", "passthrough:///"} {
		if strings.HasPrefix(a, scheme) {
			a = a[len(scheme):]
			break
		}
	}
	host := a
	if h, _, err := net.SplitHostPort(a); err == nil {
		host = h
	}
	host = strings.Trim(host, "[]")
	if strings.EqualFold(host, "localhost") || strings.EqualFold(host, "ip6-localhost") {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

func randomHex(n int) string {
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		panic(fmt.Sprintf("attnserve: no randomness: %v", err))
	}
	return hex.EncodeToString(b)
}

// newShmName is prefix-<32 hex digits>, checked to be a POSIX shared-memory name.
func newShmName(prefix string) (string, error) {
	if !strings.HasPrefix(prefix, "/") || strings.Contains(prefix[1:], "/") {
		return "", fmt.Errorf("shm prefix %q must be '/' followed by no other '/'", prefix)
	}
	for _, c := range prefix[1:] {
		ok := c == '_' || c == '.' || c == '-' || (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') ||
			(c >= 'A' && c <= 'Z')
		if !ok {
			return "", fmt.Errorf("shm prefix %q may hold only [A-Za-z0-9_.-]", prefix)
		}
	}
	name := prefix + "-" + randomHex(16)
	if len(name) > 255 {
		return "", fmt.Errorf("shm prefix %q is too long", prefix)
	}
	return name, nil
}

func alignUp(n, a int64) int64 { return (n + a - 1) / a * a }

// allocator hands out BlockAlignment-aligned blocks of [start, size), first fit, coalescing
// on free. Safe for concurrent use.
type allocator struct {
	mu       sync.Mutex
	free     [][2]int64 // sorted (offset, size) extents
	used     map[int64]int64
	capacity int64
}

func newAllocator(size, start int64) *allocator {
	end := size - size%BlockAlignment
	a := &allocator{used: map[int64]int64{}}
	if end > start {
		a.free = [][2]int64{{start, end - start}}
		a.capacity = end - start
	}
	return a
}

// allocate returns the offset of a block of at least n bytes, or -1.
func (a *allocator) allocate(n int64) int64 {
	if n < 1 {
		n = 1
	}
	need := alignUp(n, BlockAlignment)
	a.mu.Lock()
	defer a.mu.Unlock()
	for i, e := range a.free {
		if e[1] < need {
			continue
		}
		if e[1] == need {
			a.free = append(a.free[:i], a.free[i+1:]...)
		} else {
			a.free[i] = [2]int64{e[0] + need, e[1] - need}
		}
		a.used[e[0]] = need
		return e[0]
	}
	return -1
}

// release gives a block back; it panics on a block that is not allocated (a double free).
func (a *allocator) release(offset int64) {
	a.mu.Lock()
	defer a.mu.Unlock()
	size, ok := a.used[offset]
	if !ok {
		panic(fmt.Sprintf("attnserve: arena block at %d freed twice", offset))
	}
	delete(a.used, offset)
	i := sort.Search(len(a.free), func(i int) bool { return a.free[i][0] > offset })
	if i < len(a.free) && a.free[i][0] == offset+size { // merge the next extent
		size += a.free[i][1]
		a.free = append(a.free[:i], a.free[i+1:]...)
	}
	if i > 0 && a.free[i-1][0]+a.free[i-1][1] == offset { // merge into the previous one
		a.free[i-1][1] += size
		return
	}
	a.free = append(a.free, [2]int64{})
	copy(a.free[i+1:], a.free[i:])
	a.free[i] = [2]int64{offset, size}
}

func (a *allocator) usedBytes() int64 {
	a.mu.Lock()
	defer a.mu.Unlock()
	var n int64
	for _, s := range a.used {
		n += s
	}
	return n
}

// shmArena is a shared-memory object of this client, mapped, its header written at offset 0.
type shmArena struct {
	name    string // RegisterRegionRequest.name: go-shm-<16 hex digits>
	shmName string
	key     []byte
	mem     []byte
	alloc   *allocator

	mu     sync.Mutex
	linked bool
	closed bool
}

func (a *shmArena) size() int64 { return int64(len(a.mem)) }

func (a *shmArena) registerRequest() *pb.RegisterRegionRequest {
	return &pb.RegisterRegionRequest{
		Name:   a.name,
		Memory: &pb.RegisterRegionRequest_SharedMemory{SharedMemory: &pb.SharedMemory{ShmName: a.shmName}},
		Offset: 0,
		Size:   a.size(),
		Key:    a.key,
	}
}

// registered: the server has mapped the object, so its name is no longer needed.
func (a *shmArena) registered() { a.unlink() }

func (a *shmArena) close() error {
	a.mu.Lock()
	if a.closed {
		a.mu.Unlock()
		return nil
	}
	a.closed = true
	a.mu.Unlock()
	a.unlink()
	return unmapShm(a.mem)
}

func (a *shmArena) unlink() {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.linked {
		a.linked = false
		_ = unlinkShm(a.shmName)
	}
}

// block is an allocation in an arena: the slices of one call or one staged page table.
type block struct {
	arena    *shmArena
	offset   int64
	size     int64
	used     int64
	released bool
}

func (a *shmArena) allocate(n int64) *block {
	off := a.alloc.allocate(n)
	if off < 0 {
		return nil
	}
	return &block{arena: a, offset: off, size: n}
}

// carve returns the arena offset of the next slice of n bytes of the block.
func (b *block) carve(n int64) int64 {
	if b.used+n > b.size {
		panic(fmt.Sprintf("attnserve: %d more bytes overrun a block of %d", n, b.size))
	}
	off := b.offset + b.used
	b.used = alignUp(b.used+n, BlockAlignment)
	return off
}

func (b *block) release() {
	if !b.released {
		b.released = true
		b.arena.alloc.release(b.offset)
	}
}

// bytes is the arena memory of [off, off+n).
func (b *block) bytes(off, n int64) []byte { return b.arena.mem[off : off+n] }
