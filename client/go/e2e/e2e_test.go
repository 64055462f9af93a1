package e2e

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"attnserve/client/go/attnserve"
	"attnserve/client/go/attnservetest"
	pb "attnserve/client/go/gen/attnservev1"
)

// The server every test shares: a GQA pool as in the brief of the suite, and a small MLA pool.
const serverConfig = `
max_message_bytes: 67108864
pools { name: "gqa" kind: POOL_KIND_GQA num_layers: 2 page_size: 16 num_qo_heads: 8
        num_kv_heads: 2 head_dim: 64 num_pages: 256 }
pools { name: "mla" kind: POOL_KIND_MLA num_layers: 2 page_size: 64 num_qo_heads: 16
        num_pages: 32 }
`

var (
	server    *attnservetest.Server
	skipWhy   string
	client    *attnserve.Client
	serverErr error
)

func TestMain(m *testing.M) {
	var err error
	server, err = attnservetest.Start(serverConfig)
	switch {
	case errors.Is(err, attnservetest.ErrNoBinary):
		skipWhy = err.Error()
		fmt.Fprintf(os.Stderr, "SKIP end-to-end tests: %v\n", err)
	case err != nil:
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	default:
		client, err = attnserve.Dial(server.Address, attnserve.WithTimeout(60*time.Second))
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
	}
	code := m.Run()
	if server != nil {
		code = finish(code)
	}
	os.Exit(code)
}

// finish checks that every pool is entirely free again and that the server exits 0 on SIGTERM.
func finish(code int) int {
	info, err := client.ServerInfo(context.Background())
	if err != nil {
		fmt.Fprintln(os.Stderr, "server info at the end:", err)
		code = 1
	} else {
		for _, p := range info.Pools {
			if p.FreePages != p.TotalPages {
				fmt.Fprintf(os.Stderr, "pool %s: %d pages still allocated at the end\n", p.Name,
					p.TotalPages-p.FreePages)
				code = 1
			}
		}
	}
	client.Close()
	if err := server.Stop(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		code = 1
	}
	return code
}

// live returns the shared client, skipping the test when there is no server binary.
func live(t *testing.T) *attnserve.Client {
	t.Helper()
	if client == nil {
		t.Skip(skipWhy)
	}
	return client
}

func ctx() context.Context { return context.Background() }

func freePages(t *testing.T, c *attnserve.Client, pool string) int {
	t.Helper()
	p, err := c.Pool(ctx(), pool)
	if err != nil {
		t.Fatal(err)
	}
	return p.FreePages
}

// expectCode asserts err is an *attnserve.Error with the code and a message.
func expectCode(t *testing.T, err error, code codes.Code) *attnserve.Error {
	t.Helper()
	var e *attnserve.Error
	if !errors.As(err, &e) {
		t.Fatalf("got %v, want an *attnserve.Error with %v", err, attnserve.CodeName(code))
	}
	if e.Code != code || e.Message == "" {
		t.Fatalf("got %v, want %v with a message", err, attnserve.CodeName(code))
	}
	return e
}

func TestServerInfo(t *testing.T) {
	c := live(t)
	info, err := c.ServerInfo(ctx())
	if err != nil {
		t.Fatal(err)
	}
	if info.Version == "" || info.Backend != server.Backend || info.MaxMessageBytes != 64<<20 || len(info.Pools) != 2 {
		t.Fatalf("server info %+v", info)
	}
	gqa, err := info.Pool("gqa")
	if err != nil {
		t.Fatal(err)
	}
	want := attnserve.PoolInfo{Name: "gqa", Kind: attnserve.PoolKindGQA, NumLayers: 2, PageSize: 16,
		NumQOHeads: 8, NumKVHeads: 2, HeadDim: 64, TotalPages: 256, FreePages: gqa.FreePages,
		BytesPerPage: 2 * 2 * 16 * 2 * 64 * 2} // layers x (K, V) x tokens x kv heads x dim x bf16
	if gqa != want {
		t.Fatalf("gqa pool %+v\nwant %+v", gqa, want)
	}
	mla, _ := info.Pool("mla")
	if mla.Kind != attnserve.PoolKindMLA || mla.CKVDim != 512 || mla.KPEDim != 64 || mla.PageSize != 64 {
		t.Fatalf("mla pool %+v", mla)
	}
	if _, err := info.Pool(""); err == nil {
		t.Fatal(`Pool("") with two pools`)
	}
}

func TestAllocateAndFree(t *testing.T) {
	c := live(t)
	before := freePages(t, c, "gqa")
	pages, err := c.AllocatePages(ctx(), "gqa", 10)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[int32]bool{}
	for _, p := range pages {
		if p < 0 || p >= 256 || seen[p] {
			t.Fatalf("page ids %v: out of range or repeated", pages)
		}
		seen[p] = true
	}
	if got := freePages(t, c, "gqa"); got != before-10 {
		t.Fatalf("free pages %d after allocating 10 of %d", got, before)
	}
	if free, err := c.FreePages(ctx(), "gqa", pages); err != nil || free != before {
		t.Fatalf("FreePages = %d, %v; want %d", free, err, before)
	}
	// Freeing again: not allocated any more.
	_, err = c.FreePages(ctx(), "gqa", pages[:1])
	expectCode(t, err, codes.FailedPrecondition)
}

func TestAllocationErrors(t *testing.T) {
	c := live(t)
	before := freePages(t, c, "gqa")

	var retries []attnserve.RetryEvent
	policy := attnserve.DefaultRetryPolicy()
	policy.OnRetry = func(e attnserve.RetryEvent) { retries = append(retries, e) }
	rc, err := attnserve.Dial(server.Address, attnserve.WithRetryPolicy(policy))
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()

	held, err := rc.AllocatePages(ctx(), "gqa", before) // the whole pool
	if err != nil {
		t.Fatal(err)
	}
	_, err = rc.AllocatePages(ctx(), "gqa", 1)
	e := expectCode(t, err, codes.ResourceExhausted)
	if e.HasPushback || e.Attempts != 1 || len(retries) != 0 || !errors.Is(err, attnserve.ErrPoolExhausted) ||
		errors.Is(err, attnserve.ErrQueueFull) {
		t.Fatalf("a full pool must fail at once without pushback: %+v, %d retries", e, len(retries))
	}
	if _, err := rc.FreePages(ctx(), "gqa", held); err != nil {
		t.Fatal(err)
	}

	_, err = c.AllocatePages(ctx(), "nope", 1)
	expectCode(t, err, codes.NotFound)
	_, err = c.AllocatePages(ctx(), "", 1) // two pools: the name is required
	expectCode(t, err, codes.InvalidArgument)
	_, err = c.AllocatePages(ctx(), "gqa", 0)
	expectCode(t, err, codes.InvalidArgument)
	_, err = c.FreePages(ctx(), "gqa", []int32{256})
	expectCode(t, err, codes.InvalidArgument)
	one, err := c.AllocatePages(ctx(), "gqa", 1)
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.FreePages(ctx(), "gqa", []int32{one[0], one[0]})
	expectCode(t, err, codes.InvalidArgument)
	if _, err := c.FreePages(ctx(), "gqa", one); err != nil { // the failed call freed nothing
		t.Fatal(err)
	}
	if got := freePages(t, c, "gqa"); got != before {
		t.Fatalf("free pages %d, want %d", got, before)
	}
}

// Chunked prefill over both layers, then decode steps, every output and lse checked against
// the reference; the page table grows across page boundaries and frees at the end.
func TestGQAChunkedPrefillAndDecode(t *testing.T) {
	testPrefillAndDecode(t, "gqa", []int{37, 50, 16}, 16, 5)
}

func TestMLAChunkedPrefillAndDecode(t *testing.T) {
	testPrefillAndDecode(t, "mla", []int{70, 20}, 32, 3)
}

func testPrefillAndDecode(t *testing.T, pool string, prompts []int, chunk, steps int) {
	testPrefillAndDecodeOn(t, live(t), pool, prompts, chunk, steps)
}

// testPrefillAndDecodeOn runs chunked prefill (K/V appended, every layer) then decode steps
// through c, checking every result against the reference and that every page comes back.
func testPrefillAndDecodeOn(t *testing.T, c *attnserve.Client, pool string, prompts []int, chunk, steps int) {
	before := freePages(t, c, pool)
	s := newSession(t, c, pool, 1)
	ids := make([]string, len(prompts))
	remaining := map[string]int{}
	for i, n := range prompts {
		ids[i] = fmt.Sprintf("seq%d", i)
		remaining[ids[i]] = n
	}
	for {
		var batch []string
		var qLens []int
		for _, id := range ids {
			if n := remaining[id]; n > 0 {
				q := min(n, chunk)
				batch, qLens = append(batch, id), append(qLens, q)
				remaining[id] -= q
			}
		}
		if len(batch) == 0 {
			break
		}
		s.grow(batch, qLens)
		for layer := 0; layer < s.pool.NumLayers; layer++ {
			s.call(layer, batch, qLens, true)
		}
	}
	for step := 0; step < steps; step++ {
		s.grow(ids, []int{1, 1, 1}[:len(ids)])
		for layer := 0; layer < s.pool.NumLayers; layer++ {
			res := s.call(layer, ids, nil, true)
			if res.Timings.Total <= 0 || res.Timings.BatchRequests < 1 {
				t.Fatalf("timings %+v", res.Timings)
			}
		}
	}
	for i, id := range ids {
		if got, want := s.table.Len(id), prompts[i]+steps; got != want {
			t.Fatalf("%s has %d tokens, want %d", id, got, want)
		}
	}
	if err := s.table.FreeAll(ctx()); err != nil {
		t.Fatal(err)
	}
	if got := freePages(t, c, pool); got != before {
		t.Fatalf("free pages %d after freeing, want %d", got, before)
	}
}

// Rows that see no key (a read-only prefill with more queries than keys, and a sequence with no
// pages): output 0 and lse -1e30; the other rows match the reference.
func TestGQAEmptyRows(t *testing.T) {
	c := live(t)
	s := newSession(t, c, "gqa", 2)
	s.grow([]string{"a"}, []int{5})
	s.call(0, []string{"a"}, []int{5}, true) // write 5 tokens on layer 0
	s.grow([]string{"empty"}, []int{0})      // a sequence without pages
	ids, qLens := []string{"a", "empty"}, []int{8, 3}
	res := s.call(0, ids, qLens, false) // rows 0..2 of "a" and all of "empty" see no key
	h, d := s.pool.NumQOHeads, s.pool.HeadDim
	out := res.Output.Float32()
	for _, row := range []int{0, 1, 2, 8, 9, 10} {
		for head := 0; head < h; head++ {
			if lse := res.LSE.Data[row*h+head]; lse != attnserve.EmptyRowLSE {
				t.Fatalf("row %d head %d: lse %v, want -1e30", row, head, lse)
			}
			for k := 0; k < d; k++ {
				if v := out[(row*h+head)*d+k]; v != 0 {
					t.Fatalf("row %d head %d: output %v, want 0", row, head, v)
				}
			}
		}
	}
	if lse := res.LSE.Data[3*h]; lse == attnserve.EmptyRowLSE {
		t.Fatal("row 3 sees key 0 but has the empty-row lse")
	}
}

// Malformed calls fail with their code, name the problem and change nothing.
func TestBadRequests(t *testing.T) {
	c := live(t)
	s := newSession(t, c, "gqa", 3)
	s.grow([]string{"a"}, []int{20})
	s.call(1, []string{"a"}, []int{20}, true)
	before := freePages(t, c, "gqa")
	table, _ := s.table.CSR([]string{"a"}, []int{4})
	q := attnserve.BF16TensorFromFloat32(s.random(4*8*64, 1), 4, 8, 64)
	valid := func() *attnserve.AttentionRequest {
		return &attnserve.AttentionRequest{Pool: "gqa", Layer: 1, Q: q, Table: table, ReturnLSE: true}
	}
	spare, err := c.AllocatePages(ctx(), "gqa", 1)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.FreePages(ctx(), "gqa", spare); err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name   string
		edit   func(r *attnserve.AttentionRequest)
		code   codes.Code
		prefix string // the message mentions it
	}{
		{"q shape", func(r *attnserve.AttentionRequest) {
			r.Q = attnserve.NewBF16Tensor(q.Data[:4*8*32], 4, 8, 32)
		}, codes.InvalidArgument, "q"},
		{"q bytes", func(r *attnserve.AttentionRequest) {
			r.Q = attnserve.NewBF16Tensor(q.Data[:10], 4, 8, 64)
		}, codes.InvalidArgument, "q"},
		{"layer", func(r *attnserve.AttentionRequest) { r.Layer = 2 }, codes.InvalidArgument, "layer"},
		{"k without v", func(r *attnserve.AttentionRequest) {
			r.KNew = attnserve.NewBF16Tensor(make([]uint16, 4*2*64), 4, 2, 64)
		}, codes.InvalidArgument, ""},
		{"page out of range", func(r *attnserve.AttentionRequest) {
			r.Table.KVIndices = []int32{r.Table.KVIndices[0], 9999}
		}, codes.InvalidArgument, "kv_indices"},
		{"page not allocated", func(r *attnserve.AttentionRequest) {
			r.Table.KVIndices = []int32{r.Table.KVIndices[0], spare[0]}
		}, codes.FailedPrecondition, ""},
		{"last page len", func(r *attnserve.AttentionRequest) {
			r.Table.KVLastPageLen = []int32{17}
		}, codes.InvalidArgument, "kv_last_page_len"},
		{"unknown pool", func(r *attnserve.AttentionRequest) { r.Pool = "nope" }, codes.NotFound, ""},
	}
	for _, tc := range cases {
		r := valid()
		r.Table.KVIndices = append([]int32(nil), table.KVIndices...)
		tc.edit(r)
		_, err := c.Prefill(ctx(), r)
		e := expectCode(t, err, tc.code)
		if tc.prefix != "" && !strings.Contains(e.Message, tc.prefix) {
			t.Errorf("%s: message %q does not mention %q", tc.name, e.Message, tc.prefix)
		}
	}
	if got := freePages(t, c, "gqa"); got != before {
		t.Fatalf("free pages %d, want %d", got, before)
	}
	// The cache is intact: a read-only call still matches the mirror.
	s.call(1, []string{"a"}, []int{4}, false)

	// A raw request with another dtype.
	raw := valid().PrefillProto()
	raw.Q.Dtype = pb.DType_DTYPE_FP16
	_, err = c.PrefillProto(ctx(), raw)
	expectCode(t, err, codes.InvalidArgument)
}

func TestDeadlineExceeded(t *testing.T) {
	c := live(t)
	dctx, cancel := context.WithDeadline(ctx(), time.Now().Add(-time.Second))
	defer cancel()
	_, err := c.ServerInfo(dctx)
	expectCode(t, err, codes.DeadlineExceeded)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatal("not a context.DeadlineExceeded")
	}
}

// A server whose queues hold one call: concurrent prefills overflow them, the server answers
// RESOURCE_EXHAUSTED with the pushback trailer, and the default retry policy gets every call
// through.
func TestQueueFullPushbackIsRetried(t *testing.T) {
	live(t)
	srv := attnservetest.StartT(t, `
batching { max_queue_requests: 1 max_batch_requests: 1 }
pools { name: "gqa" kind: POOL_KIND_GQA num_layers: 1 page_size: 16 num_qo_heads: 8
        num_kv_heads: 2 head_dim: 64 num_pages: 64 }`)
	var mu sync.Mutex
	var pushbacks []time.Duration
	policy := attnserve.DefaultRetryPolicy()
	policy.MaxAttempts = 100
	policy.OnRetry = func(e attnserve.RetryEvent) {
		mu.Lock()
		defer mu.Unlock()
		if e.Err.HasPushback {
			pushbacks = append(pushbacks, e.Err.Pushback)
		}
	}
	c, err := attnserve.Dial(srv.Address, attnserve.WithRetryPolicy(policy))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	pages, err := c.AllocatePages(ctx(), "", 16)
	if err != nil {
		t.Fatal(err)
	}
	// A read-only prefill of 128 rows over 256 keys: a few ms on the CPU backend.
	table := attnserve.BatchCSR{QOIndptr: []int32{0, 128}, KVIndptr: []int32{0, 16}, KVIndices: pages,
		KVLastPageLen: []int32{16}}
	q := attnserve.NewBF16Tensor(make([]uint16, 128*8*64), 128, 8, 64)
	var wg sync.WaitGroup
	errs := make([]error, 12)
	for i := range errs {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			for j := 0; j < 3 && errs[i] == nil; j++ {
				_, errs[i] = c.Prefill(ctx(), &attnserve.AttentionRequest{Q: q, Table: table})
			}
		}(i)
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if len(pushbacks) == 0 {
		if srv.Backend != "cpu" { // a fast backend may drain the queue faster than calls arrive
			t.Skipf("no call was pushed back on the %s backend", srv.Backend)
		}
		t.Fatal("no call was pushed back: the queue never filled")
	}
	sort.Slice(pushbacks, func(i, j int) bool { return pushbacks[i] < pushbacks[j] })
	t.Logf("%d retries after pushback, %v .. %v", len(pushbacks), pushbacks[0], pushbacks[len(pushbacks)-1])
	if _, err := c.FreePages(ctx(), "", pages); err != nil {
		t.Fatal(err)
	}
}

func min(a, b int) int {
	if a < b {
		return a
	}
	return b
}

// Explicit sessions: pages belong to the session, not the connection, so a second connection
// bound to the session uses them; a connection's implicit session cannot; closing the session
// frees them and its handle then fails with NOT_FOUND.
func TestSessions(t *testing.T) {
	c := live(t)
	sess, err := c.OpenSession(ctx(), attnserve.SessionOptions{Lease: time.Minute, MaxPages: 4})
	if attnserve.Code(err) == codes.Unimplemented {
		t.Skip("the server binary predates sessions (OpenSession is UNIMPLEMENTED); rebuild it")
	}
	if err != nil {
		t.Fatal(err)
	}
	if sess.ID == "" || sess.Lease != time.Minute || sess.MaxPages != 4 {
		t.Fatalf("session %+v", sess)
	}
	info, err := c.ServerInfo(ctx())
	if err != nil {
		t.Fatal(err)
	}
	if info.Epoch != sess.Epoch || info.DefaultLease <= 0 {
		t.Fatalf("epoch %x (session %x), default lease %v", info.Epoch, sess.Epoch, info.DefaultLease)
	}
	before := freePages(t, c, "gqa")
	other, err := attnserve.Dial(server.Address)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	a, b := c.WithSession(sess.ID), other.WithSession(sess.ID)

	pages, err := a.AllocatePages(ctx(), "gqa", 3)
	if err != nil {
		t.Fatal(err)
	}
	_, err = a.AllocatePages(ctx(), "gqa", 2) // 5 > the quota of 4
	expectCode(t, err, codes.ResourceExhausted)
	if !errors.Is(err, attnserve.ErrPoolExhausted) {
		t.Fatalf("quota error %v is not ErrPoolExhausted", err)
	}
	table := attnserve.BatchCSR{QOIndptr: []int32{0, 4}, KVIndptr: []int32{0, 3}, KVIndices: pages,
		KVLastPageLen: []int32{16}}
	q := attnserve.NewBF16Tensor(make([]uint16, 4*8*64), 4, 8, 64)
	if _, err := b.Prefill(ctx(), &attnserve.AttentionRequest{Pool: "gqa", Q: q, Table: table}); err != nil {
		t.Fatalf("the session's pages from another connection: %v", err)
	}
	_, err = other.Prefill(ctx(), &attnserve.AttentionRequest{Pool: "gqa", Q: q, Table: table})
	expectCode(t, err, codes.FailedPrecondition) // the implicit session of `other` owns none
	_, err = other.FreePages(ctx(), "gqa", pages)
	expectCode(t, err, codes.FailedPrecondition)

	freed, err := c.CloseSession(ctx(), sess.ID)
	if err != nil || freed != 3 {
		t.Fatalf("CloseSession = %d, %v", freed, err)
	}
	if got := freePages(t, c, "gqa"); got != before {
		t.Fatalf("free pages %d after closing, want %d", got, before)
	}
	_, err = a.AllocatePages(ctx(), "gqa", 1)
	expectCode(t, err, codes.NotFound)
	_, err = c.WithSession("not-a-handle").AllocatePages(ctx(), "gqa", 1)
	expectCode(t, err, codes.InvalidArgument)
}

// A server with access tokens: no token and an unknown one are UNAUTHENTICATED, a read-only token
// may read the server info but not allocate, a full token may do both.
func TestBearerTokens(t *testing.T) {
	live(t)
	srv := attnservetest.StartT(t, `
access_tokens { name: "scheduler" token: "sched" methods: "*" }
access_tokens { name: "dashboard" token: "read" methods: "GetServerInfo" }
pools { name: "gqa" kind: POOL_KIND_GQA num_layers: 1 page_size: 16 num_qo_heads: 8
        num_kv_heads: 2 head_dim: 64 num_pages: 64 }`)
	dial := func(opts ...attnserve.Option) *attnserve.Client {
		c, err := attnserve.Dial(srv.Address, append(opts, attnserve.WithoutRetries())...)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	for _, c := range []*attnserve.Client{dial(), dial(attnserve.WithBearerToken("nope"))} {
		if _, err := c.ServerInfo(ctx()); attnserve.Code(err) != codes.Unauthenticated {
			t.Errorf("without a known token: got %v, want UNAUTHENTICATED", err)
		}
	}
	reader := dial(attnserve.WithBearerToken("read"))
	if _, err := reader.ServerInfo(ctx()); err != nil {
		t.Errorf("read-only token reading: %v", err)
	}
	if _, err := reader.AllocatePages(ctx(), "gqa", 1); attnserve.Code(err) != codes.PermissionDenied {
		t.Errorf("read-only token allocating: got %v, want PERMISSION_DENIED", err)
	}
	scheduler := dial(attnserve.WithBearerToken("sched"))
	pages, err := scheduler.AllocatePages(ctx(), "gqa", 2)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := scheduler.FreePages(ctx(), "gqa", pages); err != nil {
		t.Fatal(err)
	}
}
