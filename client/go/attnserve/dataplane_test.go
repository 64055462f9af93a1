//go:build linux

package attnserve

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"net"
	"os"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "attnserve/client/go/gen/attnservev1"
)

// shmServer serves shared-memory regions as attention.proto describes them (the header is
// checked at registration, slices for bounds and alignment) and answers Prefill/Decode with the
// query as the output and lse[r][h] = r, written where the call asks.
type shmServer struct {
	pb.UnimplementedAttentionServiceServer
	enabled bool
	stall   chan struct{} // when set, Prefill waits for it (or its deadline)
	refuse  codes.Code    // when set, Prefill fails with it

	mu       sync.Mutex
	regions  map[string][]byte // by session + "/" + name
	prefills []*pb.PrefillRequest
	decodes  []*pb.DecodeRequest
	tables   [][]int32 // the page table arrays each call named in a region
	unregs   int
	sessions int
}

func (s *shmServer) GetServerInfo(context.Context, *pb.GetServerInfoRequest) (*pb.GetServerInfoResponse, error) {
	return &pb.GetServerInfoResponse{Version: "shm-fake",
		DataPlane: &pb.DataPlane{SharedMemory: s.enabled, MaxRegionsPerSession: 4, MaxRegionBytesPerSession: 1 << 30}}, nil
}

// OpenSession hands out handles: the client opens one before its first call that needs it.
func (s *shmServer) OpenSession(context.Context, *pb.OpenSessionRequest) (*pb.OpenSessionResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.sessions++
	return &pb.OpenSessionResponse{Session: fmt.Sprintf("session-%d", s.sessions), LeaseMs: 30000}, nil
}

func (s *shmServer) RegisterRegion(_ context.Context, r *pb.RegisterRegionRequest) (*pb.RegisterRegionResponse, error) {
	if !s.enabled || r.GetSharedMemory() == nil {
		return nil, status.Error(codes.Unimplemented, "regions are off")
	}
	name := r.GetSharedMemory().GetShmName()
	if !strings.HasPrefix(name, "/attnserve-") || r.Offset%64 != 0 || r.Size < 48 {
		return nil, status.Errorf(codes.InvalidArgument, "bad region %v", r)
	}
	fd, err := syscall.Open("/dev/shm/"+name[1:], syscall.O_RDWR, 0)
	if err != nil {
		return nil, status.Error(codes.NotFound, err.Error())
	}
	defer syscall.Close(fd)
	mem, err := syscall.Mmap(fd, r.Offset, int(r.Size), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	if err != nil {
		return nil, status.Error(codes.FailedPrecondition, err.Error())
	}
	if !bytes.Equal(mem[:48], append([]byte(RegionMagic), r.Key...)) {
		syscall.Munmap(mem)
		return nil, status.Error(codes.FailedPrecondition, "header does not match")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.regions == nil {
		s.regions = map[string][]byte{}
	}
	s.regions[r.Session+"/"+r.Name] = mem
	return &pb.RegisterRegionResponse{Region: &pb.RegionInfo{Name: r.Name, Size: r.Size}}, nil
}

func (s *shmServer) UnregisterRegion(_ context.Context, r *pb.UnregisterRegionRequest) (*pb.UnregisterRegionResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	mem, ok := s.regions[r.Session+"/"+r.Name]
	if !ok {
		return nil, status.Error(codes.NotFound, r.Name)
	}
	syscall.Munmap(mem)
	delete(s.regions, r.Session+"/"+r.Name)
	s.unregs++
	return &pb.UnregisterRegionResponse{}, nil
}

func (s *shmServer) ListRegions(_ context.Context, r *pb.ListRegionsRequest) (*pb.ListRegionsResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := &pb.ListRegionsResponse{}
	for key, mem := range s.regions {
		if strings.HasPrefix(key, r.Session+"/") {
			out.Regions = append(out.Regions, &pb.RegionInfo{Name: key[len(r.Session)+1:], Size: int64(len(mem))})
		}
	}
	return out, nil
}

// slice is [at.offset, +n) of a region of the session, checked.
func (s *shmServer) slice(session string, at *pb.RegionSlice, n int64) ([]byte, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	mem, ok := s.regions[session+"/"+at.GetName()]
	if !ok {
		return nil, status.Errorf(codes.NotFound, "no region %q", at.GetName())
	}
	if at.Offset%16 != 0 || at.Offset < 0 || at.Offset+n > int64(len(mem)) {
		return nil, status.Errorf(codes.InvalidArgument, "bad slice %v of %d bytes", at, n)
	}
	return mem[at.Offset : at.Offset+n], nil
}

func (s *shmServer) answer(session string, q *pb.Tensor, ref *pb.PageTableRef, prefill bool,
	out, lse *pb.RegionSlice) (*pb.AttentionResponse, error) {
	n := int64(1)
	for _, d := range q.Shape {
		n *= d
	}
	data := q.Data
	if q.Region != nil {
		in, err := s.slice(session, q.Region, 2*n)
		if err != nil {
			return nil, err
		}
		data = append([]byte{}, in...)
	}
	if ref != nil {
		words := 2*int64(ref.Batch) + 1 + int64(ref.NumPages)
		if prefill {
			words += int64(ref.Batch) + 1
		}
		raw, err := s.slice(session, ref.At, 4*words)
		if err != nil {
			return nil, err
		}
		table := make([]int32, words)
		for i := range table {
			table[i] = int32(binary.LittleEndian.Uint32(raw[4*i:]))
		}
		s.mu.Lock()
		s.tables = append(s.tables, table)
		s.mu.Unlock()
	}
	resp := &pb.AttentionResponse{Output: &pb.Tensor{Dtype: pb.DType_DTYPE_BF16, Shape: q.Shape, Data: data}}
	if out != nil {
		dst, err := s.slice(session, out, 2*n)
		if err != nil {
			return nil, err
		}
		copy(dst, data)
		resp.Output = &pb.Tensor{Dtype: pb.DType_DTYPE_BF16, Shape: q.Shape, Region: out}
	}
	if lse != nil {
		rows, heads := q.Shape[0], q.Shape[1]
		dst, err := s.slice(session, lse, 4*rows*heads)
		if err != nil {
			return nil, err
		}
		for i := int64(0); i < rows*heads; i++ {
			binary.LittleEndian.PutUint32(dst[4*i:], math.Float32bits(float32(i/heads)))
		}
		resp.Lse = &pb.Tensor{Dtype: pb.DType_DTYPE_FP32, Shape: []int64{rows, heads}, Region: lse}
	}
	return resp, nil
}

func (s *shmServer) Prefill(ctx context.Context, r *pb.PrefillRequest) (*pb.AttentionResponse, error) {
	s.mu.Lock()
	s.prefills = append(s.prefills, r)
	stall, refuse := s.stall, s.refuse
	s.mu.Unlock()
	if refuse != codes.OK {
		return nil, status.Error(refuse, "refused")
	}
	if stall != nil {
		select {
		case <-stall:
		case <-ctx.Done():
			// As a real server answers: DEADLINE_EXCEEDED. A plain ctx.Err() reaches the
			// client as UNKNOWN, and does so whenever this side's timer fires first.
			return nil, status.FromContextError(ctx.Err()).Err()
		}
	}
	return s.answer(r.Session, r.Q, r.PageTable, true, r.OutputTo, r.LseTo)
}

func (s *shmServer) Decode(_ context.Context, r *pb.DecodeRequest) (*pb.AttentionResponse, error) {
	s.mu.Lock()
	s.decodes = append(s.decodes, r)
	s.mu.Unlock()
	return s.answer(r.Session, r.Q, r.PageTable, false, r.OutputTo, r.LseTo)
}

func startShm(t *testing.T, s *shmServer, opts ...Option) *Client {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	pb.RegisterAttentionServiceServer(srv, s)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	c, err := Dial(lis.Addr().String(), opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func oneSeq(rows int) BatchCSR {
	return BatchCSR{QOIndptr: []int32{0, int32(rows)}, KVIndptr: []int32{0, 1}, KVIndices: []int32{7},
		KVLastPageLen: []int32{int32(rows)}}
}

func query(rows, heads, dim int, seed uint16) BF16Tensor {
	t := BF16Tensor{Shape: []int{rows, heads, dim}, Data: make([]uint16, rows*heads*dim)}
	for i := range t.Data {
		t.Data[i] = seed + uint16(i)
	}
	return t
}

func TestAllocatorAlignsReusesAndCoalesces(t *testing.T) {
	a := newAllocator(1024, 64)
	first, second, third := a.allocate(1), a.allocate(65), a.allocate(64)
	if first != 64 || second != 128 || third != 256 {
		t.Fatalf("offsets %d %d %d, want 64 128 256", first, second, third)
	}
	a.release(second)
	if got := a.allocate(100); got != 128 {
		t.Fatalf("first fit gave %d, want the freed 128", got)
	}
	a.release(128)
	a.release(first)
	a.release(third)
	if a.usedBytes() != 0 || len(a.free) != 1 || a.free[0] != [2]int64{64, 960} {
		t.Fatalf("not coalesced: used %d, free %v", a.usedBytes(), a.free)
	}
	if a.allocate(960) != 64 || a.allocate(1) != -1 {
		t.Fatal("the whole arena must be one block, then none is left")
	}
	defer func() {
		if recover() == nil {
			t.Fatal("a double free must panic")
		}
	}()
	a.release(128)
}

func TestArenaHeaderModeAndUnlink(t *testing.T) {
	a, err := newShmArena(1<<16, DefaultShmPrefix, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer a.close()
	if !strings.HasPrefix(a.shmName, "/attnserve-") || len(a.shmName) != len("/attnserve-")+32 {
		t.Fatalf("shm name %q", a.shmName)
	}
	path := "/dev/shm/" + a.shmName[1:]
	st, err := os.Stat(path)
	if err != nil || st.Mode().Perm() != 0o600 || st.Size() != 1<<16 {
		t.Fatalf("stat %v, %v", st, err)
	}
	head, _ := os.ReadFile(path)
	if string(head[:16]) != RegionMagic || !bytes.Equal(head[16:48], a.key) || len(a.key) != 32 {
		t.Fatalf("header %q", head[:48])
	}
	req := a.registerRequest()
	if req.GetSharedMemory().GetShmName() != a.shmName || req.Size != 1<<16 || !bytes.Equal(req.Key, a.key) {
		t.Fatalf("request %v", req)
	}
	a.registered()
	if _, err := os.Stat(path); !os.IsNotExist(err) {
		t.Fatalf("the name must be unlinked once registered: %v", err)
	}
	b, err := newShmArena(4096, "/team", 0o640)
	if err != nil {
		t.Fatal(err)
	}
	other := "/dev/shm/" + b.shmName[1:]
	if st, err := os.Stat(other); err != nil || st.Mode().Perm() != 0o640 {
		t.Fatalf("mode: %v %v", st, err)
	}
	b.close()
	if _, err := os.Stat(other); !os.IsNotExist(err) {
		t.Fatal("closing an unregistered arena must unlink it")
	}
	for _, bad := range []string{"attnserve", "/a/b", "/a b"} {
		if _, err := newShmArena(4096, bad, 0o600); err == nil {
			t.Errorf("prefix %q accepted", bad)
		}
	}
}

func TestLocalAddressesAndTransports(t *testing.T) {
	for addr, local := range map[string]bool{
		"unix:/run/attn.sock": true, "127.0.0.1:50051": true, "localhost:1": true, "[::1]:50051": true,
		"dns:///localhost:50051": true, "ipv4:127.0.0.2:1": true, "10.0.0.1:50051": false,
		"attn.example.com:443": false, "0.0.0.0:1": false,
	} {
		if IsLocalAddress(addr) != local {
			t.Errorf("IsLocalAddress(%q) != %v", addr, local)
		}
	}
	for _, s := range []string{"auto", "bytes", "shm"} {
		if got, err := ParseTransport(s); err != nil || string(got) != s {
			t.Errorf("ParseTransport(%q) = %v, %v", s, got, err)
		}
	}
	if _, err := ParseTransport("cuda"); err == nil || !strings.Contains(err.Error(), "Python") {
		t.Errorf("cuda: %v", err)
	}
	if _, err := ParseTransport("tcp"); err == nil {
		t.Error("tcp accepted")
	}
}

func TestAutoUsesSharedMemoryOnLoopback(t *testing.T) {
	s := &shmServer{enabled: true}
	c := startShm(t, s)
	ctx := context.Background()
	q := query(3, 4, 8, 100)
	k := query(3, 2, 8, 7)
	res, err := c.Prefill(ctx, &AttentionRequest{Layer: 1, Q: q, KNew: k, VNew: k, Table: oneSeq(3), ReturnLSE: true})
	if err != nil {
		t.Fatal(err)
	}
	sent := s.prefills[0]
	if sent.Q.GetRegion() == nil || len(sent.Q.Data) != 0 || sent.KNew.GetRegion() == nil ||
		sent.OutputTo == nil || sent.LseTo == nil {
		t.Fatalf("the request must name regions, not carry bytes: %v", sent)
	}
	offsets := map[int64]bool{}
	for _, o := range []int64{sent.Q.Region.Offset, sent.KNew.Region.Offset, sent.VNew.Region.Offset,
		sent.OutputTo.Offset, sent.LseTo.Offset} {
		if o%16 != 0 || offsets[o] {
			t.Fatalf("offset %d misaligned or shared", o)
		}
		offsets[o] = true
	}
	if fmt.Sprint(res.Output.Data) != fmt.Sprint(q.Data) || fmt.Sprint(res.Output.Shape) != "[3 4 8]" {
		t.Fatalf("output %v, want the query back", res.Output.Shape)
	}
	if fmt.Sprint(res.LSE.Data) != "[0 0 0 0 1 1 1 1 2 2 2 2]" {
		t.Fatalf("lse %v", res.LSE.Data)
	}
	// The result is a copy: a later call reusing the block leaves it alone.
	if _, err := c.Prefill(ctx, &AttentionRequest{Q: query(3, 4, 8, 900), Table: oneSeq(3)}); err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(res.Output.Data) != fmt.Sprint(q.Data) {
		t.Fatal("a later call changed an earlier result")
	}
	if regions, err := c.ListRegions(ctx); err != nil || len(regions) != 1 {
		t.Fatalf("regions %v, %v", regions, err)
	}
	if used := c.plane.arenas[0].alloc.usedBytes(); used != 0 {
		t.Fatalf("%d bytes still allocated after the calls", used)
	}
	c.Close()
	if s.unregs != 1 || len(s.regions) != 0 {
		t.Fatalf("close must unregister: %d, %v", s.unregs, s.regions)
	}
}

func TestStagedPageTableServesEveryLayer(t *testing.T) {
	s := &shmServer{enabled: true}
	c := startShm(t, s)
	ctx := context.Background()
	csr := BatchCSR{QOIndptr: []int32{0, 1, 2}, KVIndptr: []int32{0, 2, 3}, KVIndices: []int32{5, 6, 9},
		KVLastPageLen: []int32{4, 1}}
	table, err := c.StagePageTable(ctx, csr)
	if err != nil || !table.Staged() {
		t.Fatalf("staged %v, %v", table, err)
	}
	for layer := 0; layer < 3; layer++ {
		if _, err := c.Decode(ctx, &AttentionRequest{Layer: layer, Q: query(2, 4, 8, 1), PageTable: table}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := c.Prefill(ctx, &AttentionRequest{Q: query(2, 4, 8, 1), PageTable: table}); err != nil {
		t.Fatal(err)
	}
	for _, d := range s.decodes {
		if d.PageTable == nil || len(d.KvIndptr) != 0 || !proto3Equal(d.PageTable, s.decodes[0].PageTable) {
			t.Fatalf("decode named %v", d)
		}
	}
	want := []string{"[0 2 3 4 1 5 6 9]", "[0 2 3 4 1 5 6 9]", "[0 2 3 4 1 5 6 9]", "[0 2 3 4 1 5 6 9 0 1 2]"}
	if fmt.Sprint(s.tables) != "["+strings.Join(want, " ")+"]" {
		t.Fatalf("tables %v, want %v", s.tables, want)
	}
	table.Release()
	table.Release()
}

func proto3Equal(a, b *pb.PageTableRef) bool {
	return a.At.Name == b.At.Name && a.At.Offset == b.At.Offset && a.Batch == b.Batch && a.NumPages == b.NumPages
}

func TestAutoSendsBytesToServersWithoutSharedMemory(t *testing.T) {
	s := &shmServer{}
	c := startShm(t, s)
	ctx := context.Background()
	table, err := c.StagePageTable(ctx, oneSeq(1))
	if err != nil || table.Staged() {
		t.Fatalf("staged %v, %v", table.Staged(), err)
	}
	res, err := c.Prefill(ctx, &AttentionRequest{Q: query(1, 4, 8, 3), PageTable: table})
	if err != nil || s.prefills[0].Q.GetRegion() != nil || len(s.prefills[0].KvIndptr) != 2 {
		t.Fatalf("%v %v", s.prefills[0], err)
	}
	if fmt.Sprint(res.Output.Data) != fmt.Sprint(query(1, 4, 8, 3).Data) {
		t.Fatal("bytes output")
	}
	explicit := startShm(t, &shmServer{}, WithTransport(TransportSHM))
	if _, err := explicit.Prefill(ctx, &AttentionRequest{Q: query(1, 4, 8, 3), Table: oneSeq(1)}); Code(err) != codes.Unimplemented {
		t.Fatalf("explicit shm against a server without regions: %v", err)
	}
}

func TestBlocksOfUnansweredCallsAreNeverReused(t *testing.T) {
	s := &shmServer{enabled: true, stall: make(chan struct{})}
	c := startShm(t, s, WithoutRetries())
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	if _, err := c.Prefill(ctx, &AttentionRequest{Q: query(2, 4, 8, 1), Table: oneSeq(2)}); Code(err) != codes.DeadlineExceeded {
		t.Fatalf("stalled call: %v", err)
	}
	arena := c.plane.arenas[0]
	orphaned := arena.alloc.usedBytes()
	if orphaned == 0 || c.plane.orphaned != orphaned {
		t.Fatalf("the unanswered call's block must stay allocated: %d, %d", orphaned, c.plane.orphaned)
	}
	close(s.stall)
	s.mu.Lock()
	s.stall, s.refuse = nil, codes.InvalidArgument
	s.mu.Unlock()
	if _, err := c.Prefill(context.Background(), &AttentionRequest{Q: query(2, 4, 8, 1), Table: oneSeq(2)}); Code(err) != codes.InvalidArgument {
		t.Fatalf("refused call: %v", err)
	}
	if arena.alloc.usedBytes() != orphaned {
		t.Fatal("a refused call's block must be given back")
	}
}

func TestConcurrentCallsGetTheirOwnBlocks(t *testing.T) {
	s := &shmServer{enabled: true}
	c := startShm(t, s, WithArenaBytes(1<<20))
	var wg sync.WaitGroup
	errs := make(chan error, 32)
	for i := 0; i < 32; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			q := query(4, 4, 8, uint16(1000*i))
			res, err := c.Decode(context.Background(), &AttentionRequest{Q: q, Table: oneSeq(4)})
			if err == nil && fmt.Sprint(res.Output.Data) != fmt.Sprint(q.Data) {
				err = fmt.Errorf("call %d got another call's output", i)
			}
			errs <- err
		}(i)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	for _, a := range c.plane.arenas {
		if a.alloc.usedBytes() != 0 {
			t.Fatal("blocks left allocated")
		}
	}
}

func TestALargeCallGetsALargerArena(t *testing.T) {
	s := &shmServer{enabled: true}
	c := startShm(t, s, WithArenaBytes(4096))
	q := query(64, 4, 8, 0) // 4 KiB of input, 4 KiB of output
	res, err := c.Prefill(context.Background(), &AttentionRequest{Q: q, Table: oneSeq(64)})
	if err != nil || fmt.Sprint(res.Output.Data) != fmt.Sprint(q.Data) {
		t.Fatalf("%v", err)
	}
	if len(c.plane.arenas) != 1 || c.plane.arenas[0].size() < 8192 {
		t.Fatalf("arenas %d", len(c.plane.arenas))
	}
}
