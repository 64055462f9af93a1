// Package attnserve is the Go client of attnserve, a gRPC server that owns a paged KV cache and
// runs attention (GQA and DeepSeek-style MLA) for schedulers that call it once per layer.
//
// The pieces:
//
//   - Client (Dial, NewFromConn): typed calls ServerInfo, AllocatePages, FreePages, Prefill,
//     Decode, OpenSession, CloseSession, CreatePlan and ReleasePlan. Every call carries a
//     deadline (the client's default timeout when the caller's context has none), message
//     limits are raised for large prefill batches, and failed calls are retried as RetryPolicy
//     describes: a full request queue (RESOURCE_EXHAUSTED with the server's
//     grpc-retry-pushback-ms trailer) after the pushback, UNAVAILABLE with backoff for the
//     idempotent methods.
//   - Sessions: pages belong to a session; WithSession binds a client to an explicit one.
//   - Error: every failed call returns an *Error with the gRPC code and the server's message;
//     match with errors.Is(err, attnserve.ErrPoolExhausted) (and the other sentinels) or
//     Code(err).
//   - BF16Tensor / F32Tensor and Float32ToBF16 / BF16ToFloat32: the wire tensors and bf16
//     conversion (round to nearest even, NaN preserved).
//   - PageTable / BatchCSR: per-sequence page lists over one pool, allocated from the server as
//     sequences grow, and the CSR page-table arrays Prefill and Decode take.
//   - StagedPageTable (StagePageTable) and shared memory (WithTransport): a step's page table
//     written once for every layer's call, and tensors and outputs passed through shared
//     memory instead of bytes (regions.go, dataplane.go).
//   - Plan (CreatePlan, ReleasePlan): a step's page table checked and pinned once by the
//     server; calls name it (AttentionRequest.Plan) instead of carrying the table (plans.go).
//
// The attention contract (bottom-right causal mask, base-2 lse, rows that see no key) is
// documented in proto/attnserve/v1/attention.proto and docs/design.md; package
// attnserve/client/go/reference recomputes it in float64.
package attnserve
