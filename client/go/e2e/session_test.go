package e2e

import (
	"fmt"
	"math/rand"
	"testing"

	"attnserve/client/go/attnserve"
	"attnserve/client/go/reference"
)

// session drives one pool: random bf16 tokens in, every result checked against the float64
// reference over a local mirror of the cache.
type session struct {
	t      *testing.T
	c      *attnserve.Client
	pool   attnserve.PoolInfo
	table  *attnserve.PageTable[string]
	mirror *reference.Mirror
	rng    *rand.Rand
	plan   *attnserve.Plan // when set, calls name it instead of carrying their table
}

func newSession(t *testing.T, c *attnserve.Client, poolName string, seed int64) *session {
	t.Helper()
	pool, err := c.Pool(ctx(), poolName)
	if err != nil {
		t.Fatal(err)
	}
	mirror, err := reference.ForPool(pool)
	if err != nil {
		t.Fatal(err)
	}
	s := &session{t: t, c: c, pool: pool, mirror: mirror, rng: rand.New(rand.NewSource(seed)),
		table: attnserve.NewPageTable[string](c, pool.Name, pool.PageSize)}
	t.Cleanup(func() {
		if err := s.table.FreeAll(ctx()); err != nil {
			t.Errorf("freeing the session's pages: %v", err)
		}
	})
	return s
}

func (s *session) isMLA() bool { return s.pool.Kind == attnserve.PoolKindMLA }

// random returns n bf16-representable values (normal, scaled).
func (s *session) random(n int, scale float64) []float32 {
	out := make([]float32, n)
	for i := range out {
		out[i] = attnserve.RoundToBF16(float32(s.rng.NormFloat64() * scale))
	}
	return out
}

// grow reserves qLens[i] new tokens for ids[i].
func (s *session) grow(ids []string, qLens []int) {
	s.t.Helper()
	for i, id := range ids {
		if _, err := s.table.Reserve(ctx(), id, qLens[i]); err != nil {
			s.t.Fatalf("reserve %s: %v", id, err)
		}
	}
}

// call sends one checked Prefill (qLens given) or Decode (qLens nil) for ids on layer. With
// appendKV it sends the K/V of each sequence's last q_len tokens (grown beforehand).
func (s *session) call(layer int, ids []string, qLens []int, appendKV bool) *attnserve.AttentionResult {
	s.t.Helper()
	decode := qLens == nil
	table, err := s.table.CSR(ids, qLens)
	if err != nil {
		s.t.Fatal(err)
	}
	totalQ, h := table.TotalQ(), s.pool.NumQOHeads
	req := &attnserve.AttentionRequest{Pool: s.pool.Name, Layer: layer, Table: table, ReturnLSE: true}
	if s.plan != nil { // the call carries no table: the server reads the plan's
		req.Table, req.Plan = attnserve.BatchCSR{}, s.plan
	}
	var q, qpe []float32
	rows := map[string][]float32{}
	if s.isMLA() {
		q, qpe = s.random(totalQ*h*attnserve.MLACKVDim, 1), s.random(totalQ*h*attnserve.MLAKPEDim, 1)
		req.Q = attnserve.BF16TensorFromFloat32(q, totalQ, h, attnserve.MLACKVDim)
		req.QPE = attnserve.BF16TensorFromFloat32(qpe, totalQ, h, attnserve.MLAKPEDim)
		req.SMScale = attnserve.SMScale(attnserve.DeepSeekV3SMScale)
		if appendKV {
			rows["ckv"], rows["kpe"] = s.random(totalQ*attnserve.MLACKVDim, 1), s.random(totalQ*attnserve.MLAKPEDim, 1)
			req.CKVNew = attnserve.BF16TensorFromFloat32(rows["ckv"], totalQ, attnserve.MLACKVDim)
			req.KPENew = attnserve.BF16TensorFromFloat32(rows["kpe"], totalQ, attnserve.MLAKPEDim)
		}
	} else {
		d, hkv := s.pool.HeadDim, s.pool.NumKVHeads
		q = s.random(totalQ*h*d, 1)
		req.Q = attnserve.BF16TensorFromFloat32(q, totalQ, h, d)
		if appendKV {
			rows["k"], rows["v"] = s.random(totalQ*hkv*d, 1), s.random(totalQ*hkv*d, 1)
			req.KNew = attnserve.BF16TensorFromFloat32(rows["k"], totalQ, hkv, d)
			req.VNew = attnserve.BF16TensorFromFloat32(rows["v"], totalQ, hkv, d)
		}
	}
	var res *attnserve.AttentionResult
	if decode {
		res, err = s.c.Decode(ctx(), req)
	} else {
		res, err = s.c.Prefill(ctx(), req)
	}
	if err != nil {
		s.t.Fatalf("layer %d %v q_lens %v: %v", layer, ids, qLens, err)
	}
	if appendKV {
		if err := s.mirror.Append(layer, table, rows); err != nil {
			s.t.Fatal(err)
		}
	}
	var refOut, refLSE []float64
	if s.isMLA() {
		refOut, refLSE, err = reference.MLA(s.mirror, layer, table, q, qpe, h, float64(attnserve.DeepSeekV3SMScale))
	} else {
		refOut, refLSE, err = reference.GQA(s.mirror, layer, table, q, h, s.pool.HeadDim, 0)
	}
	if err != nil {
		s.t.Fatal(err)
	}
	wantShape := fmt.Sprint([]int{totalQ, h, s.pool.OutputDims()})
	if got := fmt.Sprint(res.Output.Shape); got != wantShape {
		s.t.Fatalf("output shape %s, want %s", got, wantShape)
	}
	if got, want := fmt.Sprint(res.LSE.Shape), fmt.Sprint([]int{totalQ, h}); got != want {
		s.t.Fatalf("lse shape %s, want %s", got, want)
	}
	if r := reference.CheckClose(res.Output.Float32(), refOut); !r.OK() {
		s.t.Errorf("layer %d %v q_lens %v: output: %v (first at %d: %v vs %v)", layer, ids, qLens, r,
			r.FirstFailed, res.Output.Float32()[r.FirstFailed], refOut[r.FirstFailed])
	}
	if r := reference.CheckClose(res.LSE.Data, refLSE); !r.OK() {
		s.t.Errorf("layer %d %v q_lens %v: lse: %v", layer, ids, qLens, r)
	}
	return res
}
