package attnserve

import (
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"sync"
	"time"
	"unsafe"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"

	pb "attnserve/client/go/gen/attnservev1"
)

// The data plane of one client (see regions.go): whether calls use shared memory, the arenas
// registered for the client's session, and staging a call's tensors into them.
//
// Every call allocates its own block of an arena for its inputs, output and lse (concurrent
// calls never share one), and gives it back when the answer has been read: outputs are copied
// out, so results stay valid while later calls reuse the block. A call the server refused (a
// bad reference changes nothing there) gives its block back at once; a call that ended without
// an answer (deadline, cancellation, a lost connection) may still run on the server, reading
// and writing its block, so that block is never reused.
type dataPlane struct {
	transport  Transport
	address    string
	arenaBytes int64
	prefix     string
	mode       uint32

	mu         sync.Mutex
	resolved   bool
	shm        bool
	limitBytes int64 // DataPlane.max_region_bytes_per_session, 0: unknown
	arenas     []*shmArena
	generation int
	orphaned   int64

	registering sync.Mutex // one arena registration at a time
}

func newDataPlane(o options, address string) *dataPlane {
	p := &dataPlane{transport: o.transport, address: address, arenaBytes: o.arenaBytes,
		prefix: o.shmPrefix, mode: o.shmMode}
	switch {
	case o.transport == TransportSHM:
		p.resolved, p.shm = true, true
	case o.transport == TransportBytes || !IsLocalAddress(address):
		p.resolved = true
	}
	return p
}

// fresh is a plane of the same settings without arenas (for a client of another session).
func (p *dataPlane) fresh() *dataPlane {
	return newDataPlane(options{transport: p.transport, arenaBytes: p.arenaBytes, shmPrefix: p.prefix,
		shmMode: p.mode}, p.address)
}

// useShm says whether calls go through shared memory, asking the server once for auto.
func (c *Client) useShm(ctx context.Context) (bool, error) {
	p := c.plane
	p.mu.Lock()
	resolved, shm := p.resolved, p.shm
	p.mu.Unlock()
	if resolved {
		return shm, nil
	}
	info, err := c.ServerInfo(ctx)
	if err != nil {
		return false, err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.resolved = true
	p.shm = info.DataPlane.SharedMemory
	p.limitBytes = info.DataPlane.MaxRegionBytesPerSession
	p.generation++
	return p.shm, nil
}

// block allocates n bytes from an arena, registering a new arena when none has room. nil
// without an error: send the call as bytes (auto, when the server refused shared memory or the
// session's region limits are reached).
func (c *Client) block(ctx context.Context, n int64) (*block, error) {
	p := c.plane
	for {
		p.mu.Lock()
		if !p.shm {
			p.mu.Unlock()
			return nil, nil
		}
		arenas, gen := p.arenas, p.generation
		p.mu.Unlock()
		for _, a := range arenas {
			if b := a.allocate(n); b != nil {
				return b, nil
			}
		}
		ok, err := c.addArena(ctx, n, gen)
		if err != nil || !ok {
			return nil, err
		}
	}
}

// addArena registers an arena that can hold n bytes, unless another call did since gen.
// false: this call goes as bytes.
func (c *Client) addArena(ctx context.Context, n int64, gen int) (bool, error) {
	p := c.plane
	p.registering.Lock()
	defer p.registering.Unlock()
	p.mu.Lock()
	changed := p.generation != gen
	size := p.arenaBytes
	if want := alignUp(2*n, 1<<20); want > size {
		size = want
	}
	if p.limitBytes > 0 {
		var used int64
		for _, a := range p.arenas {
			used += a.size()
		}
		if room := p.limitBytes - used; room < size {
			size = room
		}
		if size < n+2*BlockAlignment {
			size = n + 2*BlockAlignment
		}
	}
	p.mu.Unlock()
	if changed {
		return true, nil
	}
	a, err := newShmArena(size, p.prefix, p.mode)
	if err != nil {
		return p.failed(err)
	}
	if _, err := c.RegisterRegion(ctx, a.registerRequest()); err != nil {
		_ = a.close()
		return p.failed(err)
	}
	a.registered()
	p.mu.Lock()
	p.arenas = append(p.arenas, a)
	p.generation++
	p.mu.Unlock()
	return true, nil
}

// failed handles an arena that could not be made or registered: an explicit shm transport
// returns the error; auto sends this call as bytes, and stops using shared memory unless the
// cause was the session's region limits.
func (p *dataPlane) failed(err error) (bool, error) {
	if p.transport != TransportAuto {
		return false, err
	}
	if Code(err) != codes.ResourceExhausted {
		p.mu.Lock()
		p.shm = false
		p.generation++
		p.mu.Unlock()
	}
	return false, nil
}

func (p *dataPlane) orphan(b *block) {
	p.mu.Lock()
	p.orphaned += b.size
	p.mu.Unlock()
}

// takeArenas forgets every arena (the client unregisters and closes them).
func (p *dataPlane) takeArenas() []*shmArena {
	p.mu.Lock()
	defer p.mu.Unlock()
	arenas := p.arenas
	p.arenas = nil
	p.generation++
	return arenas
}

// releaseRegions unregisters (when the session still has them) and unmaps the arenas.
func (c *Client) releaseRegions(unregister bool) {
	for _, a := range c.plane.takeArenas() {
		if unregister {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			_ = c.UnregisterRegion(ctx, a.name) // shared memory: the server keeps its own mapping
			cancel()
		}
		_ = a.close()
	}
}

// RegisterRegion registers memory the caller shares with the server (the transports register
// their own arenas; this is for memory managed by the caller, its header written). Not retried
// on Unavailable.
func (c *Client) RegisterRegion(ctx context.Context, req *pb.RegisterRegionRequest) (*pb.RegionInfo, error) {
	if err := c.nameSession(ctx, &req.Session); err != nil {
		return nil, err
	}
	var resp *pb.RegisterRegionResponse
	err := c.invoke(ctx, "RegisterRegion", func(ctx context.Context, o []grpc.CallOption) (err error) {
		resp, err = c.stub.RegisterRegion(ctx, req, o...)
		return err
	})
	if err != nil {
		return nil, err
	}
	return resp.GetRegion(), nil
}

// UnregisterRegion unregisters a region of the client's session (FailedPrecondition while a
// call uses it).
func (c *Client) UnregisterRegion(ctx context.Context, name string) error {
	session, err := c.sessionFor(ctx)
	if err != nil {
		return err
	}
	req := &pb.UnregisterRegionRequest{Name: name, Session: session}
	return c.invoke(ctx, "UnregisterRegion", func(ctx context.Context, o []grpc.CallOption) error {
		_, err := c.stub.UnregisterRegion(ctx, req, o...)
		return err
	})
}

// ListRegions returns the regions the server holds for the client's session.
func (c *Client) ListRegions(ctx context.Context) ([]*pb.RegionInfo, error) {
	var resp *pb.ListRegionsResponse
	session, err := c.sessionFor(ctx)
	if err != nil {
		return nil, err
	}
	req := &pb.ListRegionsRequest{Session: session}
	err = c.invoke(ctx, "ListRegions", func(ctx context.Context, o []grpc.CallOption) (err error) {
		resp, err = c.stub.ListRegions(ctx, req, o...)
		return err
	})
	if err != nil {
		return nil, err
	}
	return resp.GetRegions(), nil
}

// StagedPageTable is a page table written once into shared memory for the calls of one step
// (every layer): set it as AttentionRequest.PageTable and the calls name it (PageTableRef)
// instead of sending the same arrays each time. Without shared memory it holds the arrays,
// which then travel in each call. Release it after the step, not while a call using it runs.
type StagedPageTable struct {
	CSR     BatchCSR
	blk     *block
	prefill *pb.PageTableRef
	decode  *pb.PageTableRef
}

// Staged reports whether the table is in shared memory.
func (t *StagedPageTable) Staged() bool { return t.blk != nil && !t.blk.released }

// Release gives the table's shared memory back (a no-op when not staged or released).
func (t *StagedPageTable) Release() {
	if t.blk != nil {
		t.blk.release()
	}
}

// pageTableLayout is the int32 layout of PageTableRef: kv_indptr [batch+1], kv_last_page_len
// [batch], kv_indices, then qo_indptr (read by Prefill only: a Decode reads the same table
// without it).
func pageTableLayout(csr BatchCSR) []int32 {
	batch := len(csr.KVIndptr) - 1
	last := csr.KVLastPageLen
	if len(last) > batch {
		last = last[:batch]
	}
	if len(last) < batch { // page_size 1 may omit it: every page holds one token
		last = make([]int32, batch)
		for i := range last {
			last[i] = 1
		}
	}
	layout := append(append(append([]int32{}, csr.KVIndptr...), last...), csr.KVIndices...)
	return append(layout, csr.QOIndptr...)
}

// StagePageTable writes csr into shared memory (when the client uses it) for the calls of a
// step; see StagedPageTable.
func (c *Client) StagePageTable(ctx context.Context, csr BatchCSR) (*StagedPageTable, error) {
	t := &StagedPageTable{CSR: csr}
	shm, err := c.useShm(ctx)
	if err != nil || !shm {
		return t, err
	}
	layout := pageTableLayout(csr)
	b, err := c.block(ctx, 4*int64(len(layout)))
	if err != nil || b == nil {
		return t, err
	}
	off := b.carve(4 * int64(len(layout)))
	dst := b.bytes(off, 4*int64(len(layout)))
	for i, v := range layout {
		binary.LittleEndian.PutUint32(dst[4*i:], uint32(v))
	}
	ref := &pb.PageTableRef{At: &pb.RegionSlice{Name: b.arena.name, Offset: off},
		Batch: int32(len(csr.KVIndptr) - 1), NumPages: int32(len(csr.KVIndices))}
	t.blk, t.prefill, t.decode = b, ref, ref
	return t, nil
}

// stagedCall is a request whose tensors are in an arena block.
type stagedCall struct {
	plane            *dataPlane
	blk              *block
	inputs           [6]int64 // arena offsets of the tensors, in AttentionRequest.tensors order
	out, lse         int64    // arena offsets; lse -1 without ReturnLSE
	outShape, lseDim []int
}

// refused are the codes with which the server refuses a call before it runs.
var refused = map[codes.Code]bool{codes.InvalidArgument: true, codes.NotFound: true,
	codes.FailedPrecondition: true, codes.ResourceExhausted: true, codes.Unimplemented: true,
	codes.PermissionDenied: true, codes.Unauthenticated: true, codes.OutOfRange: true,
	codes.AlreadyExists: true}

func (s *stagedCall) abandon(err error) {
	if refused[Code(err)] {
		s.blk.release()
		return
	}
	s.plane.orphan(s.blk)
}

// attend sends a Prefill or Decode, staging its tensors in shared memory when the client uses
// it.
func (c *Client) attend(ctx context.Context, req *AttentionRequest, prefill bool) (*AttentionResult, error) {
	method := "Decode"
	if prefill {
		method = "Prefill"
	}
	if err := checkPlan(method, req, prefill); err != nil {
		return nil, err
	}
	shm, err := c.useShm(ctx)
	if err != nil {
		return nil, err
	}
	var s *stagedCall
	if shm {
		if s, err = c.stage(ctx, req); err != nil {
			return nil, err
		}
	}
	var resp *pb.AttentionResponse
	p, d := c.protos(req, s, prefill)
	if prefill {
		err = c.nameSession(ctx, &p.Session)
	} else {
		err = c.nameSession(ctx, &d.Session)
	}
	if err != nil {
		if s != nil {
			s.abandon(err)
		}
		return nil, err
	}
	err = c.invoke(ctx, method, func(ctx context.Context, opts []grpc.CallOption) (err error) {
		if prefill {
			resp, err = c.stub.Prefill(ctx, p, opts...)
		} else {
			resp, err = c.stub.Decode(ctx, d, opts...)
		}
		return err
	})
	if err != nil {
		if s != nil {
			s.abandon(err)
		}
		return nil, err
	}
	if s == nil || len(resp.GetOutput().GetData()) > 0 {
		if s != nil {
			s.blk.release()
		}
		return decodeResult(method, resp)
	}
	defer s.blk.release()
	res, err := s.read(resp)
	if err != nil {
		return nil, &Error{Method: method, Code: codes.Internal, Message: "malformed response: " + err.Error()}
	}
	return res, nil
}

// tensors of an AttentionRequest in wire field order.
func (r *AttentionRequest) tensors() []*BF16Tensor {
	return []*BF16Tensor{&r.Q, &r.QPE, &r.KNew, &r.VNew, &r.CKVNew, &r.KPENew}
}

// stage writes the request's tensors into one block, with room for the output (and lse). nil
// without an error: send as bytes (no shared memory, or a tensor whose data does not fill its
// shape, which the server then rejects naming it).
func (c *Client) stage(ctx context.Context, req *AttentionRequest) (*stagedCall, error) {
	var n int64
	for _, t := range req.tensors() {
		if t.IsSet() {
			if t.NumElements() != len(t.Data) {
				return nil, nil
			}
			n += alignUp(2*int64(len(t.Data)), BlockAlignment)
		}
	}
	if len(req.Q.Shape) != 3 {
		return nil, nil
	}
	rows, heads := int64(req.Q.Shape[0]), int64(req.Q.Shape[1])
	n += alignUp(2*int64(req.Q.NumElements()), BlockAlignment)
	if req.ReturnLSE {
		n += 4 * rows * heads
	}
	b, err := c.block(ctx, n)
	if err != nil || b == nil {
		return nil, err
	}
	s := &stagedCall{plane: c.plane, blk: b, lse: -1, outShape: req.Q.Shape}
	for i, t := range req.tensors() {
		if t.IsSet() {
			s.inputs[i] = b.carve(2 * int64(len(t.Data)))
			putUint16s(b.bytes(s.inputs[i], 2*int64(len(t.Data))), t.Data)
		}
	}
	s.out = b.carve(2 * int64(req.Q.NumElements()))
	if req.ReturnLSE {
		s.lse = b.carve(4 * rows * heads)
		s.lseDim = []int{int(rows), int(heads)}
	}
	return s, nil
}

// protos builds the wire request, naming the staged slices (in carve order) when s is set.
func (c *Client) protos(req *AttentionRequest, s *stagedCall, prefill bool) (*pb.PrefillRequest, *pb.DecodeRequest) {
	var p *pb.PrefillRequest
	var d *pb.DecodeRequest
	if prefill {
		p = req.PrefillProto()
	} else {
		d = req.DecodeProto()
	}
	if s == nil {
		return p, d
	}
	fields := [6]**pb.Tensor{}
	if prefill {
		fields = [6]**pb.Tensor{&p.Q, &p.QPe, &p.KNew, &p.VNew, &p.CkvNew, &p.KpeNew}
	} else {
		fields = [6]**pb.Tensor{&d.Q, &d.QPe, &d.KNew, &d.VNew, &d.CkvNew, &d.KpeNew}
	}
	name := s.blk.arena.name
	for i, t := range req.tensors() {
		if t.IsSet() {
			*fields[i] = &pb.Tensor{Dtype: pb.DType_DTYPE_BF16, Shape: shape64(t.Shape),
				Region: &pb.RegionSlice{Name: name, Offset: s.inputs[i]}}
		}
	}
	out := &pb.RegionSlice{Name: name, Offset: s.out}
	var lse *pb.RegionSlice
	if s.lse >= 0 {
		lse = &pb.RegionSlice{Name: name, Offset: s.lse}
	}
	if prefill {
		p.OutputTo, p.LseTo = out, lse
	} else {
		d.OutputTo, d.LseTo = out, lse
	}
	return p, d
}

// read copies the output (and lse) the server wrote into the block out of it.
func (s *stagedCall) read(resp *pb.AttentionResponse) (*AttentionResult, error) {
	got := resp.GetOutput()
	if got.GetRegion().GetName() != s.blk.arena.name || got.GetRegion().GetOffset() != s.out {
		return nil, fmt.Errorf("output written to %s@%d, not to the %s@%d asked for",
			got.GetRegion().GetName(), got.GetRegion().GetOffset(), s.blk.arena.name, s.out)
	}
	if got.GetDtype() != pb.DType_DTYPE_BF16 || !sameShape(got.GetShape(), s.outShape) {
		return nil, fmt.Errorf("output %v %v is not the bf16 %v asked for", got.GetDtype(), got.GetShape(), s.outShape)
	}
	res, err := resultFromProto(&pb.AttentionResponse{Output: &pb.Tensor{Dtype: pb.DType_DTYPE_BF16,
		Shape: got.GetShape(), Data: s.blk.bytes(s.out, 2*int64(numElements(s.outShape)))},
		Timings: resp.GetTimings()})
	if err != nil {
		return nil, err
	}
	if s.lse >= 0 {
		if !sameShape(resp.GetLse().GetShape(), s.lseDim) {
			return nil, fmt.Errorf("lse %v is not the %v asked for", resp.GetLse().GetShape(), s.lseDim)
		}
		raw := s.blk.bytes(s.lse, 4*int64(numElements(s.lseDim)))
		res.LSE = F32Tensor{Shape: append([]int{}, s.lseDim...), Data: make([]float32, numElements(s.lseDim))}
		for i := range res.LSE.Data {
			res.LSE.Data[i] = math.Float32frombits(binary.LittleEndian.Uint32(raw[4*i:]))
		}
	}
	return res, nil
}

func sameShape(a []int64, b []int) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != int64(b[i]) {
			return false
		}
	}
	return true
}

var littleEndian = func() bool { x := uint16(1); return *(*byte)(unsafe.Pointer(&x)) == 1 }()

// putUint16s writes v little-endian into dst (2*len(v) bytes): one copy on little-endian hosts.
func putUint16s(dst []byte, v []uint16) {
	if littleEndian && len(v) > 0 {
		copy(unsafe.Slice((*uint16)(unsafe.Pointer(&dst[0])), len(v)), v)
		return
	}
	for i, x := range v {
		binary.LittleEndian.PutUint16(dst[2*i:], x)
	}
}
