package attnserve

import (
	"context"
	"sync"
	"time"

	"google.golang.org/grpc"

	pb "attnserve/client/go/gen/attnservev1"
)

// Sessions (attention.proto "Sessions and leases"): pages belong to a session, and every call
// that uses pages names one (the server has no implicit sessions). A client bound to none opens
// one, with the server's defaults, on its first such call; to share a session between clients
// or choose its lease and quota, open one and bind clients to it with WithSession. A session
// belongs to the token (or client certificate) that opened it. Every call naming a session
// renews its lease; a session without calls for its lease is closed by the server and its pages
// are reclaimed. Handles carry the server's epoch: after a server restart they fail with
// FAILED_PRECONDITION.

// SessionOptions are what OpenSession asks for; zero values take the server's defaults.
type SessionOptions struct {
	Lease    time.Duration // closed after this long without a call (capped by the server)
	MaxPages int           // most pages the session may hold, over all pools (0: server default)
}

// Session is an opened session, as granted.
type Session struct {
	ID       string        // the handle calls name
	Epoch    uint64        // the server's epoch (changes on every restart)
	Lease    time.Duration // lease granted
	MaxPages int           // quota granted (0: none)
}

// OpenSession opens a session. Bind a client to it with WithSession(s.ID).
func (c *Client) OpenSession(ctx context.Context, opts SessionOptions) (*Session, error) {
	var resp *pb.OpenSessionResponse
	req := &pb.OpenSessionRequest{LeaseMs: int32(opts.Lease / time.Millisecond), MaxPages: int32(opts.MaxPages)}
	err := c.invoke(ctx, "OpenSession", func(ctx context.Context, o []grpc.CallOption) (err error) {
		resp, err = c.stub.OpenSession(ctx, req, o...)
		return err
	})
	if err != nil {
		return nil, err
	}
	return &Session{
		ID:       resp.GetSession(),
		Epoch:    resp.GetEpoch(),
		Lease:    time.Duration(resp.GetLeaseMs()) * time.Millisecond,
		MaxPages: int(resp.GetMaxPages()),
	}, nil
}

// CloseSession closes a session and frees its pages (pages an unfinished call uses are freed
// when it finishes); it returns how many pages were released.
func (c *Client) CloseSession(ctx context.Context, id string) (int, error) {
	var resp *pb.CloseSessionResponse
	req := &pb.CloseSessionRequest{Session: id}
	err := c.invoke(ctx, "CloseSession", func(ctx context.Context, o []grpc.CallOption) (err error) {
		resp, err = c.stub.CloseSession(ctx, req, o...)
		return err
	})
	if err != nil {
		return 0, err
	}
	if id == c.session {
		c.releaseRegions(false) // the session's regions went with it
	}
	c.plans.drop(id, "") // and its plans
	return int(resp.GetFreedPages()), nil
}

// WithSession returns a client bound to the session id: it shares c's connection and options,
// and every ServerInfo, AllocatePages, FreePages, Prefill and Decode call names the session
// (an AttentionRequest with its own Session keeps it). Closing the bound client does not close
// the connection. "" unbinds.
func (c *Client) WithSession(id string) *Client {
	bound := *c
	bound.session = id
	bound.conn = nil
	bound.plane = c.plane.fresh() // regions belong to a session
	return &bound
}

// Session is the session the client is bound to, or the one it opened itself ("" until its
// first call that needs one).
func (c *Client) Session() string {
	if c.session != "" || c.auto == nil {
		return c.session
	}
	c.auto.mu.Lock()
	defer c.auto.mu.Unlock()
	return c.auto.id
}

// autoSession is the session a client without one opens on its first call that needs one,
// shared by the clients WithSession("") makes from it.
type autoSession struct {
	mu sync.Mutex
	id string
}

// sessionFor is the session a call names: the bound one, or the one opened for this client.
func (c *Client) sessionFor(ctx context.Context) (string, error) {
	if c.session != "" || c.auto == nil {
		return c.session, nil
	}
	c.auto.mu.Lock()
	defer c.auto.mu.Unlock()
	if c.auto.id == "" {
		s, err := c.OpenSession(ctx, SessionOptions{})
		if err != nil {
			return "", err
		}
		c.auto.id = s.ID
	}
	return c.auto.id, nil
}

// nameSession sets *field to the client's session when it is empty.
func (c *Client) nameSession(ctx context.Context, field *string) error {
	if *field != "" {
		return nil
	}
	s, err := c.sessionFor(ctx)
	*field = s
	return err
}
