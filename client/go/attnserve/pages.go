package attnserve

import (
	"context"
	"fmt"
)

// BatchCSR is the page table of one batch in CSR form (attention.proto):
//
//	QOIndptr [batch+1]: query rows of sequence b are QOIndptr[b] .. QOIndptr[b+1] (Prefill only).
//	KVIndptr [batch+1]: sequence b owns KVIndices[KVIndptr[b] .. KVIndptr[b+1]].
//	KVIndices [KVIndptr[batch]]: page ids in token order.
//	KVLastPageLen [batch] (or [batch+1], the last entry ignored): tokens in each sequence's last
//	  page (1..page_size), 0 for a sequence without pages; may be nil when page_size is 1.
type BatchCSR struct {
	QOIndptr      []int32
	KVIndptr      []int32
	KVIndices     []int32
	KVLastPageLen []int32
}

// BatchSize is the number of sequences.
func (b BatchCSR) BatchSize() int {
	if len(b.KVIndptr) == 0 {
		return 0
	}
	return len(b.KVIndptr) - 1
}

// TotalQ is the number of query rows (QOIndptr's last entry; 0 without QOIndptr).
func (b BatchCSR) TotalQ() int {
	if len(b.QOIndptr) == 0 {
		return 0
	}
	return int(b.QOIndptr[len(b.QOIndptr)-1])
}

// QLens is the number of query rows of every sequence.
func (b BatchCSR) QLens() []int {
	out := make([]int, 0, b.BatchSize())
	for i := 1; i < len(b.QOIndptr); i++ {
		out = append(out, int(b.QOIndptr[i]-b.QOIndptr[i-1]))
	}
	return out
}

// SeqPages is sequence b's page ids (a subslice, not a copy).
func (b BatchCSR) SeqPages(seq int) []int32 {
	return b.KVIndices[b.KVIndptr[seq]:b.KVIndptr[seq+1]]
}

// KVLens is the number of tokens of every sequence: (pages - 1) * pageSize + last page length,
// 0 without pages. A missing KVLastPageLen entry counts as a full page (page size 1).
func (b BatchCSR) KVLens(pageSize int) []int {
	n := b.BatchSize()
	out := make([]int, n)
	for i := 0; i < n; i++ {
		pages := int(b.KVIndptr[i+1] - b.KVIndptr[i])
		if pages == 0 {
			continue
		}
		last := pageSize
		if i < len(b.KVLastPageLen) {
			last = int(b.KVLastPageLen[i])
		}
		out[i] = (pages-1)*pageSize + last
	}
	return out
}

// PagesFor is the number of pages that hold numTokens tokens.
func PagesFor(numTokens, pageSize int) int {
	return (numTokens + pageSize - 1) / pageSize
}

// PageAllocator is what a PageTable needs from the server; *Client implements it.
type PageAllocator interface {
	AllocatePages(ctx context.Context, pool string, numPages int) ([]int32, error)
	FreePages(ctx context.Context, pool string, pageIDs []int32) (int, error)
}

// PageTable tracks, per sequence, the pages it owns (in token order) and its length in tokens,
// allocates pages from the server as sequences grow, and builds the CSR arrays of a batch. K is
// the scheduler's sequence id type (a request id string, an int, ...).
//
// Not safe for concurrent use. State changes only after the server call it depends on
// succeeded, so an error (e.g. ErrResourceExhausted from a full pool) leaves the table as it was.
type PageTable[K comparable] struct {
	alloc    PageAllocator
	pool     string
	pageSize int
	seqs     map[K]*sequence
	order    []K // sequences in the order they were created
}

type sequence struct {
	pages  []int32
	length int
}

// NewPageTable returns an empty table over one pool of the given page size (PoolInfo.PageSize).
// It panics if pageSize < 1.
func NewPageTable[K comparable](alloc PageAllocator, pool string, pageSize int) *PageTable[K] {
	if pageSize < 1 {
		panic(fmt.Sprintf("attnserve: page size must be >= 1, got %d", pageSize))
	}
	return &PageTable[K]{alloc: alloc, pool: pool, pageSize: pageSize, seqs: map[K]*sequence{}}
}

// Pool is the pool name the table allocates from.
func (t *PageTable[K]) Pool() string { return t.pool }

// PageSize is the pool's page size.
func (t *PageTable[K]) PageSize() int { return t.pageSize }

// SeqIDs lists the sequences in the order they were created.
func (t *PageTable[K]) SeqIDs() []K { return append([]K(nil), t.order...) }

// Has reports whether the table holds the sequence.
func (t *PageTable[K]) Has(id K) bool { _, ok := t.seqs[id]; return ok }

// Len is the sequence's length in tokens, counting every reserved token (0 if unknown).
func (t *PageTable[K]) Len(id K) int {
	if s, ok := t.seqs[id]; ok {
		return s.length
	}
	return 0
}

// Pages is the sequence's page ids in token order (a copy; nil if unknown).
func (t *PageTable[K]) Pages(id K) []int32 {
	if s, ok := t.seqs[id]; ok {
		return append([]int32(nil), s.pages...)
	}
	return nil
}

// NumPages is the number of pages held by all sequences together.
func (t *PageTable[K]) NumPages() int {
	n := 0
	for _, s := range t.seqs {
		n += len(s.pages)
	}
	return n
}

// Reserve appends numNewTokens tokens to the sequence (created if new): it allocates the
// missing pages in one AllocatePages call and returns the new page ids. The tokens count as
// present from now on: CSR describes the table after their append, which is what a Prefill or
// Decode that writes their K/V expects.
func (t *PageTable[K]) Reserve(ctx context.Context, id K, numNewTokens int) ([]int32, error) {
	if numNewTokens < 0 {
		return nil, fmt.Errorf("attnserve: numNewTokens must be >= 0, got %d", numNewTokens)
	}
	s, ok := t.seqs[id]
	if !ok {
		s = &sequence{}
	}
	var newPages []int32
	if missing := PagesFor(s.length+numNewTokens, t.pageSize) - len(s.pages); missing > 0 {
		pages, err := t.alloc.AllocatePages(ctx, t.pool, missing)
		if err != nil {
			return nil, err
		}
		if len(pages) != missing {
			return nil, fmt.Errorf("attnserve: asked for %d pages, the allocator returned %d",
				missing, len(pages))
		}
		newPages = pages
	}
	s.pages = append(s.pages, newPages...)
	s.length += numNewTokens
	if !ok {
		t.seqs[id] = s
		t.order = append(t.order, id)
	}
	return newPages, nil
}

// CSR builds the batch's page table, sequences in the order given. qLens gives the query rows of
// each sequence; nil means one per sequence (Decode). It is not checked against the lengths:
// rows beyond a sequence's length see no key.
func (t *PageTable[K]) CSR(ids []K, qLens []int) (BatchCSR, error) {
	if qLens == nil {
		qLens = make([]int, len(ids))
		for i := range qLens {
			qLens[i] = 1
		}
	}
	if len(qLens) != len(ids) {
		return BatchCSR{}, fmt.Errorf("attnserve: %d qLens for %d sequences", len(qLens), len(ids))
	}
	b := BatchCSR{
		QOIndptr:      make([]int32, 1, len(ids)+1),
		KVIndptr:      make([]int32, 1, len(ids)+1),
		KVIndices:     []int32{},
		KVLastPageLen: make([]int32, 0, len(ids)),
	}
	for i, id := range ids {
		s, ok := t.seqs[id]
		if !ok {
			return BatchCSR{}, fmt.Errorf("attnserve: unknown sequence %v", id)
		}
		if qLens[i] < 0 {
			return BatchCSR{}, fmt.Errorf("attnserve: negative q_len %d for sequence %v", qLens[i], id)
		}
		b.QOIndptr = append(b.QOIndptr, b.QOIndptr[i]+int32(qLens[i]))
		b.KVIndices = append(b.KVIndices, s.pages...)
		b.KVIndptr = append(b.KVIndptr, int32(len(b.KVIndices)))
		last := 0
		if len(s.pages) > 0 {
			last = s.length - (len(s.pages)-1)*t.pageSize
		}
		b.KVLastPageLen = append(b.KVLastPageLen, int32(last))
	}
	return b, nil
}

// Free returns the sequence's pages to the pool and forgets the sequence. An unknown id is a
// no-op. On error the sequence stays (all or nothing on the server too).
func (t *PageTable[K]) Free(ctx context.Context, id K) error {
	s, ok := t.seqs[id]
	if !ok {
		return nil
	}
	if len(s.pages) > 0 {
		if _, err := t.alloc.FreePages(ctx, t.pool, s.pages); err != nil {
			return err
		}
	}
	delete(t.seqs, id)
	for i, o := range t.order {
		if o == id {
			t.order = append(t.order[:i], t.order[i+1:]...)
			break
		}
	}
	return nil
}

// FreeAll frees every sequence, stopping at the first error.
func (t *PageTable[K]) FreeAll(ctx context.Context) error {
	for _, id := range t.SeqIDs() {
		if err := t.Free(ctx, id); err != nil {
			return err
		}
	}
	return nil
}
