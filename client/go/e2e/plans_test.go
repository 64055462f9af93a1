package e2e

import (
	"fmt"
	"testing"

	"google.golang.org/grpc/codes"

	"attnserve/client/go/attnserve"
)

// Plans (attention.proto "Plans") over the shared server, the tables in the messages.
func TestPlans(t *testing.T) {
	c := live(t)
	for _, pool := range []string{"gqa", "mla"} {
		t.Run(pool, func(t *testing.T) { testPlansOn(t, c, pool, false) })
	}
}

// The same with the plans' tables read from shared memory.
func TestSharedMemoryPlans(t *testing.T) {
	c := shmClient(t)
	for _, pool := range []string{"gqa", "mla"} {
		t.Run(pool, func(t *testing.T) { testPlansOn(t, c, pool, true) })
	}
}

// testPlansOn runs a prefill step and a decode step whose every layer's call (K/V appended)
// names the step's plan, checked against the reference; a read-only decode over the plan
// matches the same decode over the table bit for bit. While the plan pins the pages FreePages
// is refused; after ReleasePlan the plan is gone and they can be freed.
func testPlansOn(t *testing.T, c *attnserve.Client, pool string, staged bool) {
	s := newSession(t, c, pool, 11)
	ids := []string{"a", "b", "c"}
	plan := func(csr attnserve.BatchCSR, prefill bool) *attnserve.Plan {
		t.Helper()
		req := &attnserve.PlanRequest{Pool: pool, Prefill: prefill, Table: csr}
		if staged {
			st, err := c.StagePageTable(ctx(), csr)
			if err != nil || !st.Staged() {
				t.Fatalf("staging the table: staged %v, %v", st != nil && st.Staged(), err)
			}
			// The server copies the table: its memory may go to the calls' tensors at once.
			defer st.Release()
			req.Table, req.PageTable = attnserve.BatchCSR{}, st
		}
		p, err := c.CreatePlan(ctx(), req)
		if err != nil {
			t.Fatal(err)
		}
		want := attnserve.Plan{Name: attnserve.DefaultPlanName, Pool: pool, Prefill: prefill,
			Batch: len(ids), TotalQ: csr.TotalQ(), NumPages: len(csr.KVIndices)}
		if !prefill {
			want.TotalQ = len(ids)
		}
		if got := (attnserve.Plan{Name: p.Name, Pool: p.Pool, Prefill: p.Prefill, Batch: p.Batch,
			TotalQ: p.TotalQ, NumPages: p.NumPages}); got != want {
			t.Fatalf("plan %+v, want %+v", got, want)
		}
		return p
	}

	qLens := []int{20, 3, 9}
	s.grow(ids, qLens)
	csr, err := s.table.CSR(ids, qLens)
	if err != nil {
		t.Fatal(err)
	}
	s.plan = plan(csr, true)
	for layer := 0; layer < s.pool.NumLayers; layer++ {
		s.call(layer, ids, qLens, true)
	}
	_, err = c.Decode(ctx(), &attnserve.AttentionRequest{Pool: pool, Plan: s.plan})
	expectCode(t, err, codes.InvalidArgument) // a Prefill plan, refused before it is sent

	// The next step's plan replaces the prefill plan under the same name: the old *Plan is
	// refused rather than naming the new one.
	s.grow(ids, []int{1, 1, 1})
	if csr, err = s.table.CSR(ids, nil); err != nil {
		t.Fatal(err)
	}
	prefillPlan := s.plan
	s.plan = plan(csr, false)
	_, err = c.Prefill(ctx(), &attnserve.AttentionRequest{Pool: pool, Plan: prefillPlan})
	expectCode(t, err, codes.NotFound)
	for layer := 0; layer < s.pool.NumLayers; layer++ {
		s.call(layer, ids, nil, true)
	}
	decodes := map[bool]*attnserve.AttentionResult{}
	for _, viaPlan := range []bool{false, true} {
		if viaPlan {
			s.plan = plan(csr, false)
		} else {
			s.plan = nil
		}
		s.rng.Seed(7) // the same queries both times
		decodes[viaPlan] = s.call(1, ids, nil, false)
	}
	if a, b := decodes[false], decodes[true]; fmt.Sprint(a.Output.Data) != fmt.Sprint(b.Output.Data) ||
		fmt.Sprint(a.LSE.Data) != fmt.Sprint(b.LSE.Data) {
		t.Fatal("a decode over the plan differs from the same decode over its table")
	}

	_, err = c.FreePages(ctx(), pool, csr.SeqPages(1)) // pinned by the plan
	expectCode(t, err, codes.FailedPrecondition)
	if err := c.ReleasePlan(ctx(), s.plan.Name); err != nil {
		t.Fatal(err)
	}
	expectCode(t, c.ReleasePlan(ctx(), s.plan.Name), codes.NotFound)
	_, err = c.Decode(ctx(), &attnserve.AttentionRequest{Pool: pool, Plan: s.plan})
	expectCode(t, err, codes.NotFound) // refused by the client
	q := make([]float32, len(ids)*s.pool.NumQOHeads*s.pool.QueryDims())
	_, err = c.Decode(ctx(), &attnserve.AttentionRequest{Pool: pool, Plan: &attnserve.Plan{Name: s.plan.Name},
		Q: attnserve.BF16TensorFromFloat32(q, len(ids), s.pool.NumQOHeads, s.pool.QueryDims())})
	expectCode(t, err, codes.NotFound) // by the server
	// The plan's pins are gone.
	if err := s.table.Free(ctx(), "b"); err != nil {
		t.Fatal(err)
	}
}

// A closed session takes its plans along: their pins do not keep its pages out of the pool,
// and the client refuses its *Plans afterwards.
func TestPlansGoWithTheirSession(t *testing.T) {
	c := live(t)
	before := freePages(t, c, "gqa")
	sess, err := c.OpenSession(ctx(), attnserve.SessionOptions{})
	if err != nil {
		t.Fatal(err)
	}
	bound := c.WithSession(sess.ID)
	pages, err := bound.AllocatePages(ctx(), "gqa", 2)
	if err != nil {
		t.Fatal(err)
	}
	plan, err := bound.CreatePlan(ctx(), &attnserve.PlanRequest{Pool: "gqa", Table: attnserve.BatchCSR{
		KVIndptr: []int32{0, 2}, KVIndices: pages, KVLastPageLen: []int32{5}}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.CloseSession(ctx(), sess.ID); err != nil {
		t.Fatal(err)
	}
	if got := freePages(t, c, "gqa"); got != before {
		t.Fatalf("%d pages free after closing the session, want %d", got, before)
	}
	_, err = bound.Decode(ctx(), &attnserve.AttentionRequest{Pool: "gqa", Plan: plan})
	expectCode(t, err, codes.NotFound)
}
