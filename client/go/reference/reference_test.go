package reference

import (
	"math"
	"testing"

	"attnserve/client/go/attnserve"
)

func near(a, b float64) bool { return math.Abs(a-b) < 1e-12 }

func TestAttendByHand(t *testing.T) {
	// One head, two keys, q_len 2 over kv_len 2: row 0 sees key 0, row 1 sees both.
	q := []float64{1, 0, 0, 1}
	keys := []float64{1, 0, 0, 2}
	values := []float64{10, 20}
	out, lse := Attend(q, 2, 1, 2, keys, values, 2, 1, 1, 1)
	if !near(out[0], 10) || !near(lse[0], 1/math.Ln2) {
		t.Fatalf("row 0: out %v lse %v", out[0], lse[0])
	}
	// Row 1: logits 0 and 2.
	p0, p1 := 1.0, math.Exp(2)
	if want := (10*p0 + 20*p1) / (p0 + p1); !near(out[1], want) {
		t.Fatalf("row 1: out %v, want %v", out[1], want)
	}
	if want := math.Log2(p0 + p1); !near(lse[1], want) {
		t.Fatalf("row 1: lse %v, want %v", lse[1], want)
	}
}

func TestAttendEmptyRowsAndGroups(t *testing.T) {
	// q_len 3 over kv_len 1: rows 0 and 1 see no key. 4 query heads over 2 KV heads.
	const h, hkv, d = 4, 2, 1
	q := make([]float64, 3*h*d)
	for i := range q {
		q[i] = 1
	}
	keys := []float64{0, 0}
	values := []float64{5, 7} // KV head 0 -> 5, KV head 1 -> 7
	out, lse := Attend(q, 3, h, d, keys, values, 1, hkv, d, 1)
	for row := 0; row < 2; row++ {
		for head := 0; head < h; head++ {
			if out[row*h+head] != 0 || lse[row*h+head] != float64(attnserve.EmptyRowLSE) {
				t.Fatalf("row %d head %d: out %v lse %v", row, head, out[row*h+head], lse[row*h+head])
			}
		}
	}
	want := []float64{5, 5, 7, 7}
	for head := 0; head < h; head++ {
		if out[2*h+head] != want[head] || lse[2*h+head] != 0 {
			t.Fatalf("row 2 head %d: out %v lse %v", head, out[2*h+head], lse[2*h+head])
		}
	}
}

func TestMirrorAcrossPages(t *testing.T) {
	m := NewMirror(1, 2, Field{"k", 1}, Field{"v", 1})
	// One sequence of 3 tokens in pages 7 and 4 (page size 2), written as one chunk.
	table := attnserve.BatchCSR{QOIndptr: []int32{0, 3}, KVIndptr: []int32{0, 2}, KVIndices: []int32{7, 4},
		KVLastPageLen: []int32{1}}
	if err := m.Append(0, table, map[string][]float32{"k": {1, 2, 3}, "v": {4, 5, 6}}); err != nil {
		t.Fatal(err)
	}
	got, n, err := m.Gather(0, table, 0)
	if err != nil || n != 3 || got["k"][2] != 3 || got["v"][0] != 4 {
		t.Fatalf("gather %v %d %v", got, n, err)
	}
	// One more token (decode): position 3, slot 1 of page 4.
	table.QOIndptr, table.KVLastPageLen = []int32{0, 1}, []int32{2}
	if err := m.Append(0, table, map[string][]float32{"k": {9}, "v": {8}}); err != nil {
		t.Fatal(err)
	}
	if got, _, _ := m.Gather(0, table, 0); got["k"][3] != 9 || got["k"][2] != 3 {
		t.Fatalf("after decode %v", got["k"])
	}
	// Unwritten slots read as NaN.
	table.KVLastPageLen = []int32{2}
	table.KVIndices = []int32{7, 5}
	if got, _, _ := m.Gather(0, table, 0); !math.IsNaN(got["k"][2]) {
		t.Fatalf("unwritten slot %v", got["k"][2])
	}
	if err := m.Append(1, table, nil); err == nil {
		t.Fatal("layer out of range")
	}
	bad := attnserve.BatchCSR{QOIndptr: []int32{0, 4}, KVIndptr: []int32{0, 1}, KVIndices: []int32{0},
		KVLastPageLen: []int32{2}}
	if err := m.Append(0, bad, map[string][]float32{"k": make([]float32, 4), "v": make([]float32, 4)}); err == nil {
		t.Fatal("q_len > kv_len accepted")
	}
}

func TestCheckClose(t *testing.T) {
	ref := []float64{1, 100, 0, 1e-3}
	// abs err 0.005 passes (atol); 0.5 on 100 passes (rtol 0.005); 0.02 on 0 fails; tiny ok.
	r := CheckClose([]float32{1.005, 100.5, 0.02, 1e-3}, ref)
	if r.NumFailed != 1 || r.FirstFailed != 2 || r.OK() || math.Abs(r.MaxAbsErr-0.5) > 1e-9 {
		t.Fatalf("%+v", r)
	}
	r = CheckClose([]float32{float32(math.NaN()), 100, 0, 1e-3}, ref)
	if r.NumFailed != 1 || !math.IsNaN(r.MaxAbsErr) {
		t.Fatalf("NaN: %+v", r)
	}
	r = CheckClose([]float32{float32(math.Inf(1)), 100, 0, 1e-3}, ref)
	if r.NumFailed != 1 {
		t.Fatalf("Inf: %+v", r)
	}
	if r := CheckClose([]float32{1}, ref); r.NumFailed != 4 {
		t.Fatalf("length mismatch: %+v", r)
	}
	if r := CheckClose([]float32{-1e30}, []float64{-1e30}); !r.OK() {
		t.Fatalf("empty-row lse: %+v", r)
	}
}

func TestForPool(t *testing.T) {
	gqa, err := ForPool(attnserve.PoolInfo{Kind: attnserve.PoolKindGQA, NumLayers: 2, PageSize: 16,
		NumKVHeads: 2, HeadDim: 64})
	if err != nil || gqa.fields[0] != (Field{"k", 128}) {
		t.Fatalf("gqa %v %v", gqa, err)
	}
	mla, err := ForPool(attnserve.PoolInfo{Kind: attnserve.PoolKindMLA, NumLayers: 2, PageSize: 64})
	if err != nil || mla.fields[1] != (Field{"kpe", 64}) {
		t.Fatalf("mla %v %v", mla, err)
	}
	if _, err := ForPool(attnserve.PoolInfo{}); err == nil {
		t.Fatal("unknown kind")
	}
}
