package attnservetest

import (
	"context"
	"path"
	"sync"

	"google.golang.org/grpc"

	"attnserve/client/go/attnserve"
)

// Call is one unary call a client made, as sent and as answered.
type Call struct {
	Method     string // the method's name: "Decode", "CreatePlan", ...
	Req, Reply interface{}
	Err        error
}

// Recorder keeps every unary call of the clients it is an option of (Option), in the order they
// were answered. Safe for concurrent clients.
type Recorder struct {
	mu    sync.Mutex
	calls []Call
}

// Option records the calls of a client dialed with it.
func (r *Recorder) Option() attnserve.Option {
	return attnserve.WithDialOptions(grpc.WithUnaryInterceptor(func(ctx context.Context, method string,
		req, reply interface{}, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		err := invoker(ctx, method, req, reply, cc, opts...)
		r.mu.Lock()
		r.calls = append(r.calls, Call{path.Base(method), req, reply, err})
		r.mu.Unlock()
		return err
	}))
}

// Calls is a copy of the calls recorded so far.
func (r *Recorder) Calls() []Call {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]Call(nil), r.calls...)
}
