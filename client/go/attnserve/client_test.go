package attnserve

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	pb "attnserve/client/go/gen/attnservev1"
)

// fakeServer answers AttentionService calls with a scripted handler, in process.
type fakeServer struct {
	pb.UnimplementedAttentionServiceServer
	scriptOpen bool // OpenSession answers as next() says too
	mu         sync.Mutex
	calls      int32
	handle     func(ctx context.Context, call int) error // nil: success
	deadline   time.Duration                             // time left at the last call
	lastSize   int
	sessions   []string // the session each call named
}

func (f *fakeServer) sawSession(s string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.sessions = append(f.sessions, s)
}

// OpenSession is scripted only with scriptOpen: a client without a session opens one before its
// first call that needs one, and the tests script that call.
func (f *fakeServer) OpenSession(ctx context.Context, r *pb.OpenSessionRequest) (*pb.OpenSessionResponse, error) {
	if f.scriptOpen {
		if err := f.next(ctx); err != nil {
			return nil, err
		}
	}
	return &pb.OpenSessionResponse{Session: "s-1", Epoch: 42, LeaseMs: r.LeaseMs + 1, MaxPages: r.MaxPages}, nil
}

func (f *fakeServer) CloseSession(ctx context.Context, r *pb.CloseSessionRequest) (*pb.CloseSessionResponse, error) {
	if err := f.next(ctx); err != nil {
		return nil, err
	}
	f.sawSession(r.Session)
	return &pb.CloseSessionResponse{FreedPages: 3}, nil
}

func (f *fakeServer) FreePages(ctx context.Context, r *pb.FreePagesRequest) (*pb.FreePagesResponse, error) {
	if err := f.next(ctx); err != nil {
		return nil, err
	}
	f.sawSession(r.Session)
	return &pb.FreePagesResponse{FreePages: 10}, nil
}

func (f *fakeServer) next(ctx context.Context) error {
	n := int(atomic.AddInt32(&f.calls, 1))
	f.mu.Lock()
	if d, ok := ctx.Deadline(); ok {
		f.deadline = time.Until(d)
	} else {
		f.deadline = -1
	}
	h := f.handle
	f.mu.Unlock()
	if h == nil {
		return nil
	}
	return h(ctx, n)
}

func (f *fakeServer) setHandle(h func(ctx context.Context, call int) error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.handle = h
}

// seen returns what the last call saw: its time left before the deadline (-1 without one) and
// the size of its q.
func (f *fakeServer) seen() (deadline time.Duration, qBytes int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.deadline, f.lastSize
}

func (f *fakeServer) GetServerInfo(ctx context.Context, r *pb.GetServerInfoRequest) (*pb.GetServerInfoResponse, error) {
	if err := f.next(ctx); err != nil {
		return nil, err
	}
	f.sawSession(r.Session)
	return &pb.GetServerInfoResponse{Version: "test", Backend: "fake", Pools: []*pb.PoolInfo{
		{Name: "gqa", Kind: pb.PoolKind_POOL_KIND_GQA, NumLayers: 2, PageSize: 16, NumQoHeads: 8,
			NumKvHeads: 2, HeadDim: 64, TotalPages: 10, FreePages: 7},
	}}, nil
}

func (f *fakeServer) AllocatePages(ctx context.Context, r *pb.AllocatePagesRequest) (*pb.AllocatePagesResponse, error) {
	if err := f.next(ctx); err != nil {
		return nil, err
	}
	f.sawSession(r.Session)
	ids := make([]int32, r.NumPages)
	for i := range ids {
		ids[i] = int32(i)
	}
	return &pb.AllocatePagesResponse{PageIds: ids}, nil
}

func (f *fakeServer) Decode(ctx context.Context, r *pb.DecodeRequest) (*pb.AttentionResponse, error) {
	if err := f.next(ctx); err != nil {
		return nil, err
	}
	f.mu.Lock()
	f.lastSize = len(r.GetQ().GetData())
	f.mu.Unlock()
	f.sawSession(r.Session)
	out := BF16TensorFromFloat32([]float32{1, 2}, 1, 1, 2)
	resp := &pb.AttentionResponse{Output: out.Proto(),
		Timings: &pb.Timings{QueueUs: 5, ComputeUs: 7, TotalUs: 20, BatchRequests: 3,
			PrepareUs: 2, ExecuteUs: 8, FinishUs: 1}}
	if r.ReturnLse {
		resp.Lse = F32Tensor{Shape: []int{1, 1}, Data: []float32{0.25}}.Proto()
	}
	return resp, nil
}

func (f *fakeServer) Prefill(ctx context.Context, r *pb.PrefillRequest) (*pb.AttentionResponse, error) {
	if err := f.next(ctx); err != nil {
		return nil, err
	}
	f.sawSession(r.Session)
	// A malformed response: 3 bytes of bf16.
	return &pb.AttentionResponse{Output: &pb.Tensor{Dtype: pb.DType_DTYPE_BF16, Shape: []int64{2}, Data: []byte{1, 2, 3}}}, nil
}

func startFake(t *testing.T, f *fakeServer, opts ...Option) *Client {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(grpc.MaxRecvMsgSize(64 << 20))
	pb.RegisterAttentionServiceServer(srv, f)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	// These tests script the calls the server sees: bytes, so that no ServerInfo asks for the
	// data plane first (dataplane_test.go tests the transports).
	opts = append([]Option{WithTransport(TransportBytes)}, opts...)
	c, err := Dial(lis.Addr().String(), opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// fastRetries keeps the tests quick.
func fastRetries(events *[]RetryEvent) RetryPolicy {
	p := DefaultRetryPolicy()
	p.InitialBackoff, p.MaxBackoff = time.Millisecond, 4*time.Millisecond
	p.OnRetry = func(e RetryEvent) { *events = append(*events, e) }
	return p
}

func TestServerInfoAndDefaultDeadline(t *testing.T) {
	f := &fakeServer{}
	c := startFake(t, f, WithTimeout(7*time.Second))
	info, err := c.ServerInfo(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	p, err := info.Pool("")
	if err != nil || p.Name != "gqa" || p.Kind != PoolKindGQA || p.NumKVHeads != 2 || p.FreePages != 7 {
		t.Fatalf("pool %+v, %v", p, err)
	}
	if d, _ := f.seen(); d <= 6*time.Second || d > 7*time.Second {
		t.Fatalf("server saw %v left, want the 7 s default", d)
	}
	// The caller's deadline wins.
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if _, err := c.ServerInfo(ctx); err != nil {
		t.Fatal(err)
	}
	if d, _ := f.seen(); d > 2*time.Second || d < 0 {
		t.Fatalf("server saw %v left, want at most the caller's 2 s", d)
	}
	if _, err := c.Pool(ctx, "nope"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("unknown pool: %v", err)
	}
}

func TestErrorsCarryCodeAndMessage(t *testing.T) {
	f := &fakeServer{handle: func(context.Context, int) error {
		return status.Error(codes.InvalidArgument, "q: shape [1, 8, 64], want [2, 8, 64]")
	}}
	var events []RetryEvent
	c := startFake(t, f, WithRetryPolicy(fastRetries(&events)))
	_, err := c.Decode(context.Background(), &AttentionRequest{})
	var e *Error
	if !errors.As(err, &e) {
		t.Fatalf("%T %v is not an *Error", err, err)
	}
	if e.Code != codes.InvalidArgument || e.Method != "Decode" || e.Message != "q: shape [1, 8, 64], want [2, 8, 64]" ||
		e.Attempts != 1 || len(events) != 0 {
		t.Fatalf("error %+v, %d retries", e, len(events))
	}
	if !errors.Is(err, ErrInvalidArgument) || errors.Is(err, ErrNotFound) || Code(err) != codes.InvalidArgument ||
		status.Code(err) != codes.InvalidArgument {
		t.Fatal("error does not match its code")
	}
	if got := err.Error(); got != "attnserve: Decode: INVALID_ARGUMENT: q: shape [1, 8, 64], want [2, 8, 64]" {
		t.Fatalf("message %q", got)
	}
}

func TestRetriesUnavailable(t *testing.T) {
	f := &fakeServer{handle: func(_ context.Context, n int) error {
		if n < 3 {
			return status.Error(codes.Unavailable, "draining")
		}
		return nil
	}}
	var events []RetryEvent
	c := startFake(t, f, WithRetryPolicy(fastRetries(&events)))
	res, err := c.Decode(context.Background(), &AttentionRequest{ReturnLSE: true})
	if err != nil {
		t.Fatal(err)
	}
	if len(events) != 2 || events[0].Attempt != 1 || events[1].Attempt != 2 || events[0].Method != "Decode" ||
		!errors.Is(events[0].Err, ErrUnavailable) {
		t.Fatalf("retry events %+v", events)
	}
	if res.Output.NumElements() != 2 || res.LSE.Data[0] != 0.25 || res.Timings.Compute != 7*time.Microsecond ||
		res.Timings.BatchRequests != 3 || res.Timings.Prepare != 2*time.Microsecond ||
		res.Timings.Execute != 8*time.Microsecond || res.Timings.Finish != time.Microsecond {
		t.Fatalf("result %+v", res)
	}

	// Gives up after MaxAttempts and reports how many.
	f.setHandle(func(context.Context, int) error { return status.Error(codes.Unavailable, "down") })
	events = nil
	_, err = c.Decode(context.Background(), &AttentionRequest{})
	var e *Error
	if !errors.As(err, &e) || e.Code != codes.Unavailable || e.Attempts != 5 || len(events) != 4 {
		t.Fatalf("err %v, %d retries", err, len(events))
	}
}

func TestRetriesResourceExhaustedOnlyWithPushback(t *testing.T) {
	var sawPushback time.Duration
	f := &fakeServer{handle: func(ctx context.Context, n int) error {
		if n == 1 {
			_ = grpc.SetTrailer(ctx, metadata.Pairs(PushbackTrailer, "30"))
			return status.Error(codes.ResourceExhausted, "prefill queue of pool gqa is full")
		}
		return nil
	}}
	var events []RetryEvent
	p := fastRetries(&events)
	p.OnRetry = func(e RetryEvent) { events = append(events, e); sawPushback = e.Err.Pushback }
	c := startFake(t, f, WithRetryPolicy(p))
	start := time.Now()
	if _, err := c.Decode(context.Background(), &AttentionRequest{}); err != nil {
		t.Fatal(err)
	}
	if len(events) != 1 || sawPushback != 30*time.Millisecond || events[0].Wait < 30*time.Millisecond ||
		time.Since(start) < 30*time.Millisecond {
		t.Fatalf("events %+v, pushback %v, took %v", events, sawPushback, time.Since(start))
	}

	// A full pool (no trailer) fails at once.
	f.setHandle(func(context.Context, int) error {
		return status.Error(codes.ResourceExhausted, "pool gqa has 3 free pages, asked for 8")
	})
	events = nil
	_, err := c.AllocatePages(context.Background(), "gqa", 8)
	var e *Error
	if !errors.As(err, &e) || !errors.Is(err, ErrResourceExhausted) || e.HasPushback || e.Attempts != 1 || len(events) != 0 {
		t.Fatalf("err %+v, %d retries", err, len(events))
	}

	// A negative pushback means "do not retry".
	f.setHandle(func(ctx context.Context, _ int) error {
		_ = grpc.SetTrailer(ctx, metadata.Pairs(PushbackTrailer, "-1"))
		return status.Error(codes.ResourceExhausted, "full")
	})
	if _, err := c.Decode(context.Background(), &AttentionRequest{}); !errors.As(err, &e) || e.HasPushback || e.Attempts != 1 {
		t.Fatalf("negative pushback: %+v", err)
	}
}

func TestRetryStopsAtDeadline(t *testing.T) {
	f := &fakeServer{handle: func(ctx context.Context, _ int) error {
		_ = grpc.SetTrailer(ctx, metadata.Pairs(PushbackTrailer, "5000"))
		return status.Error(codes.ResourceExhausted, "queue full")
	}}
	var events []RetryEvent
	c := startFake(t, f, WithRetryPolicy(fastRetries(&events)), WithTimeout(2*time.Second))
	start := time.Now()
	_, err := c.Decode(context.Background(), &AttentionRequest{})
	// The 5 s pushback does not fit the 2 s deadline: the server's error comes back at once.
	if !errors.Is(err, ErrResourceExhausted) || len(events) != 0 || time.Since(start) > time.Second {
		t.Fatalf("err %v, %d retries, took %v", err, len(events), time.Since(start))
	}
}

func TestDeadlineAndCancellation(t *testing.T) {
	f := &fakeServer{handle: func(ctx context.Context, _ int) error {
		time.Sleep(500 * time.Millisecond) // an answer that comes too late
		return nil
	}}
	c := startFake(t, f, WithTimeout(50*time.Millisecond))
	_, err := c.ServerInfo(context.Background())
	if !errors.Is(err, ErrDeadlineExceeded) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err = %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err = c.ServerInfo(ctx)
	if !errors.Is(err, ErrCanceled) || !errors.Is(err, context.Canceled) || Code(err) != codes.Canceled {
		t.Fatalf("err = %v", err)
	}
}

func TestWithoutRetries(t *testing.T) {
	f := &fakeServer{handle: func(context.Context, int) error { return status.Error(codes.Unavailable, "down") }}
	c := startFake(t, f, WithoutRetries())
	_, err := c.ServerInfo(context.Background())
	var e *Error
	if calls := atomic.LoadInt32(&f.calls); !errors.As(err, &e) || e.Attempts != 1 || calls != 1 {
		t.Fatalf("err %v, %d calls", err, calls)
	}
}

func TestLargeMessages(t *testing.T) {
	f := &fakeServer{}
	c := startFake(t, f)
	n := 3 << 20 // 6 MiB of bf16, over gRPC's 4 MiB default
	q := NewBF16Tensor(make([]uint16, n), n)
	if _, err := c.Decode(context.Background(), &AttentionRequest{Q: q}); err != nil {
		t.Fatal(err)
	}
	if _, got := f.seen(); got != 2*n {
		t.Fatalf("server got %d bytes", got)
	}
	small := startFake(t, &fakeServer{}, WithMaxMessageBytes(1<<20), WithoutRetries())
	if _, err := small.Decode(context.Background(), &AttentionRequest{Q: q}); !errors.Is(err, ErrResourceExhausted) {
		t.Fatalf("over the client's limit: %v", err)
	}
}

func TestMalformedResponseIsInternal(t *testing.T) {
	c := startFake(t, &fakeServer{})
	_, err := c.Prefill(context.Background(), &AttentionRequest{})
	if !errors.Is(err, ErrInternal) {
		t.Fatalf("err = %v", err)
	}
}

func TestNewFromConnAndCodeOfOtherErrors(t *testing.T) {
	if Code(nil) != codes.OK || Code(errors.New("x")) != codes.Unknown ||
		Code(context.DeadlineExceeded) != codes.DeadlineExceeded || CodeName(codes.ResourceExhausted) != "RESOURCE_EXHAUSTED" {
		t.Fatal("Code")
	}
	f := &fakeServer{}
	base := startFake(t, f)
	c := NewFromConn(base.conn)
	if _, err := c.AllocatePages(context.Background(), "gqa", 3); err != nil {
		t.Fatal(err)
	}
	if err := c.Close(); err != nil { // does not close the caller's connection
		t.Fatal(err)
	}
	if _, err := base.ServerInfo(context.Background()); err != nil {
		t.Fatal(err)
	}
}

func TestWaitReady(t *testing.T) {
	f := &fakeServer{handle: func(_ context.Context, n int) error {
		if n < 8 { // more than one call's retries
			return status.Error(codes.Unavailable, "starting")
		}
		return nil
	}}
	var events []RetryEvent
	c := startFake(t, f, WithRetryPolicy(fastRetries(&events)))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	info, err := c.WaitReady(ctx)
	if err != nil || info.Version != "test" || c.Address() == "" {
		t.Fatalf("WaitReady = %v, %v", info, err)
	}
	f.setHandle(func(context.Context, int) error { return status.Error(codes.Internal, "boom") })
	if _, err := c.WaitReady(ctx); !errors.Is(err, ErrInternal) {
		t.Fatalf("WaitReady on INTERNAL = %v", err)
	}
}

func TestUnavailableOnlyRetriedWhenIdempotent(t *testing.T) {
	f := &fakeServer{scriptOpen: true,
		handle: func(context.Context, int) error { return status.Error(codes.Unavailable, "lost") }}
	var events []RetryEvent
	c := startFake(t, f, WithRetryPolicy(fastRetries(&events)))
	b := c.WithSession("s") // its calls need no OpenSession first
	for name, call := range map[string]func() error{
		"AllocatePages": func() error { _, err := b.AllocatePages(context.Background(), "gqa", 1); return err },
		"FreePages":     func() error { _, err := b.FreePages(context.Background(), "gqa", []int32{1}); return err },
		"CloseSession":  func() error { _, err := c.CloseSession(context.Background(), "s"); return err },
	} {
		events = nil
		err := call()
		var e *Error
		if !errors.As(err, &e) || !errors.Is(err, ErrUnavailable) || e.Attempts != 1 || len(events) != 0 {
			t.Errorf("%s: %v, %d retries", name, err, len(events))
		}
	}
	for name, call := range map[string]func() error{
		"GetServerInfo": func() error { _, err := c.ServerInfo(context.Background()); return err },
		"Prefill":       func() error { _, err := b.Prefill(context.Background(), &AttentionRequest{}); return err },
		"OpenSession":   func() error { _, err := c.OpenSession(context.Background(), SessionOptions{}); return err },
	} {
		events = nil
		if err := call(); !errors.Is(err, ErrUnavailable) || len(events) != 4 {
			t.Errorf("%s: %v, %d retries (want 4)", name, err, len(events))
		}
	}
}

func TestResourceExhaustedKinds(t *testing.T) {
	queueFull := &Error{Method: "Prefill", Code: codes.ResourceExhausted, HasPushback: true, Pushback: time.Millisecond}
	poolFull := &Error{Method: "AllocatePages", Code: codes.ResourceExhausted}
	tooBig := &Error{Method: "Prefill", Code: codes.ResourceExhausted}
	cases := []struct {
		err              *Error
		queue, pool, any bool
	}{
		{queueFull, true, false, true},
		{poolFull, false, true, true},
		{tooBig, false, false, true},
	}
	for _, c := range cases {
		if errors.Is(c.err, ErrQueueFull) != c.queue || errors.Is(c.err, ErrPoolExhausted) != c.pool ||
			errors.Is(c.err, ErrResourceExhausted) != c.any || errors.Is(c.err, ErrUnavailable) {
			t.Errorf("%v: queue %v pool %v any %v", c.err, errors.Is(c.err, ErrQueueFull),
				errors.Is(c.err, ErrPoolExhausted), errors.Is(c.err, ErrResourceExhausted))
		}
	}
	if !retryable(queueFull) || retryable(poolFull) || retryable(tooBig) {
		t.Fatal("retryable")
	}
	p := DefaultRetryPolicy()
	for attempt := 1; attempt < 10; attempt++ {
		w := p.wait(attempt, queueFull)
		if w < time.Millisecond || w > time.Millisecond+p.MaxBackoff {
			t.Fatalf("wait %v after attempt %d", w, attempt)
		}
	}
	if w := p.wait(1, &Error{}); w < 25*time.Millisecond || w > 50*time.Millisecond {
		t.Fatalf("first backoff %v, want 25..50 ms", w)
	}
	if w := p.wait(9, &Error{}); w < time.Second || w > 2*time.Second {
		t.Fatalf("capped backoff %v, want 1..2 s", w)
	}
}

func TestSessions(t *testing.T) {
	f := &fakeServer{}
	c := startFake(t, f)
	s, err := c.OpenSession(context.Background(), SessionOptions{Lease: 2 * time.Second, MaxPages: 9})
	if err != nil {
		t.Fatal(err)
	}
	if s.ID != "s-1" || s.Epoch != 42 || s.Lease != 2001*time.Millisecond || s.MaxPages != 9 {
		t.Fatalf("session %+v", s)
	}
	bound := c.WithSession(s.ID)
	if bound.Session() != "s-1" || c.Session() != "" {
		t.Fatal("WithSession changed the original client")
	}
	ctx := context.Background()
	if _, err := bound.ServerInfo(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := bound.AllocatePages(ctx, "gqa", 2); err != nil {
		t.Fatal(err)
	}
	if _, err := bound.Decode(ctx, &AttentionRequest{}); err != nil {
		t.Fatal(err)
	}
	_, _ = bound.Prefill(ctx, &AttentionRequest{Session: "explicit"}) // malformed reply, session seen
	if _, err := bound.FreePages(ctx, "gqa", []int32{0, 1}); err != nil {
		t.Fatal(err)
	}
	if err := bound.Close(); err != nil { // not the shared connection
		t.Fatal(err)
	}
	if _, err := c.Decode(ctx, &AttentionRequest{}); err != nil { // unbound: opens one
		t.Fatal(err)
	}
	if c.Session() != "s-1" {
		t.Fatalf("the unbound client's session is %q", c.Session())
	}
	if n, err := c.CloseSession(ctx, s.ID); err != nil || n != 3 {
		t.Fatalf("CloseSession = %d, %v", n, err)
	}
	f.mu.Lock()
	got := fmt.Sprint(f.sessions)
	f.mu.Unlock()
	if want := "[s-1 s-1 s-1 explicit s-1 s-1 s-1]"; got != want {
		t.Fatalf("sessions seen %s, want %s", got, want)
	}
}
