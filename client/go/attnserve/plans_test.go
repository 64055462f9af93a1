package attnserve

import (
	"context"
	"errors"
	"reflect"
	"testing"
)

func TestPlanProtos(t *testing.T) {
	csr := BatchCSR{QOIndptr: []int32{0, 2}, KVIndptr: []int32{0, 1}, KVIndices: []int32{7},
		KVLastPageLen: []int32{2}}
	p := (&PlanRequest{Pool: "p", Prefill: true, Table: csr}).Proto()
	if p.Name != DefaultPlanName || p.Pool != "p" || !p.Prefill || p.PageTable != nil ||
		!reflect.DeepEqual(p.QoIndptr, csr.QOIndptr) || !reflect.DeepEqual(p.KvIndices, csr.KVIndices) ||
		!reflect.DeepEqual(p.KvLastPageLen, csr.KVLastPageLen) {
		t.Fatalf("prefill plan proto %v", p)
	}
	// A decode plan sends no qo_indptr; an unstaged PageTable sends its CSR.
	d := (&PlanRequest{Name: "d", Table: BatchCSR{}, PageTable: &StagedPageTable{CSR: csr}}).Proto()
	if d.Name != "d" || d.Prefill || d.QoIndptr != nil || !reflect.DeepEqual(d.KvIndptr, csr.KVIndptr) {
		t.Fatalf("decode plan proto %v", d)
	}

	// A call naming a plan carries no page table, whatever else the request holds.
	req := &AttentionRequest{Pool: "p", Table: csr, PageTable: &StagedPageTable{CSR: csr},
		Plan: &Plan{Name: "d"}}
	dec := req.DecodeProto()
	if dec.Plan != "d" || dec.KvIndptr != nil || dec.KvIndices != nil || dec.KvLastPageLen != nil ||
		dec.PageTable != nil {
		t.Fatalf("decode proto %v", dec)
	}
	req.Plan.Prefill = true
	pre := req.PrefillProto()
	if pre.Plan != "d" || pre.QoIndptr != nil || pre.KvIndptr != nil || pre.PageTable != nil {
		t.Fatalf("prefill proto %v", pre)
	}
}

// A call whose plan serves the other method fails before anything is sent (the client has no
// connection to send it on).
func TestPlanOfTheOtherMethodIsRefused(t *testing.T) {
	c := NewFromConn(nil)
	_, err := c.Decode(context.Background(), &AttentionRequest{Plan: &Plan{Name: "s", Prefill: true}})
	if !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("decode over a prefill plan: %v", err)
	}
	_, err = c.Prefill(context.Background(), &AttentionRequest{Plan: &Plan{Name: "s"}})
	if !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("prefill over a decode plan: %v", err)
	}
}

// The plan book: a plan stops being current when one of its session and name replaces it, when
// it is released and when its session is closed; other sessions' plans are left alone.
func TestPlanBook(t *testing.T) {
	b := &planBook{}
	plan := func(session, name string) *Plan {
		key := planKey{session, name}
		return &Plan{Name: name, book: b, key: key, gen: b.add(key)}
	}
	first, other, elsewhere := plan("s", "step"), plan("s", "other"), plan("t", "step")
	second := plan("s", "step")
	if first.current() || !second.current() || !other.current() || !elsewhere.current() {
		t.Fatal("a replaced plan is still current, or a plan that was not replaced is not")
	}
	b.drop("s", "other")
	if other.current() || !second.current() {
		t.Fatal("releasing a plan by name")
	}
	b.drop("s", "")
	if second.current() || !elsewhere.current() || !(&Plan{Name: "step"}).current() {
		t.Fatal("closing a session")
	}
}
