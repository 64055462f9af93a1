package attnserve

import (
	"context"
	"fmt"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"

	pb "attnserve/client/go/gen/attnservev1"
)

// Plans (attention.proto "Plans"): a scheduler's step calls every layer with the same page
// table. CreatePlan has the server check that table and pin its pages once, under a name of the
// session; a Prefill or Decode whose AttentionRequest.Plan is set names the plan and carries no
// table, and the server does nothing per page for it. The pages stay pinned until ReleasePlan,
// a plan of the same name replacing it, or the session's end: FreePages refuses them meanwhile
// (FailedPrecondition), so plan the next step under the same name first, then free the pages of
// the sequences that finished. Calls already sent with a plan keep it.

// DefaultPlanName is the name CreatePlan gives a plan whose request names none: a scheduler
// that plans each step under it replaces the previous step's plan.
const DefaultPlanName = "step"

// PlanRequest is one CreatePlan.
type PlanRequest struct {
	Pool string // "" selects the server's only pool
	// Name is 1..64 bytes of [A-Za-z0-9._-] ("" is DefaultPlanName); a plan of the session
	// with this name is replaced.
	Name string
	// Prefill makes a plan for Prefill calls (Table.QOIndptr is sent), else for Decode calls.
	Prefill bool
	// Table is the page table after the step's appends, as AttentionRequest.Table.
	Table BatchCSR
	// PageTable, when set, replaces Table: the server reads it from shared memory when it is
	// staged there (Client.StagePageTable), else its CSR is sent.
	PageTable *StagedPageTable
	// Session holding the plan; "" takes the client's (WithSession) or the connection's.
	Session string
}

// Plan is a page table the server holds for the session's calls (CreatePlan): set it as
// AttentionRequest.Plan. It serves one pool and one method. The server knows a plan by its name
// only, so once ReleasePlan dropped it, a plan of its name replaced it or its session was closed
// (through this client or one WithSession made from it), calls refuse it (ErrNotFound) rather
// than name whatever plan has the name now.
type Plan struct {
	Name     string
	Pool     string // as the request named it
	Prefill  bool   // a Prefill plan, else a Decode plan
	Batch    int    // sequences
	TotalQ   int    // query rows a call naming the plan carries (Batch for Decode)
	NumPages int    // pages it pins

	book *planBook // nil for a Plan the caller made itself: not checked
	key  planKey
	gen  uint64
}

// planBook is which Plan is current under each session's plan name, shared by a client and the
// clients WithSession makes from it.
type planBook struct {
	mu   sync.Mutex
	gens map[planKey]uint64 // the current plan's generation
	last uint64
}

type planKey struct{ session, name string }

// add records a plan the server just made (replacing any of its key) and returns its generation.
func (b *planBook) add(key planKey) uint64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.gens == nil {
		b.gens = map[planKey]uint64{}
	}
	b.last++
	b.gens[key] = b.last
	return b.last
}

// drop forgets the plans of the session (all of them when name is "").
func (b *planBook) drop(session, name string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for key := range b.gens {
		if key.session == session && (name == "" || key.name == name) {
			delete(b.gens, key)
		}
	}
}

// current reports whether p is still the plan of its name.
func (p *Plan) current() bool {
	if p.book == nil {
		return true
	}
	p.book.mu.Lock()
	defer p.book.mu.Unlock()
	return p.book.gens[p.key] == p.gen
}

// Proto is the request as the wire CreatePlanRequest.
func (r *PlanRequest) Proto() *pb.CreatePlanRequest {
	name := r.Name
	if name == "" {
		name = DefaultPlanName
	}
	q := &pb.CreatePlanRequest{Pool: r.Pool, Name: name, Prefill: r.Prefill, Session: r.Session}
	at := &AttentionRequest{Table: r.Table, PageTable: r.PageTable}
	if ref, table := at.table(r.Prefill); ref != nil {
		q.PageTable = ref
	} else {
		if r.Prefill {
			q.QoIndptr = table.QOIndptr
		}
		q.KvIndptr, q.KvIndices, q.KvLastPageLen = table.KVIndptr, table.KVIndices, table.KVLastPageLen
	}
	return q
}

// CreatePlan has the server check and pin a page table for the calls of one step (see
// "Plans"). The table's errors are a call's (InvalidArgument; FailedPrecondition for pages not
// the session's); ResourceExhausted past the session's plans (DataPlane.MaxPlansPerSession).
// A refused table leaves the session's plan of that name as it was.
func (c *Client) CreatePlan(ctx context.Context, req *PlanRequest) (*Plan, error) {
	q := req.Proto()
	if err := c.nameSession(ctx, &q.Session); err != nil {
		return nil, err
	}
	var resp *pb.CreatePlanResponse
	err := c.invoke(ctx, "CreatePlan", func(ctx context.Context, o []grpc.CallOption) (err error) {
		resp, err = c.stub.CreatePlan(ctx, q, o...)
		return err
	})
	if err != nil {
		return nil, err
	}
	key := planKey{q.Session, q.Name}
	return &Plan{Name: q.Name, Pool: req.Pool, Prefill: req.Prefill, Batch: int(resp.GetBatch()),
		TotalQ: int(resp.GetTotalQ()), NumPages: int(resp.GetNumPages()),
		book: c.plans, key: key, gen: c.plans.add(key)}, nil
}

// ReleasePlan drops the session's plan of that name (NotFound when it has none); its pins go
// when the calls admitted with it have ended. Not retried on Unavailable (a retry after the
// release ran would answer NotFound).
func (c *Client) ReleasePlan(ctx context.Context, name string) error {
	session, err := c.sessionFor(ctx)
	if err != nil {
		return err
	}
	c.plans.drop(session, name)
	req := &pb.ReleasePlanRequest{Name: name, Session: session}
	return c.invoke(ctx, "ReleasePlan", func(ctx context.Context, o []grpc.CallOption) error {
		_, err := c.stub.ReleasePlan(ctx, req, o...)
		return err
	})
}

// checkPlan refuses a call whose plan serves the other method or is no longer current, before
// anything is sent.
func checkPlan(method string, req *AttentionRequest, prefill bool) error {
	p := req.Plan
	switch {
	case p == nil:
		return nil
	case p.Prefill != prefill:
		kind := "Decode"
		if p.Prefill {
			kind = "Prefill"
		}
		return &Error{Method: method, Code: codes.InvalidArgument,
			Message: fmt.Sprintf("plan %q is a %s plan", p.Name, kind)}
	case !p.current():
		return &Error{Method: method, Code: codes.NotFound, Message: fmt.Sprintf(
			"plan %q was released, replaced by a plan of its name or closed with its session", p.Name)}
	}
	return nil
}
