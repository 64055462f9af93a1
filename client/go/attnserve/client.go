package attnserve

import (
	"context"
	"errors"
	"fmt"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"

	pb "attnserve/client/go/gen/attnservev1"
)

// Defaults of a Client.
const (
	DefaultTimeout         = 30 * time.Second
	DefaultMaxMessageBytes = 256 << 20 // gRPC's 4 MiB default is too small for prefill batches
)

// Client calls one attnserve server. It is safe for concurrent use; Close it when done.
type Client struct {
	addr    string
	conn    *grpc.ClientConn // nil when the connection belongs to the caller (NewFromConn)
	session string           // WithSession
	auto    *autoSession     // the session opened for a client without one (session.go)
	stub    pb.AttentionServiceClient
	opts    options
	calls   []grpc.CallOption
	plane   *dataPlane // the session's registered memory (dataplane.go)
	plans   *planBook  // the current plan of every name (plans.go), shared with WithSession's
}

type options struct {
	timeout         time.Duration
	maxMessageBytes int
	retry           RetryPolicy
	creds           credentials.TransportCredentials
	token           string
	dialOptions     []grpc.DialOption
	transport       Transport
	arenaBytes      int64
	shmPrefix       string
	shmMode         uint32
}

// Option configures a Client.
type Option func(*options)

// WithTimeout sets the deadline given to calls whose context has none (default 30 s; 0 or less:
// no default deadline). The deadline covers the call's retries too.
func WithTimeout(d time.Duration) Option { return func(o *options) { o.timeout = d } }

// WithMaxMessageBytes sets the largest message sent or received (default 256 MiB). The server
// has its own limit (ServerInfo.MaxMessageBytes).
func WithMaxMessageBytes(n int) Option { return func(o *options) { o.maxMessageBytes = n } }

// WithRetryPolicy replaces DefaultRetryPolicy.
func WithRetryPolicy(p RetryPolicy) Option { return func(o *options) { o.retry = p } }

// WithoutRetries sends every call once.
func WithoutRetries() Option { return func(o *options) { o.retry.MaxAttempts = 1 } }

// WithTransportCredentials connects with TLS (or other credentials) instead of plaintext.
func WithTransportCredentials(c credentials.TransportCredentials) Option {
	return func(o *options) { o.creds = c }
}

// WithBearerToken sends "authorization: Bearer <token>" with every call, for servers configured
// with access tokens (UNAUTHENTICATED without one, PERMISSION_DENIED for a method the token may
// not call). Tokens are sent on plaintext connections too; use TLS where the network is shared.
func WithBearerToken(token string) Option { return func(o *options) { o.token = token } }

// bearerToken is the per-call credential of WithBearerToken.
type bearerToken string

func (t bearerToken) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + string(t)}, nil
}

func (bearerToken) RequireTransportSecurity() bool { return false }

// WithTransport sets how calls carry their tensors, page tables and outputs (default
// TransportAuto: shared memory toward unix: and loopback servers that allow it; see regions.go).
func WithTransport(t Transport) Option { return func(o *options) { o.transport = t } }

// WithArenaBytes sets the size of the client's shared-memory arenas (default 64 MiB; a call
// that needs more gets a larger one).
func WithArenaBytes(n int64) Option { return func(o *options) { o.arenaBytes = n } }

// WithShmPrefix sets the prefix of the client's shared-memory names (default "/attnserve": the
// server opens only names under its DataPlaneConfig.shm_name_prefix).
func WithShmPrefix(prefix string) Option { return func(o *options) { o.shmPrefix = prefix } }

// WithShmMode sets the file mode of the client's shared-memory objects (default 0600: this
// user only; 0660 and a shared group for a server running as another user).
func WithShmMode(mode uint32) Option { return func(o *options) { o.shmMode = mode } }

// WithDialOptions adds gRPC dial options (interceptors, keepalive, ...), applied after the
// client's own.
func WithDialOptions(opts ...grpc.DialOption) Option {
	return func(o *options) { o.dialOptions = append(o.dialOptions, opts...) }
}

func newOptions(opts []Option) options {
	o := options{
		timeout:         DefaultTimeout,
		maxMessageBytes: DefaultMaxMessageBytes,
		retry:           DefaultRetryPolicy(),
		transport:       TransportAuto,
		arenaBytes:      DefaultArenaBytes,
		shmPrefix:       DefaultShmPrefix,
		shmMode:         defaultShmMode,
	}
	for _, opt := range opts {
		opt(&o)
	}
	return o
}

// Dial returns a client of the server at address ("host:port", or any gRPC target). It does not
// wait for the connection: the first call does (and a server that is not up yet answers
// UNAVAILABLE, which the retry policy rides out).
func Dial(address string, opts ...Option) (*Client, error) {
	o := newOptions(opts)
	dial := []grpc.DialOption{
		grpc.WithDefaultCallOptions(
			grpc.MaxCallRecvMsgSize(o.maxMessageBytes),
			grpc.MaxCallSendMsgSize(o.maxMessageBytes)),
	}
	if o.creds != nil {
		dial = append(dial, grpc.WithTransportCredentials(o.creds))
	} else {
		dial = append(dial, grpc.WithInsecure())
	}
	dial = append(dial, o.dialOptions...)
	conn, err := grpc.Dial(address, dial...)
	if err != nil {
		return nil, &Error{Method: "Dial", Code: codes.Unavailable, Message: err.Error()}
	}
	c := NewFromConn(conn, opts...)
	c.conn, c.addr = conn, address
	c.plane = newDataPlane(c.opts, address)
	return c, nil
}

// NewFromConn returns a client over a connection the caller owns (Close does not close it).
// The message limits are applied per call, so they hold whatever the connection's defaults.
func NewFromConn(conn grpc.ClientConnInterface, opts ...Option) *Client {
	o := newOptions(opts)
	calls := []grpc.CallOption{
		grpc.MaxCallRecvMsgSize(o.maxMessageBytes),
		grpc.MaxCallSendMsgSize(o.maxMessageBytes),
	}
	if o.token != "" {
		calls = append(calls, grpc.PerRPCCredentials(bearerToken(o.token)))
	}
	c := &Client{stub: pb.NewAttentionServiceClient(conn), opts: o, calls: calls, auto: &autoSession{},
		plans: &planBook{}}
	target := ""
	if cc, ok := conn.(*grpc.ClientConn); ok {
		target = cc.Target()
	}
	c.plane = newDataPlane(o, target)
	return c
}

// Close unregisters and unmaps the client's shared memory, then closes the connection Dial
// opened (NewFromConn and WithSession clients leave the connection open).
func (c *Client) Close() error {
	c.releaseRegions(true)
	if c.conn == nil {
		return nil
	}
	return c.conn.Close()
}

// Address is the target Dial was given ("" for NewFromConn).
func (c *Client) Address() string { return c.addr }

// WaitReady calls ServerInfo until the server answers, riding out UNAVAILABLE (a server still
// starting or restarting) with backoff until ctx ends; other errors return at once. Use it
// with a context deadline, e.g. when a scheduler starts next to the server.
func (c *Client) WaitReady(ctx context.Context) (*ServerInfo, error) {
	backoff := c.opts.retry.InitialBackoff
	if backoff <= 0 {
		backoff = 50 * time.Millisecond
	}
	for {
		info, err := c.ServerInfo(ctx)
		if !errors.Is(err, ErrUnavailable) || ctx.Err() != nil {
			return info, err
		}
		if !sleep(ctx, backoff) {
			return nil, err
		}
		if backoff *= 2; backoff > time.Second {
			backoff = time.Second
		}
	}
}

// Stub is the generated client underneath, for calls without this package's deadlines, retries
// and error conversion.
func (c *Client) Stub() pb.AttentionServiceClient { return c.stub }

// ServerInfo returns the server's version, backend, device and every pool's geometry and
// occupancy.
func (c *Client) ServerInfo(ctx context.Context) (*ServerInfo, error) {
	var resp *pb.GetServerInfoResponse
	err := c.invoke(ctx, "GetServerInfo", func(ctx context.Context, opts []grpc.CallOption) (err error) {
		resp, err = c.stub.GetServerInfo(ctx, &pb.GetServerInfoRequest{Session: c.session}, opts...)
		return err
	})
	if err != nil {
		return nil, err
	}
	return serverInfoFromProto(resp), nil
}

// Pool returns one pool's PoolInfo; "" selects the server's only pool. An unknown name is an
// *Error with code NotFound, "" on a server with several pools one with InvalidArgument.
func (c *Client) Pool(ctx context.Context, name string) (PoolInfo, error) {
	info, err := c.ServerInfo(ctx)
	if err != nil {
		return PoolInfo{}, err
	}
	p, err := info.Pool(name)
	if err != nil {
		code := codes.NotFound
		if name == "" {
			code = codes.InvalidArgument
		}
		return PoolInfo{}, &Error{Method: "GetServerInfo", Code: code, Message: err.Error()}
	}
	return p, nil
}

// AllocatePages allocates numPages pages of the pool (all or nothing) and returns their ids,
// owned by the caller until FreePages. A full pool fails with ResourceExhausted (not retried).
func (c *Client) AllocatePages(ctx context.Context, pool string, numPages int) ([]int32, error) {
	var resp *pb.AllocatePagesResponse
	session, err := c.sessionFor(ctx)
	if err != nil {
		return nil, err
	}
	req := &pb.AllocatePagesRequest{Pool: pool, NumPages: int32(numPages), Session: session}
	err = c.invoke(ctx, "AllocatePages", func(ctx context.Context, opts []grpc.CallOption) (err error) {
		resp, err = c.stub.AllocatePages(ctx, req, opts...)
		return err
	})
	if err != nil {
		return nil, err
	}
	if len(resp.GetPageIds()) != numPages {
		return nil, &Error{Method: "AllocatePages", Code: codes.Internal,
			Message: fmt.Sprintf("asked for %d pages, got %d", numPages, len(resp.GetPageIds()))}
	}
	return resp.GetPageIds(), nil
}

// FreePages returns pages to the pool (all or nothing) and returns the pool's free page count
// after the call.
func (c *Client) FreePages(ctx context.Context, pool string, pageIDs []int32) (int, error) {
	var resp *pb.FreePagesResponse
	session, err := c.sessionFor(ctx)
	if err != nil {
		return 0, err
	}
	req := &pb.FreePagesRequest{Pool: pool, PageIds: pageIDs, Session: session}
	err = c.invoke(ctx, "FreePages", func(ctx context.Context, opts []grpc.CallOption) (err error) {
		resp, err = c.stub.FreePages(ctx, req, opts...)
		return err
	})
	if err != nil {
		return 0, err
	}
	return int(resp.GetFreePages()), nil
}

// Prefill appends the new K/V (when given), then runs causal paged attention (bottom-right
// aligned mask) for every query row; req.Table.QOIndptr splits the rows into sequences.
func (c *Client) Prefill(ctx context.Context, req *AttentionRequest) (*AttentionResult, error) {
	return c.attend(ctx, req, true)
}

// Decode runs one query row per sequence (req.Q [batch, ...]) over all of its tokens, after
// appending its K/V (when given) at position kv_len - 1.
func (c *Client) Decode(ctx context.Context, req *AttentionRequest) (*AttentionResult, error) {
	return c.attend(ctx, req, false)
}

// PrefillProto sends a ready-made wire request as is (with the client's deadline, retries and
// error conversion), e.g. to send another dtype or to test the server's validation. A request
// naming no session gets the client's.
func (c *Client) PrefillProto(ctx context.Context, req *pb.PrefillRequest) (*AttentionResult, error) {
	var resp *pb.AttentionResponse
	if err := c.nameSession(ctx, &req.Session); err != nil {
		return nil, err
	}
	err := c.invoke(ctx, "Prefill", func(ctx context.Context, opts []grpc.CallOption) (err error) {
		resp, err = c.stub.Prefill(ctx, req, opts...)
		return err
	})
	if err != nil {
		return nil, err
	}
	return decodeResult("Prefill", resp)
}

// DecodeProto sends a ready-made wire DecodeRequest as is (naming the client's session when it
// names none).
func (c *Client) DecodeProto(ctx context.Context, req *pb.DecodeRequest) (*AttentionResult, error) {
	var resp *pb.AttentionResponse
	if err := c.nameSession(ctx, &req.Session); err != nil {
		return nil, err
	}
	err := c.invoke(ctx, "Decode", func(ctx context.Context, opts []grpc.CallOption) (err error) {
		resp, err = c.stub.Decode(ctx, req, opts...)
		return err
	})
	if err != nil {
		return nil, err
	}
	return decodeResult("Decode", resp)
}

func decodeResult(method string, resp *pb.AttentionResponse) (*AttentionResult, error) {
	res, err := resultFromProto(resp)
	if err != nil {
		return nil, &Error{Method: method, Code: codes.Internal, Message: "malformed response: " + err.Error()}
	}
	return res, nil
}

// invoke runs call under the default deadline, converting errors and retrying per the policy.
func (c *Client) invoke(ctx context.Context, method string,
	call func(context.Context, []grpc.CallOption) error) error {
	if _, ok := ctx.Deadline(); !ok && c.opts.timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, c.opts.timeout)
		defer cancel()
	}
	policy := &c.opts.retry
	for attempt := 1; ; attempt++ {
		var trailer metadata.MD
		opts := append(c.calls[:len(c.calls):len(c.calls)], grpc.Trailer(&trailer))
		err := call(ctx, opts)
		if err == nil {
			return nil
		}
		e := newError(method, err, trailer)
		e.Attempts = attempt
		if attempt >= policy.MaxAttempts || !retryable(e) || ctx.Err() != nil {
			return e
		}
		wait := policy.wait(attempt, e)
		if deadline, ok := ctx.Deadline(); ok && time.Until(deadline) < wait {
			return e // the retry could not finish in time; the server's answer says more
		}
		if policy.OnRetry != nil {
			policy.OnRetry(RetryEvent{Method: method, Attempt: attempt, Err: e, Wait: wait})
		}
		if !sleep(ctx, wait) {
			return e
		}
	}
}
