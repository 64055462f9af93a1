package attnserve

import (
	"fmt"
	"strings"
	"time"

	pb "attnserve/client/go/gen/attnservev1"
)

// MLA latent widths (fixed by the server): q_nope, ckv and the output are 512 wide, q_pe and kpe
// 64.
const (
	MLACKVDim = 512
	MLAKPEDim = 64
)

// DeepSeekV3SMScale is the softmax scale DeepSeek-V3 uses for MLA; MLA calls must send a scale.
const DeepSeekV3SMScale float32 = 0.1352337747812271

// EmptyRowLSE is the lse of a query row that sees no key (its output is 0).
const EmptyRowLSE float32 = -1e30

// PoolKind is the attention family of a pool.
type PoolKind int32

const (
	PoolKindUnspecified PoolKind = 0
	PoolKindGQA         PoolKind = 1 // grouped-query attention
	PoolKindMLA         PoolKind = 2 // DeepSeek-style multi-head latent attention (absorbed)
)

func (k PoolKind) String() string {
	switch k {
	case PoolKindGQA:
		return "GQA"
	case PoolKindMLA:
		return "MLA"
	}
	return fmt.Sprintf("PoolKind(%d)", int32(k))
}

// PoolInfo is the geometry and occupancy of one pool (attention.proto PoolInfo).
type PoolInfo struct {
	Name         string
	Kind         PoolKind
	NumLayers    int
	PageSize     int // tokens per page
	NumQOHeads   int // H: query heads of every call
	NumKVHeads   int // GQA: H_kv (1 for MLA)
	HeadDim      int // GQA: D
	CKVDim       int // MLA: 512
	KPEDim       int // MLA: 64
	TotalPages   int
	FreePages    int // at the moment of the call
	BytesPerPage int64
}

// QueryDims is the width of q (GQA: D; MLA: 512, with q_pe of 64 besides).
func (p PoolInfo) QueryDims() int {
	if p.Kind == PoolKindMLA {
		return MLACKVDim
	}
	return p.HeadDim
}

// OutputDims is the width of an output row per head (GQA: D; MLA: 512).
func (p PoolInfo) OutputDims() int { return p.QueryDims() }

// ServerInfo is the server's version, backend and pools (attention.proto GetServerInfoResponse).
type ServerInfo struct {
	Version         string
	Backend         string // "cpu" or "cuda"
	Device          string
	Pools           []PoolInfo
	MaxMessageBytes int64 // largest request the server accepts
	// Epoch is drawn at every server start: a change means the server restarted and every page
	// id and session handle from before is gone.
	Epoch        uint64
	DefaultLease time.Duration // lease of OpenSession without one
	DataPlane    DataPlane
}

// DataPlane is which registered-memory kinds the server accepts, and the per-session limits
// (attention.proto DataPlane). All zero on a server without them.
type DataPlane struct {
	SharedMemory             bool
	CudaIPC                  bool
	MaxRegionsPerSession     int
	MaxRegionBytesPerSession int64
	CudaPCIBusID             string // the server's GPU, for CUDA IPC callers
	MaxPlansPerSession       int    // plans one session may hold (CreatePlan); 0 without plans
}

// Pool returns the pool with that name; "" selects the server's only pool (an error if there
// are several).
func (s *ServerInfo) Pool(name string) (PoolInfo, error) {
	if name == "" {
		if len(s.Pools) != 1 {
			return PoolInfo{}, fmt.Errorf("attnserve: the server has %d pools; name one", len(s.Pools))
		}
		return s.Pools[0], nil
	}
	names := make([]string, len(s.Pools))
	for i, p := range s.Pools {
		if p.Name == name {
			return p, nil
		}
		names[i] = p.Name
	}
	return PoolInfo{}, fmt.Errorf("attnserve: no pool %q; the server has [%s]", name,
		strings.Join(names, ", "))
}

func serverInfoFromProto(r *pb.GetServerInfoResponse) *ServerInfo {
	info := &ServerInfo{
		Version:         r.GetVersion(),
		Backend:         r.GetBackend(),
		Device:          r.GetDevice(),
		MaxMessageBytes: r.GetMaxMessageBytes(),
		Epoch:           r.GetEpoch(),
		DefaultLease:    time.Duration(r.GetDefaultLeaseMs()) * time.Millisecond,
	}
	if d := r.GetDataPlane(); d != nil {
		info.DataPlane = DataPlane{SharedMemory: d.GetSharedMemory(), CudaIPC: d.GetCudaIpc(),
			MaxRegionsPerSession: int(d.GetMaxRegionsPerSession()), MaxRegionBytesPerSession: d.GetMaxRegionBytesPerSession(),
			CudaPCIBusID: d.GetCudaPciBusId(), MaxPlansPerSession: int(d.GetMaxPlansPerSession())}
	}
	for _, p := range r.GetPools() {
		info.Pools = append(info.Pools, PoolInfo{
			Name:         p.GetName(),
			Kind:         PoolKind(p.GetKind()),
			NumLayers:    int(p.GetNumLayers()),
			PageSize:     int(p.GetPageSize()),
			NumQOHeads:   int(p.GetNumQoHeads()),
			NumKVHeads:   int(p.GetNumKvHeads()),
			HeadDim:      int(p.GetHeadDim()),
			CKVDim:       int(p.GetCkvDim()),
			KPEDim:       int(p.GetKpeDim()),
			TotalPages:   int(p.GetTotalPages()),
			FreePages:    int(p.GetFreePages()),
			BytesPerPage: p.GetBytesPerPage(),
		})
	}
	return info
}

// AttentionRequest is one Prefill or Decode call.
//
// Shapes (total_q = query rows of the call; for Decode one per sequence, total_q = batch):
//
//	GQA: Q [total_q, H, D]; KNew, VNew [total_q, H_kv, D] (both or neither).
//	MLA: Q is q_nope [total_q, H, 512]; QPE [total_q, H, 64]; CKVNew [total_q, 512] and
//	     KPENew [total_q, 64] (both or neither); SMScale is required.
//
// Tensors left at their zero value are not sent. When the new K/V are given, row r of sequence
// b is written at position kv_len[b] - q_len[b] + (r - qo_indptr[b]) before attention runs.
type AttentionRequest struct {
	Pool  string // "" selects the server's only pool
	Layer int

	Q      BF16Tensor
	QPE    BF16Tensor
	KNew   BF16Tensor
	VNew   BF16Tensor
	CKVNew BF16Tensor
	KPENew BF16Tensor

	// Table is the page table after the append. Prefill sends Table.QOIndptr; Decode does not.
	Table BatchCSR
	// PageTable, when set, replaces Table: the call names it in shared memory when it is
	// staged there (Client.StagePageTable), else sends its CSR.
	PageTable *StagedPageTable
	// Plan, when set, replaces Table and PageTable: the call names the plan (CreatePlan), made
	// for this method and pool, and carries no page table.
	Plan *Plan
	// SMScale is the softmax scale (nil: the server's default 1/sqrt(D) for GQA; MLA needs one).
	SMScale *float32
	// ReturnLSE asks for the base-2 log-sum-exp of every row and head.
	ReturnLSE bool
	// Session owning the pages; "" takes the client's (WithSession) or the connection's.
	Session string
}

// SMScale returns a pointer to v, for AttentionRequest.SMScale.
func SMScale(v float32) *float32 { return &v }

// PrefillProto is the request as the wire PrefillRequest.
func (r *AttentionRequest) PrefillProto() *pb.PrefillRequest {
	q := &pb.PrefillRequest{
		Pool:      r.Pool,
		Layer:     int32(r.Layer),
		Q:         optTensor(r.Q),
		QPe:       optTensor(r.QPE),
		KNew:      optTensor(r.KNew),
		VNew:      optTensor(r.VNew),
		CkvNew:    optTensor(r.CKVNew),
		KpeNew:    optTensor(r.KPENew),
		ReturnLse: r.ReturnLSE,
		Session:   r.Session,
	}
	if ref, table := r.table(true); r.Plan != nil {
		q.Plan = r.Plan.Name
	} else if ref != nil {
		q.PageTable = ref
	} else {
		q.QoIndptr, q.KvIndptr, q.KvIndices, q.KvLastPageLen =
			table.QOIndptr, table.KVIndptr, table.KVIndices, table.KVLastPageLen
	}
	if r.SMScale != nil {
		q.SmScale = SMScale(*r.SMScale)
	}
	return q
}

// table is the request's page table: a PageTableRef of the prefill or decode layout when it
// has a staged PageTable, else the CSR arrays to send.
func (r *AttentionRequest) table(prefill bool) (*pb.PageTableRef, BatchCSR) {
	if r.PageTable == nil {
		return nil, r.Table
	}
	if !r.PageTable.Staged() {
		return nil, r.PageTable.CSR
	}
	if prefill {
		return r.PageTable.prefill, r.PageTable.CSR
	}
	return r.PageTable.decode, r.PageTable.CSR
}

// DecodeProto is the request as the wire DecodeRequest (Table.QOIndptr is not part of it).
func (r *AttentionRequest) DecodeProto() *pb.DecodeRequest {
	q := &pb.DecodeRequest{
		Pool:      r.Pool,
		Layer:     int32(r.Layer),
		Q:         optTensor(r.Q),
		QPe:       optTensor(r.QPE),
		KNew:      optTensor(r.KNew),
		VNew:      optTensor(r.VNew),
		CkvNew:    optTensor(r.CKVNew),
		KpeNew:    optTensor(r.KPENew),
		ReturnLse: r.ReturnLSE,
		Session:   r.Session,
	}
	if ref, table := r.table(false); r.Plan != nil {
		q.Plan = r.Plan.Name
	} else if ref != nil {
		q.PageTable = ref
	} else {
		q.KvIndptr, q.KvIndices, q.KvLastPageLen = table.KVIndptr, table.KVIndices, table.KVLastPageLen
	}
	if r.SMScale != nil {
		q.SmScale = SMScale(*r.SMScale)
	}
	return q
}

func optTensor(t BF16Tensor) *pb.Tensor {
	if !t.IsSet() {
		return nil
	}
	return t.Proto()
}

// Timings is the server-side time of one call (attention.proto Timings).
type Timings struct {
	Queue         time.Duration // from validation until the call's batch started
	Compute       time.Duration // the batch's append + attention on the backend (within Execute)
	Total         time.Duration // from the call's arrival to its completion
	BatchRequests int           // calls merged into the launch that served this one
	// The launch's stages: gathering inputs, the backend's work (GPU: copies in, kernels,
	// copies out), writing outputs.
	Prepare, Execute, Finish time.Duration
}

// AttentionResult is what Prefill and Decode return.
type AttentionResult struct {
	// Output is bf16: GQA [total_q, H, D], MLA [total_q, H, 512]. Rows that see no key are 0.
	Output BF16Tensor
	// LSE is float32 [total_q, H], base-2; absent (zero value) unless ReturnLSE. Rows that see
	// no key have EmptyRowLSE.
	LSE     F32Tensor
	Timings Timings
}

func resultFromProto(r *pb.AttentionResponse) (*AttentionResult, error) {
	out, err := BF16TensorFromProto(r.GetOutput())
	if err != nil {
		return nil, fmt.Errorf("output: %w", err)
	}
	res := &AttentionResult{Output: out}
	if r.GetLse() != nil {
		if res.LSE, err = F32TensorFromProto(r.GetLse()); err != nil {
			return nil, fmt.Errorf("lse: %w", err)
		}
	}
	t := r.GetTimings()
	res.Timings = Timings{
		Queue:         time.Duration(t.GetQueueUs()) * time.Microsecond,
		Compute:       time.Duration(t.GetComputeUs()) * time.Microsecond,
		Total:         time.Duration(t.GetTotalUs()) * time.Microsecond,
		BatchRequests: int(t.GetBatchRequests()),
		Prepare:       time.Duration(t.GetPrepareUs()) * time.Microsecond,
		Execute:       time.Duration(t.GetExecuteUs()) * time.Microsecond,
		Finish:        time.Duration(t.GetFinishUs()) * time.Microsecond,
	}
	return res, nil
}
