package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"sort"
	"strings"
	"testing"

	"attnserve/client/go/attnserve"
	"attnserve/client/go/attnservetest"
	pb "attnserve/client/go/gen/attnservev1"
)

func TestParsePlanFlag(t *testing.T) {
	attnservetest.CheckBoolFlag(t, "plan", "--op=prefill", "planned once",
		func(args []string, usage io.Writer) (bool, error) {
			cfg, err := parseFlags(args, usage)
			return cfg.plan, err
		})
	if _, err := parseFlags([]string{"--plan", "extra"}, io.Discard); err == nil {
		t.Error("a stray argument after --plan accepted")
	}
}

// --plan is refused before anything is allocated on a server without plans, and with
// --shared-conn when the clients' plans would not fit the connection's one session.
func TestCheckPlans(t *testing.T) {
	for _, tc := range []struct {
		plan, shared bool
		clients      int
		maxPlans     int
		ok           bool
	}{
		{plan: false, clients: 40, maxPlans: 0, ok: true},
		{plan: true, clients: 1, maxPlans: 0, ok: false},
		{plan: true, clients: 40, maxPlans: 16, ok: true}, // a session per connection
		{plan: true, shared: true, clients: 16, maxPlans: 16, ok: true},
		{plan: true, shared: true, clients: 17, maxPlans: 16, ok: false},
	} {
		cfg := config{plan: tc.plan, sharedConn: tc.shared, clients: tc.clients}
		if err := checkPlans(cfg, tc.maxPlans); (err == nil) != tc.ok {
			t.Errorf("%+v: %v", tc, err)
		}
	}
}

// attentionCall is what Prefill and Decode requests have in common.
type attentionCall interface {
	GetPlan() string
	GetKvIndptr() []int32
	GetKvIndices() []int32
	GetKvLastPageLen() []int32
	GetPageTable() *pb.PageTableRef
	GetQ() *pb.Tensor
	GetKNew() *pb.Tensor
}

// carriesTable reports whether a call sent a page table of its own (in the message or staged).
func carriesTable(q attentionCall) bool {
	if p, ok := q.(*pb.PrefillRequest); ok && len(p.GetQoIndptr()) > 0 {
		return true
	}
	return len(q.GetKvIndptr()) > 0 || len(q.GetKvIndices()) > 0 || len(q.GetKvLastPageLen()) > 0 ||
		q.GetPageTable() != nil
}

// The clients of a --plan run each plan their table once after the fill (p0, p1, ...), every
// measured and warm-up call names its client's plan and carries no table, and the plans are
// released at the end so that every page goes back. A run without --plan creates none and its
// calls carry the table (what tells the two apart).
func TestLoadgenPlan(t *testing.T) {
	// Shared memory on: --transport=auto takes it, as do the shm runs.
	srv := attnservetest.StartT(t, `pools { name: "gqa" kind: POOL_KIND_GQA num_layers: 2
		page_size: 16 num_qo_heads: 8 num_kv_heads: 2 head_dim: 64 num_pages: 256 }
		data_plane { shared_memory: true max_regions_per_session: 8
		             max_region_bytes_per_session: 1073741824 }`)
	for _, tc := range []struct {
		op, transport string
		plan, shared  bool
	}{
		{op: "decode", transport: "bytes", plan: true},
		{op: "prefill", transport: "bytes", plan: true},
		{op: "decode", transport: "auto", plan: true, shared: true}, // the plans share one session
		{op: "decode", transport: "shm", plan: true},
		{op: "prefill", transport: "shm", plan: true},
		{op: "decode", transport: "bytes"},
		{op: "prefill", transport: "shm"},
	} {
		name := tc.op + "/" + tc.transport
		if tc.shared {
			name += "/shared-conn"
		}
		if tc.plan {
			name += "/plan"
		}
		t.Run(name, func(t *testing.T) {
			const clients, batch, tokens = 3, 2, 100
			args := []string{"--address=" + srv.Address, "--op=" + tc.op, "--transport=" + tc.transport,
				fmt.Sprintf("--clients=%d", clients), fmt.Sprintf("--batch=%d", batch),
				fmt.Sprintf("--context=%d", tokens), "--prefill-tokens=16", "--fill-chunk=64",
				"--duration=300ms", "--warmup=50ms"}
			if tc.plan {
				args = append(args, "--plan")
			}
			if tc.shared {
				args = append(args, "--shared-conn")
			}
			cfg, err := parseFlags(args, io.Discard)
			if err != nil {
				t.Fatal(err)
			}
			var rec attnservetest.Recorder
			var out bytes.Buffer
			res, err := loadgen(context.Background(), cfg, &out, rec.Option())
			t.Logf("loadgen %v:\n%s", args, out.String())
			if err != nil {
				t.Fatal(err)
			}
			if res.Plan != tc.plan || res.Calls == 0 || len(res.Errors) != 0 {
				t.Fatalf("result %+v", res)
			}
			if strings.Contains(out.String(), ", plan:") != tc.plan ||
				strings.Contains(out.String(), "plan p0:") != tc.plan {
				t.Fatalf("the summary does not say whether the calls named plans:\n%s", out.String())
			}
			checkPlanCalls(t, rec.Calls(), tc.op, tc.transport, tc.plan, clients, batch, tokens, 16, res.Calls)

			// The plans were released: FreePages took every page back.
			c, err := attnserve.Dial(srv.Address)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			pool, err := c.Pool(context.Background(), "gqa")
			if err != nil || pool.FreePages != pool.TotalPages {
				t.Fatalf("pool after the run: %+v, %v", pool, err)
			}
		})
	}
}

// checkPlanCalls checks the calls of a run of clients x batch sequences of that many tokens in
// pages of pageSize that measured that many calls.
func checkPlanCalls(t *testing.T, calls []attnservetest.Call, op, transport string, plan bool, clients, batch, tokens,
	pageSize, measured int) {
	t.Helper()
	method := map[string]string{"decode": "Decode", "prefill": "Prefill"}[op]
	created, released := map[string]bool{}, map[string]bool{}
	lastCreate, firstRelease := -1, len(calls)
	for i, c := range calls {
		if c.Err != nil {
			t.Fatalf("call %d, %s, failed: %v", i, c.Method, c.Err)
		}
		switch c.Method {
		case "CreatePlan":
			q, r := c.Req.(*pb.CreatePlanRequest), c.Reply.(*pb.CreatePlanResponse)
			if q.Prefill != (op == "prefill") || len(q.KvIndptr) != batch+1 ||
				r.Batch != int32(batch) || int(r.NumPages) != batch*((tokens+pageSize-1)/pageSize) {
				t.Fatalf("CreatePlan %v answered %v", q, r)
			}
			if created[q.Name] {
				t.Fatalf("plan %s created twice", q.Name)
			}
			created[q.Name], lastCreate = true, i
		case "ReleasePlan":
			q := c.Req.(*pb.ReleasePlanRequest)
			if !created[q.Name] || released[q.Name] {
				t.Fatalf("ReleasePlan %s: created %v, released before %v", q.Name, created[q.Name], released[q.Name])
			}
			released[q.Name] = true
			if i < firstRelease {
				firstRelease = i
			}
		case "FreePages":
			if len(released) != len(created) {
				t.Fatalf("call %d frees pages while plans pin them: %d created, %d released", i,
					len(created), len(released))
			}
		}
	}
	names := func(m map[string]bool) string {
		var s []string
		for n := range m {
			s = append(s, n)
		}
		sort.Strings(s)
		return strings.Join(s, ",")
	}
	want := map[string]bool{}
	for i := 0; plan && i < clients; i++ {
		want[fmt.Sprintf("p%d", i)] = true
	}
	if names(created) != names(want) || names(released) != names(want) {
		t.Fatalf("plans created %q, released %q; want %q", names(created), names(released), names(want))
	}

	// The calls the clients loop on: after the fill (and the plans), before the releases.
	start := lastCreate + 1
	if !plan {
		start = 0
		for i, c := range calls {
			if q, ok := c.Req.(*pb.PrefillRequest); ok && q.KNew != nil { // a fill
				start = i + 1
			}
		}
	}
	named, looped := map[string]bool{}, 0
	for _, c := range calls[start:firstRelease] {
		if c.Method != method {
			continue
		}
		looped++
		q := c.Req.(attentionCall)
		if q.GetKNew() != nil {
			t.Fatalf("a measured call appends K/V: the table would not stay fixed")
		}
		if transport != "auto" && (transport == "shm") != (q.GetQ().GetRegion() != nil) {
			t.Fatalf("--transport=%s: q in a region %v", transport, q.GetQ().GetRegion() != nil)
		}
		if plan && (q.GetPlan() == "" || carriesTable(q)) {
			t.Fatalf("%s under --plan: plan %q, carries a table %v", method, q.GetPlan(), carriesTable(q))
		}
		if !plan && (q.GetPlan() != "" || !carriesTable(q)) {
			t.Fatalf("%s without --plan: plan %q, carries a table %v", method, q.GetPlan(), carriesTable(q))
		}
		named[q.GetPlan()] = true
	}
	if looped < measured {
		t.Fatalf("%d %s calls after the fill, fewer than the %d measured", looped, method, measured)
	}
	if plan && names(named) != names(want) {
		t.Fatalf("the calls named plans %q, want %q", names(named), names(want))
	}
}
