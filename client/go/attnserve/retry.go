package attnserve

import (
	"context"
	"math/rand"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
)

// RetryPolicy says how often and how patiently failed calls are sent again. The rules (the
// same as the Python client's):
//
//   - RESOURCE_EXHAUSTED with the grpc-retry-pushback-ms trailer (ErrQueueFull), any method:
//     the server refused the call before queueing it, so nothing happened. The retry waits at
//     least the pushback the server asked for.
//   - UNAVAILABLE, for the idempotent methods only: GetServerInfo, Prefill, Decode,
//     OpenSession and CreatePlan. attnserve answers UNAVAILABLE while it drains, for calls it
//     refused before their launch; UNAVAILABLE from the transport (connection lost mid-call) is
//     ambiguous, the call may have run. Prefill and Decode are still safe to run twice: the
//     append writes row r of a sequence at the position the page table fixes, so the same
//     request writes the same bytes into the same slots. A lost OpenSession leaves an empty
//     session that expires; a second CreatePlan replaces its name's plan with the same table.
//   - Not AllocatePages, FreePages, CloseSession or ReleasePlan on UNAVAILABLE: if the lost
//     attempt ran, a second AllocatePages allocates again and the first pages leak, a second
//     FreePages may free pages another client was given in between, and a second ReleasePlan
//     answers NotFound. They return ErrUnavailable at once.
//   - Never ErrPoolExhausted (AllocatePages on a full pool, no pushback: waiting does not free
//     pages; free or preempt sequences), nor any other code.
//
// The caller's context deadline (or the client's default timeout) bounds the whole call,
// retries included: a retry whose wait would end past the deadline is not made and the last
// error is returned. Before retry n (from 0) the wait is pushback + b * (1 - Jitter * u), with
// b = min(MaxBackoff, InitialBackoff * Multiplier^n) and u uniform in [0, 1). Zero fields are
// taken as they are (a zero backoff retries at once): start from DefaultRetryPolicy().
type RetryPolicy struct {
	// MaxAttempts counts the first call; 1 (or less) disables retries.
	MaxAttempts    int
	InitialBackoff time.Duration
	MaxBackoff     time.Duration
	Multiplier     float64
	// Jitter is the fraction of each backoff drawn at random (0: none, 1: anywhere in [0, b]).
	Jitter float64
	// OnRetry, when set, is called before each wait (for logs or metrics).
	OnRetry func(RetryEvent)
}

// RetryEvent describes a retry about to happen.
type RetryEvent struct {
	Method  string
	Attempt int    // the attempt that failed, from 1
	Err     *Error // its error
	Wait    time.Duration
}

// DefaultRetryPolicy: 5 attempts, backoff 50 ms doubling up to 2 s, half of it random.
func DefaultRetryPolicy() RetryPolicy {
	return RetryPolicy{
		MaxAttempts:    5,
		InitialBackoff: 50 * time.Millisecond,
		MaxBackoff:     2 * time.Second,
		Multiplier:     2,
		Jitter:         0.5,
	}
}

// idempotentMethods may be resent after an ambiguous UNAVAILABLE.
var idempotentMethods = map[string]bool{
	"GetServerInfo": true,
	"Prefill":       true,
	"Decode":        true,
	"OpenSession":   true,
	"CreatePlan":    true,
}

// retryable reports whether a call that failed with e may be sent again.
func retryable(e *Error) bool {
	switch e.Code {
	case codes.ResourceExhausted:
		return e.HasPushback
	case codes.Unavailable:
		return idempotentMethods[e.Method]
	}
	return false
}

// wait is how long to wait before the retry that follows the given failed attempt (from 1).
func (p *RetryPolicy) wait(attempt int, e *Error) time.Duration {
	b := float64(p.InitialBackoff)
	for i := 1; i < attempt && b < float64(p.MaxBackoff); i++ {
		b *= p.Multiplier
	}
	if b > float64(p.MaxBackoff) {
		b = float64(p.MaxBackoff)
	}
	d := b * (1 - p.Jitter*randFloat())
	if d < 0 {
		d = 0
	}
	return e.Pushback + time.Duration(d)
}

// sleep waits d unless ctx ends first (then it returns false).
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

var (
	rngMu sync.Mutex
	rng   = rand.New(rand.NewSource(time.Now().UnixNano()))
)

func randFloat() float64 {
	rngMu.Lock()
	defer rngMu.Unlock()
	return rng.Float64()
}
