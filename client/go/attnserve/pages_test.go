package attnserve

import (
	"context"
	"errors"
	"reflect"
	"testing"

	"google.golang.org/grpc/codes"
)

// fakeAllocator hands out increasing page ids from a pool of a fixed size.
type fakeAllocator struct {
	next, free int
	allocated  map[int32]bool
	calls      int
}

func newFakeAllocator(pages int) *fakeAllocator {
	return &fakeAllocator{free: pages, allocated: map[int32]bool{}}
}

func (f *fakeAllocator) AllocatePages(_ context.Context, pool string, n int) ([]int32, error) {
	f.calls++
	if n > f.free {
		return nil, &Error{Method: "AllocatePages", Code: codes.ResourceExhausted, Message: "pool full"}
	}
	ids := make([]int32, n)
	for i := range ids {
		ids[i] = int32(f.next)
		f.allocated[ids[i]] = true
		f.next++
	}
	f.free -= n
	return ids, nil
}

func (f *fakeAllocator) FreePages(_ context.Context, pool string, ids []int32) (int, error) {
	for _, id := range ids {
		if !f.allocated[id] {
			return 0, &Error{Method: "FreePages", Code: codes.FailedPrecondition, Message: "not allocated"}
		}
	}
	for _, id := range ids {
		delete(f.allocated, id)
	}
	f.free += len(ids)
	return f.free, nil
}

func TestPageTableReserveAndCSR(t *testing.T) {
	ctx := context.Background()
	alloc := newFakeAllocator(100)
	pt := NewPageTable[string](alloc, "gqa", 4)
	if pages, err := pt.Reserve(ctx, "a", 6); err != nil || !reflect.DeepEqual(pages, []int32{0, 1}) {
		t.Fatalf("reserve a = %v, %v", pages, err)
	}
	if _, err := pt.Reserve(ctx, "b", 0); err != nil { // a sequence without pages
		t.Fatal(err)
	}
	if pages, err := pt.Reserve(ctx, "c", 4); err != nil || !reflect.DeepEqual(pages, []int32{2}) {
		t.Fatalf("reserve c = %v, %v", pages, err)
	}
	// Growing "a" within its last page allocates nothing; past it one page.
	if pages, _ := pt.Reserve(ctx, "a", 2); len(pages) != 0 {
		t.Fatalf("reserve within the page allocated %v", pages)
	}
	if pages, _ := pt.Reserve(ctx, "a", 1); !reflect.DeepEqual(pages, []int32{3}) {
		t.Fatalf("reserve past the page = %v", pages)
	}
	if pt.Len("a") != 9 || pt.NumPages() != 4 || !reflect.DeepEqual(pt.SeqIDs(), []string{"a", "b", "c"}) {
		t.Fatalf("len %d pages %d ids %v", pt.Len("a"), pt.NumPages(), pt.SeqIDs())
	}

	csr, err := pt.CSR([]string{"c", "a", "b"}, []int{4, 3, 0})
	if err != nil {
		t.Fatal(err)
	}
	want := BatchCSR{
		QOIndptr:      []int32{0, 4, 7, 7},
		KVIndptr:      []int32{0, 1, 4, 4},
		KVIndices:     []int32{2, 0, 1, 3},
		KVLastPageLen: []int32{4, 1, 0},
	}
	if !reflect.DeepEqual(csr, want) {
		t.Fatalf("csr = %+v\nwant %+v", csr, want)
	}
	if got := csr.KVLens(4); !reflect.DeepEqual(got, []int{4, 9, 0}) {
		t.Fatalf("kv lens %v", got)
	}
	if got := csr.QLens(); !reflect.DeepEqual(got, []int{4, 3, 0}) || csr.TotalQ() != 7 || csr.BatchSize() != 3 {
		t.Fatalf("q lens %v total %d batch %d", got, csr.TotalQ(), csr.BatchSize())
	}
	if dec, _ := pt.CSR([]string{"a"}, nil); !reflect.DeepEqual(dec.QOIndptr, []int32{0, 1}) {
		t.Fatalf("decode qo_indptr %v", dec.QOIndptr)
	}
	if _, err := pt.CSR([]string{"zz"}, nil); err == nil {
		t.Fatal("CSR of an unknown sequence")
	}
	if _, err := pt.CSR([]string{"a"}, []int{1, 2}); err == nil {
		t.Fatal("CSR with mismatched q lens")
	}

	if err := pt.Free(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	if pt.Has("a") || alloc.free != 99 || !reflect.DeepEqual(pt.SeqIDs(), []string{"b", "c"}) {
		t.Fatalf("after free: has %v free %d ids %v", pt.Has("a"), alloc.free, pt.SeqIDs())
	}
	if err := pt.FreeAll(ctx); err != nil || alloc.free != 100 || len(pt.SeqIDs()) != 0 {
		t.Fatalf("free all: %v, free %d", err, alloc.free)
	}
}

func TestPageTableUnchangedOnError(t *testing.T) {
	ctx := context.Background()
	alloc := newFakeAllocator(2)
	pt := NewPageTable[int](alloc, "", 16)
	if _, err := pt.Reserve(ctx, 1, 20); err != nil {
		t.Fatal(err)
	}
	_, err := pt.Reserve(ctx, 1, 20) // needs 2 more pages, 0 left
	if !errors.Is(err, ErrResourceExhausted) {
		t.Fatalf("err = %v", err)
	}
	if pt.Len(1) != 20 || len(pt.Pages(1)) != 2 {
		t.Fatalf("table changed: len %d pages %v", pt.Len(1), pt.Pages(1))
	}
	if _, err := pt.Reserve(ctx, 2, 1); err == nil || pt.Has(2) {
		t.Fatal("a failed reserve created the sequence")
	}
	if _, err := pt.Reserve(ctx, 1, -1); err == nil {
		t.Fatal("negative reserve")
	}
}

func TestKVLensPageSizeOne(t *testing.T) {
	b := BatchCSR{KVIndptr: []int32{0, 3, 3}, KVIndices: []int32{5, 6, 7}}
	if got := b.KVLens(1); !reflect.DeepEqual(got, []int{3, 0}) {
		t.Fatalf("kv lens %v", got)
	}
	if PagesFor(0, 16) != 0 || PagesFor(16, 16) != 1 || PagesFor(17, 16) != 2 {
		t.Fatal("PagesFor")
	}
}
