package attnserve

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// PushbackTrailer is the standard gRPC trailer in which the server says how long to wait before
// retrying; attnserve sends it with RESOURCE_EXHAUSTED when a request queue is full.
const PushbackTrailer = "grpc-retry-pushback-ms"

// Error is a failed call: the gRPC status code and the server's message. Every error the Client
// returns is an *Error; a response the client cannot decode is an *Error with code Internal.
//
// Errors match by code: errors.Is(err, ErrResourceExhausted) is true for any *Error with code
// ResourceExhausted. Code DeadlineExceeded also matches context.DeadlineExceeded and Canceled
// matches context.Canceled. GRPCStatus makes status.FromError and status.Code work too.
type Error struct {
	Method  string // the RPC, e.g. "Prefill"; empty for a sentinel
	Code    codes.Code
	Message string
	// Pushback is the server's grpc-retry-pushback-ms trailer when HasPushback (a full request
	// queue). A RESOURCE_EXHAUSTED without it (a full page pool) is not worth retrying as is.
	Pushback    time.Duration
	HasPushback bool
	// Attempts is how many times the call was sent (more than 1 after retries).
	Attempts int

	kind sentinelKind // narrower sentinels only
}

type sentinelKind int

const (
	kindCode sentinelKind = iota
	kindPoolExhausted
	kindQueueFull
)

// Sentinels for errors.Is: they match any *Error with the same code, except the two narrower
// kinds of RESOURCE_EXHAUSTED.
var (
	ErrInvalidArgument   = &Error{Code: codes.InvalidArgument}
	ErrResourceExhausted = &Error{Code: codes.ResourceExhausted} // either kind below, or a message over a limit
	// ErrPoolExhausted: AllocatePages found fewer free pages than asked (or the session's quota
	// was reached) and allocated nothing. Never retried: free or preempt sequences first.
	ErrPoolExhausted = &Error{Code: codes.ResourceExhausted, kind: kindPoolExhausted}
	// ErrQueueFull: the server's request queue was full and it refused the call before queueing
	// it, sending a retry pushback. Retried by default.
	ErrQueueFull          = &Error{Code: codes.ResourceExhausted, kind: kindQueueFull}
	ErrFailedPrecondition = &Error{Code: codes.FailedPrecondition}
	ErrNotFound           = &Error{Code: codes.NotFound}
	ErrUnavailable        = &Error{Code: codes.Unavailable}
	ErrDeadlineExceeded   = &Error{Code: codes.DeadlineExceeded}
	ErrCanceled           = &Error{Code: codes.Canceled}
	ErrInternal           = &Error{Code: codes.Internal}
)

func (e *Error) Error() string {
	s := "attnserve: "
	if e.Method != "" {
		s += e.Method + ": "
	}
	s += CodeName(e.Code)
	if e.Message != "" {
		s += ": " + e.Message
	}
	if e.Attempts > 1 {
		s += fmt.Sprintf(" (after %d attempts)", e.Attempts)
	}
	return s
}

// Is reports whether target is an *Error with the same code (ErrPoolExhausted: a
// RESOURCE_EXHAUSTED of AllocatePages without pushback; ErrQueueFull: one with pushback), or
// the context error of the same meaning: context.DeadlineExceeded for DeadlineExceeded,
// context.Canceled for Canceled.
func (e *Error) Is(target error) bool {
	switch t := target.(type) {
	case *Error:
		switch t.kind {
		case kindPoolExhausted:
			return e.Code == codes.ResourceExhausted && !e.HasPushback && e.Method == "AllocatePages"
		case kindQueueFull:
			return e.Code == codes.ResourceExhausted && e.HasPushback
		}
		return t.Code == e.Code
	}
	switch target {
	case context.DeadlineExceeded:
		return e.Code == codes.DeadlineExceeded
	case context.Canceled:
		return e.Code == codes.Canceled
	}
	return false
}

// GRPCStatus returns the error as a gRPC status (used by status.FromError and status.Code).
func (e *Error) GRPCStatus() *status.Status { return status.New(e.Code, e.Message) }

// Code is the gRPC code of err: OK for nil, the code of an *Error or a gRPC status error,
// DeadlineExceeded / Canceled for the context errors, Unknown otherwise.
func Code(err error) codes.Code {
	if err == nil {
		return codes.OK
	}
	var e *Error
	if errors.As(err, &e) {
		return e.Code
	}
	if errors.Is(err, context.DeadlineExceeded) {
		return codes.DeadlineExceeded
	}
	if errors.Is(err, context.Canceled) {
		return codes.Canceled
	}
	if s, ok := status.FromError(err); ok {
		return s.Code()
	}
	return codes.Unknown
}

// CodeName is the canonical upper-case name of a code, e.g. "RESOURCE_EXHAUSTED".
func CodeName(c codes.Code) string {
	if int(c) < len(codeNames) {
		return codeNames[c]
	}
	return "CODE(" + strconv.Itoa(int(c)) + ")"
}

var codeNames = [...]string{
	codes.OK:                 "OK",
	codes.Canceled:           "CANCELLED",
	codes.Unknown:            "UNKNOWN",
	codes.InvalidArgument:    "INVALID_ARGUMENT",
	codes.DeadlineExceeded:   "DEADLINE_EXCEEDED",
	codes.NotFound:           "NOT_FOUND",
	codes.AlreadyExists:      "ALREADY_EXISTS",
	codes.PermissionDenied:   "PERMISSION_DENIED",
	codes.ResourceExhausted:  "RESOURCE_EXHAUSTED",
	codes.FailedPrecondition: "FAILED_PRECONDITION",
	codes.Aborted:            "ABORTED",
	codes.OutOfRange:         "OUT_OF_RANGE",
	codes.Unimplemented:      "UNIMPLEMENTED",
	codes.Internal:           "INTERNAL",
	codes.Unavailable:        "UNAVAILABLE",
	codes.DataLoss:           "DATA_LOSS",
	codes.Unauthenticated:    "UNAUTHENTICATED",
}

// newError converts what a gRPC call returned (a status error, or a context error raised before
// the call) into an *Error, reading the pushback trailer.
func newError(method string, err error, trailer metadata.MD) *Error {
	e := &Error{Method: method, Code: Code(err), Message: err.Error()}
	// A context error raised on this side (e.g. the deadline passed while the call's tensors
	// were staged) keeps its code: FromError may report it as UNKNOWN.
	contextErr := errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled)
	if s, ok := status.FromError(err); ok && !(contextErr && s.Code() == codes.Unknown) {
		e.Code, e.Message = s.Code(), s.Message()
	}
	if v := trailer.Get(PushbackTrailer); len(v) == 1 {
		// As gRPC's own retry: a negative or malformed value means "do not retry".
		if ms, perr := strconv.ParseInt(v[0], 10, 64); perr == nil && ms >= 0 {
			e.Pushback, e.HasPushback = time.Duration(ms)*time.Millisecond, true
		}
	}
	return e
}
